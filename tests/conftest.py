import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n N: the workers share the cores, torch in each its part
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from launch.demo_target import build_tokenizer, make_conversations  # noqa: E402
from tests.templates import SPECIALS  # noqa: E402
from tests.train_runs import TRAIN  # noqa: E402


def _corpus() -> list[str]:
    texts = [m["content"] for c in make_conversations(300, seed=7) for m in c["messages"]]
    return texts + ["think about it", "get_weather city Paris", "The weather in Paris is sunny."]


@pytest.fixture(scope="session")
def make_tokenizer(tmp_path_factory):
    """Tokenizer per template style ('llama3', 'chatml', 'kimi'), trained with `tokenizers` once a session."""
    cache = {}

    def make(style: str):
        if style not in cache:
            template, specials, bos, eos = SPECIALS[style]
            out = tmp_path_factory.mktemp(f"tok-{style}")
            cache[style] = build_tokenizer(_corpus(), out, vocab_size=400, chat_template=template,
                                           special_tokens=specials, bos=bos, eos=eos)
        return cache[style]
    return make


@pytest.fixture(scope="session")
def tiny_target(make_tokenizer, tmp_path_factory):
    """A random tiny Llama target directory with the llama3-style tokenizer (config, safetensors, tokenizer)."""
    from launch.demo_target import build_tiny_llama
    tok = make_tokenizer("llama3")
    out = tmp_path_factory.mktemp("target")
    tok.save_pretrained(str(out))
    build_tiny_llama(out, vocab_size=len(tok), hidden=32, layers=4, heads=4, seed=0,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return out


@pytest.fixture(scope="session")
def features_run(make_tokenizer, tmp_path_factory):
    """A run directory with prepared samples and extracted features of a tiny target whose distributions are
    peaked (large init), so the teacher has argmaxes worth learning. Returns (config path, raw config dict)."""
    import json

    from data.config import load_config
    from data.prepare import prepare
    from extract.job import run as extract
    from launch.demo_target import build_tiny_llama

    root = tmp_path_factory.mktemp("train-run")
    tok = make_tokenizer("llama3")
    target = root / "target"
    tok.save_pretrained(str(target))
    build_tiny_llama(target, vocab_size=len(tok), hidden=32, layers=4, heads=4, seed=1, initializer_range=0.3,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    convs = root / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(160, seed=3)))
    raw = {"run_dir": str(root / "run"), "seed": 0,
           "target": {"path": str(target), "aux_layer_ids": [0, 1, 2]},
           "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 128, "samples_per_shard": 50,
                    "heldout_fraction": 0.1},
           "extract": {"samples_per_shard": 50},
           "train": TRAIN}
    config = root / "run.yaml"
    config.write_text(json.dumps(raw))
    cfg = load_config(config)
    prepare(cfg)
    extract(cfg)
    return config, raw


@pytest.fixture(scope="session")
def zero2_run(features_run, tmp_path_factory):
    """A finished two-rank ZeRO-2 training run: (run dir, launcher output)."""
    from tests.train_runs import finish, launch, with_run_dir
    run = tmp_path_factory.mktemp("zero2") / "run"
    return run, finish(launch(with_run_dir(features_run, run)))


@pytest.fixture(scope="session")
def zero3_run(features_run, tmp_path_factory):
    """The same run under ZeRO-3 (parameters partitioned across the ranks), with the logits recomputed in
    backward (train.recompute_logits: the head's weight must be gathered again there)."""
    from tests.train_runs import TRAIN, finish, launch, with_run_dir
    run = tmp_path_factory.mktemp("zero3") / "run"
    return run, finish(launch(with_run_dir(features_run, run, optim=TRAIN["optim"] | {"zero_stage": 3},
                                           recompute_logits=True)))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The README demo at reduced scale, through the real pipeline: a trained tiny target, self-distilled data,
    extraction, two-rank DeepSpeed training, export (through SGLang's loader when installed), evaluation."""
    from launch.demo_target import build_demo_assets
    from tests.train_runs import demo_config, run_pipeline
    root = tmp_path_factory.mktemp("demo")
    build_demo_assets(root / "assets", conversations=240, train_steps=300)
    path = root / "demo.yaml"
    config = demo_config("demo.yaml", root / "assets", root / "run")
    # 240 conversations: the demo config's 15 epochs are 45 steps, where the accept length still climbs steeply
    # (1.97 on one CPU, above 2 on another: the target's float rounding differs); there, 20 epochs (60 steps) gave
    # 2.58 and 25 gave 2.84
    config["train"]["epochs"] = 20
    out = run_pipeline(config, path=path)
    return root / "run", path, out


RELIABILITY: list[dict] = []


@pytest.fixture
def survival(request):
    """record(case, tried, survived, lost): one row of the reliability table printed after the run (and written
    as Markdown to $EYRIE_RELIABILITY_TABLE when set). The row travels in the test's report, which pytest-xdist
    brings back from its worker to the process that prints the summary."""
    def record(case: str, tried: int, survived: int, lost: int | str = 0) -> None:
        request.node.user_properties.append(
            ("survival", {"case": case, "tried": tried, "survived": survived, "lost": lost}))
    return record


def pytest_runtest_logreport(report):
    if report.when == "call":
        RELIABILITY.extend(row for name, row in report.user_properties if name == "survival")


def pytest_terminal_summary(terminalreporter):
    if not RELIABILITY:
        return
    lines = ["| case | tried | survived | data lost |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['tried']} | {r['survived']} | {r['lost']} |" for r in RELIABILITY]
    terminalreporter.write_sep("=", "reliability: faults tried and survived (tests/reliability)")
    terminalreporter.write_line("\n".join(lines))
    if os.environ.get("EYRIE_RELIABILITY_TABLE"):
        Path(os.environ["EYRIE_RELIABILITY_TABLE"]).write_text("\n".join(lines) + "\n")


# `pytest -n 2` (the README's test command, pytest-xdist) hands the workers whole work units: the files that use
# one of these session fixtures together, so that it is built once and not once per worker, and every other file
# alone, so that its module fixtures are built once. Largest first, so that the two workers finish together: the
# shared fixtures' units (about 270 and 185 s of the serial suite's 950 on the 2-core CI machine), then the files
# holding a test marked slow, then the rest.
# (Not xdist's `--dist loadgroup`: it groups by renaming node ids, which pytest 9.2's nodes no longer take, and
# its groups were silently ignored.)
SHARED_FIXTURE_FILES = {
    "features_run": ("tests/reliability/test_train_faults.py", "tests/train/test_drafter.py",  # zero2_run and
                     "tests/serve/test_export.py", "tests/train/test_dflash.py",            # zero3_run too
                     "tests/serve/test_eagle31_export.py", "tests/train/test_trainer.py"),
    "demo_run": ("tests/serve/test_decode.py", "tests/serve/test_smoke.py", "tests/test_results.py"),
}


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return next((fixture for fixture, files in SHARED_FIXTURE_FILES.items() if path in files), path)


def pytest_collection_modifyitems(config, items):
    """The work units' order (above); and the table kept whole: a file using one of its fixtures but missing from
    it would build that fixture on a second worker."""
    for item in items:
        for fixture in SHARED_FIXTURE_FILES:
            if fixture in item.fixturenames and work_unit(item.nodeid) != fixture:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add its file to SHARED_FIXTURE_FILES "
                                        "in tests/conftest.py")
    order = list(SHARED_FIXTURE_FILES)
    slow = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        unit = work_unit(item.nodeid)
        return order.index(unit) if unit in order else len(order) + (unit not in slow)
    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        """xdist's scope scheduling with `work_unit` as the scope, in collection order."""
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    if config.getvalue("dist") != "load":  # the default of -n; another one asked for is left to xdist
        return None
    config.option.loadscopereorder = False  # its reordering is by test count, not by cost
    return ByWorkUnit(config, log)
