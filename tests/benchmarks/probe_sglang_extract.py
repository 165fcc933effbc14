"""The sglang extraction backend against transformers, and its prefill speed (GPU machine with SGLang 0.5.14;
not collected by pytest).

    source .sgl/sglang-env.sh; PYTHONPATH=$PWD python3 tests/benchmarks/probe_sglang_extract.py TARGET 0,1,2

Captures three prompts with `extract.sglang.SGLangBackend` and compares aux and final states with
transformers' `hidden_states` (bf16, same GPU), then times batches of synthetic prompts. (The numbers in
RESULTS.md were measured by this probe at commit 67679ad, before its code moved into extract/sglang.py.)
"""
import json
import sys
import time

import torch


def main(target: str, layer_ids: list[int]) -> None:
    from transformers import AutoModelForCausalLM

    from extract.backend import BackendSpec
    from extract.sglang import SGLangBackend

    backend = SGLangBackend(BackendSpec(target, layer_ids, torch.bfloat16, torch.device("cuda", 0)))
    vocab = backend.runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def batch(sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = torch.zeros(len(sizes), max(sizes), dtype=torch.long), torch.zeros(len(sizes), max(sizes))
        for b, n in enumerate(sizes):
            ids[b, :n], mask[b, :n] = torch.randint(5, vocab, (n,), generator=g), 1
        return ids, mask.long()

    sizes = [37, 64, 11]
    ids, mask = batch(sizes)
    aux, final = backend.capture(ids, mask)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    worst = {str(i): [1.0, 0.0] for i in [*layer_ids, "final"]}
    H, start = final.shape[-1], 0
    for b, n in enumerate(sizes):
        with torch.no_grad():
            hs = hf(ids[b:b + 1, :n].cuda(), output_hidden_states=True).hidden_states
        rows = slice(start, start + n)  # the states are packed, request after request
        start += n
        pairs = [(str(i), aux[rows, j * H:(j + 1) * H], hs[i + 1][0]) for j, i in enumerate(layer_ids)]
        for name, x, y in [*pairs, ("final", final[rows], hs[-1][0])]:
            x, y = x.float(), y.float()
            worst[name][0] = min(worst[name][0], torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item())
            worst[name][1] = max(worst[name][1], (x - y).abs().max().item())
    report = {"parity_min_cos_max_abs": worst}
    print("PROBE " + json.dumps(report), flush=True)
    for bs, T in ((4, 2048), (2, 4096)):  # prefill with capture, states left on the GPU
        ids, mask = batch([T] * bs)
        backend.capture(ids, mask)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            backend.capture(ids, mask)
        torch.cuda.synchronize()
        report[f"tokens_per_s_bs{bs}_T{T}"] = round(3 * bs * T / (time.perf_counter() - t))
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
