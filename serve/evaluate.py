"""Offline acceptance of exported drafters (ours or a third party's) on stored target features, no server.

    python -m serve.evaluate --drafter DIR [--drafter DIR2 ...] --run RUN_DIR [--split eval|all]
                             [--steps 7] [--draft-cost 0.05] [--out REPORT_DIR]

For every position of the chosen samples the drafter drafts a chain of `--steps` tokens from the target's
stored states (teacher forcing: exact when the data are the target's own greedy outputs, as with
`data.regenerate`); draft j is accepted while drafts 0..j all equal the target's argmax. Reported per drafter:

- acceptance by position: alpha_j = P(draft j accepted | drafts < j accepted)
- accept length tau(k) = 1 + sum_{j<k} P(drafts 0..j accepted): tokens per target verify step (SGLang's
  spec_accept_length) for chain drafting with k steps, top-k 1
- expected speedup(k) = tau(k) / (1 + k * c), c = one draft step's cost relative to a target verify step
  (`--draft-cost`; ~0.02-0.05 for a one-layer drafter on a large target)

Writes REPORT_DIR/evaluate.json and acceptance.png (one line per drafter).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from data.batching import length_grouped_batches
from data.layout import RunLayout, write_scalars
from data.shards import read_manifest
from data.target import load_target_info
from train.drafter import Eagle3Drafter
from train.loader import FeatureData
from train.teacher import Teacher
from train.metrics import score

from .drafter_dir import DrafterDirError, load_drafter


def answer_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of loss-carrying tokens: one assistant answer each, generated after a prefill."""
    edges = np.diff(np.concatenate([[0], loss_mask.astype(np.int8), [0]]))
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


def walk(depth: np.ndarray, start: int, end: int, steps: int) -> tuple[int, int]:
    """(tokens emitted, target verify steps) decoding positions start..end-1 as SGLang does with chain drafting:
    the prefill emits x[start]; after x[t+1] is verified, the chain drafted at t has depth[t] drafts accepted in a
    row, so the verify emits min(depth[t], steps) + 1 tokens and decoding goes on from there. A verify that runs
    past `end` (the answer's end or max_new_tokens) still counts, as in serving."""
    tokens, verifies, last = 1, 0, start
    while last < end - 1:
        accepted = min(int(depth[last - 1]), steps)
        tokens += min(accepted + 1, end - 1 - last)
        verifies += 1
        last += accepted + 1
    return tokens, verifies


def decoded_accept_lengths(answers: list[tuple[np.ndarray, int, int]], steps: int) -> list[float]:
    """Accept length for 1..steps draft steps by walking each answer (depth, start, end) as a decoder would:
    completion tokens / verify steps summed over answers. It weighs positions as decoding does (a hard stretch
    takes many verify steps for few tokens), where tau(k) averages chains over every position."""
    out = []
    for k in range(1, steps + 1):
        walked = [walk(depth, start, end, k) for depth, start, end in answers]
        out.append(sum(t for t, _ in walked) / max(sum(v for _, v in walked), 1))
    return out


def acceptance(drafter: Eagle3Drafter, data: FeatureData, batches: list[list[int]], teacher: Teacher,
               steps: int, device: torch.device, dtype: torch.dtype, prompt_rows: list[int],
               max_new: int) -> dict:
    per_row: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # feature row -> (depth, loss mask)

    def keep(indices: list[int], batch, result) -> None:
        for r, i in enumerate(indices):
            n = int(batch.lengths[r])
            per_row[i] = (result.depth[r, :n].cpu().numpy(), batch.loss_mask[r, :n].cpu().numpy())
    reduced = score(drafter, data, batches, teacher, steps, 1.0, device, dtype, keep).reduce()
    p = [reduced[f"p_accepted_through_step{j}"] for j in range(steps)]
    alpha = [p[0]] + [p[j] / p[j - 1] if p[j - 1] else 0.0 for j in range(1, steps)]
    tau = [1.0 + sum(p[:k]) for k in range(1, steps + 1)]
    every_answer = [(depth, *span) for depth, mask in per_row.values() for span in answer_spans(mask)]
    first_answers = []  # of the prompts serve.decode and serve.smoke use, cut at their max_new_tokens
    for i in prompt_rows:
        depth, mask = per_row[i]
        spans = answer_spans(mask)
        if spans:  # an answer truncated away by data.max_length leaves none
            start, end = spans[0]
            first_answers.append((depth, start, min(end, start + max_new)))
    return {"chains": int(reduced["chains"]), "p_accepted_through": p, "alpha_by_position": alpha,
            "accept_length_by_steps": tau, "decoded_accept_length_by_steps": decoded_accept_lengths(every_answer, steps),
            "prompts": {"count": len(first_answers), "max_new_tokens": max_new,
                        "decoded_accept_length_by_steps": decoded_accept_lengths(first_answers, steps)}}


def evaluate(drafters: list[str], run_dir: str | Path, split: str = "eval", steps: int = 7,
             draft_cost: float = 0.05, max_batch_tokens: int = 8192, eval_fraction: float | None = None,
             prompts: int = 16, max_new: int = 64) -> dict:
    layout = RunLayout(run_dir)
    features = read_manifest(layout.features)
    config = json.loads(layout.train_summary.read_text())["config"] if layout.train_summary.exists() else None
    target = features["meta"]["target_id"]
    fraction = eval_fraction if eval_fraction is not None else (config["train"]["eval_fraction"] if config else 0.05)
    data = FeatureData(layout.features, fraction, max_batch_tokens, seed=0, rank=0, world=1)
    picked = data.eval_idx if split == "eval" else np.arange(len(data.ds))
    row_of = {data.sample_ids[i]: int(i) for i in picked}
    prompt_rows = [row_of[c] for c, _ in held_out_conversations(run_dir, prompts) if c in row_of] if config else []
    batches = length_grouped_batches(data.lengths, picked, max_batch_tokens, None)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info = load_target_info(target)
    report = {"features": str(layout.features), "target": target, "split": split, "samples": int(len(picked)), "steps": steps,
              "draft_cost": draft_cost, "formulas": {
                  "alpha_j": "P(draft j accepted | drafts < j accepted)",
                  "accept_length(k)": "1 + sum_{j<k} P(drafts 0..j accepted) = tokens per target verify step",
                  "speedup(k)": "accept_length(k) / (1 + k * draft_cost)",
                  "decoded_accept_length(k)": "completion tokens / verify steps decoding each answer from its "
                                              "first token, each verify emitting the drafts its chain got right + 1",
                  "prompts": f"the first {prompts} held-out prompts' first answers, cut at {max_new} tokens: "
                             "the prompts serve.decode and serve.smoke decode"}, "drafters": {}}
    for path in drafters:
        model = load_drafter(path, target, device, dtype)
        ids = model.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
        if list(ids) != list(features["meta"]["aux_layer_ids"]):
            raise DrafterDirError(f"{path}: reads layers {ids}, but {layout.features} holds layers "
                                  f"{features['meta']['aux_layer_ids']} (extract with those ids to compare)")
        teacher = Teacher.from_target(target, info.text_config, features["meta"]["final_hidden"], model.t2d, device,
                                      dtype)
        result = acceptance(model, data, batches, teacher, steps, device, dtype, prompt_rows, max_new)
        result["speedup_by_steps"] = [t / (1 + (k + 1) * draft_cost)
                                      for k, t in enumerate(result["accept_length_by_steps"])]
        report["drafters"][str(path)] = result
    return report


def held_out_conversations(run_dir: str | Path, n: int) -> list[tuple[str, list[dict]]]:
    """(id, first user turn) of up to n conversations the drafter did not train on (the eval split's ids)."""
    from data.conversations import SkipReport, load_conversations
    from train.loader import held_out

    from .decode import first_turn
    config = json.loads(RunLayout(run_dir).train_summary.read_text())["config"]
    out = []
    for conv in load_conversations(config["data"]["inputs"], SkipReport(), skip_malformed=True):
        if len(out) == n:
            break
        if held_out(conv.id, config["train"]["eval_fraction"]):
            out.append((conv.id, first_turn(conv.messages)))
    return out


def held_out_prompts(run_dir: str | Path, n: int) -> list[list[dict]]:
    """First user turns of up to n conversations the drafter did not train on: the prompts serve.decode and
    serve.smoke decode."""
    return [messages for _, messages in held_out_conversations(run_dir, n)]


def print_table(report: dict) -> None:
    names = list(report["drafters"])
    print(f"{report['samples']} samples ({report['split']}), chain drafting, top-k 1; accept = tau(k) over "
          f"positions, decoded = walked answer by answer, prompts = decoded on {report['formulas']['prompts']}; "
          f"speedup = accept / (1 + steps x {report['draft_cost']})")
    print(f"{'steps':>5} " + " ".join(f"{'alpha':>7} {'accept':>7} {'decoded':>7} {'prompts':>7} {'speedup':>7}"
                                      for _ in names))
    for k in range(report["steps"]):
        cells = []
        for n in names:
            r = report["drafters"][n]
            cells.append(f"{r['alpha_by_position'][k]:7.3f} {r['accept_length_by_steps'][k]:7.3f} "
                         f"{r['decoded_accept_length_by_steps'][k]:7.3f} "
                         f"{r['prompts']['decoded_accept_length_by_steps'][k]:7.3f} {r['speedup_by_steps'][k]:7.3f}")
        print(f"{k + 1:>5} " + " ".join(cells))
    for i, n in enumerate(names):
        print(f"  drafter {i + 1}: {n}")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in report["drafters"].items():
        ax.plot(range(1, report["steps"] + 1), r["alpha_by_position"], marker="o",
                label=f"{Path(name).name} (accept length {r['accept_length_by_steps'][-1]:.2f})")
    ax.set(xlabel="draft position j", ylabel="P(accepted | earlier accepted)", ylim=(0, 1),
           title="acceptance by position (offline)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", required=True, help="an exported drafter dir (repeat to compare)")
    p.add_argument("--run", required=True, help="RUN_DIR whose features/ to evaluate on")
    p.add_argument("--split", choices=["eval", "all"], default="eval", help="held-out samples (default) or all")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--draft-cost", type=float, default=0.05)
    p.add_argument("--out", default=None, help="report dir (default RUN_DIR/evaluate)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also run the reference speculative decoder (serve.decode) on N held-out prompts")
    p.add_argument("--decode-steps", type=int, default=3)
    a = p.parse_args(argv)
    report = evaluate(a.drafter, a.run, a.split, a.steps, a.draft_cost, prompts=a.decode or 16)
    out = Path(a.out) if a.out else RunLayout(a.run).evaluate
    out.mkdir(parents=True, exist_ok=True)
    if a.decode:
        from .decode import run as decode
        report["decode"] = {d: decode(report["target"], d, held_out_prompts(a.run, a.decode), a.decode_steps)
                            for d in a.drafter}
    (out / "evaluate.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "acceptance.png")
    scalars: dict[int, dict[str, float]] = {}  # x axis: draft steps k
    for name, r in report["drafters"].items():
        for k in range(report["steps"]):
            scalars.setdefault(k + 1, {}).update({f"{Path(name).name}/alpha": r["alpha_by_position"][k],
                                                  f"{Path(name).name}/accept_length": r["accept_length_by_steps"][k]})
    for name, d in report.get("decode", {}).items():
        scalars.setdefault(d["steps"], {})[f"{Path(name).name}/reference_decoder_accept_length"] = d["accept_length"]
    write_scalars(a.run, "evaluate", scalars)
    print_table(report)
    for name, d in report.get("decode", {}).items():
        print(f"reference decoder, {name}: accept length {d['accept_length']:.3f} ({d['accept_length_formula']}) "
              f"over {len(d['prompts'])} prompts, {d['steps']} steps; output identical to greedy: "
              f"{d['identical_to_greedy']}; wall-clock speedup {d['speedup_wall_clock']:.2f}x on {d['device']}")
    print(f"report: {out / 'evaluate.json'}, plot: {out / 'acceptance.png'}")
    return report


if __name__ == "__main__":
    from data.config import stage_errors
    with stage_errors("evaluate"):
        main()
