"""The smoke test's arithmetic on CPU; the servers themselves only on a GPU machine."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from serve.sglang_server import decode_graph_args
from serve.smoke import accept_length, cycle_costs, measured_once, server_key
from serve.smoke_reference import compare_with_run
from serve.timing import NO_DIFFERENCE, decode_ms, ratio, spread, timed_pass, verdict

ROOT = Path(__file__).resolve().parents[2]


def test_accept_length_is_tokens_per_verify_step_over_all_requests():
    # pooled 10 tokens / 4 verify steps, not the mean of the per-request ratios (3.0 and 1.0)
    assert accept_length([{"completion_tokens": 9, "spec_verify_ct": 3},
                          {"completion_tokens": 1, "spec_verify_ct": 1}]) == 2.5
    assert accept_length([{"completion_tokens": 40}]) is None  # baseline server: no speculation


def test_speedups_are_medians_with_the_range_of_the_repeats_and_a_straddle_is_no_difference():
    base, fast, noisy = spread([500.0, 520.0, 480.0]), spread([700.0, 690.0, 720.0]), spread([450.0, 560.0, 510.0])
    assert ratio(fast, base) == pytest.approx({"median": 1.4, "min": 690 / 520, "max": 720 / 480})
    assert verdict(ratio(fast, base)).startswith("faster: 1.40x (1.33-1.50)")
    assert verdict(ratio(noisy, base)).startswith(NO_DIFFERENCE)  # 0.87-1.17: straddles 1.0
    assert verdict(ratio(base, fast)).startswith("slower")


def test_a_step_or_cycle_is_a_streamed_requests_decode_time_over_its_steps_or_cycles():
    # (arrival s, cumulative tokens, cumulative verify count): a prefill chunk, then a step per chunk except one
    # merged chunk of two steps
    plain = [(0.0, 1, 0), (0.002, 2, 0), (0.004, 3, 0), (0.010, 5, 0)]
    assert decode_ms(plain, speculative=False) == pytest.approx(2.5)  # 10 ms over 4 steps
    # SGLang 0.5.14 streams spec_verify_ct only in the finished chunk (tokenizer_manager: the spec metrics are
    # added when the request finishes): 4 cycles after the prefill, emitting 3, 2, then 2 x 2 tokens in 30 ms.
    # Taking gaps between the chunks' counts once timed a 0.026 ms "cycle" (the last gap over every cycle)
    spec = [(0.0, 1, 0), (0.006, 4, 0), (0.012, 6, 0), (0.030, 10, 4)]
    assert decode_ms(spec, speculative=True) == pytest.approx(7.5)
    assert decode_ms(spec[:1], speculative=True) is None  # one chunk: nothing to time
    assert decode_ms([(0.0, 1, 0), (0.01, 5, 0)], speculative=True) is None  # no verify count: not a cycle count


def test_a_timed_pass_keeps_every_client_busy_until_its_time_is_up():
    import threading
    import time
    active, most = [0], [0]
    lock = threading.Lock()

    def generate(prompt, max_new):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        return {"meta_info": {"completion_tokens": len(prompt)}}
    result = timed_pass(generate, [[1], [1, 2]], 8, concurrency=4, min_seconds=0.2)
    assert most[0] == 4 and result["seconds"] >= 0.2 and result["requests"] >= 4 * 15
    assert result["completion_tokens"] == pytest.approx(1.5 * result["requests"], abs=1)  # the prompts in turn
    assert result["tokens_per_s"] == result["completion_tokens"] / result["seconds"]


def test_cycle_costs_tell_overhead_from_drafter_quality():
    step = spread([1.9, 2.0, 2.1])
    pays = cycle_costs(step, spread([3.9, 4.0, 4.2]), 2.5, 3)
    assert pays["break_even_accept_length"] == pytest.approx({"median": 2.0, "min": 3.9 / 2.1, "max": 4.2 / 1.9})
    assert pays["limited_by"].startswith("nothing")
    quality = cycle_costs(step, spread([5.9, 6.0, 6.1]), 2.5, 3)
    assert quality["limited_by"].startswith("drafter quality")  # 3 steps' cost, under the 4 tokens a cycle emits
    overhead = cycle_costs(step, spread([9.9, 10.0, 10.2]), 2.5, 3)
    assert overhead["limited_by"].startswith("overhead") and overhead["most_tokens_per_cycle"] == 4
    assert cycle_costs(step, spread([4.8, 5.0, 5.2]), 2.5, 3)["limited_by"].startswith(
        "undecided")  # 2.29-2.74 holds 2.5


def canned_measurement(tokens_per_s: dict, accept: float | None, texts: list[str], step_ms: float) -> dict:
    """What serve.smoke.measure returns for one server (a stand-in for a GPU run's server-NAME.json)."""
    group = {"texts": texts, "output_ids": [[1]] * len(texts), "prompts": len(texts), "completion_tokens": 40,
             "verify_steps": 16 if accept else 0, "accept_length": accept, "spec_accept_length_mean": accept,
             "per_prompt": [{"completion_tokens": 20, "verify_steps": 8}] * len(texts)}
    return {"groups": {"default": group},
            "step_ms": spread([step_ms * 0.98, step_ms, step_ms * 1.02]),
            "tokens_per_s": {c: spread([v * 0.98, v, v * 1.02]) for c, v in tokens_per_s.items()}, "passes": {}}


def test_the_report_sets_each_servers_measurements_beside_the_baseline(tiny_target, tmp_path, monkeypatch):
    """main's report from the servers' measurements (stand-ins for what server-NAME.json holds after a GPU run)."""
    import serve.smoke
    measured = {"baseline": ({"1": 500.0, "8": 2000.0}, None, ["a", "b"], 2.0),
                "eagle3": ({"1": 600.0, "8": 1500.0}, 2.5, ["a", "b"], 4.0),
                "eagle3_steps5": ({"1": 500.0, "8": 1000.0}, 3.0, ["a", "c"], 6.7),
                "baseline_deterministic": ({}, None, ["a", "d"], 2.2),
                "eagle3_deterministic": ({}, 2.4, ["a", "d"], 4.4)}

    def canned(path, key, serve_and_measure):
        return {"command": "launch_server", "ready_s": 30.0, "stopped": {"port_free": True},
                "measured": canned_measurement(*measured[path.stem.removeprefix("server-")])}
    monkeypatch.setattr(serve.smoke, "measured_once", canned)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"dtype": "float32"}))  # as the target declares
    args = ["--target", str(tiny_target), "--drafter", str(tmp_path / "drafter"), "--limit", "2",
            "--concurrency", "1,8", "--steps", "3,5", "--out", str(tmp_path / "out"), "--deterministic-parity"]
    report = serve.smoke.main(args)
    assert report["parity"] == 1.0 and report["eagle3_steps5"]["parity"] == {"default": 0.5, "all": 0.5}
    assert report["eagle3"]["chain"] == "SGLang EAGLE3, 3 steps / top-k 1 / 4 draft tokens"
    assert report["eagle3"]["accept_length_by_group"] == {"default": 2.5}
    # EAGLE3 compared with the plain server of the same kernels
    assert report["deterministic"] == {"parity": 1.0, "accept_length": {"default": 2.4},
                                       "baseline_parity_with_default_kernels": 0.5}
    assert report["verdict"]["1"].startswith("faster: 1.20x") and report["verdict"]["8"].startswith("slower: 0.75x")
    assert report["eagle3_steps5"]["verdict"]["1"].startswith(NO_DIFFERENCE)
    assert report["eagle3"]["costs"]["break_even_accept_length"]["median"] == pytest.approx(2.0)
    deeper = report["eagle3_steps5"]["costs"]  # 6.7 ms a cycle = 3.35 decode steps, above the 3.0 accepted
    assert deeper["limited_by"].startswith("drafter quality") and deeper["most_tokens_per_cycle"] == 6
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["environment"]["versions"]["torch"] and saved["timing"]["repeats"] == 3

    # a deterministic server that does not start costs the check, not the report
    def failing(path, key, serve_and_measure):
        if path.stem == "server-eagle3_deterministic":
            raise RuntimeError("server exited with 1; log ...: deterministic inference needs ...")
        return canned(path, key, serve_and_measure)
    monkeypatch.setattr(serve.smoke, "measured_once", failing)
    report = serve.smoke.main(args)
    assert report["deterministic"]["error"].startswith("eagle3_deterministic: server exited with 1")
    assert report["verdict"]["1"].startswith("faster: 1.20x")


def test_a_sweep_recommends_per_concurrency_only_what_is_measurably_faster(tiny_target, tmp_path, monkeypatch):
    """--sweep: chains 1-7 and the default trees (stand-in measurements); per concurrency the fastest configuration
    whose whole range is above plain, the plain server where none is, and a tree whose server fails reported."""
    import serve.smoke
    from serve.sweep import DEFAULT_TREES
    plain = {"1": 500.0, "8": 2000.0, "64": 5000.0}
    measured = {"baseline": plain, "eagle3": {"1": 600.0, "8": 2100.0, "64": 4000.0},
                "eagle3_steps1": {"1": 550.0, "8": 2300.0, "64": 5150.0},  # 64: 1.03x, a range straddling 1.0
                "eagle3_steps3_topk4_tokens8": {"1": 700.0, "8": 1900.0, "64": 3000.0}}

    def canned(path, key, serve_and_measure):
        name = path.stem.removeprefix("server-")
        if name == "eagle3_steps4_topk8_tokens16":
            raise RuntimeError("server exited with 1: out of memory for the tree's KV cache")
        rates = measured.get(name, {c: v * 0.9 for c, v in plain.items()})  # the other chains: slower
        return {"command": "launch_server", "ready_s": 30.0, "stopped": {"port_free": True},
                "measured": canned_measurement(rates, None if name == "baseline" else 2.5, ["a", "b"], 2.0)}
    monkeypatch.setattr(serve.smoke, "measured_once", canned)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dtype": "float32"}))
    report = serve.smoke.main(["--target", str(tiny_target), "--drafter", str(drafter), "--limit", "2",
                               "--concurrency", "1,8,64", "--sweep", "--out", str(tmp_path / "out")])
    assert {f"eagle3_steps{n}" for n in (1, 2, 4, 5, 6, 7)} <= set(report) and len(DEFAULT_TREES) == 3
    assert report["eagle3_steps4_topk8_tokens16"] == {"error": "server exited with 1: out of memory for the tree's "
                                                               "KV cache"}
    rec = report["recommended"]["by_concurrency"]
    assert rec["1"]["config"] == "eagle3_steps3_topk4_tokens8" and rec["1"]["speedup"]["median"] == pytest.approx(1.4)
    assert rec["1"]["flags"] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter),
                                 "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                                 "--speculative-num-draft-tokens", "8"]
    assert rec["8"]["config"] == "eagle3_steps1" and rec["8"]["speedup"]["min"] > 1.0
    assert rec["64"]["config"] is None and "closest: eagle3_steps1, 1.03x" in rec["64"]["why"]
    assert report["recommended"]["pays_up_to_concurrency"] == 8
    assert report["recommended"]["does_not_pay_from_concurrency"] == 64


def test_trees_sglang_cannot_build_are_refused_when_parsed(capsys):
    from serve.smoke import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--drafter", "d", "--trees", "3/4/20"])
    assert "a tree of 3 steps x top-k 4 holds 2 to 13 draft tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--drafter", "d", "--trees", "3/1/5"])
    assert parse_args(["--target", "t", "--drafter", "d", "--trees", "3/4/8"]).configs[-1] == (3, 4, 8)


def test_a_dflash_drafter_is_served_with_its_own_block_size(tiny_target, tmp_path, monkeypatch, capsys):
    """A DFlash drafter directory: one server with SGLang's DFLASH flags at the drafter's block size (stand-in
    measurements), keyed `dflash`; EAGLE-3 configuration flags are refused for it."""
    import serve.smoke
    from serve.dflash_dir import SGLANG_CLASS
    drafter = tmp_path / "dflash"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": [SGLANG_CLASS], "dtype": "float32",
                                                     "dflash_config": {"block_size": 8, "mask_token_id": 3,
                                                                       "target_layer_ids": [1, 2]}}))
    commands = {}

    def canned(path, key, serve_and_measure):
        name = path.stem.removeprefix("server-")
        commands[name] = key
        rates = {"1": 500.0} if name == "baseline" else {"1": 900.0}
        return {"command": "launch_server", "ready_s": 30.0, "stopped": {"port_free": True},
                "measured": canned_measurement(rates, None if name == "baseline" else 3.5, ["a", "b"], 2.0)}
    monkeypatch.setattr(serve.smoke, "measured_once", canned)
    plan = serve.smoke.server_plan(serve.smoke.parse_args(["--target", str(tiny_target), "--drafter", str(drafter),
                                                           "--concurrency", "1"]))
    [(name, args, _)] = plan[1:]
    assert name == "dflash" and args[args.index("--speculative-algorithm") + 1] == "DFLASH"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "8" and "--speculative-eagle-topk" not in args
    report = serve.smoke.main(["--target", str(tiny_target), "--drafter", str(drafter), "--limit", "2",
                               "--concurrency", "1", "--out", str(tmp_path / "out")])
    assert set(commands) == {"baseline", "dflash"} and report["parity"] == 1.0
    assert report["dflash"]["chain"] == "SGLang DFLASH, blocks of 8 (7 drafts)"
    assert report["verdict"]["1"].startswith("faster: 1.80x")
    assert report["dflash"]["costs"]["most_tokens_per_cycle"] == 8
    with pytest.raises(SystemExit):
        serve.smoke.parse_args(["--target", "t", "--drafter", str(drafter), "--sweep"])
    assert "is a DFlash drafter" in capsys.readouterr().err


def test_mixed_served_dtypes_fail_before_any_server_starts(tiny_target, tmp_path):
    from serve.smoke import served_dtype_args
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))  # the target declares float32
    with pytest.raises(SystemExit, match="drafter in bfloat16 and the target in float16.*--dtype=bfloat16"):
        served_dtype_args(str(tiny_target), str(drafter), ["--attention-backend=triton"])
    assert served_dtype_args(str(tiny_target), str(drafter), ["--dtype=bfloat16"]) == []  # one dtype for both
    assert served_dtype_args(str(tiny_target), str(drafter), ["--dtype", "float16"]) == []
    (drafter / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert served_dtype_args(str(tiny_target), str(drafter), []) == []  # both served in float16


def test_a_dflash_drafter_is_served_in_bfloat16(tiny_target, tmp_path):
    """SGLang 0.5.14 feeds a DFlash block's embeddings in bfloat16: served in float16 (the demo's float32 configs
    under --dtype auto), the DFlash server died at its first block on an H100. bfloat16 is added for every server
    unless the user chose it; another explicit dtype is refused before any server starts."""
    from serve.dflash_dir import SGLANG_CLASS
    from serve.smoke import served_dtype_args
    drafter = tmp_path / "dflash"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": [SGLANG_CLASS], "dtype": "float32"}))
    assert served_dtype_args(str(tiny_target), str(drafter), ["--attention-backend=triton"]) == ["--dtype", "bfloat16"]
    assert served_dtype_args(str(tiny_target), str(drafter), ["--dtype", "bfloat16"]) == []
    with pytest.raises(SystemExit, match="--dtype float16: SGLang 0.5.14 serves a DFlash drafter in bfloat16 only"):
        served_dtype_args(str(tiny_target), str(drafter), ["--dtype=bfloat16", "--dtype", "float16"])


def test_decode_graphs_cover_each_concurrency_in_few_sizes_and_a_users_list_wins():
    """Read back through SGLang's own parser: powers of two up to the largest concurrency plus each one (7 sizes
    for 1/8/32/64, where SGLang's default up to 64 has 12, 27 in speculative mode), and a user's list given after
    it replaces it."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ours = decode_graph_args([1, 8, 32, 64])
    assert parser.parse_args(["--model-path", "t", *ours]).cuda_graph_bs_decode == [1, 2, 4, 8, 16, 32, 64]
    assert decode_graph_args([48])[1:] == ["1", "2", "4", "8", "16", "32", "48"]
    users = parser.parse_args(["--model-path", "t", *ours, "--cuda-graph-bs-decode", "1", "3"])
    assert users.cuda_graph_bs_decode == [1, 3]


def test_compare_with_run_sets_sglang_beside_the_reference_decoder_and_offline_evaluator(tmp_path):
    offline = {"accept_length_by_steps": [1.8, 2.3, 2.75, 3.0],
               "prompts": {"decoded_accept_length_by_steps": [1.7, 2.2, 2.5, 2.6]}}
    evaluate = {"split": "eval", "drafters": {"D": {"sampled": offline, "unseen": offline}},
                "decode": {"D": {g: {"steps": 3, "accept_length": 2.6, "device": "cpu",
                                     "prompts": [{"output_ids": [5, 6, 4]}, {"output_ids": [7, 4]}]}
                                 for g in ("sampled", "unseen")}}}
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "evaluate.json").write_text(json.dumps(evaluate))
    spec = {"groups": {"sampled": {"accept_length": 2.5, "output_ids": [[5, 6, 4], [7, 8]], "per_prompt": []},
                       "unseen": {"accept_length": 2.0, "output_ids": [[5, 6, 4], [7, 4]], "per_prompt": []}}}
    r = compare_with_run(str(tmp_path), "D", 3, spec)
    assert r["sampled"]["chain"] == "3 steps / top-k 1 / 4 draft tokens"
    assert r["sampled"]["accept_length"]["reference_decoder"]["relative_to_sglang"] == pytest.approx(0.04)
    assert r["sampled"]["accept_length"]["offline_evaluator_tau"]["value"] == 2.75  # tau at the served steps
    assert r["sampled"]["accept_length"]["offline_evaluator_prompts"]["value"] == 2.5  # the same prompts, offline
    assert r["sampled"]["token_parity_with_reference_decoder"] == 0.5
    assert r["unseen"]["accept_length"]["reference_decoder"]["relative_to_sglang"] == pytest.approx(0.3)
    assert r["unseen"]["token_parity_with_reference_decoder"] == 1.0
    with pytest.raises(SystemExit, match="4 steps"):
        compare_with_run(str(tmp_path), "D", 4, spec)
    # a DFlash drafter: its offline figure is the block accept length (evaluate's dflash_drafters)
    evaluate |= {"drafters": {}, "dflash_drafters": {"D": {"sampled": {"accept_length": 2.4}}},
                 "decode": {"D": {"sampled": evaluate["decode"]["D"]["sampled"] | {"steps": 7}}}}
    (tmp_path / "evaluate" / "evaluate.json").write_text(json.dumps(evaluate))
    r = compare_with_run(str(tmp_path), "D", 7, spec)
    assert list(r) == ["sampled"] and r["sampled"]["chain"] == "DFlash blocks of 8"
    assert r["sampled"]["accept_length"]["offline_evaluator_blocks"]["value"] == 2.4
    assert set(r["sampled"]["accept_length"]) == {"sglang", "reference_decoder", "offline_evaluator_blocks"}


def test_accept_lengths_compared_on_the_prompts_where_both_decoders_emitted_the_same_tokens(tmp_path):
    # The mission run's shape: SGLang flipped one greedy near-tie, ended that answer early, and its all-prompt accept
    # length came out 8% above the reference decoder's while the prompts with equal outputs agreed exactly.
    reference = [{"output_ids": [5] * 12, "tokens": 12, "verify_calls": 3},
                 {"output_ids": [6] * 10, "tokens": 10, "verify_calls": 8}]
    offline = {"accept_length_by_steps": [1.8, 2.3, 2.75], "prompts": {"decoded_accept_length_by_steps": [1, 2, 3]}}
    evaluate = {"split": "eval", "drafters": {"D": {"sampled": offline}},
                "decode": {"D": {"sampled": {"steps": 3, "accept_length": 22 / 11, "device": "cuda",
                                             "prompts": reference}}}}
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "evaluate.json").write_text(json.dumps(evaluate))
    sglang = {"accept_length": 16 / 5, "output_ids": [[5] * 12, [6, 6, 7, 2]],
              "per_prompt": [{"completion_tokens": 12, "verify_steps": 3}, {"completion_tokens": 4, "verify_steps": 2}]}
    r = compare_with_run(str(tmp_path), "D", 3, {"groups": {"sampled": sglang}})["sampled"]
    assert r["accept_length"]["reference_decoder"]["relative_to_sglang"] == pytest.approx(2.0 / 3.2 - 1)
    assert r["same_output_prompts"] == {"prompts": 1, "sglang": 4.0, "reference_decoder": 4.0,
                                        "relative_to_sglang": 0.0, "prompts_with_equal_verify_steps": 1}


def test_a_rerun_reuses_a_server_measured_with_the_same_command_prompts_and_drafter(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(b"weights v1")
    key = server_key(["launch_server", "--speculative-draft-model-path", str(drafter)], {"g": [[1, 2]]}, [64, 3],
                     [1, 8], str(drafter))
    calls = []

    def serve_and_measure():
        calls.append(1)
        return {"command": "c", "ready_s": 1.0, "stopped": {}, "measured": {"tokens_per_s": {"1": 10.0, "8": 70.0}}}
    first = measured_once(tmp_path / "server-eagle3.json", key, serve_and_measure)
    again = measured_once(tmp_path / "server-eagle3.json", key, serve_and_measure)
    assert len(calls) == 1 and again == first
    assert server_key(["launch_server"], {"g": [[1, 2]]}, [64, 3], [1, 8], None) != key
    assert server_key(["launch_server", "--speculative-draft-model-path", str(drafter)], {"g": [[1, 2]]}, [64, 5],
                      [1, 8], str(drafter)) != key  # timed with other repeats: measured again
    (drafter / "model.safetensors").write_bytes(b"weights v2")  # re-exported drafter: measured again
    changed = server_key(["launch_server", "--speculative-draft-model-path", str(drafter)], {"g": [[1, 2]]}, [64, 3],
                         [1, 8], str(drafter))
    measured_once(tmp_path / "server-eagle3.json", changed, serve_and_measure)
    assert changed != key and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-smi") is None,
                    reason="not run: the SGLang servers (baseline and EAGLE3) need a GPU; run serve.smoke on the "
                           "GPU machine (see ../shared/device/README.md)")
def test_smoke_on_the_demo(demo_run, tmp_path):
    from serve.smoke import main
    run = demo_run[0]
    target = json.loads((run / "train" / "summary.json").read_text())["config"]["target"]["path"]
    report = main(["--target", target, "--drafter", str(run / "drafter"), "--out", str(tmp_path), "--run", str(run),
                   "--concurrency", "1,8", "--repeats", "3", "--pass-seconds", "2",
                   "--server-arg=--attention-backend=triton", "--server-arg=--dtype=bfloat16",
                   "--server-arg=--sampling-backend=pytorch", "--server-arg=--grammar-backend=none",
                   "--server-arg=--disable-cuda-graph", "--server-arg=--mem-fraction-static=0.3"])
    # bf16 near-ties of a tiny target flip a few outputs (13/15 equal measured on the H200), never most of them
    assert report["parity"] >= 0.7 and report["eagle3"]["accept_length_by_group"]["sampled"] > 1.5
    # measured on the mission run: the prompts with equal outputs 0.0% apart; over all prompts 7.6% apart, one
    # answer flipped at a near-tie and ended early (tau over every held-out position: 21% apart)
    same = report["reference"]["sampled"]["same_output_prompts"]
    assert same["prompts"] >= 0.7 * report["prompts"]["sampled"] and abs(same["relative_to_sglang"]) < 0.02, same
    for name in ("reference_decoder", "offline_evaluator_prompts"):
        r = report["reference"]["sampled"]["accept_length"][name]
        assert abs(r["relative_to_sglang"]) < 0.10, (name, r)
    costs = report["eagle3"]["costs"]  # measured: a cycle (3 drafts + a 4-token verify) costs more than one step
    assert costs["cycle_ms"]["median"] > costs["plain_step_ms"]["median"] > 0
    assert report["baseline_stopped"]["port_free"] and report["eagle3_stopped"]["port_free"]


@pytest.mark.parametrize("chunked", [True, False])  # chunked: as uvicorn (SGLang's HTTP server) streams
def test_streamed_steps_are_timed_as_they_arrive(chunked):
    """Server.stream against a stand-in SSE endpoint (not SGLang: a local http.server writing /generate's event
    format, the verify count only in the finished event as SGLang 0.5.14 sends it): an event every 50 ms arrives
    50 ms apart, and events that arrive together are one chunk (iter_lines' 512-byte buffering once gave several
    steps one arrival time). 50 ms, not less: on a loaded 2-core machine a read came 4 ms late, and a read
    later than the interval would join two events."""
    import http.server
    import threading
    import time

    from serve.sglang_server import Server
    interval = 0.05

    class Events(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if chunked else "HTTP/1.0"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            raw_write = self.wfile.write
            if chunked:
                self.wfile.write = lambda data: raw_write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

            def event(tokens: int, verify: int | None = None) -> bytes:  # SGLang: the verify count when finished
                meta = {"completion_tokens": tokens} | ({"spec_verify_ct": verify} if verify else {})
                return f"data: {json.dumps({'text': 'x', 'meta_info': meta})}\n\n".encode()
            self.wfile.write(event(1))  # the prefill's token, then a 3-token cycle every interval
            self.wfile.flush()
            for cycle in range(1, 7):
                time.sleep(interval)
                self.wfile.write(event(1 + 3 * cycle))
                self.wfile.flush()
            time.sleep(interval)
            self.wfile.write(event(22) + event(25, verify=8))  # two cycles' events in one write, the last finished
            self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            if chunked:
                raw_write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Events)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = object.__new__(Server)
        server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        chunks = server.stream([1, 2, 3], 24)
    finally:
        httpd.shutdown()
    assert [c[1:] for c in chunks] == [(1, 0), (4, 0), (7, 0), (10, 0), (13, 0), (16, 0), (19, 0), (25, 8)]
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:])]
    assert all(interval / 2 < gap < 3 * interval for gap in gaps), gaps  # timed as they arrived, not at the end
    # 8 cycles over at least 7 intervals; the last two cycles arrived together, one interval apart from the others
    assert 7 / 8 * interval * 1e3 <= decode_ms(chunks, speculative=True) < 2 * interval * 1e3


def test_a_process_stopped_by_sigterm_stops_its_server_and_frees_the_port(tmp_path):
    """`timeout` (tests/benchmarks/mission.sh's time-limited commands) and Slurm stop a smoke test with SIGTERM; the
    server it had started must go with it. Seen on an H100: a DFlash server left running by a smoke test that
    `timeout` ended held port 30000, and the next command's EAGLE3 server could not bind it. The server here is a
    stand-in, not SGLang: Python's http.server answering /health_generate, started through serve.sglang_server."""
    import signal
    import subprocess
    import sys
    import time

    from launch.pipeline import free_port
    from serve.sglang_server import port_free
    (tmp_path / "health_generate").write_text("ok")
    port = free_port()
    script = f"""
import sys, time
import serve.sglang_server as sglang_server
sglang_server.server_command = lambda port, args: [sys.executable, "-m", "http.server", str(port), "--bind",
                                                   "127.0.0.1", "--directory", {str(tmp_path)!r}]
with sglang_server.serving([], {port}, {str(tmp_path / 'server.log')!r}, timeout=60) as server:
    print(server.proc.pid, flush=True)
    time.sleep(120)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server_pid = int(proc.stdout.readline())
    assert not port_free(port)  # the stand-in server is up
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 128 + signal.SIGTERM
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)  # its whole process group is gone
    assert port_free(port)
