"""The embedded demo's target: a generated chat corpus, a BPE tokenizer trained on it, a tiny Llama (or a
tiny DeepseekV3 with `--arch deepseek_v3`, for the MLA drafter: launch/configs/demo-deepseek.yaml).

No model hub is reachable, so the demo builds everything itself. The corpus has structure a drafter can
learn (templated tasks with deterministic answers), so a target trained on it produces predictable text.

    python -m launch.demo_target --out runs/demo/assets [--conversations 400] [--arch deepseek_v3] [--hidden 128]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|pad|>"]

WORDS = ("apple river stone cloud tiger maple silver garden rocket candle violet harbor falcon meadow "
         "copper lantern orbit pepper thunder willow amber canyon dragon ember glacier island jasmine").split()
NAMES = "Ada Ben Cleo Dan Eve Finn Gus Hana Ivo Jun".split()


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"The sum of {a} and {b} is {a + b}."
    if kind == 1:
        xs = rng.sample(WORDS, rng.randrange(3, 7))
        return (f"Sort these words: {', '.join(xs)}.",
                f"Here are the words in alphabetical order: {', '.join(sorted(xs))}.")
    if kind == 2:
        n = rng.randrange(2, 9)
        return f"Count from 1 to {n}.", "Counting: " + ", ".join(str(i) for i in range(1, n + 1)) + "."
    if kind == 3:
        w = rng.choice(WORDS)
        return f"Spell the word {w}.", f"The word {w} is spelled " + "-".join(w.upper()) + "."
    if kind == 4:
        name, w = rng.choice(NAMES), rng.choice(WORDS)
        return (f"Write a short note from {name} about a {w}.",
                f"Dear friend, this is {name}. Today I saw a {w}. The {w} was beautiful. Best wishes, {name}.")
    xs = [rng.randrange(50) for _ in range(rng.randrange(3, 6))]
    return (f"What is the largest of {', '.join(map(str, xs))}?",
            f"The largest number in the list {', '.join(map(str, xs))} is {max(xs)}.")


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    """OpenAI-style conversations, some multi-turn, some with a system prompt."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are a precise assistant."})
        for _ in range(1 if rng.random() < 0.7 else 2):
            q, a = _task(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append({"id": f"demo-{i:05d}", "messages": messages})
    return convs


def build_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 512,
                    chat_template: str = LLAMA3_TEMPLATE, special_tokens: list[str] = LLAMA3_SPECIALS,
                    bos: str = "<|begin_of_text|>", eos: str = "<|eot_id|>", pad: str = "<|pad|>"):
    """Train a byte-level BPE tokenizer with `tokenizers` and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_llama(out_dir: str | Path, vocab_size: int, hidden: int = 64, layers: int = 4, heads: int = 4,
                     seed: int = 0, bos_token_id: int = 0, eos_token_id: int = 4, initializer_range: float = 0.02):
    """A randomly initialised Llama saved with safetensors (`train_target` trains the demo's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=1024, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=False, initializer_range=initializer_range)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out_dir))
    return model


# Fields of DeepSeek-V3's and Kimi-K2.5's config.json that SGLang's deepseek_v2 reads without a default and
# transformers' DeepseekV3Config leaves out (without them the server dies: "'DeepseekV3Config' object has no
# attribute 'moe_layer_freq'"). The values are the routing transformers' DeepseekV3 computes.
DEEPSEEK_V3_SGLANG_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# DeepSeek-V3's latent-attention widths, which SGLang 0.5.14's triton MLA kernels are written for (decode splits
# the cached row as 512 + 64 or 256 + 32). Measured on the H200 (tests/benchmarks/probe_sglang_deepseek.py): a
# target with kv_lora 16 / rope 16 crashed the server at its first prefill (illegal memory access in the extend
# kernel), kv_lora 64 / rope 64 failed to compile the decode kernel; these widths served (hidden 256, 2 heads).
# The demo's DeepseekV3 target keeps them and stays tiny elsewhere (hidden 64); tests that never serve it pass
# servable_mla=False (build_tiny_deepseek's narrow widths train 2x faster on a CPU, and learn faster).
SGLANG_MLA_DIMS = {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 512,
                   "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def build_tiny_deepseek(out_dir: str | Path, vocab_size: int, hidden: int = 64, layers: int = 5, heads: int = 4,
                        seed: int = 0, bos_token_id: int = 0, eos_token_id: int = 4, rope_parameters: dict | None = None,
                        **overrides):
    """A randomly initialised DeepseekV3 (MLA attention, a dense first layer, then MoE layers): the Kimi-K2.5 /
    DeepSeek-V3 architecture at toy size. `overrides`: other DeepseekV3Config fields. Five layers: the fewest
    with three aux ids SGLang serves on this architecture, [1, 2, 3] (data.target.sglang_serving_problem)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    head = hidden // heads
    fields = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                  moe_intermediate_size=hidden, num_hidden_layers=layers, first_k_dense_replace=1,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                  num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=hidden // 2,
                  kv_lora_rank=hidden // 4, qk_nope_head_dim=head, qk_rope_head_dim=head,
                  v_head_dim=head, max_position_embeddings=1024, bos_token_id=bos_token_id,
                  eos_token_id=eos_token_id, tie_word_embeddings=False, **DEEPSEEK_V3_SGLANG_FIELDS,
                  **({"rope_parameters": rope_parameters} if rope_parameters else {}))
    config = DeepseekV3Config(**(fields | overrides))
    model = DeepseekV3ForCausalLM(config)
    model.save_pretrained(str(out_dir))
    return model


def train_target(model, tokenizer, conversations: list[dict], steps: int, seq_len: int = 256, batch: int = 16,
                 lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-token training on the chat-rendered corpus, so the target's greedy text follows the tasks' patterns
    (what makes a drafter's job learnable). Returns the loss every 50 steps."""
    import torch
    from tqdm import tqdm

    rows = [tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=False)[:seq_len]
            for c in conversations]
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    labels = ids.masked_fill(ids == pad, -100)
    lengths = torch.tensor([len(r) for r in rows])
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses = []
    for step in tqdm(range(steps), desc="train demo target"):
        pick = torch.randint(0, len(rows), (batch,), generator=g)
        width = int(lengths[pick].max())  # the batch's own longest row: columns past it are padding only
        x, y = ids[pick, :width], labels[pick, :width]
        loss = model(input_ids=x, attention_mask=(x != pad).long(), labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(round(loss.item(), 4))
    return losses


def build_demo_assets(out: str | Path, conversations: int = 400, seed: int = 0, train_steps: int = 500,
                      arch: str = "llama", servable_mla: bool = True, hidden: int | None = None) -> dict:
    """Corpus, tokenizer and a tiny target (Llama, or DeepseekV3: MLA + MoE, with SGLANG_MLA_DIMS unless
    `servable_mla` is False) trained on other conversations of the same tasks. `hidden`: the target's width
    (default: the builder's, 64); an INT4 DeepseekV3 target for SGLang needs 128, the narrowest expert width
    SGLang's Marlin MoE kernel takes (n % 128 == 0, marlin_utils.check_moe_marlin_supports_layer)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    convs = make_conversations(conversations, seed)
    with open(out / "conversations.jsonl", "w") as fh:
        fh.writelines(json.dumps(c) + "\n" for c in convs)
    corpus = make_conversations(4000, seed + 1)
    tok = build_tokenizer([m["content"] for c in corpus for m in c["messages"]], out / "target")
    if arch == "deepseek_v3":
        build, dims = build_tiny_deepseek, SGLANG_MLA_DIMS if servable_mla else {}
    else:
        build, dims = build_tiny_llama, {}
    model = build(out / "target", vocab_size=len(tok), seed=seed, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, **dims, **({"hidden": hidden} if hidden else {}))
    losses = train_target(model, tok, corpus, train_steps, seed=seed)
    model.save_pretrained(str(out / "target"))
    info = {"conversations": str(out / "conversations.jsonl"), "target": str(out / "target"),
            "target_training_loss": losses}
    (out / "target" / "demo_training.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=["llama", "deepseek_v3"], default="llama")
    p.add_argument("--hidden", type=int, help="the target's hidden size (default 64)")
    a = p.parse_args()
    print(build_demo_assets(a.out, a.conversations, a.seed, arch=a.arch, hidden=a.hidden))
