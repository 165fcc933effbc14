"""Offline acceptance of exported drafters (ours or a third party's) on stored target features, no server.

    python -m serve.evaluate --drafter DIR [--drafter DIR2 ...] --run RUN_DIR [--split eval|all]
                             [--steps 7] [--draft-cost 0.05] [--out REPORT_DIR]

The samples are the run's held-out groups (RUN_DIR/data/split.json, data/split.py: prompts split by their content,
"sampled" by the prompt hash and any group the rows name), each reported on its own; the stage refuses when a
held-out prompt occurs in the training data or the drafter was trained with another split. For every position of
the chosen samples the drafter drafts a chain of `--steps` tokens from the target's
stored states (teacher forcing: exact when the data are the target's own greedy outputs, as with
`data.regenerate`); draft j is accepted while drafts 0..j all equal the target's argmax. Reported per drafter:

- acceptance by position: alpha_j = P(draft j accepted | drafts < j accepted)
- accept length tau(k) = 1 + sum_{j<k} P(drafts 0..j accepted): tokens per target verify step (SGLang's
  spec_accept_length) for chain drafting with k steps, top-k 1
- expected speedup(k) = tau(k) / (1 + k * c), c = one draft step's cost relative to a target verify step
  (`--draft-cost`; ~0.02-0.05 for a one-layer drafter on a large target)

Writes REPORT_DIR/evaluate.json and acceptance.png (one line per drafter and group).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from data.batching import length_grouped_batches
from data.layout import RunLayout, write_scalars
from data.shards import read_manifest
from data.split import HeldOutLeak, check_no_overlap, heldout_ids, read_split, split_digest
from data.target import load_target_info
from train.drafter import Eagle3Drafter
from train.loader import FeatureData
from train.metrics import score
from train.teacher import Teacher

from .drafter_dir import DrafterDirError, load_drafter, target_match


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


def heldout_rows(layout: RunLayout, split: str, max_batch_tokens: int = 8192
                 ) -> tuple[dict, FeatureData, dict[str, list[int]]]:
    """The split record, the features, and each held-out group's feature rows (`split="eval"`), or every row as
    group "all" (`split="all"`: training samples included, so not a held-out figure)."""
    record = heldout_record(layout) if split == "eval" else read_split(layout.split)
    data = FeatureData(layout.features, heldout_ids(record), max_batch_tokens, seed=0, rank=0, world=1)
    if split != "eval":
        return record, data, {"all": list(range(len(data.ds)))}
    row_of = {s: i for i, s in enumerate(data.sample_ids)}
    return record, data, {g: [row_of[r["id"]] for r in record["heldout"] if r["group"] == g and r["id"] in row_of]
                          for g in record["groups"]}


def evaluate(drafters: list[str], run_dir: str | Path, split: str = "eval", steps: int = 7,
             draft_cost: float = 0.05, max_batch_tokens: int = 8192, prompts: int = 16, max_new: int = 64) -> dict:
    """Offline acceptance of each drafter on each held-out group (`split="eval"`, RUN_DIR/data/split.json) or on
    every sample (`split="all"`, group "all": training samples included, so not a held-out figure)."""
    layout = RunLayout(run_dir)
    features = read_manifest(layout.features)
    target = features["meta"]["target_id"]
    record, data, group_rows = heldout_rows(layout, split, max_batch_tokens)
    row_of = {s: i for i, s in enumerate(data.sample_ids)}
    group_prompts = {g: [row_of[p.id] for p in heldout_prompts(record, g, prompts) if p.id in row_of]
                     for g in record["groups"]} if split == "eval" else {"all": []}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info = load_target_info(target)
    report = {"features": str(layout.features), "target": target, "split": split, "steps": steps,
              "draft_cost": draft_cost, "chain": chain_label(steps, source="offline"),
              "split_rule": record["rule"], "heldout_overlap_with_training": record["heldout_overlap_with_training"],
              "groups": {g: {"samples": len(rows), "tokens": int(data.lengths[rows].sum()) if rows else 0,
                             "prompts": (record["groups"].get(g, {}).get("prompts") if split == "eval" else None)}
                         for g, rows in group_rows.items()},
              "formulas": {
                  "alpha_j": "P(draft j accepted | drafts < j accepted)",
                  "accept_length(k)": "1 + sum_{j<k} P(drafts 0..j accepted) = tokens per target verify step",
                  "speedup(k)": "accept_length(k) / (1 + k * draft_cost)",
                  "decoded_accept_length(k)": "completion tokens / verify steps decoding each answer from its "
                                              "first token, each verify emitting the drafts its chain got right + 1",
                  "prompts": f"the first {prompts} held-out prompts of each group, first answers cut at {max_new} "
                             "tokens: the prompts serve.decode and serve.smoke decode"}, "drafters": {}}
    report["target_match"] = {}
    for path in drafters:
        report["target_match"][str(path)] = match = target_match(path, target)
        if match["same_target"] is False:
            print(f"[evaluate] note: {path}: {match['note']}", flush=True)
        model = load_drafter(path, target, device, dtype)
        ids = model.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
        if list(ids) != list(features["meta"]["aux_layer_ids"]):
            raise DrafterDirError(f"{path}: reads layers {ids}, but {layout.features} holds layers "
                                  f"{features['meta']['aux_layer_ids']} (extract with those ids to compare)")
        teacher = Teacher.from_target(target, info.text_config, features["meta"]["final_hidden"], model.t2d, device,
                                      dtype)
        by_group = {}
        for group, rows in group_rows.items():
            if not rows:
                continue
            batches = length_grouped_batches(data.lengths, np.array(rows), max_batch_tokens, None)
            result = acceptance(model, data, batches, teacher, steps, device, dtype, group_prompts[group], max_new)
            result["speedup_by_steps"] = [t / (1 + (k + 1) * draft_cost)
                                          for k, t in enumerate(result["accept_length_by_steps"])]
            by_group[group] = result
        report["drafters"][str(path)] = by_group
    return report


def dflash_acceptance(path: str, group_rows: dict[str, list[int]], data: FeatureData, blocks_per_sample: int = 64,
                      max_batch_tokens: int = 8192) -> dict:
    """A DFlash drafter on each held-out group's stored features: blocks anchored at up to `blocks_per_sample`
    positions of each sample (the same ones every run), drafted over the context before them; the accept length
    of a block = 1 + its drafts equal to the sample's tokens in a row (greedy, teacher-forced context)."""
    from data.target import load_embedding_and_head
    from train.dflash import dflash_objective
    from train.metrics import BlockStats

    from . import dflash_dir
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = dflash_dir.load(path, device, dtype)
    ids, block_size = model.config.dflash_config["target_layer_ids"], model.config.dflash_config["block_size"]
    if list(ids) != list(data.meta["aux_layer_ids"]):
        raise DrafterDirError(f"{path}: reads layers {ids}, but the features hold layers "
                              f"{data.meta['aux_layer_ids']} (extract with those ids to compare)")
    embed, head = (t.to(device, dtype) for t in load_embedding_and_head(data.meta["target_id"]))
    out = {}
    for group, rows in group_rows.items():
        stats = BlockStats(block_size)
        for i, indices in enumerate(length_grouped_batches(data.lengths, np.array(rows), max_batch_tokens, None)):
            b = data.collate(indices).to(device, dtype)
            with torch.no_grad():
                stats.add(dflash_objective(model, embed, head, b.input_ids, b.aux_hidden, b.loss_mask, b.lengths,
                                           blocks_per_sample, None, torch.Generator().manual_seed(i)),
                          b.tokens, b.padded)
        s = stats.reduce()
        if s["blocks"]:
            out[group] = {"blocks": int(s["blocks"]), "accept_length": s["accept_length"],
                          "accuracy_by_position": [s[f"acc_pos{j}"] for j in range(1, block_size)],
                          "block_size": block_size}
    return out


def chain_label(steps: int, source: str, topk: int = 1) -> str:
    """How every accept length is labelled: its chain and who measured it."""
    draft_tokens = steps + 1 if topk == 1 else None
    return f"{source}, {steps} steps / top-k {topk}" + (f" / {draft_tokens} draft tokens" if draft_tokens else "")


def heldout_record(layout: RunLayout) -> dict:
    """The run's split, checked: no held-out prompt in the training data, and the drafter trained on this split."""
    record = read_split(layout.split)
    check_no_overlap(record, str(layout.split))
    if layout.train_summary.exists():
        trained = json.loads(layout.train_summary.read_text()).get("split", {})
        if trained.get("digest") != split_digest(record):
            raise HeldOutLeak(f"{layout.train_summary} was trained with another held-out split than {layout.split} "
                              "(the data stage ran again after training): train again before evaluating")
    return record


class HeldOutPrompt(NamedTuple):
    id: str
    messages: list[dict]       # the conversation up to its first user turn
    tools: list[dict] | None   # the row's tool declarations: the template renders them into the prompt


def heldout_prompts(record: dict, group: str, n: int) -> list[HeldOutPrompt]:
    """The first n held-out prompts of a group of a split record (data/split.py), in data order, distinct prompts
    only: what serve.decode and serve.smoke decode."""
    out, seen = [], set()
    for row in record["heldout"]:
        key = json.dumps([row["prompt"], row.get("tools")])
        if row["group"] == group and key not in seen and len(out) < n:
            seen.add(key)
            out.append(HeldOutPrompt(row["id"], row["prompt"], row.get("tools")))
    return out


def print_table(report: dict) -> None:
    names = list(report["drafters"])
    if not names:
        return
    print(f"offline evaluator, chain drafting, top-k 1; accept = tau(k) over "
          f"positions, decoded = walked answer by answer, prompts = {report['formulas']['prompts']}; "
          f"speedup = accept / (1 + steps x {report['draft_cost']})")
    for group, sizes in report["groups"].items():
        print(f"group {group!r}: {sizes['samples']} samples, {sizes['tokens']} tokens"
              + (f", {sizes['prompts']} distinct prompts" if sizes.get("prompts") is not None else ""))
        print(f"{'steps':>5} " + " ".join(f"{'alpha':>7} {'accept':>7} {'decoded':>7} {'prompts':>7} {'speedup':>7}"
                                          for _ in names))
        for k in range(report["steps"]):
            cells = []
            for n in names:
                r = report["drafters"][n].get(group)
                cells.append(f"{r['alpha_by_position'][k]:7.3f} {r['accept_length_by_steps'][k]:7.3f} "
                             f"{r['decoded_accept_length_by_steps'][k]:7.3f} "
                             f"{r['prompts']['decoded_accept_length_by_steps'][k]:7.3f} "
                             f"{r['speedup_by_steps'][k]:7.3f}" if r else f"{'-':>39}")
            print(f"{k + 1:>5} " + " ".join(cells))
    for i, n in enumerate(names):
        print(f"  drafter {i + 1}: {n}")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, groups in report["drafters"].items():
        for group, r in groups.items():
            ax.plot(range(1, report["steps"] + 1), r["alpha_by_position"], marker="o",
                    label=f"{Path(name).name}, {group} (accept length {r['accept_length_by_steps'][-1]:.2f})")
    ax.set(xlabel="draft position j", ylabel="P(accepted | earlier accepted)", ylim=(0, 1),
           title="acceptance by position (offline)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", required=True, help="an exported drafter dir (repeat to compare)")
    p.add_argument("--run", required=True, help="RUN_DIR whose features/ to evaluate on")
    p.add_argument("--split", choices=["eval", "all"], default="eval",
                   help="held-out groups (default) or every sample (training samples too: not a held-out figure)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--draft-cost", type=float, default=0.05)
    p.add_argument("--out", default=None, help="report dir (default RUN_DIR/evaluate)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also run the reference speculative decoder (serve.decode) on N held-out prompts per group")
    p.add_argument("--decode-steps", type=int, default=3)
    a = p.parse_args(argv)
    from . import dflash_dir
    blocks = [d for d in a.drafter if dflash_dir.is_dflash_dir(d)]  # DFlash drafters: their own offline figure
    report = evaluate([d for d in a.drafter if d not in blocks], a.run, a.split, a.steps, a.draft_cost,
                      prompts=a.decode or 16)
    if blocks:
        _, data, rows = heldout_rows(RunLayout(a.run), a.split)
        report["dflash_drafters"] = {d: dflash_acceptance(d, rows, data) for d in blocks}
        report["target_match"] |= {d: target_match(d, report["target"]) for d in blocks}
    out = Path(a.out) if a.out else RunLayout(a.run).evaluate
    out.mkdir(parents=True, exist_ok=True)
    if a.decode and a.split == "eval":
        from .decode import run as decode
        record = read_split(RunLayout(a.run).split)
        prompts = {g: heldout_prompts(record, g, a.decode) for g in report["groups"]}
        report["decode"] = {d: {g: decode(report["target"], d, [p.messages for p in ps], a.decode_steps,
                                          tools=[p.tools for p in ps]) for g, ps in prompts.items()}
                            for d in a.drafter}
    (out / "evaluate.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "acceptance.png")
    scalars: dict[int, dict[str, float]] = {}  # x axis: draft steps k
    for name, groups in report["drafters"].items():
        for group, r in groups.items():
            for k in range(report["steps"]):
                scalars.setdefault(k + 1, {}).update({
                    f"{Path(name).name}/{group}/alpha": r["alpha_by_position"][k],
                    f"{Path(name).name}/{group}/offline_accept_length": r["accept_length_by_steps"][k]})
    for name, groups in report.get("decode", {}).items():
        for group, d in groups.items():
            scalars.setdefault(d["steps"], {})[f"{Path(name).name}/{group}/reference_decoder_accept_length"] = \
                d["accept_length"]
    write_scalars(a.run, "evaluate", scalars)
    print_table(report)
    for name, groups in report.get("decode", {}).items():
        for group, d in groups.items():
            print(f"{d['chain']}, {name}, group {group!r}: "
                  f"accept length {d['accept_length']:.3f} ({d['accept_length_formula']}) over {len(d['prompts'])} "
                  f"prompts, {d['completion_tokens']} tokens; output identical to greedy: {d['identical_to_greedy']}; "
                  f"wall-clock speedup {d['speedup_wall_clock']:.2f}x on {d['device']}")
    for name, groups in report.get("dflash_drafters", {}).items():
        for group, d in groups.items():
            print(f"offline evaluator, DFlash blocks of {d['block_size']}, {name}, group {group!r}: accept length "
                  f"{d['accept_length']:.3f} over {d['blocks']} blocks (1 + drafts equal to the sample's tokens in "
                  "a row, teacher-forced context)")
    print(f"held-out split: {report['split_rule']}; overlap with training {report['heldout_overlap_with_training']}")
    print(f"report: {out / 'evaluate.json'}, plot: {out / 'acceptance.png'}")
    return report


if __name__ == "__main__":
    from data.config import stage_errors
    with stage_errors("evaluate"):
        main()
