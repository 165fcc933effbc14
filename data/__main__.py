"""`python -m data --config run.yaml [--data.key value ...]`: the data stage (see data/prepare.py)."""
from .config import cli_config, stage_errors
from .prepare import prepare


def main(argv: list[str] | None = None) -> None:
    cfg, _ = cli_config("data", "Eyrie data stage: conversations → tokens, loss masks, draft vocabulary.", argv)
    prepare(cfg)


if __name__ == "__main__":
    with stage_errors("data"):
        main()
