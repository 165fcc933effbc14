"""SGLang's accept lengths beside the pipeline run's own figures (serve.smoke --run RUN_DIR): per held-out group,
the reference decoder's and the offline evaluator's at the same chain length, token parity with the reference
decoder, and both decoders' accept lengths over only the prompts where their outputs agree."""
from __future__ import annotations

import json

from data.layout import RunLayout


def reference_decoding(run: str, drafter: str, steps: int) -> dict:
    """The run's serve.evaluate report, which must hold a reference-decoder run of this drafter and chain."""
    report = json.loads(RunLayout(run).evaluate_report.read_text())
    decoded = report.get("decode", {}).get(drafter, {})
    if not decoded or any(d.get("steps") != steps for d in decoded.values()):
        raise SystemExit(f"{run}/evaluate/evaluate.json has no reference-decoder run of {drafter} with {steps} steps")
    return report


def compare_with_run(run: str, drafter: str, steps: int, spec: dict) -> dict:
    """Per held-out group, SGLang's accept length beside the reference decoder's and the offline evaluator's of the
    same run, all at this chain length."""
    report = reference_decoding(run, drafter, steps)
    out = {}
    for group, measured in spec["groups"].items():
        blocks = drafter in report.get("dflash_drafters", {})  # a DFlash drafter: its offline block figure
        decoded = report["decode"][drafter].get(group)
        offline = (report["dflash_drafters"] if blocks else report["drafters"])[drafter].get(group)
        if decoded is None or offline is None:
            continue
        sglang = measured["accept_length"]
        values = {"sglang": sglang, "reference_decoder": decoded["accept_length"]} | (
            {"offline_evaluator_blocks": offline["accept_length"]} if blocks else
            {"offline_evaluator_tau": offline["accept_length_by_steps"][steps - 1],
             "offline_evaluator_prompts": offline["prompts"]["decoded_accept_length_by_steps"][steps - 1]})
        same = [x == y for x, y in zip(measured["output_ids"], [r["output_ids"] for r in decoded["prompts"]])]
        out[group] = {"chain": f"DFlash blocks of {steps + 1}" if blocks else
                      f"{steps} steps / top-k 1 / {steps + 1} draft tokens",
                      "accept_length": {k: {"value": v, "relative_to_sglang": v / sglang - 1}
                                        for k, v in values.items()},
                      "token_parity_with_reference_decoder": sum(same) / max(len(same), 1),
                      "reference_decoder_device": decoded["device"], "prompts_compared": len(same)}
        if any(same):
            out[group]["same_output_prompts"] = same_output_accept_lengths(measured["per_prompt"], decoded["prompts"],
                                                                            same)
    return out


def same_output_accept_lengths(sglang: list[dict], reference: list[dict], same: list[bool]) -> dict:
    """Both decoders' accept lengths over only the prompts where they emitted the same tokens. A greedy output that
    flips at a near-tie (bf16 kernels differ between a 1-token decode and a k-token verify) continues as different
    text with its own acceptance, so the all-prompt totals can differ while the drafting itself agrees."""
    def tau(tokens: int, verify: int) -> float:
        return tokens / verify if verify else float("nan")
    pairs = [(s, r) for s, r, ok in zip(sglang, reference, same) if ok]
    s_tok, s_ver = sum(s["completion_tokens"] for s, _ in pairs), sum(s["verify_steps"] for s, _ in pairs)
    r_tok, r_ver = sum(r["tokens"] for _, r in pairs), sum(r["verify_calls"] for _, r in pairs)
    sglang_tau, reference_tau = tau(s_tok, s_ver), tau(r_tok, r_ver)
    return {"prompts": len(pairs), "sglang": sglang_tau, "reference_decoder": reference_tau,
            "relative_to_sglang": reference_tau / sglang_tau - 1,
            "prompts_with_equal_verify_steps": sum(s["verify_steps"] == r["verify_calls"] for s, r in pairs)}


def print_reference(reference: dict) -> None:
    for group, r in reference.items():
        for name, v in r["accept_length"].items():
            print(f"{group:>16} {name:>28}: accept length {v['value']:.3f} ({v['relative_to_sglang']:+.1%} vs SGLang)")
        print(f"{group:>16} SGLang EAGLE3 output tokens equal to the reference decoder's: "
              f"{r['token_parity_with_reference_decoder']:.0%}")
        if "same_output_prompts" in r:
            same = r["same_output_prompts"]
            print(f"{group:>16} on the {same['prompts']} prompts with equal outputs: SGLang {same['sglang']:.3f}, "
                  f"reference decoder {same['reference_decoder']:.3f} ({same['relative_to_sglang']:+.1%}); equal "
                  f"verify steps on {same['prompts_with_equal_verify_steps']}")
