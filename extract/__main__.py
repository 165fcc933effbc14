"""`torchrun --nproc-per-node N -m extract --config run.yaml` (or plain `python -m extract ...`).

Reads RUN_DIR/data/samples, writes RUN_DIR/features (see extract/job.py)."""
from data.config import cli_config, stage_errors

from .job import run


def main(argv: list[str] | None = None) -> None:
    cfg, _ = cli_config("extract", "Eyrie extraction: target hidden states into Arrow shards.", argv)
    run(cfg)


if __name__ == "__main__":
    with stage_errors("extract"):
        main()
