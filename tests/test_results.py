"""Raw results are committed and RESULTS.md is rendered from them: a hand edit, or a results file whose table was
not rendered again, fails here; so does a results file without its provenance."""
import json
from pathlib import Path

import pytest

from tests.benchmarks import render_results

RESULTS = Path(render_results.__file__).parent / "results"
ROOT = Path(render_results.__file__).parents[2]


@pytest.fixture
def scripts(monkeypatch):
    """tests/benchmarks' scripts import one another as top-level modules: their folder goes on sys.path."""
    monkeypatch.syspath_prepend(str(RESULTS.parent))


def test_results_md_is_what_the_results_files_render():
    assert render_results.OUT.read_text() == render_results.render(), \
        "tests/benchmarks/RESULTS.md is stale: run python tests/benchmarks/render_results.py"


def test_every_results_file_says_where_it_came_from_and_keeps_every_repeat():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        record = json.loads(path.read_text())
        assert record["name"] == path.stem and record["kind"] in render_results.RENDERERS
        assert record["commands"] and len(record["commit"]) == 40
        env = record["environment"]
        assert env["device"] and env["versions"]["torch"], path
        for c, runs in record["results"].get("throughput", {}).items():
            assert len(runs["baseline"]) >= 3 and len(runs["eagle3"]) >= 3, (path, c)  # every repeat, not a median
            assert all(p["seconds"] >= 10 for p in runs["baseline_passes"] + runs["eagle3_passes"]), (path, c)
        if record["kind"] == "served":
            served = [record["results"]["baseline"], *record["results"]["drafters"]]
            for passes in (p for s in served for p in s["passes"].values()):
                assert len(passes) >= 3 and all(p["seconds"] >= 10 for p in passes), path


def test_a_speedup_whose_range_holds_one_is_no_measurable_difference():
    assert render_results.speedup([110, 120, 130], [100, 101, 102]).startswith("faster: 1.19x (1.08-1.30)")
    assert render_results.speedup([90, 120, 130], [100, 101, 102]).startswith("no measurable difference")
    assert render_results.speedup([80, 85, 90], [100, 101, 102]).startswith("slower")


def test_the_training_table_sets_each_peer_beside_eyrie_with_its_range():
    """A stand-in record (not a measurement: made-up step times) through the train_step renderer."""
    def row(peer: str, seconds: list[float], peak_gib: float = 30.1) -> dict:
        ordered = sorted(seconds)
        return {"peer": peer, "shape": "llama3-8b", "T": 2048, "step_seconds": seconds,
                "tokens_per_s": round(2048 / ordered[len(ordered) // 2]),
                "tokens_per_s_min": round(2048 / max(seconds)),
                "tokens_per_s_max": round(2048 / min(seconds)), "peak_gib": peak_gib, "resident_gib": 4.2, "mfu": 0.41,
                "mfu_of_dense_peak": 0.33, "peak_bf16_matmul_tflops": 790.0}
    record = {"name": "stand-in", "date": "2026-12-06", "commit": "0" * 40, "commands": ["python bench_train.py"],
              "environment": {"device": ["NVIDIA H100"], "cpu_count": 16, "python": "3.12", "versions": {"torch": "2"}},
              "results": {"steps": 3, "dense_bf16_peak_tflops": 989.0,
                          "rows": [row("specforge", [0.13, 0.14, 0.15]), row("eyrie", [0.10, 0.11, 0.12], peak_gib=19.9),
                                   {"peer": "specforge-compact", "shape": "llama3-8b", "error": "not importable"}]}}
    text = "\n".join(render_results.render_train_step(record))
    assert "| llama3-8b | 2,048 | specforge | 14,629 (13,653-15,754) | faster: 1.27x (1.08-1.50) | 30.1 | 1.00 |" \
        in text
    assert "| llama3-8b | 2,048 | eyrie | 18,618 (17,067-20,480) |  | 19.9 | 0.66 |" in text  # listed first
    assert text.index("| eyrie |") < text.index("| specforge |")
    assert "41.0% of 790 | 33.0% |" in text and "specforge-compact llama3-8b T=-: not importable" in text
    # a DFlash record: its peers set beside eyrie-dflash, under a title that names the family
    blocks = {"block_size": 16, "anchors": 384}
    record["results"]["rows"] = [row("specforge-dflash", [0.13, 0.14, 0.15], peak_gib=8.6) | blocks,
                                 row("eyrie-dflash", [0.10, 0.11, 0.12], peak_gib=17.2) | blocks]
    text = "\n".join(render_results.render_train_step(record))
    assert text.startswith("## DFlash drafter training step")
    assert "DFlash steps: blocks of 16 at 384 anchors," in text  # read from the rows, not assumed
    assert "| specforge-dflash | 14,629 (13,653-15,754) | faster: 1.27x (1.08-1.50) | 8.6 | 1.00 |" in text
    assert "| eyrie-dflash | 18,618 (17,067-20,480) |  | 17.2 | 2.00 |" in text


def test_options_are_compared_with_the_first_variant_paired_by_seed():
    """A stand-in record (not a measurement: made-up accept lengths) through the drafter_options renderer."""
    def run(seed: int, accept: float, tau: float) -> dict:
        return {"seed": seed, "commit": "0" * 40, "accept_length": accept, "offline_accept_length": accept,
                "formula": "tokens / verify", "heldout_overlap_with_training": 0, "train_steps": 75, "lossless": True,
                "groups": {"sampled": {"prompts": 16, "completion_tokens": 290, "reference_decoder": accept,
                                       "offline_tau_by_steps": [1.5, tau], "heldout_samples": 20,
                                       "heldout_tokens": 1200}}}
    variants = {"plain": {"overrides": [], "runs": [run(0, 2.5, 2.0), run(1, 2.4, 2.1), run(2, 2.6, 2.2)]},
                "fc_norm": {"overrides": ["--train.drafter.fc_norm=true"],
                            "runs": [run(0, 2.7, 1.9), run(1, 2.5, 2.3), run(2, 2.9, 2.2)]}}
    record = {"name": "stand-in", "date": "2026-12-06", "commit": "0" * 40, "commands": ["python compare_options.py"],
              "environment": {"device": ["cpu"], "cpu_count": 2, "python": "3.12", "versions": {"torch": "2"}},
              "results": {"config": "demo.yaml", "extra_arguments": ["--train.drafter.arch=mla"], "seeds": [0, 1, 2],
                          "variants": variants}}
    text = "\n".join(render_results.render_drafter_options(record))
    # accept length: paired differences +0.2, +0.1, +0.3 → all above 0; tau: -0.1, +0.2, 0.0 → holds 0
    assert "| plain | `-` | 2.500 (2.400-2.600) |  | 2.100 (2.000-2.200) |  |" in text
    assert "| fc_norm | `--train.drafter.fc_norm=true` | 2.700 (2.500-2.900) | +0.200 (+0.100 to +0.300) | " \
           "2.200 (1.900-2.300) | no measurable difference: +0.000 (-0.100 to +0.200) |" in text
    assert "(0, 1, 2) with `--train.drafter.arch=mla` on the same data" in text
    assert "same steps (75), held-out overlap with training 0" in text
    # DFlash drafters: their offline figure is the block accept length (no tau by chain length)
    for v in variants.values():
        for r in v["runs"]:
            group = r["groups"]["sampled"]
            group["offline_blocks"] = group.pop("offline_tau_by_steps")[-1]
    text = "\n".join(render_results.render_drafter_options(record))
    assert "| variant | overrides | accept length, reference decoder | difference | offline block accept length | " \
           "difference |" in text and "over blocks anchored in the 'sampled' held-out group's samples" in text
    assert "| fc_norm | `--train.drafter.fc_norm=true` | 2.700 (2.500-2.900) | +0.200 (+0.100 to +0.300) | " \
           "2.200 (1.900-2.300) | no measurable difference: +0.000 (-0.100 to +0.200) |" in text


def test_a_variant_cut_off_after_training_shows_its_training_evaluation_alone(scripts):
    """A stand-in record (not a measurement: made-up figures) of one seed, whose second variant's evaluate stage did
    not run: its other cells read "not run", and one seed's difference says it has no spread."""
    import compare_options
    train_eval = {"accept_length": 3.0, "chains": 900.0, "tokens": 1500.0, "acc_step0": 0.7,
                  "p_accepted_through_step0": 0.7, "p_accepted_through_step1": 0.5, "p_accepted_through_step2": 0.3}
    plain_training = compare_options.training_heldout({"eval": train_eval})
    assert plain_training["steps"] == 3 and "1 + sum over k < 3 of P" in plain_training["formula"]
    assert compare_options.training_heldout({"eval": {"accept_length": 2.0, "blocks": 50.0}}) is None  # DFlash
    plain = {"seed": 0, "commit": "0" * 40, "accept_length": 2.5, "offline_accept_length": 2.5,
             "formula": "tokens / verify", "heldout_overlap_with_training": 0, "train_steps": 420, "lossless": True,
             "groups": {"sampled": {"prompts": 16, "completion_tokens": 290, "reference_decoder": 2.5,
                                    "offline_tau_by_steps": [1.5, 2.0], "heldout_samples": 20, "heldout_tokens": 1200}},
             "training_heldout": plain_training}
    cut_off = {"seed": 0, "commit": "0" * 40, "accept_length": None, "offline_accept_length": None, "formula": None,
               "heldout_overlap_with_training": 0, "train_steps": 420, "lossless": None, "groups": {},
               "training_heldout": plain_training | {"accept_length": 3.4}}
    record = {"name": "stand-in", "date": "2026-12-07", "commit": "0" * 40, "commands": ["python compare_options.py"],
              "environment": {"device": ["gpu"], "cpu_count": 16, "python": "3.12", "versions": {"torch": "2"}},
              "results": {"config": "mission.yaml", "extra_arguments": [], "seeds": [0],
                          "variants": {"plain": {"overrides": [], "runs": [plain]},
                                       "fc_norm": {"overrides": ["--train.drafter.fc_norm=true"], "runs": [cut_off]}}}}
    text = "\n".join(render_results.render_drafter_options(record))
    assert "| offline tau | difference | held-out accept length, training evaluation (3 steps) | difference |" in text
    assert "| plain | `-` | 2.500 (one seed) |  | 2.000 (one seed) |  | 3.000 (one seed) |  |" in text
    assert "| fc_norm | `--train.drafter.fc_norm=true` | not run |  | not run |  | 3.400 (one seed) | " \
           "+0.400 (one seed: no spread) |" in text
    assert "over 900 positions (1,500 tokens) of every held-out group" in text
    assert "One seed: no spread, so no difference here is established." in text


def test_a_drafter_scored_after_training_alone_keeps_its_training_evaluation_and_split(demo_run, scripts):
    """compare_options --stages data,extract,train: the report the pipeline writes when the evaluate stage has not
    run for the drafter it trained (the real demo run's, summarised as if its evaluate stage were stale) still
    gives the training evaluation, the steps and the held-out overlap; the evaluated figures are None."""
    import compare_options

    from data.config import load_config
    from launch.pipeline import fingerprints, summarize
    run, config_path, _ = demo_run
    cfg = load_config(str(config_path), [])
    full = json.loads((run / "report.json").read_text())
    prints = fingerprints(cfg) | {"evaluate": "another drafter's"}
    full |= {"commit": "0" * 40}  # what compare_options adds to each report it keeps
    trained = summarize(cfg, {}, prints) | {"commit": "0" * 40}
    assert "accept_length" not in trained and trained["split"] == full["split"]
    assert trained["split"]["heldout_overlap_with_training"] == 0 and "normalised" in trained["split"]["rule"]
    alone, evaluated = compare_options.summary(trained), compare_options.summary(full)
    assert alone["training_heldout"] == evaluated["training_heldout"] == \
        compare_options.training_heldout(full["train"])
    assert alone["training_heldout"]["accept_length"] > 1.5 and alone["train_steps"] == full["train"]["steps"] > 0
    assert (alone["accept_length"], alone["groups"], evaluated["accept_length"]) == (None, {}, full["accept_length"])
    assert alone["heldout_overlap_with_training"] == evaluated["heldout_overlap_with_training"] == 0


def test_a_comparison_by_training_evaluation_alone_refuses_dflash_before_training(tmp_path, scripts, capsys):
    import compare_options
    with pytest.raises(SystemExit) as stopped:
        compare_options.main(["--config", str(ROOT / "launch/configs/demo.yaml"), "--run-dir", str(tmp_path),
                              "--variant", "tokens=", "--stages", "data,extract,train", "--record", "x", "--",
                              "--train.drafter.family=dflash"])
    assert stopped.value.code == 2 and "counts blocks" in capsys.readouterr().err
    assert not (tmp_path / "options").exists()


def test_a_comparison_cut_off_by_a_time_limit_keeps_whole_pairs_and_resumes(tmp_path, scripts, monkeypatch):
    """Seed by seed, every variant of a seed before the next, the record rewritten after each seed. The pipeline
    is a stand-in here (made-up reports, no training): the test is of the order, the record and the resumption."""
    import compare_options
    calls = []

    def stand_in_pipeline(config, run_dir, overrides, seed, extra, stages):
        if len(calls) == limit:
            raise KeyboardInterrupt  # the time limit's SIGINT
        calls.append((overrides, seed))
        accept = 3.0 + seed / 10 + 0.2 * bool(overrides)
        return {"commit": "1" * 40, "train": {"steps": 128, "eval": {
            "accept_length": accept, "chains": 900.0, "tokens": 1500.0, "acc_step0": 0.7,
            "p_accepted_through_step0": 0.7}}, "split": {"heldout_overlap_with_training": 0}}
    monkeypatch.setattr(compare_options, "run_variant", stand_in_pipeline)
    args = ["--config", str(ROOT / "launch/configs/demo.yaml"), "--run-dir", str(tmp_path / "run"), "--variant",
            "plain=", "--variant", "fc_norm=--train.drafter.fc_norm=true", "--stages", "data,extract,train",
            "--seeds", "0,1,2", "--record", "cut", "--out", str(tmp_path)]
    fc_norm = ["--train.drafter.fc_norm=true"]
    limit = 3
    with pytest.raises(KeyboardInterrupt):
        compare_options.main(args)
    assert calls == [([], 0), (fc_norm, 0), ([], 1)]
    cut = json.loads((tmp_path / "cut.json").read_text())["results"]
    assert cut["seeds"] == [0] and [len(v["runs"]) for v in cut["variants"].values()] == [1, 1]
    text = "\n".join(render_results.render_drafter_options(json.loads((tmp_path / "cut.json").read_text())))
    assert "| fc_norm | `--train.drafter.fc_norm=true` | 3.200 (one seed) | +0.200 (one seed: no spread) |" in text
    calls.clear()
    limit = None
    compare_options.main(args)  # resumed: plain seed 1 was kept, so it is not trained again
    assert calls == [(fc_norm, 1), ([], 2), (fc_norm, 2)]
    whole = json.loads((tmp_path / "cut.json").read_text())["results"]
    assert whole["seeds"] == [0, 1, 2]
    assert [r["training_heldout"]["accept_length"] for r in whole["variants"]["fc_norm"]["runs"]] == \
        pytest.approx([3.2, 3.3, 3.4])


def test_options_compared_by_training_evaluation_alone_show_that_column_only():
    """A stand-in record (not a measurement: made-up figures) of three seeds where no run was evaluated."""
    def run(seed: int, accept: float) -> dict:
        return {"seed": seed, "commit": "0" * 40, "accept_length": None, "offline_accept_length": None,
                "formula": None, "heldout_overlap_with_training": 0, "train_steps": 140, "lossless": None,
                "groups": {}, "training_heldout": {"accept_length": accept, "chains": 900.0, "tokens": 1500.0,
                                                   "steps": 7, "acc_step0": 0.7, "formula": "1 + sum of P"}}
    record = {"name": "stand-in", "date": "2026-12-07", "commit": "0" * 40, "commands": ["python compare_options.py"],
              "environment": {"device": ["gpu"], "cpu_count": 16, "python": "3.12", "versions": {"torch": "2"}},
              "results": {"config": "mission.yaml", "extra_arguments": [], "seeds": [0, 1, 2],
                          "variants": {"plain": {"overrides": [], "runs": [run(0, 3.0), run(1, 3.2), run(2, 3.1)]},
                                       "fc_norm": {"overrides": ["--train.drafter.fc_norm=true"],
                                                   "runs": [run(0, 3.4), run(1, 3.1), run(2, 3.5)]}}}}
    text = "\n".join(render_results.render_drafter_options(record))
    assert "| variant | overrides | held-out accept length, training evaluation (7 steps) | difference |" in text
    assert "| plain | `-` | 3.100 (3.000-3.200) |  |" in text
    assert "| fc_norm | `--train.drafter.fc_norm=true` | 3.400 (3.100-3.500) | " \
           "no measurable difference: +0.400 (-0.100 to +0.400) |" in text
    assert "Reference decoder" not in text and "Training evaluation: 1 + sum of P, over 900 positions" in text


def served_report(drafter: str, server: str, tokens_per_s: list[float], plain: list[float]) -> dict:
    """A stand-in serve.smoke report (made-up figures, the keys serve.smoke writes) of one speculative server."""
    def passes(values):
        return {"1": [{"requests": 9, "completion_tokens": 900, "seconds": 10.0, "tokens_per_s": v} for v in values]}
    cost = {"median": 2.0, "min": 1.9, "max": 2.1, "n": 3, "repeats": [2.0, 1.9, 2.1]}
    return {"target": "t", "drafter": drafter, "timing": {"repeats": 3, "pass_seconds": 10.0, "max_new_tokens": 256,
                                                          "prompts": "sampled"},
            "environment": {"commit": "0" * 40, "device": ["NVIDIA H100"], "cpu_count": 16, "python": "3.12",
                            "versions": {"torch": "2"}},
            "baseline": {"passes": passes(plain), "step_ms": cost | {"median": 1.0, "min": 0.9, "max": 1.1}},
            "baseline_command": "sglang.launch_server ...", f"{server}_command": "sglang.launch_server ... --spec",
            server: {"chain": f"{server} chain", "flags": ["--speculative-algorithm", server.upper()],
                     "groups": {"sampled": {"prompts": 16, "completion_tokens": 290, "accept_length": 2.5}},
                     "parity": {"sampled": 1.0}, "passes": passes(tokens_per_s), "step_ms": cost,
                     "costs": {"break_even_accept_length": {"median": 2.0, "min": 1.7, "max": 2.3},
                               "limited_by": "nothing", "how": "streamed alone"}},
            "reference": {"sampled": {"accept_length": {"reference_decoder": {"value": 2.4}},
                                      "token_parity_with_reference_decoder": 0.9}}}


def test_drafters_served_beside_one_plain_server_make_one_table(tmp_path, scripts):
    """record_smoke with two stand-in reports: one row per drafter, each speedup over the shared plain server's
    passes, a drafter served on another copy of its target flagged, extract.parity's figures as a table; reports
    measured against different plain servers are refused."""
    import record_smoke
    plain = [100.0, 101.0, 102.0]
    reports = [served_report("a", "eagle3", [120.0, 125.0, 130.0], plain),
               served_report("b", "dflash", [90.0, 95.0, 99.0], plain)]
    reports[0]["target_match"] = {"same_target": True, "note": ""}
    reports[1]["target_match"] = {"same_target": False, "note": "trained on features of t-bf16 (full precision), "
                                                                "served on t (compressed-tensors)"}
    for i, report in enumerate(reports):
        (tmp_path / f"{i}.json").write_text(json.dumps(report))
    # extract.parity's output: its table, then the same figures as one JSON line
    layer = {"cosine_mean": 0.99991, "cosine_min": 0.955, "max_abs_diff": 8.75}
    parity = {"a": "int4/features", "b": "bf16/features", "samples": 334, "dtypes": ["bfloat16", "bfloat16"],
              "layers": {"layer 1": layer, "final": layer | {"max_abs_diff": 1.2}}}
    (tmp_path / "parity.log").write_text("a table\n" + json.dumps(parity) + "\n")
    out = record_smoke.main([str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--label", "EAGLE-3", "--label",
                             "DFlash", "--name", "stand-in", "--date", "2026-12-07", "--command", "c",
                             "--feature-parity", str(tmp_path / "parity.log"), "--out", str(tmp_path)])
    text = "\n".join(render_results.render_served(json.loads(out.read_text())))
    assert "- DFlash: trained on features of t-bf16 (full precision), served on t (compressed-tensors)." in text
    assert "- EAGLE-3: trained on" not in text
    assert "### Features: `int4/features` against `bf16/features`" in text and "over 334 samples" in text
    assert "| layer 1 | 0.99991 | 0.9550 | 8.75 |" in text and "| final | 0.99991 | 0.9550 | 1.2 |" in text
    assert text.startswith("## SGLang serving on t: EAGLE-3, DFlash (2026-12-07)")
    assert "| EAGLE-3 | eagle3 chain, greedy | sampled | 16 (290) | **2.500** | 2.400 | 100% | 90% |" in text
    assert "| 1 | 101.0 (100.0-102.0) | 125.0 (120.0-130.0) | faster: 1.24x (1.18-1.30) | 95.0 (90.0-99.0) | " \
           "slower: 0.94x (0.88-0.99) |" in text
    assert "- DFlash: cycle 2.000 (1.900-2.100) ms = 2.00 (1.70-2.30) plain steps" in text
    # the features' parity measured later, added to a file recorded without it
    out = record_smoke.main([str(tmp_path / "0.json"), "--name", "later", "--date", "d", "--command", "c",
                             "--out", str(tmp_path)])
    assert "### Features" not in "\n".join(render_results.render_served(json.loads(out.read_text())))
    record_smoke.main(["--into", str(out), "--feature-parity", str(tmp_path / "parity.log"), "--command", "p"])
    later = json.loads(out.read_text())
    assert later["commands"] == ["c", "p"] and "| layer 1 | 0.99991 | 0.9550 | 8.75 |" in "\n".join(
        render_results.render_served(later))
    reports[1]["baseline"]["passes"]["1"][0]["tokens_per_s"] = 99.0  # another plain server's passes
    (tmp_path / "1.json").write_text(json.dumps(reports[1]))
    with pytest.raises(SystemExit, match="not measured against the same plain server"):
        record_smoke.main([str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--name", "x", "--date", "d",
                           "--command", "c", "--out", str(tmp_path)])


def test_a_record_is_appended_to_only_from_the_same_commit_and_device(tmp_path, monkeypatch, scripts):
    """bench_train's --append: two commands' rows make one table (a row measured again replaces the old one, each
    command listed once however often a run rewrites the file); a run at another commit is refused. Stand-in rows
    (made-up figures), written to a temporary folder."""
    import bench_train
    monkeypatch.setenv("EYRIE_COMMIT", "a" * 40)
    rows = {name: {"peer": name, "shape": "kimi-k2.5-kv8", "T": 2048, "tokens_per_s": n}
            for name, n in (("eyrie", 1), ("specforge-compact", 2))}
    bench_train.record("kv8", ["--peers", "eyrie,specforge-compact"], {"rows": list(rows.values())}, results=tmp_path)
    again = {"rows": [rows["specforge-compact"] | {"tokens_per_s": 3}, rows["eyrie"] | {"peer": "specforge"}]}
    for _ in range(2):  # rewritten after each peer
        bench_train.record("kv8", ["--peers", "specforge"], again, append=True, results=tmp_path)
    record = json.loads((tmp_path / "kv8.json").read_text())
    assert [(r["peer"], r["tokens_per_s"]) for r in record["results"]["rows"]] == \
        [("eyrie", 1), ("specforge-compact", 3), ("specforge", 1)]
    assert [c.split("--peers ")[1] for c in record["commands"]] == ["eyrie,specforge-compact", "specforge"]
    monkeypatch.setenv("EYRIE_COMMIT", "b" * 40)
    with pytest.raises(SystemExit, match="was measured at aaaaaaaaaa .*record it under another name"):
        bench_train.record("kv8", ["--peers", "specforge"], again, append=True, results=tmp_path)


def test_drafters_evaluated_on_one_run_are_compared_paired_by_seed(tmp_path, scripts):
    """record_evaluate with a stand-in serve.evaluate report (made-up figures, the keys serve.evaluate writes): two
    variants of two drafters each, paired by seed; a drafter missing from the report and unequal training steps are
    refused."""
    import record_evaluate
    accepts = {"a0": 2.8, "a1": 2.9, "b0": 2.8, "b1": 2.7}
    for name in accepts:
        (tmp_path / name / "drafter").mkdir(parents=True)
        (tmp_path / name / "report.json").write_text(json.dumps({"train": {"steps": 75}}))
    drafter = {name: str(tmp_path / name / "drafter") for name in accepts}
    report = {"target": "t-int4", "heldout_overlap_with_training": 0,
              "groups": {"sampled": {"samples": 19, "tokens": 1098, "prompts": 17}},
              "drafters": {drafter[n]: {"sampled": {"accept_length_by_steps": [1.8, a + 0.1],
                                                    "alpha_by_position": [0.8, 0.7],
                                                    "prompts": {"decoded_accept_length_by_steps": [1.9, a]}}}
                           for n, a in accepts.items()},
              "decode": {drafter[n]: {"sampled": {"steps": 2, "chain": "reference decoder, 2 steps",
                                                  "accept_length": a, "accept_length_formula": "tokens / verify calls",
                                                  "completion_tokens": 286, "identical_to_greedy": True,
                                                  "prompts": [{}] * 16}} for n, a in accepts.items()}}
    (tmp_path / "evaluate.json").write_text(json.dumps(report))
    args = [str(tmp_path / "evaluate.json"), "--variant", f"A={drafter['a0']},{drafter['a1']}", "--variant",
            f"B={drafter['b0']},{drafter['b1']}", "--seeds", "0,1", "--how", "B=--target.path bf16",
            "--trained", "Trained on A's or B's features", "--config", "c.yaml", "--record", "stand-in",
            "--command", "c", "--out", str(tmp_path)]
    record = json.loads(record_evaluate.main(args).read_text())
    text = "\n".join(render_results.render_drafter_options(record))
    assert text.startswith("## Drafters compared on `t-int4`: `c.yaml`")
    assert "Trained on A's or B's features, for the same steps (75), held-out overlap with training 0" in text
    # reference decoder: B - A = 0.0 and -0.2 → holds 0; offline tau (accept + 0.1) alike
    assert "| B | `--target.path bf16` | 2.750 (2.700-2.800) | no measurable difference: -0.100 (-0.200 to +0.000) |" \
        in text
    with pytest.raises(SystemExit):
        record_evaluate.main(args[:4] + [f"B={drafter['b0']},{tmp_path}/other"] + args[5:])
    (tmp_path / "b1" / "report.json").write_text(json.dumps({"train": {"steps": 50}}))
    with pytest.raises(SystemExit):
        record_evaluate.main(args)
