"""`eyrie`: one command for the whole project.

    eyrie demo                      the whole pipeline on the embedded tiny default (CPU, minutes)
    eyrie run --config run.yaml     the pipeline from one config (prints each stage's command)
    eyrie check --config run.yaml   the config checked against its target before any work
    eyrie STAGE ...                 one stage: regenerate, data, extract, train, export, evaluate, decode, smoke,
                                    parity, sglang-check (`eyrie STAGE --help` for its arguments)

Each subcommand is the module a `python -m` would run (the table below). As a console script, `eyrie` never
imports from the working directory, so a user's own `data.py` or `train.py` there cannot shadow a stage; the
commands the pipeline starts run with PYTHONSAFEPATH=1 for the same reason. Several ranks: `eyrie run` launches
them (torchrun, deepspeed), or by hand `torchrun --nproc-per-node N -m extract ...` and
`deepspeed --num_gpus N train/main.py ...`.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv), what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("launch.demo", "the whole pipeline on the embedded tiny default (a target trained on the spot)"),
    "run": ("launch.pipeline", "regenerate → data → extract → train → export → evaluate [→ smoke] from one config"),
    "check": ("launch.check", "check a config against its target before any work: every problem, its key, the fix"),
    "regenerate": ("data.regenerate", "the target answers the conversations' prompts again (self-distillation)"),
    "data": ("data.__main__", "conversations → tokens, assistant loss masks, draft vocabulary"),
    "extract": ("extract.__main__", "target hidden states into Arrow shards (under torchrun: one rank each)"),
    "train": ("train.main", "train the drafter with DeepSpeed (under deepspeed: one rank each)"),
    "export": ("serve.export", "a checkpoint (or a published drafter) → an SGLang drafter directory"),
    "evaluate": ("serve.evaluate", "offline acceptance of drafters on stored features (+ the reference decoder)"),
    "decode": ("serve.decode", "reference speculative decoding over a transformers target"),
    "smoke": ("serve.smoke", "SGLang serving: plain vs EAGLE3 servers, parity, accept length, tokens/s (GPU)"),
    "parity": ("extract.parity", "per-layer cosine and max difference between two feature datasets"),
    "sglang-check": ("serve.sglang_check", "load drafter directories with SGLang's own loader (CPU)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: eyrie COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()) + \
        "\n\n`eyrie COMMAND --help` shows a command's arguments."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eyrie: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"eyrie {name}"  # argparse's prog in each command's usage line
    from data.config import stage_errors
    with stage_errors(name):
        result = importlib.import_module(COMMANDS[name][0]).main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
