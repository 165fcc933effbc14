"""`eyrie check --config run.yaml [--deepspeed_config ds.json] [--section.key value ...]`

The whole config checked against its target before any work (the pipeline runs the same check before its first
stage): the target's directory, the aux layer ids (count, range, what SGLang reads), the draft vocabulary against
the target's, a chat template to render with, the conversation files, the drafter's shape, the extraction backend
on this machine, warm-start and DeepSpeed JSON files. Every problem is listed with its config key and the fix;
nothing is loaded but config files and the tokenizer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.config import ConfigError, EyrieConfig, load_config


def problems(cfg: EyrieConfig, deepspeed_json: str | None = None) -> list[str]:
    """'key: what is wrong; the fix' for everything that would stop a stage later on."""
    from data.target import configured_aux_layer_ids, load_target_info
    found = []
    try:
        info = load_target_info(cfg.target.path)
    except (FileNotFoundError, ValueError) as e:
        return [f"target.path: {e}; point it at a transformers model directory (config.json, safetensors, tokenizer)"]
    try:
        ids = configured_aux_layer_ids(info, cfg)  # its refusals name target.aux_layer_ids
    except ValueError as e:
        found.append(str(e))
        ids = None
    try:
        info.check_draft_vocab_size(cfg.data.draft_vocab_size)
    except ValueError as e:
        found.append(str(e))
        ids = None  # the drafter's shape is checked only with valid ids and draft vocab
    found += tokenizer_problems(cfg)
    found += [f"data.inputs: {p} does not exist" for p in cfg.data.inputs if not Path(p).exists()]
    if ids is not None:
        found += drafter_problems(cfg, info, ids)
    found += extract_problems(cfg)
    if cfg.train.warm_start and not (Path(cfg.train.warm_start) / "config.json").exists():
        found.append(f"train.warm_start: {cfg.train.warm_start} is not an exported drafter directory (no config.json)")
    if deepspeed_json:
        found += deepspeed_problems(cfg, deepspeed_json)
    return found + [p for stage in ("extract", "train") for p in (launch_problem(cfg, stage), rank_problem(cfg, stage))
                    if p]


def rank_problem(cfg: EyrieConfig, stage: str) -> str | None:
    """On GPUs rank r takes cuda:r, so a stage cannot start more ranks per node than this machine shows GPUs (on a
    CPU any number of gloo ranks runs)."""
    import torch
    ranks, gpus = getattr(cfg, stage).nproc_per_node, torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < ranks:
        return (f"{stage}.nproc_per_node is {ranks} but this machine shows {gpus} GPU(s): each rank takes one GPU; "
                f"set --{stage}.nproc_per_node {gpus} (or fewer)")
    return None


def launch_problem(cfg: EyrieConfig, stage: str) -> str | None:
    """What a stage needs to launch on several nodes (the pipeline refuses to build its command without it)."""
    launch = cfg.launch
    if launch.nnodes > 1 and stage == "extract" and not launch.rdzv_endpoint:
        return (f"launch.nnodes is {launch.nnodes}: extraction needs launch.rdzv_endpoint (HOST:PORT on the first "
                "node), and the extract stage run on every node")
    if launch.nnodes > 1 and stage == "train" and not launch.hostfile:
        return (f"launch.nnodes is {launch.nnodes}: training needs launch.hostfile (DeepSpeed launches every host "
                "listed there from this node)")
    return None


def tokenizer_problems(cfg: EyrieConfig) -> list[str]:
    path = cfg.target.tokenizer_path
    key = "target.tokenizer" if cfg.target.tokenizer else "target.path"
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code)
    except Exception as e:  # noqa: BLE001  (transformers raises OSError, ValueError, ... for a bad directory)
        return [f"{key}: no tokenizer loads from {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "point --target.tokenizer at the target's tokenizer directory"]
    if not tokenizer.chat_template:
        return [f"{key}: the tokenizer in {path} has no chat template (conversations are rendered with it); point "
                "--target.tokenizer at a tokenizer directory that has one (chat_template in tokenizer_config.json "
                "or chat_template.jinja)"]
    return []


def drafter_problems(cfg: EyrieConfig, info, ids: list[int]) -> list[str]:
    if cfg.train.drafter.family == "dflash":
        from train.families import mask_token_id
        try:
            mask_token_id(cfg, info.vocab_size)
        except ValueError as e:
            return [str(e)]
        return []
    from train.drafter import drafter_config
    try:
        drafter_config(info, cfg.train.drafter, cfg.data.draft_vocab_size, ids)
    except ValueError as e:
        return [f"train.drafter: {str(e).removeprefix('drafter: ')}"]
    return []


def extract_problems(cfg: EyrieConfig) -> list[str]:
    from extract.job import resolve_backend, resolve_device
    try:
        resolve_backend(cfg, resolve_device(cfg, 0))
    except (ValueError, RuntimeError) as e:
        return [f"extract.backend: {e}"]
    return []


def deepspeed_problems(cfg: EyrieConfig, path: str) -> list[str]:
    from train.engine import deepspeed_config
    try:
        deepspeed_config(cfg.train, 1, False, path)
    except ConfigError as e:
        return [f"--deepspeed_config: {e}"]
    except Exception as e:  # noqa: BLE001
        return [f"--deepspeed_config: {path}: {type(e).__name__}: {e}"]
    return []


def report(cfg: EyrieConfig, source: str, deepspeed_json: str | None = None) -> list[str]:
    """Print the check's result; returns the problems."""
    found = problems(cfg, deepspeed_json)
    if found:
        print(f"[check] {source}: {len(found)} problem{'s' if len(found) > 1 else ''}, nothing was run:",
              file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
    else:
        print(f"[check] {source}: target, data, drafter and launch settings are consistent", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--deepspeed_config", help="a DeepSpeed JSON the train stage would be given")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if report(cfg, args.config, args.deepspeed_config) else 0


if __name__ == "__main__":
    sys.exit(main())
