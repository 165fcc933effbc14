"""`python -m launch.demo`: the embedded tiny default, end to end on a CPU (or on this machine's GPUs).

Builds the demo target (generated corpus, trained tokenizer, tiny Llama) under runs/demo/assets, then runs
the pipeline on launch/configs/demo.yaml. Extra arguments go to the pipeline (e.g. --stages data).
"""
import sys
from pathlib import Path

import torch

from launch.demo_target import build_demo_assets
from launch.pipeline import main as pipeline

CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def main(argv: list[str] | None = None) -> dict:
    assets = Path("runs/demo/assets")
    if not (assets / "target" / "config.json").exists():
        print(f"[demo] building the demo target in {assets}", flush=True)
        build_demo_assets(assets)
    argv = sys.argv[1:] if argv is None else argv
    return pipeline(["--config", str(CONFIG), *rank_overrides(argv), *argv])


def demo_ranks() -> int:
    """The demo's two ranks per stage (gloo on a CPU), or one per GPU where this machine has fewer than two."""
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def rank_overrides(argv: list[str]) -> list[str]:
    """--extract/--train.nproc_per_node for demo_ranks(), unless the command line sets them."""
    given = {a.split("=")[0] for a in argv}
    return [a for stage in ("extract", "train") if f"--{stage}.nproc_per_node" not in given
            for a in (f"--{stage}.nproc_per_node", str(demo_ranks()))]


if __name__ == "__main__":
    main()
