"""Probe for the SGLang extraction backend (issue 4), GPU machine, SGLang 0.5.14 (not collected by pytest).

    source .sgl/sglang-env.sh; PYTHONPATH=$PWD python3 tests/benchmarks/probe_sglang_extract.py TARGET 0,1,2

Drives SGLang in-process the way its own `sglang.bench_one_batch` does (ModelRunner, ScheduleBatch.init_new,
prepare_for_extend, ForwardBatch.init_new, forward) with the model's built-in EAGLE-3 capture
(`set_eagle3_layers_to_capture`) and `return_hidden_states`, plus a forward hook on the final norm for the
teacher's post-norm state; compares both with transformers' `hidden_states` on the same prompts (bf16) and
times a prefill of synthetic batches. SGLang's code is not patched.
"""
import json
import sys
import time
from array import array
from types import SimpleNamespace

import torch


class _NoPrefixCache(SimpleNamespace):  # what bench_one_batch hands ScheduleBatch: allocation, no prefix reuse
    def supports_swa(self): return False
    def supports_mamba(self): return False
    def is_chunk_cache(self): return False
    def is_tree_cache(self): return True
    def evict(self, params): pass


def main(target: str, layer_ids: list[int]) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = ServerArgs(model_path=target, attention_backend="triton", sampling_backend="pytorch",
                      grammar_backend="none", disable_cuda_graph=True, mem_fraction_static=0.5,
                      dtype="bfloat16", disable_radix_cache=True)
    _set_envs_and_config(args)
    port_args = PortArgs.init_new(args)
    initialize_moe_config(args)
    initialize_fp8_gemm_config(args)
    runner = ModelRunner(model_config=ModelConfig.from_server_args(args), mem_fraction_static=0.5, gpu_id=0,
                         tp_rank=0, tp_size=1, moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1,
                         nccl_port=port_args.nccl_port, server_args=args)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # also sets up the eager runner that forward() uses with graphs disabled
    model = runner.model
    model.set_eagle3_layers_to_capture(layer_ids)
    final = {}
    model.model.norm.register_forward_hook(lambda m, i, o: final.__setitem__("h", o[0] if isinstance(o, tuple) else o))

    def prefill(prompts: list[list[int]]):
        reqs = []
        for i, ids in enumerate(prompts):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1), return_hidden_states=True)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.fill_len = len(req.full_untruncated_fill_ids)
            req.logprob_start_len = -1
            req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
            reqs.append(req)
        batch = ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=_NoPrefixCache(page_size=args.page_size, device=runner.device,
                                      token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator),
            model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
        fb = ForwardBatch.init_new(batch, runner)
        out = runner.forward(fb).logits_output
        aux, fin = out.hidden_states, final["h"]
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        return aux, fin, str(fb.capture_hidden_mode)

    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (37, 64, 11)]
    aux, fin, mode = prefill(prompts)
    report = {"capture_mode": mode, "aux_shape": list(aux.shape) if aux is not None else None,
              "final_shape": list(fin.shape)}

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    start, per_layer = 0, {i: [] for i in [*layer_ids, "final"]}
    for ids in prompts:
        with torch.no_grad():
            hs = hf(torch.tensor([ids], device="cuda"), output_hidden_states=True).hidden_states
        n = len(ids)
        H = hs[0].shape[-1]
        for j, i in enumerate(layer_ids):
            a, b = aux[start:start + n, j * H:(j + 1) * H].float(), hs[i + 1][0].float()
            per_layer[i].append((torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item(),
                                 (a - b).abs().max().item()))
        a, b = fin[start:start + n].float(), hs[-1][0].float()
        per_layer["final"].append((torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item(),
                                   (a - b).abs().max().item()))
        start += n
    report["parity"] = {str(k): {"min_cos": min(x[0] for x in v), "max_abs": max(x[1] for x in v)}
                        for k, v in per_layer.items()}
    print("PROBE " + json.dumps(report), flush=True)

    for bs, T in ((4, 2048), (2, 4096)):  # prefill speed with capture (<= 8,192 tokens: SGLang's buffers)
        batch = [torch.randint(5, vocab, (T,), generator=g).tolist() for _ in range(bs)]
        prefill(batch)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            prefill(batch)
        torch.cuda.synchronize()
        report[f"tokens_per_s_bs{bs}_T{T}"] = round(3 * bs * T / (time.perf_counter() - t))
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
