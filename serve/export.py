"""Export a trained drafter for SGLang, or import a third-party one.

    python -m serve.export --checkpoint RUN_DIR [--tag latest|best|stepN] --out DRAFTER_DIR [--untrained-out DIR]
    python -m serve.export --from-sglang DIR --out DRAFTER_DIR [--target TARGET] [--untrained-out DIR]

Export consolidates the DeepSpeed checkpoint (any ZeRO stage, with DeepSpeed's zero_to_fp32), writes
`config.json` + `model.safetensors` (bf16 weights, int64 `d2t`, bool `t2d`) + a model card, validates the key
set, shapes, vocab and layer ids, and then, when sglang is importable, loads the directory through SGLang's
own loader (serve/sglang_check.py). Import reads a published drafter (its layer ids from its config; with
`--target`, a config naming none takes SGLang's default ids for that target), validates it the same way and
writes it in this layout, its weights in their stored dtype: `train.warm_start` (which keeps its RoPE and norm
settings) and `serve.evaluate` take it.
`--untrained-out` also writes a freshly initialised drafter of the same shape, vocab and layer ids (seed
`--seed`): the baseline that shows what training bought, in the same process (no second start-up).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from data.files import read_json
from data.layout import RunLayout
from data.shards import read_manifest
from data.target import declared_dtype, load_target_info
from train.drafter import eagle31_options
from train.drafters import arch_of

from . import dflash_dir
from .drafter_dir import (DrafterDirError, expected_shapes, read_config, read_tensors, sglang_config, validate,
                          write_trained_on, write_whole)


def resolve_tag(checkpoints: Path, tag: str) -> str:
    if tag == "latest":
        return (checkpoints / "latest").read_text().strip()
    if tag == "best":
        best = checkpoints / "best.json"
        if not best.exists():
            raise DrafterDirError(f"{best}: no best checkpoint recorded (no eval ran); use --tag latest")
        return json.loads(best.read_text())["tag"]
    if not (checkpoints / tag).is_dir():
        raise DrafterDirError(f"{checkpoints / tag}: no such checkpoint (have: "
                              f"{', '.join(sorted(p.name for p in checkpoints.glob('step*')))})")
    return tag


def consolidate(checkpoints: Path, tag: str) -> dict[str, torch.Tensor]:
    """The trained weights of one tag, whatever the ZeRO stage and rank count."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=tag, exclude_frozen_parameters=True)


def write_drafter_dir(out: Path, config: LlamaConfig, tensors: dict[str, torch.Tensor], card: str,
                      weights_dtype: torch.dtype | None = torch.bfloat16) -> None:
    """The directory, written whole or not at all; floating tensors in `weights_dtype` (None: as they are)."""
    tensors = {k: v.to(weights_dtype or v.dtype).contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in tensors.items()}
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
    validate(config, tensors, str(out))
    write_whole(out, tensors, sglang_config(config), card)


SERVED_STEPS = 3  # the chain the model card's serve command uses (and the pipeline's reference decoder)


def model_card(config: LlamaConfig, summary: dict, tag: str, features: dict) -> str:
    c, best = summary["config"], summary.get("best") or {}
    ev = summary.get("eval") or {}
    ttt = c["train"]["ttt_steps"]
    acc = ", ".join(f"{ev[k]:.3f}" for k in sorted(k for k in ev if k.startswith("acc_step")))
    # tau(k) = 1 + sum_{j<k} P(drafts 0..j accepted): the served chain's figure, from the same evaluation
    served = min(SERVED_STEPS, ttt)
    tau = 1 + sum(ev.get(f"p_accepted_through_step{j}", float("nan")) for j in range(served))
    split = summary.get("split", {})
    return f"""# EAGLE-3 drafter (exported by Eyrie)

- Target: `{c['target']['path']}` (config hash {features['meta']['target_config_hash']}), aux layer ids
  {config.eagle_config['eagle_aux_hidden_state_layer_ids']} (SGLang convention: output of decoder layer i)
- Data: {features['totals']['rows']} samples, {features['totals']['tokens']} tokens from {c['data']['inputs']};
  {split.get('heldout_samples', '?')} held out ({split.get('rule', 'split rule not recorded')}; held-out overlap with
  training: {split.get('heldout_overlap_with_training', '?')})
- Drafter: hidden {config.hidden_size}, {config.num_attention_heads}/{config.num_key_value_heads} heads, MLP
  {config.intermediate_size}, draft vocab {config.draft_vocab_size} of {config.vocab_size}; EAGLE-3.1 options:
  {', '.join(k for k, on in eagle31_options(config).items() if on) or 'none'}
- Training: checkpoint `{tag}` of {summary['steps']} steps, {summary['tokens']} tokens, {summary['world_size']} ranks,
  TTT {ttt} steps
- Accept length (tokens per target verify step, = SGLang's spec_accept_length) for the serve command below
  ({served} steps / top-k 1 / {served + 1} draft tokens), offline on the held-out samples (teacher-forced chains at
  every position, final step): **{tau:.3f}**. At {ttt} steps: {ev.get('accept_length', float('nan')):.3f} (best
  {best.get('accept_length', float('nan')):.3f} at `{best.get('tag', '-')}`); per-step accuracy (draft argmax ==
  target argmax) {acc or '-'}. The run's evaluate stage adds the reference decoder's figure on held-out prompts.

Serve: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3
--speculative-draft-model-path THIS_DIR --speculative-num-steps {served} --speculative-eagle-topk 1
--speculative-num-draft-tokens {served + 1}`
"""


def export(run_dir: str | Path, tag: str, out: str | Path, check_with_sglang: bool = True) -> dict:
    layout, out = RunLayout(run_dir), Path(out)
    checkpoints = layout.checkpoints
    if not (checkpoints / "latest").exists():
        raise DrafterDirError(f"{checkpoints}: no checkpoint (train first: deepspeed train/main.py ...)")
    tag = resolve_tag(checkpoints, tag)
    config = LlamaConfig(**json.loads(layout.drafter_config.read_text()))
    weights = consolidate(checkpoints, tag)
    if config.architectures == [dflash_dir.SGLANG_CLASS]:
        return export_dflash(config, weights, layout, tag, out, check_with_sglang)
    tensors = {k: v for k, v in weights.items() if k in expected_shapes(config)}
    features = read_manifest(layout.features)
    validate(config, tensors, str(checkpoints / tag), layer_ids=features["meta"]["aux_layer_ids"])
    summary = json.loads(layout.train_summary.read_text())
    write_drafter_dir(out, config, tensors, model_card(config, summary, tag, features))
    write_trained_on(out, features["meta"])
    report = {"drafter": str(out), "tag": tag, "tensors": len(tensors)}
    if check_with_sglang:
        report["sglang_check"] = maybe_check_with_sglang(out)
    return report


def export_dflash(config: LlamaConfig, weights: dict[str, torch.Tensor], layout: RunLayout, tag: str, out: Path,
                  check_with_sglang: bool) -> dict:
    """A DFlash drafter's directory (serve/dflash_dir.py): its tensors as trained, its config as SGLang reads it."""
    summary = json.loads(layout.train_summary.read_text())
    dc, ev = config.dflash_config, summary.get("eval") or {}
    card = f"""# DFlash drafter (exported by Eyrie)

- Target: `{summary['config']['target']['path']}`, target layer ids {dc['target_layer_ids']} (output of decoder layer i)
- Drafter: {config.num_hidden_layers} layers, blocks of {dc['block_size']}, mask token id {dc['mask_token_id']}
- Training: checkpoint `{tag}` of {summary['steps']} steps, {summary['tokens']} tokens; held-out greedy accept length
  of a block (tokens per verify step, teacher-forced context): {ev.get('accept_length', float('nan')):.3f}

Serve: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
--speculative-draft-model-path THIS_DIR --speculative-num-draft-tokens {dc['block_size']}`
"""
    dflash_dir.write(out, config, weights, card)
    write_trained_on(out, read_manifest(layout.features)["meta"])
    report = {"drafter": str(out), "tag": tag, "tensors": len(weights), "family": "dflash"}
    if check_with_sglang:
        report["sglang_check"] = maybe_check_with_sglang(out, "dflash")
    return report


def import_sglang(src: str | Path, out: str | Path, check_with_sglang: bool = True,
                  target: str | Path | None = None) -> dict:
    """A published drafter into this layout, kept as it was: weights in their stored dtype, its RoPE and norm
    settings, its layer ids (with `target`, a config naming none takes SGLang's default ids for that target).
    `t2d` is derived from `d2t` when the publisher left it out; an `embed_tokens.weight` SGLang would replace by
    the target's (hidden sizes equal) is dropped. Every such change is listed in the report and the model card."""
    notes = []
    default_ids = load_target_info(target).aux_layer_ids(None) if target else None
    config, tensors = read_config(src, default_ids), read_tensors(src)
    raw = read_json(Path(src) / "config.json")  # read_config has checked it exists
    raw_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not raw_ids and default_ids:
        notes.append(f"its config names no aux layer ids: took {default_ids}, the layers SGLang captures for a "
                     f"drafter without ids on {target} (set_eagle3_layers_to_capture(None))")
    if "d2t" in tensors and "t2d" not in tensors:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(tensors["d2t"])) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
        notes.append("t2d derived from d2t")
    if "embed_tokens.weight" in tensors and "embed_tokens.weight" not in expected_shapes(config):
        del tensors["embed_tokens.weight"]
        notes.append("embed_tokens.weight dropped: its hidden size is the target's, and SGLang serves an EAGLE-3 "
                     "drafter with the target's embedding then (Eyrie's evaluation does the same)")
    validate(config, tensors, str(src))
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    declared = declared_dtype(raw)
    if declared and stored != [declared]:
        notes.append(f"weights stored as {', '.join(stored)} while its config declares {declared}: kept as stored "
                     f"(SGLang casts them to the dtype it serves in)")
    card = f"# EAGLE-3 drafter imported from `{src}`\n\nAux layer ids: " \
           f"{config.eagle_config['eagle_aux_hidden_state_layer_ids']}; weights {', '.join(stored)}\n" + \
        "".join(f"\n- {n}" for n in notes) + ("\n" if notes else "")
    write_drafter_dir(Path(out), config, tensors, card, weights_dtype=None)
    report = {"drafter": str(out), "imported_from": str(src), "tensors": len(tensors), "weights_dtype": stored,
              "changes": notes}
    if check_with_sglang:
        report["sglang_check"] = maybe_check_with_sglang(Path(out))
    return report


def untrained_like(src: str | Path, out: str | Path, seed: int = 0) -> dict:
    """A drafter of src's shape, draft vocab and layer ids with the initial weights training starts from."""
    from train.drafter import Eagle3Drafter
    if dflash_dir.is_dflash_dir(src):
        raise DrafterDirError(f"{src}: an untrained twin is made for EAGLE-3 drafters only (this is a DFlash one)")
    config, tensors = read_config(src), read_tensors(src)
    torch.manual_seed(seed)
    model = Eagle3Drafter(config, tensors["d2t"], tensors["t2d"])
    fresh = {k: v for k, v in model.state_dict().items() if k in tensors}
    write_drafter_dir(Path(out), config, fresh, f"# Untrained EAGLE-3 drafter shaped like `{src}` (seed {seed})\n")
    return {"drafter": str(out), "untrained_like": str(src), "tensors": len(fresh)}


def maybe_check_with_sglang(directory: Path, family: str = "eagle3") -> dict | str:
    if importlib.util.find_spec("sglang") is None:  # asked, not imported: the check imports it in its worker
        return "not run: sglang is not installed (pip install -e '.[sglang]')"
    if family == "eagle3":
        config = read_config(directory)
        problem = arch_of(config).cpu_check_problem(config)
        if problem:
            return f"not run: {problem}"
    from .sglang_check import check_in_subprocess
    return check_in_subprocess(directory)[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run directory (RUN_DIR) with train/checkpoints")
    src.add_argument("--from-sglang", help="a published EAGLE-3 drafter directory to import")
    p.add_argument("--untrained-out", help="also write an untrained EAGLE-3 drafter of the result's shape here")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed for --untrained-out")
    p.add_argument("--target", help="--from-sglang: the target it will serve on (a drafter naming no layer ids "
                                    "takes SGLang's default ids for it)")
    p.add_argument("--tag", default="latest", help="latest | best | stepN")
    p.add_argument("--out", required=True)
    p.add_argument("--no-sglang-check", action="store_true", help="skip loading the result with SGLang's loader")
    a = p.parse_args(argv)
    try:
        report = export(a.checkpoint, a.tag, a.out, not a.no_sglang_check) if a.checkpoint else \
            import_sglang(a.from_sglang, a.out, not a.no_sglang_check, a.target)
        if a.untrained_out:
            report["untrained"] = untrained_like(a.out, a.untrained_out, a.seed)
    except DrafterDirError as e:
        p.exit(1, f"error: {e}\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
