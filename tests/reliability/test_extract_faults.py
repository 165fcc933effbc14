"""Extraction under kill -9 (two ranks, random points) and under a disk that refuses writes."""
import json
import random
import shutil
import subprocess
import sys
import time

import pytest

from launch.demo_target import make_conversations
from tests.extract.test_extract import ROOT, finish, kill_tree, snapshot, torchrun

from .faults import file_size_limit, kill_points

LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory):
    """A run dir whose data stage is done, and the features of one uninterrupted extraction."""
    base = tmp_path_factory.mktemp("extract-faults")
    convs = base / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(40, seed=11)))
    cfg = {"run_dir": str(base / "run"), "target": {"path": str(tiny_target), "aux_layer_ids": LAYERS},
           "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 64},
           "extract": {"samples_per_shard": 2, "max_batch_tokens": 1, "verify_resume": True}}
    config = base / "run.yaml"
    config.write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "data", "--config", str(config)], check=True, capture_output=True)
    start = time.time()
    finish(torchrun(config))
    seconds = time.time() - start
    reference = base / "reference"
    shutil.move(base / "run" / "features", reference)
    return config, base / "run", snapshot(reference), seconds


def lost_samples(got: list, reference: list) -> int:
    """Samples missing, duplicated or different (ids and tensors, bit for bit) against the reference."""
    want = {s[0]: s for s in reference}
    seen: dict = {}
    for s in got:
        seen[s[0]] = seen.get(s[0], 0) + 1
    lost = sum(1 for sid in want if seen.get(sid) != 1) + sum(1 for sid in seen if sid not in want)
    for s in got:
        if s[0] in want and seen[s[0]] == 1:
            r = want[s[0]]
            if not all(a.equal(b) for a, b in zip(s[1:], r[1:])):
                lost += 1
    return lost


def test_kill_9_at_random_points_then_rerun_equals_an_uninterrupted_run(prepared, survival):
    config, run, reference, seconds = prepared
    rng = random.Random(0)
    n = kill_points(full=10, ci=3)
    survived, lost = 0, 0
    for point in range(n):
        shutil.rmtree(run / "features", ignore_errors=True)
        proc = torchrun(config)
        time.sleep(rng.uniform(0.25, 0.95) * seconds)  # start-up, model load, mid-shard, between shards, merge
        kill_tree(proc)
        finish(torchrun(config))  # the re-run completes (checksums of kept shards verified on resume)
        got = snapshot(run / "features")  # verify=True: every shard's checksum against the manifest
        missing = lost_samples(got, reference)
        survived += missing == 0
        lost += missing
        assert not list((run / "features").glob(".*.tmp-*")), "a temporary file was left behind"
    survival("extraction: kill -9 (2 ranks) at random points", n, survived, f"{lost} samples")
    assert survived == n and lost == 0


def test_disk_refusing_writes_is_a_clear_error_and_a_rerun_completes(prepared, survival):
    config, run, reference, _ = prepared
    shutil.rmtree(run / "features", ignore_errors=True)
    limit = 16 * 1024  # bytes per file: below one shard, above every JSON record
    out = subprocess.run([sys.executable, "-m", "extract", "--config", str(config)], cwd=ROOT, capture_output=True,
                         text=True, preexec_fn=file_size_limit(limit))
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "write failed (File too large)" in text and ".arrow.tmp-" in text, text[-2000:]
    assert "shards left need" in text and "Completed shards are kept" in text, text[-2000:]
    features = run / "features"
    assert not list(features.glob("*.arrow")) and not list(features.glob(".*.tmp-*")), "half-written shard left"
    assert not (features / "manifest.json").exists()
    finish(torchrun(config))  # space freed: the same command completes
    lost = lost_samples(snapshot(features), reference)
    survival("extraction: disk refuses writes (EFBIG), then re-run", 1, int(lost == 0), f"{lost} samples")
    assert lost == 0
