"""`python -m data --config run.yaml [--data.key value ...]`: the data stage (see data/prepare.py)."""
from .config import cli_config
from .prepare import prepare

if __name__ == "__main__":
    cfg, _ = cli_config("Eyrie data stage: conversations → tokens, loss masks, draft vocabulary.")
    prepare(cfg)
