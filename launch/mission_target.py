"""The mission-scale run's target: a ~110M-parameter Llama trained here, on the GPU machine, on an offline corpus.

No model hub is reachable, so the run builds its own target, fresh on every machine (they are wiped when
released): a byte-level BPE tokenizer and a Llama trained on the Python standard library's sources plus
generated dialogues whose answers have structure (the demo's tasks, and code tasks answered with the
standard library's own functions), until its greedy answers follow them. It also writes the prompts the
drafter's data is made from (the target answers them itself in the pipeline's regenerate stage): --prompts
distinct prompts of the same tasks drawn from a pool disjoint from the target's dialogues (`side_of`), so no
held-out prompt occurs in the target's training corpus either, and --unseen-prompts of task families no training
data has, marked as the held-out group `unseen-families` (the out-of-distribution figure). OUT/prompts.json
counts them and their overlap with the target's dialogues (0).

    python -m launch.mission_target --out runs/mission/assets [--minutes 7] [--steps 1500] [--size 110m|tiny]

Training stops at --minutes of wall time or --steps, whichever comes first, saves every --save-minutes and
resumes from the last save when run again (model and AdamW state in safetensors, the step in JSON), so a
run cut short by a command's time limit continues where it stopped. Writes OUT/target (a transformers
directory: config, safetensors, tokenizer, chat template), OUT/conversations.jsonl, OUT/prompts.json and
OUT/target/training.json
(losses, tokens/s, model TFLOP/s, greedy samples).
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import signal
import sysconfig
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import xxhash

from data.files import atomic_write_json
from data.split import normalise, prompt_of

from .demo_target import _task, build_tokenizer

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab, sequence length
    "110m": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16384, seq=1024),
    "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512, seq=128),
}
SYSTEM = "You are a precise assistant."


@functools.cache  # the scan takes seconds; a process that builds several targets (the tests) makes it once
def stdlib_functions() -> tuple[tuple[str, str, str], ...]:
    """(module, function name, source) for top-level functions of the standard library with a docstring."""
    import ast
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        if path.stem.startswith("_"):  # private modules: not what a user asks about
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are deliberately not valid Python 3 (test data): not in the corpus
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                source = ast.get_source_segment(text, node)
                if source and len(source) < 2000:
                    out.append((path.stem, node.name, source))
    return tuple(out)


def stdlib_sources(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


ASKS = ["Show me the function {name} from the Python module {module}.", "How is {module}.{name} implemented?",
        "Write the source code of {name} in {module}.", "Print the implementation of {module}.{name}.",
        "What does the code of {name} in the {module} module look like?", "Give me {module}.{name}'s source."]
# Task families that neither the target's dialogues nor the drafter's training data contain: the drafter's
# out-of-distribution held-out group (the target answers them as best it can; its answers are what is drafted)
UNSEEN_FAMILIES = "unseen-families"


def _unseen_task(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} minus {b}?", f"The difference of {a} and {b} is {a - b}."
    xs = [rng.randrange(50) for _ in range(rng.randrange(3, 6))]
    return (f"What is the smallest of {', '.join(map(str, xs))}?",
            f"The smallest number in the list {', '.join(map(str, xs))} is {min(xs)}.")


def side_of(item: str) -> str:
    """Which of the two disjoint prompt pools an item belongs to: the target's own training dialogues or the
    prompts the drafter's data is made from. An item is a stdlib function (all its wordings on one side) or a
    task's normalised question, so no drafter prompt, held out or not, occurs in the target's training corpus."""
    return "drafter" if xxhash.xxh64_intdigest(item.encode(), seed=17) % 2 else "target"


def make_dialogues(n: int, functions: Sequence[tuple[str, str, str]], seed: int, side: str,
                   distinct: bool = False) -> list[dict]:
    """Chat conversations of one pool: half the demo's templated tasks, half code tasks answered with stdlib
    source, as far as the pool has them (with `distinct`, each prompt once: the pool runs out of code prompts
    first). Stops at n or when 50 n draws found nothing new."""
    rng = random.Random(seed)
    convs, seen = [], set()
    for _ in range(50 * n):
        if len(convs) == n:
            break
        system = rng.random() < 0.3
        if functions and rng.random() < 0.5:
            module, name, source = rng.choice(functions)
            item = f"{module}.{name}"
            q = rng.choice(ASKS).format(module=module, name=name)
            a = f"Here is `{module}.{name}`:\n```python\n{source}\n```"
        else:
            q, a = _task(rng)
            item = normalise(q)
        if side_of(item) != side or (distinct and normalise(q) in seen):
            continue
        seen.add(normalise(q))
        messages = [{"role": "system", "content": SYSTEM}] if system else []
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append({"id": f"mission-{side}-{seed}-{len(convs):06d}", "messages": messages})
    return convs


def unseen_family_prompts(n: int, seed: int) -> list[dict]:
    """Distinct prompts of the task families no training data has, marked as the held-out group `unseen-families`."""
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(50 * n):
        if len(out) == n:
            break
        q, a = _unseen_task(rng)
        if normalise(q) not in seen:
            seen.add(normalise(q))
            out.append({"id": f"mission-unseen-{len(out):05d}", "heldout": UNSEEN_FAMILIES,
                        "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def prompt_report(dialogues: list[dict], drafter_convs: list[dict]) -> dict:
    """How the drafter's prompts relate to the target's training dialogues (written beside the prompts)."""
    target_prompts = {normalise(prompt_of(c["messages"])) for c in dialogues}
    drafter_prompts = [normalise(prompt_of(c["messages"])) for c in drafter_convs]
    groups = dict(Counter(c.get("heldout", "pool") for c in drafter_convs))
    return {"rule": "prompt pools split by xxh64(item) % 2, item = stdlib function or normalised question; "
                    f"the '{UNSEEN_FAMILIES}' rows are task families (subtraction, smallest-of) absent from both",
            "drafter_rows": len(drafter_convs), "drafter_distinct_prompts": len(set(drafter_prompts)),
            "rows_by_group": groups, "target_dialogues": len(dialogues),
            "target_distinct_prompts": len(target_prompts),
            "drafter_prompts_in_target_dialogues": sum(p in target_prompts for p in drafter_prompts)}


def token_stream(tok, texts: list[str], dialogues: list[dict]) -> np.ndarray:
    """Every text and chat-rendered dialogue, tokenized, joined by EOS: the stream packed sequences come from.
    One batch call: the fast tokenizer encodes it on every core (a fresh machine tokenizes the corpus each time)."""
    rendered = [tok.apply_chat_template(c["messages"], tokenize=False) for c in dialogues]  # ends with its EOS
    ids = tok(texts + rendered, add_special_tokens=False)["input_ids"]
    rows = [r + [tok.eos_token_id] for r in ids[:len(texts)]] + ids[len(texts):]
    random.Random(0).shuffle(rows)
    return np.fromiter((t for r in rows for t in r), dtype=np.int32)


def next_token_loss(model, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
        logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())


def build_model(size: dict, tok, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=False, rope_theta=10000.0)
    return LlamaForCausalLM(config)


def _save_state(path: Path, model, opt, state: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path / "model"))
    tensors = {}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        s = opt.state.get(p)
        if s:
            tensors |= {f"{i}.exp_avg": s["exp_avg"], f"{i}.exp_avg_sq": s["exp_avg_sq"], f"{i}.step": s["step"]}
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(path / "optimizer.safetensors"))
    atomic_write_json(path / "state.json", state)  # written last: marks the save complete


def _load_state(path: Path, model, opt) -> dict | None:
    if not (path / "state.json").exists():
        return None
    from transformers import LlamaForCausalLM
    model.load_state_dict(LlamaForCausalLM.from_pretrained(str(path / "model")).state_dict())
    tensors = load_file(str(path / "optimizer.safetensors"))
    for i, p in enumerate(opt.param_groups[0]["params"]):
        if f"{i}.exp_avg" in tensors:
            opt.state[p] = {k: tensors[f"{i}.{k}"].to(p.device) for k in ("exp_avg", "exp_avg_sq", "step")}
    return json.loads((path / "state.json").read_text())


def greedy_samples(model, tok, prompts: list[str], max_new: int = 96) -> list[dict]:
    model.eval()
    out = []
    for q in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"].to(model.device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append({"prompt": q, "answer": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    model.train()
    return out


def train(model, stream: np.ndarray, size: dict, out: Path, minutes: float, max_steps: int, save_minutes: float,
          batch: int, lr: float, seed: int, stop_at: int | None = None, compile_model: bool = False) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ckpt = out / "checkpoint"
    state = _load_state(ckpt, model, opt) or {"step": 0, "tokens": 0, "losses": [], "seconds": 0.0}
    seq, n_params = size["seq"], sum(p.numel() for p in model.parameters())
    windows = (len(stream) - 1) // seq
    if windows < batch:
        raise ValueError(f"corpus of {len(stream)} tokens makes {windows} sequences of {seq}: fewer than a batch")
    data = torch.from_numpy(stream[:windows * seq + 1].astype(np.int64))
    warmup = 100
    t_start, t_save, tokens0 = time.time(), time.time(), state["tokens"]
    from tqdm import tqdm
    bar = tqdm(desc="train mission target", initial=state["step"], total=max_steps, unit="step")
    loss, interrupted = None, []
    # Inductor fuses what eager runs as separate memory-bound kernels at hidden 768 (RMSNorm's fp32 upcasts, RoPE,
    # SiLU-mul, the fp32 logits the loss reads); if compiling fails, the step runs eager
    loss_fn = torch.compile(next_token_loss) if compile_model else next_token_loss
    # SIGINT (a command's time running out: mission.sh's `timeout -s INT`) ends the loop between steps, saved
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    while state["step"] < min(max_steps, stop_at or max_steps) and time.time() - t_start < minutes * 60 \
            and not interrupted:
        step = state["step"]
        # linear warmup, then cosine to 10% over max_steps
        progress = min(1.0, step / max_steps)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)))
        g_ = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the batch is a function of the step
        starts = torch.randint(0, windows, (batch,), generator=g_) * seq
        x = torch.stack([data[s:s + seq + 1] for s in starts]).to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        try:
            loss = loss_fn(model, x)
            loss.backward()
        except Exception as e:
            if loss_fn is next_token_loss:
                raise
            print(f"[mission_target] torch.compile failed ({type(e).__name__}: {str(e)[:300]}); training eager")
            loss_fn = next_token_loss
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, x)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += batch * seq
        if state["step"] % 50 == 0 or state["step"] == 1:
            state["losses"].append([state["step"], round(loss.item(), 4)])
            bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        if time.time() - t_save > save_minutes * 60:
            state["seconds"] += time.time() - t_save
            t_save = time.time()
            _save_state(ckpt, model, opt, state)
    bar.close()
    signal.signal(signal.SIGINT, previous)
    if loss is not None and state["losses"][-1][0] != state["step"]:
        state["losses"].append([state["step"], round(loss.item(), 4)])
    elapsed = time.time() - t_start
    state["seconds"] += time.time() - t_save
    _save_state(ckpt, model, opt, state)
    tokens_per_s = (state["tokens"] - tokens0) / max(elapsed, 1e-9)
    return state | {"parameters": n_params, "tokens_per_s_this_run": round(tokens_per_s),
                    "compiled": loss_fn is not next_token_loss,
                    "model_tflops_this_run": round(6 * n_params * tokens_per_s / 1e12, 1), "device": str(device)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="110m")
    p.add_argument("--minutes", type=float, default=7.0, help="wall-time cap of this invocation's training")
    p.add_argument("--steps", type=int, default=1500,
                   help="training steps in all (the LR schedule's length; 98M tokens)")
    p.add_argument("--save-minutes", type=float, default=1.5)
    p.add_argument("--stop-at", type=int, default=None, help="end this invocation at this step, as if its time ran out")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=12000, help="distinct prompts written for the drafter's data")
    p.add_argument("--unseen-prompts", type=int, default=256,
                   help="prompts of task families absent from all training data (held-out group 'unseen-families')")
    p.add_argument("--corpus-mb", type=float, default=40.0, help="stdlib source text in the training corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training step (default: on a GPU)")
    a = p.parse_args(argv)
    size, out = SIZES[a.size], Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "target"
    done = target / "training.json"
    if done.exists() and json.loads(done.read_text())["step"] >= a.steps:
        print(f"[mission_target] {target} is trained ({done}); nothing to do")
        return json.loads(done.read_text())
    t0 = time.time()
    functions = stdlib_functions()
    sources = stdlib_sources(int(a.corpus_mb * 1e6))
    dialogues = make_dialogues(max(2000, a.prompts * 2), functions, a.seed + 1, side="target")
    if not (target / "tokenizer.json").exists():
        sample = sources[: max(1, len(sources) // 4)] + [m["content"] for c in dialogues[:5000] for m in c["messages"]]
        build_tokenizer(sample, target, vocab_size=size["vocab"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = out / "conversations.jsonl"
    if not prompts.exists():
        drafter_convs = make_dialogues(a.prompts, functions, a.seed + 2, side="drafter", distinct=True) + \
            unseen_family_prompts(a.unseen_prompts, a.seed + 3)
        atomic_write_json(out / "prompts.json", prompt_report(dialogues, drafter_convs))
        with open(prompts, "w") as fh:
            fh.writelines(json.dumps(c) + "\n" for c in drafter_convs)
    print(f"[mission_target] drafter prompts: {json.loads((out / 'prompts.json').read_text())}", flush=True)
    cached = out / "corpus-tokens.npy"  # a plain int32 array (np.save, no pickle): tokenized once per machine
    if cached.exists():
        stream = np.load(cached, allow_pickle=False)
    else:
        stream = token_stream(tok, sources, dialogues)
        np.save(cached, stream, allow_pickle=False)
    prep_s = time.time() - t0
    print(f"[mission_target] corpus: {len(sources)} stdlib files, {len(dialogues)} dialogues "
          f"({len(functions)} stdlib functions), {len(stream):,} tokens; prepared in {prep_s:.0f} s", flush=True)
    model = build_model(size, tok, a.seed)
    state = train(model, stream, size, out, a.minutes, a.steps, a.save_minutes, a.batch, a.lr, a.seed, a.stop_at,
                  torch.cuda.is_available() if a.compile is None else a.compile)
    # shipped in bf16 as real targets are: extraction runs it in bf16, and SGLang's `--dtype auto` would serve a
    # float32-declared model in float16
    model.to(torch.bfloat16).save_pretrained(str(target))
    samples = greedy_samples(model, tok, ["What is 17 plus 25?", "Sort these words: tiger, apple, river.",
                                          f"Show me the function {functions[0][1]} from the Python module "
                                          f"{functions[0][0]}." if functions else "Count from 1 to 5."])
    info = state | {"size": a.size, "corpus_tokens": int(len(stream)), "stdlib_files": len(sources),
                    "dialogues": len(dialogues), "prompts_file": str(prompts), "greedy_samples": samples,
                    "finished": state["step"] >= a.steps}
    atomic_write_json(target / ("training.json" if info["finished"] else "training-partial.json"), info)
    last_loss = state["losses"][-1][1] if state["losses"] else "?"
    print(f"[mission_target] step {state['step']}/{a.steps}, loss {last_loss}, "
          f"{state['tokens_per_s_this_run']:,} tokens/s; samples: {json.dumps(samples)[:600]}")
    return info


if __name__ == "__main__":
    main()
