"""`python -m launch.demo`: the embedded tiny default, end to end on a CPU.

Builds the demo target (generated corpus, trained tokenizer, tiny Llama) under runs/demo/assets, then runs
the pipeline on launch/configs/demo.yaml. Extra arguments go to the pipeline (e.g. --stages data).
"""
import sys
from pathlib import Path

from launch.demo_target import build_demo_assets
from launch.pipeline import main as pipeline

CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def main(argv: list[str] | None = None) -> dict:
    assets = Path("runs/demo/assets")
    if not (assets / "target" / "config.json").exists():
        print(f"[demo] building the demo target in {assets}", flush=True)
        build_demo_assets(assets)
    return pipeline(["--config", str(CONFIG), *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
