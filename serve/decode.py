"""A reference EAGLE-3 speculative decoder: greedy chain drafting over a transformers target and an exported
drafter directory, with KV caches on both sides. It runs the algorithm SGLang runs for
`--speculative-num-steps S --speculative-eagle-topk 1 --speculative-num-draft-tokens S+1`:

    prefill   target(prompt) -> first token x, aux states; drafter extend over the prompt (tokens shifted by
              one, the target's aux states), its last output drafts d1
    draft     S-1 more drafter steps, each on its own previous token and hidden output (positions T, T+1, ...)
    verify    one target forward over [x, d1..dS]; accept the longest prefix of drafts equal to the target's
              greedy tokens, emit it plus the target's next token; crop both caches to the accepted length
    extend    drafter extend over the accepted tokens with the target's aux states from the verify pass

A DFlash drafter directory is decoded by blocks instead (speculative_blocks). Greedy output equals the target's
own greedy output (lossless). Accept length = completion tokens / target
verify calls (SGLang's spec_accept_length).

    python -m serve.decode --target TARGET --drafter DRAFTER_DIR [--steps 3] [--prompts FILE] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.split import first_turn
from data.target import AuxCapture, load_causal_lm
from train.drafter import KVCache

from . import dflash_dir
from .drafter_dir import load_drafter


@dataclass
class DecodeResult:
    tokens: list[int]
    verify_calls: int = 0
    accepted_drafts: list[int] = field(default_factory=list)  # per verify call
    seconds: float = 0.0

    @property
    def accept_length(self) -> float:
        return len(self.tokens) / max(self.verify_calls, 1)


class Target:
    """A transformers causal LM whose forward also returns the configured layers' outputs (SGLang's ids)."""

    def __init__(self, path: str, aux_layer_ids: list[int], device: torch.device, dtype: torch.dtype):
        self.model = load_causal_lm(path, dtype, device)
        self.aux = AuxCapture(self.model.get_decoder().layers, aux_layer_ids)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and aux states [n, 3H] for `ids` [n] at positions start.."""
        pos = torch.arange(start, start + len(ids), device=ids.device)[None]
        out = self.model(input_ids=ids[None], position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[0], self.aux.take()[0]


@torch.inference_mode()
def greedy(target: Target, prompt: list[int], max_new: int, eos: set[int]) -> DecodeResult:
    """Plain greedy decoding with a KV cache: the reference output and the speed baseline."""
    from transformers import DynamicCache
    t0 = time.perf_counter()
    cache, ids = DynamicCache(), torch.tensor(prompt, device=target.model.device)
    logits, _ = target(ids, cache, 0)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in eos:
        logits, _ = target(torch.tensor(tokens[-1:], device=ids.device), cache, len(prompt) + len(tokens) - 1)
        tokens.append(int(logits[-1].argmax()))
    return DecodeResult(tokens, verify_calls=len(tokens), seconds=time.perf_counter() - t0)


def verify(target: Target, cache, drafts: list[int], p: int, result: DecodeResult, max_new: int, eos: set[int]
           ) -> tuple[list[int], torch.Tensor]:
    """One target forward over [x, drafts...] at positions p.. (x = the last emitted token, at p): the drafts equal
    to the target's greedy tokens in a row plus its next token, appended to `result` up to where plain greedy
    decoding would stop; the rejected drafts leave the target's cache. Returns (accepted drafts + the target's
    token, the aux states of the forward)."""
    logits, aux = target(torch.tensor(result.tokens[-1:] + drafts, device=target.model.device), cache, p)
    greedy_ids = logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy_ids[accepted]:
        accepted += 1
    result.verify_calls += 1
    result.accepted_drafts.append(accepted)
    for tok in drafts[:accepted] + [greedy_ids[accepted]]:  # stop exactly where plain greedy decoding would
        if len(result.tokens) >= max_new or result.tokens[-1] in eos:
            break
        result.tokens.append(tok)
    if accepted < len(drafts):
        cache.crop(accepted - len(drafts))  # negative: drop the rejected drafts (the form every version takes)
    return drafts[:accepted] + [greedy_ids[accepted]], aux


@torch.inference_mode()
def speculative(target: Target, drafter, prompt: list[int], max_new: int, eos: set[int], steps: int) -> DecodeResult:
    from transformers import DynamicCache
    t0 = time.perf_counter()
    dev = target.model.device
    t_cache, d_cache = DynamicCache(), KVCache()
    ids = torch.tensor(prompt, device=dev)
    logits, aux = target(ids, t_cache, 0)
    tokens = [int(logits[-1].argmax())]
    result = DecodeResult(tokens)
    # drafter extend over the prompt: position t holds token x[t+1] and the target's state at t
    extend_ids = torch.tensor(prompt[1:] + tokens[-1:], device=dev)
    extend_hidden, extend_start = aux, 0
    while len(tokens) < max_new and tokens[-1] not in eos:
        n = len(extend_ids)
        pos = torch.arange(extend_start, extend_start + n, device=dev)
        out = drafter(extend_ids[None], extend_hidden[None], pos[None], cache=d_cache)
        drafts, hidden = [], out.hidden[:, -1:]
        draft = drafter.to_target_ids(out.logits[0, -1].argmax())
        for j in range(steps):
            drafts.append(int(draft))
            if j == steps - 1:
                break
            step = drafter(draft.view(1, 1), hidden, pos[-1:].view(1, 1) + j + 1, cache=d_cache)
            hidden, draft = step.hidden, drafter.to_target_ids(step.logits[0, -1].argmax())
        p = len(prompt) + len(tokens) - 1
        new, aux = verify(target, t_cache, drafts, p, result, max_new, eos)
        d_cache.crop(p)  # drop the chain's draft entries; re-extend with the target's states
        extend_ids = torch.tensor(new, device=dev)
        extend_hidden, extend_start = aux[:len(new)], p
    result.seconds = time.perf_counter() - t0
    return result


@torch.inference_mode()
def speculative_blocks(target: Target, drafter, prompt: list[int], max_new: int, eos: set[int]) -> DecodeResult:
    """DFlash's cycle, as SGLang's DFLASH worker runs it greedily: the block [x, mask, ...] at x's position p,
    drafted in one forward over the target's aux states of positions < p; one target forward verifies
    [x, d1..d(B-1)]; the accepted tokens' aux states join the context."""
    from transformers import DynamicCache
    t0 = time.perf_counter()
    dev = target.model.device
    cfg = drafter.config.dflash_config
    size, mask = cfg["block_size"], cfg["mask_token_id"]
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    t_cache = DynamicCache()
    logits, context = target(torch.tensor(prompt, device=dev), t_cache, 0)
    tokens = [int(logits[-1].argmax())]
    result = DecodeResult(tokens)
    while len(tokens) < max_new and tokens[-1] not in eos:
        p = len(prompt) + len(tokens) - 1  # the position of x, the last emitted token: context is what precedes it
        block = torch.tensor(tokens[-1:] + [mask] * (size - 1), device=dev)
        hidden = drafter(embed(block)[None], torch.arange(p, p + size, device=dev)[None], context[None],
                         torch.arange(p, device=dev)[None])
        new, aux = verify(target, t_cache, head(hidden[0, 1:]).argmax(-1).tolist(), p, result, max_new, eos)
        context = torch.cat([context, aux[:len(new)]])  # x and the accepted drafts now have target states
    result.seconds = time.perf_counter() - t0
    return result


def run(target_path: str, drafter_dir: str, prompts: list[list[dict]], steps: int = 3, max_new: int = 64,
        device: str | None = None, tools: list[list[dict] | None] | None = None) -> dict:
    """Greedy and speculative decoding of each prompt (with its tool declarations, when given)."""
    from transformers import AutoTokenizer
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dflash_dir.is_dflash_dir(drafter_dir):  # a block drafter: its target layers, one forward per block
        drafter = dflash_dir.load(drafter_dir, dev, dtype)
        layers = drafter.config.dflash_config["target_layer_ids"]
        steps = drafter.config.dflash_config["block_size"] - 1
        chain = f"reference decoder, DFlash blocks of {steps + 1} ({steps} drafts)"
        decode = lambda target, prompt: speculative_blocks(target, drafter, prompt, max_new, eos)  # noqa: E731
    else:
        drafter = load_drafter(drafter_dir, target_path, dev, dtype)
        layers = drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
        chain = f"reference decoder, {steps} steps / top-k 1 / {steps + 1} draft tokens"
        decode = lambda target, prompt: speculative(target, drafter, prompt, max_new, eos, steps)  # noqa: E731
    target = Target(target_path, layers, dev, dtype)
    tok = AutoTokenizer.from_pretrained(target_path)
    gen_eos = getattr(target.model.generation_config, "eos_token_id", None)
    eos = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None}
    rows, base_s, spec_s, gen, calls = [], 0.0, 0.0, 0, 0
    for messages, prompt_tools in zip(prompts, tools or [None] * len(prompts)):
        prompt = tok.apply_chat_template(messages, tools=prompt_tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        base = greedy(target, prompt, max_new, eos)
        spec = decode(target, prompt)
        rows.append({"prompt": messages[-1]["content"], "identical": base.tokens == spec.tokens,
                     "tokens": len(spec.tokens), "verify_calls": spec.verify_calls,
                     "accept_length": spec.accept_length, "text": tok.decode(spec.tokens),
                     "output_ids": spec.tokens})
        base_s, spec_s = base_s + base.seconds, spec_s + spec.seconds
        gen, calls = gen + len(spec.tokens), calls + spec.verify_calls
    return {"target": target_path, "drafter": drafter_dir, "steps": steps, "device": str(dev),
            "chain": chain,
            "identical_to_greedy": all(r["identical"] for r in rows), "completion_tokens": gen,
            "verify_calls": calls, "accept_length": gen / max(calls, 1),
            "accept_length_formula": "completion tokens / target verify calls (SGLang's spec_accept_length)",
            "speedup_wall_clock": base_s / max(spec_s, 1e-9), "prompts": rows}


def read_prompts(path: str | Path) -> list[list[dict]]:
    """A JSONL of conversations ({'messages': [...]}), each cut to its first user turn."""
    return [first_turn(json.loads(line)["messages"]) for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", help="JSONL of conversations ({'messages': [...]}); each up to its first user turn")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=16, help="prompts to run")
    a = p.parse_args(argv)
    prompts = [[{"role": "user", "content": "Count from 1 to 8."}]]
    if a.prompts:
        prompts = read_prompts(a.prompts)[:a.limit]
    report = run(a.target, a.drafter, prompts, a.steps, a.max_new_tokens)
    print(json.dumps({k: v for k, v in report.items() if k != "prompts"}, indent=1))
    return report


if __name__ == "__main__":
    main()
