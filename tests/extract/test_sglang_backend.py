"""The sglang extraction backend's CPU-checkable parts; the backend itself runs in tests/gpu/."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.config import load_config
from extract.job import resolve_backend

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
from extract.sglang import MAX_FORWARD_TOKENS, check_version, check_packed


def config(**extract):
    return load_config(None, ["--target.path=t", "--data.inputs=[c.jsonl]",
                              *[f"--extract.{k}={v}" for k, v in extract.items()]])


def test_untested_sglang_versions_are_refused_by_name():
    check_version("0.5.14")
    with pytest.raises(RuntimeError, match="sglang 0.5.23 is installed, this backend is tested with 0.5.14"):
        check_version("0.5.23")


def test_packed_states_must_cover_every_input_token():
    flat = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)  # requests of 3 and 4 tokens, flat
    assert check_packed(flat, [3, 4]) is flat
    with pytest.raises(RuntimeError, match="returned 7 token states for 6 input tokens"):
        check_packed(flat, [3, 3])


def test_backend_resolution():
    if not torch.cuda.is_available():  # auto: sglang only where a GPU and a tested sglang are present
        assert resolve_backend(config(), CPU) == ("hf", "float32")
    assert resolve_backend(config(backend="hf"), GPU) == ("hf", "bfloat16")  # auto dtype follows the device
    assert resolve_backend(config(backend="hf", dtype="bfloat16"), CPU) == ("hf", "bfloat16")
    assert resolve_backend(config(backend="sglang"), GPU) == ("sglang", "bfloat16")
    with pytest.raises(ValueError, match="no float32 RMSNorm"):
        resolve_backend(config(backend="sglang", dtype="float32"), GPU)
    long = load_config(None, ["--target.path=t", "--data.inputs=[c.jsonl]", "--extract.backend=sglang",
                              f"--data.max_length={MAX_FORWARD_TOKENS + 1}"])
    with pytest.raises(ValueError, match="above the 8192 tokens"):
        resolve_backend(long, GPU)


def test_targets_too_narrow_for_sglangs_attention_kernels_are_refused_up_front(tiny_target):
    from extract.sglang import check_head_dim
    with pytest.raises(ValueError, match="has head_dim 8; SGLang's triton attention kernels need at least 16"):
        check_head_dim(str(tiny_target))


def test_tensor_parallel_groups_are_consecutive_ranks_on_one_node():
    from extract.job import tp_layout
    # 2 nodes x 8 GPUs, TP 8 (Kimi-K2.5): one target copy per node, rank 0 of each writes
    assert [tp_layout(r, 16, 8, 8) for r in (0, 7, 8, 15)] == [(0, 2, 0), (0, 2, 7), (1, 2, 0), (1, 2, 7)]
    assert [tp_layout(r, 8, 8, 2)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # 4 copies of TP 2
    assert tp_layout(3, 4, 4, 1) == (3, 4, 0)  # TP 1: every rank is its own group
    with pytest.raises(ValueError, match="must divide the ranks per node"):
        tp_layout(0, 12, 6, 4)
    with pytest.raises(ValueError, match="tp_size > 1 is for the sglang backend"):
        resolve_backend(config(backend="hf", tp_size=2), GPU)


RENDEZVOUS = """
import contextlib, socket, sys
from extract.sglang import own_rendezvous
from sglang.srt.distributed.parallel_state import init_distributed_environment
with socket.socket() as s:  # a free port, as SGLang's PortArgs picks one
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
with own_rendezvous() if sys.argv[1] == "wrapped" else contextlib.nullcontext():
    # what SGLang's ModelRunner calls for its own one-rank group (gloo here: no GPU)
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo", timeout=1 if sys.argv[1] == "bare" else 30)
print("group ready")
"""


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="not run: needs sglang installed (SGLang's own process-group setup, on CPU)")
@pytest.mark.parametrize("mode", ["bare", "wrapped"])
def test_runner_group_forms_under_torchrun(mode, tmp_path):
    """Under torchrun SGLang's tcp:// rendezvous is a client of a store nobody hosts; own_rendezvous lets it host one."""
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          str(script), mode], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": "."})
    if mode == "wrapped":
        assert out.returncode == 0 and "group ready" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    else:  # the failure the GPU machine hit (there for SGLang's 10 minutes), shortened to 1 s
        assert out.returncode != 0 and "group ready" not in out.stdout
        assert "TCP client failed to connect" in out.stderr, out.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_the_tiny_deepseek_target_declares_every_field_sglangs_deepseek_v2_reads(tmp_path):
    """SGLang's DeepseekV2 model (which serves DeepseekV3 and Kimi-K2.5) reads `config.X` for fields transformers'
    DeepseekV3Config does not write; the H200 server died on the first ('moe_layer_freq') before this."""
    import re

    import sglang
    from transformers import AutoConfig

    from launch.demo_target import build_tiny_deepseek
    build_tiny_deepseek(tmp_path, vocab_size=64, hidden=32, layers=2)
    config = AutoConfig.from_pretrained(tmp_path)
    source = (Path(sglang.__file__).parent / "srt" / "models" / "deepseek_v2.py").read_text()
    read = set(re.findall(r"(?<![\w.])(?:self\.)?config\.([a-z_]+)\b(?!\()", source))
    guarded = {"rope_theta", "quantization_config"}  # read only where rope_parameters / quantization are absent
    assert read - guarded - set(dir(config)) == set()
    assert {"moe_layer_freq", "topk_method", "scoring_func"} <= read
