"""The SGLang backend (extract/backend.py's protocol): the target runs in SGLang's own model code, weight loader and
kernels, in-process.

The numerics that will serve are the numerics the drafter learns from. SGLang is driven the way its own
`sglang.bench_one_batch` drives it (one `ModelRunner` per rank; `ScheduleBatch.init_new` →
`prepare_for_extend` → `ForwardBatch.init_new` → `forward`), with the model's built-in EAGLE-3 capture
(`set_eagle3_layers_to_capture(ids)`: SGLang adds 1 itself, so id i is the output of decoder layer i, our
convention; DeepseekV2-family models add it only when the first id is 1, which data.target requires there)
and `Req(return_hidden_states=True)`, which returns the aux states `[tokens, n_aux * H]` concatenated and
flat over the batch's requests. The final state (post-norm, as the hf backend stores it) is read with a
forward hook on the model's final norm. The states stay GPU tensors; nothing of SGLang is
patched. Every version-specific call is in this module; versions not listed in TESTED_VERSIONS are refused.

Parity with the hf backend is a GPU test (tests/gpu/test_sglang_extract.py: a 4-layer, hidden-64 Llama, bf16,
per-layer cosine and max abs difference); no parity on an 8B-shaped target has been measured, and the throughput
measured before results files existed is in tests/benchmarks/RESULTS.md's git history. With `extract.tp_size`
> 1 a group of ranks on one node holds one tensor-parallel copy of the target (not yet run on a multi-GPU
machine: none was lent; `tests/gpu/test_sglang_extract.py::test_sglang_tensor_parallel_features_match_hf_features`
checks it against the hf backend on 2 GPUs).
"""
from __future__ import annotations

import os
from array import array
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from .backend import BackendSpec

TESTED_VERSIONS = ("0.5.14",)
# SGLang sizes its per-forward buffers by chunked_prefill_size; 16,384 tokens in one forward failed at the
# default 8,192 (tests/benchmarks/RESULTS.md), so forwards are cut to this many tokens.
MAX_FORWARD_TOKENS = 8192


def check_version(version: str) -> None:
    if version not in TESTED_VERSIONS:
        raise RuntimeError(f"extract.backend sglang: sglang {version} is installed, this backend is tested with "
                           f"{', '.join(TESTED_VERSIONS)} (extract/sglang.py keeps every version-specific call); "
                           "use extract.backend hf or a tested sglang")


def available() -> bool:
    """Whether `extract.backend: auto` should pick this backend: a GPU and a tested sglang."""
    if not torch.cuda.is_available():
        return False
    try:
        import sglang
    except ImportError:
        return False
    return sglang.__version__ in TESTED_VERSIONS


def check_packed(states: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """SGLang's states are flat over the batch's requests, `[sum(sizes), D]`: the packed layout we store."""
    if states.shape[0] != sum(sizes):
        raise RuntimeError(f"sglang returned {states.shape[0]} token states for {sum(sizes)} input tokens")
    return states


def check_head_dim(target_path: str) -> None:
    """SGLang's triton attention fails to compile for head_dim < 16 (tl.dot needs K >= 16): say so up front."""
    from data.target import load_target_info
    config = load_target_info(target_path).text_config
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim < 16:
        raise ValueError(f"extract.backend sglang: {target_path} has head_dim {head_dim}; SGLang's triton attention "
                         "kernels need at least 16 (tl.dot: K >= 16); use extract.backend hf")


@contextmanager
def own_rendezvous():
    """SGLang's ModelRunner builds its process group with `init_method="tcp://127.0.0.1:PORT"`. Under torchrun
    (TORCHELASTIC_USE_AGENT_STORE=True) torch makes every rank a client of a store it assumes the launcher hosts
    on that port; nothing listens there, so the runner retries for SGLang's 10-minute timeout (seen on the GPU
    machine: the pipeline's extract stage hung). With the flag hidden while the runner starts, the group's rank
    0 hosts its own store, as it does outside torchrun."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


class _NoPrefixCache(SimpleNamespace):
    """What ScheduleBatch needs of a tree cache when nothing is cached (as in sglang.bench_one_batch)."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def evict(self, params) -> None:
        pass


class SGLangBackend:
    max_forward_tokens = MAX_FORWARD_TOKENS

    def __init__(self, spec: BackendSpec, mem_fraction_static: float = 0.5):
        import sglang
        check_version(sglang.__version__)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import PortArgs, ServerArgs

        target_path, trust_remote_code, tp_rank, tp_size = (spec.target_path, spec.trust_remote_code, spec.tp_rank,
                                                             spec.tp_size)
        gpu_id = spec.device.index or 0
        check_head_dim(target_path)
        args = ServerArgs(model_path=target_path, attention_backend="triton", sampling_backend="pytorch",
                          grammar_backend="none", disable_cuda_graph=True, disable_radix_cache=True,
                          mem_fraction_static=mem_fraction_static, dtype="bfloat16",
                          chunked_prefill_size=MAX_FORWARD_TOKENS, trust_remote_code=trust_remote_code,
                          tp_size=tp_size)
        _set_envs_and_config(args)
        initialize_moe_config(args)
        initialize_fp8_gemm_config(args)
        # one runner per process; a tensor-parallel group's ranks meet on the port they were given (tp 1: its own
        # one-rank group on a free port). Every rank gets the full aux and final states (SGLang all-reduces them).
        with own_rendezvous():
            self.runner = ModelRunner(model_config=ModelConfig.from_server_args(args),
                                      mem_fraction_static=mem_fraction_static, gpu_id=gpu_id, tp_rank=tp_rank,
                                      tp_size=tp_size, moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1,
                                      nccl_port=spec.nccl_port or PortArgs.init_new(args).nccl_port, server_args=args)
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()  # with graphs disabled this sets up the eager runner forward() uses
        self.args, self.device = args, torch.device("cuda", gpu_id)
        self.runner.model.set_eagle3_layers_to_capture(list(spec.aux_layer_ids))
        self._final: list[torch.Tensor] = []
        self.runner.model.model.norm.register_forward_hook(
            lambda _m, _i, out: self._final.append(out[0] if isinstance(out, tuple) else out))

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] right-padded batch → aux [N, n_aux * H], final [N, H] on the GPU, each row's tokens packed
        row after row (the hf backend's API)."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        sizes = attention_mask.sum(-1).tolist()
        if sum(sizes) > MAX_FORWARD_TOKENS:
            raise ValueError(f"{sum(sizes)} tokens in one forward; the sglang backend takes {MAX_FORWARD_TOKENS}")
        reqs = []
        for b, n in enumerate(sizes):
            req = Req(rid=str(b), origin_input_text="", origin_input_ids=array("q", input_ids[b, :n].tolist()),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1), return_hidden_states=True)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.fill_len = n
            req.logprob_start_len = -1
            req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
            reqs.append(req)
        runner = self.runner
        batch = ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=_NoPrefixCache(page_size=self.args.page_size, device=runner.device,
                                      token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator),
            model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        self._final.clear()
        try:
            aux = runner.forward(ForwardBatch.init_new(batch, runner)).logits_output.hidden_states
        finally:  # nothing is decoded after the prefill: give the KV slots back for the next batch
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
        return check_packed(aux, sizes), check_packed(self._final[-1], sizes)
