"""The smoke test's arithmetic on CPU; the servers themselves only on a GPU machine."""
import shutil

import pytest
import torch

from serve.smoke import accept_length, verdict


def test_accept_length_is_tokens_per_verify_step_over_all_requests():
    # pooled 10 tokens / 4 verify steps, not the mean of the per-request ratios (3.0 and 1.0)
    assert accept_length([{"completion_tokens": 9, "spec_verify_ct": 3},
                          {"completion_tokens": 1, "spec_verify_ct": 1}]) == 2.5
    assert accept_length([{"completion_tokens": 40}]) is None  # baseline server: no speculation


def test_verdict_per_concurrency():
    v = verdict({1: 100.0, 8: 500.0, 64: 2000.0}, {1: 180.0, 8: 510.0, 64: 1500.0})
    assert v[1].startswith("pays") and v[8].startswith("neutral") and v[64].startswith("does not pay")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                    reason="not run: the SGLang servers (baseline and EAGLE3) need a GPU; run serve.smoke on the "
                           "GPU machine (see ../shared/device/README.md)")
def test_smoke_on_the_demo(demo_run, tmp_path):
    from serve.smoke import main
    run = demo_run[0]
    import json
    target = json.loads((run / "train" / "summary.json").read_text())["config"]["target"]["path"]
    report = main(["--target", target, "--drafter", str(run / "drafter"), "--out", str(tmp_path),
                   "--concurrency", "1,8", "--server-arg=--attention-backend=triton",
                   "--server-arg=--disable-cuda-graph", "--server-arg=--mem-fraction-static=0.3"])
    assert report["parity"] >= 0.9 and report["eagle3"]["accept_length"] > 1.5
    assert report["baseline_stopped"]["port_free"] and report["eagle3_stopped"]["port_free"]
