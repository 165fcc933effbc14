"""The pipeline runs the stages as commands, skips completed ones, and re-runs exactly what a change affects."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.demo_target import make_conversations
from tests.train_runs import run_pipeline

ROOT = Path(__file__).resolve().parents[2]


def pipeline(config, *args):
    return run_pipeline(config, "--stages", "data,extract,train", *args, timeout=400)


@pytest.mark.slow
def test_stages_skip_when_done_and_rerun_when_their_config_changes(tiny_target, tmp_path):
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(30, seed=2)))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "run_dir": str(tmp_path / "run"), "target": {"path": str(tiny_target), "aux_layer_ids": [0, 1, 2]},
        "data": {"inputs": [str(convs)], "max_length": 128, "draft_vocab_size": 64, "heldout_fraction": 0.2},
        "extract": {"nproc_per_node": 2, "samples_per_shard": 8},
        "train": {"max_steps": 3, "max_batch_tokens": 1024, "ttt_steps": 2}}))
    first = pipeline(config)
    assert "[pipeline] data: " in first and "-m data --config" in first
    assert "torch.distributed.run --standalone --nproc-per-node 2 -m extract" in first
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    split = json.loads((tmp_path / "run" / "data" / "split.json").read_text())
    dropped = sum(split["excluded"].values())  # duplicates and held-out prompts: the generator repeats a few tasks
    assert report["samples"] == report["features"]["rows"] == 30 - dropped > 20
    assert len(report["features"]["tokens_per_s_by_rank"]) == 2
    assert "deepspeed --num_gpus 1 --master_port" in first and report["train"]["steps"] == 3

    # another run given this one's finished stages (hard links, as tests/benchmarks/mission.sh gives a DFlash run the
    # EAGLE-3 run's data and features) and no report (as when an invocation is killed before it writes one): they
    # are complete there too, since a fingerprint does not name the run dir
    shared = tmp_path / "shared"
    for folder in ("data", "features", "train", "pipeline", "config"):
        shutil.copytree(tmp_path / "run" / folder, shared / folder, copy_function=os.link)
    there = pipeline(config, "--run_dir", str(shared))
    assert all(f"{stage}: complete, inputs unchanged; skipped" in there for stage in ("data", "extract", "train"))
    again = json.loads((shared / "report.json").read_text())
    assert again["features"]["rows"] == 30 - dropped and again["train"]["steps"] == 3
    # each stage's time is the one of the run that made its output, whichever invocation that was
    assert again["stage_seconds"] == report["stage_seconds"]
    assert set(report["stage_seconds"]) == {"data", "extract", "train"}

    changed = pipeline(config, "--extract.dtype", "bfloat16")
    assert "data: complete, inputs unchanged; skipped" in changed and "-m extract" in changed
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    features = json.loads((tmp_path / "run" / "features" / "manifest.json").read_text())
    assert features["meta"]["dtype"] == "bfloat16" and report["features"]["rows"] == 30 - dropped
    # new features: the old drafter run is kept aside and a new one trains on them
    assert "train was made for other inputs; moved to" in changed and (tmp_path / "run" / "train.prev-1").is_dir()
    assert "features was made for other inputs; moved to" in changed  # its shards are not resumed either
    assert (tmp_path / "run" / "features.prev-1" / "manifest.json").exists()
    assert report["train"]["steps"] == 3 and "resumed" not in changed


def test_an_edited_input_file_reruns_every_stage_that_reads_it_and_those_after(tmp_path):
    """Files are signed by size and mtime: an edit that keeps the size still counts."""
    from launch.pipeline import STAGES, fingerprints
    convs, target = tmp_path / "c.jsonl", tmp_path / "target"
    convs.write_text('{"messages": []}\n')
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "model.safetensors").write_bytes(b"12345678")
    cfg = config_with(data={"inputs": [str(convs)]}, target={"path": str(target)})
    base = fingerprints(cfg)

    def changed():
        prints = fingerprints(cfg)
        return [s for s in STAGES if prints[s] != base[s]]
    assert changed() == []
    convs.write_text('{"messages": [1]}\n')
    assert changed() == list(STAGES)  # the regenerate and data stages read it; each later one folds in its upstream
    base = fingerprints(cfg)
    os.utime(target / "sub" / "model.safetensors", ns=(1, 1))  # same bytes, new mtime: a retrained checkpoint
    assert changed() == list(STAGES)


def test_work_made_for_other_inputs_is_set_aside_and_a_killed_run_of_the_same_inputs_resumes(tmp_path):
    """The regenerate stage resumes from the answers it finds; after the target changed (a retrained checkpoint
    at the same path, same config) they are the old target's and must not be reused."""
    from launch.pipeline import set_aside_work_of_other_inputs
    cfg = config_with(run_dir=str(tmp_path / "run"))
    answers = cfg.layout.regenerated
    answers.parent.mkdir(parents=True)
    answers.write_text("old target\n")
    cfg.layout.regenerated_partial.write_text("old target, unfinished\n")
    assert set_aside_work_of_other_inputs(cfg, "regenerate", "first") == []  # no record: a fresh run
    assert set_aside_work_of_other_inputs(cfg, "regenerate", "first") == []  # killed, same inputs: resume
    assert answers.exists()
    moved = set_aside_work_of_other_inputs(cfg, "regenerate", "second")  # the target's files changed
    assert sorted(p.name for p in moved) == [answers.name + ".partial.prev-1", answers.name + ".prev-1"]
    assert not answers.exists() and answers.with_name(answers.name + ".prev-1").read_text() == "old target\n"
    assert set_aside_work_of_other_inputs(cfg, "regenerate", "second") == []


def config_with(**sections):
    from data.config import load_config
    base = {"run_dir": "runs/x", "target": {"path": "t"}, "data": {"inputs": ["c.jsonl"]}}
    return load_config(None, [f"--{k}={v if isinstance(v, str) else json.dumps(v)}"
                              for k, v in {**base, **sections}.items()])


def test_a_config_change_invalidates_exactly_the_stages_downstream_of_it():
    from launch.pipeline import STAGES, fingerprints
    base = fingerprints(config_with())

    def changed(**sections):
        prints = fingerprints(config_with(**sections))
        return [s for s in STAGES if prints[s] != base[s]]
    assert changed(train={"optim": {"lr": 0.01}}) == ["train", "export", "evaluate", "smoke"]
    assert changed(extract={"dtype": "bfloat16"}) == ["extract", "train", "export", "evaluate", "smoke"]
    assert changed(data={"inputs": ["c.jsonl"], "max_length": 512}) == list(STAGES)
    assert changed(seed=1) == ["train", "export", "evaluate", "smoke"]
    assert changed(serve={"tp": 8}) == ["smoke"]
    assert changed(launch={"master_port": 29501}) == []  # how it launches does not change what it computes
    # a run moved or copied elsewhere keeps its finished stages, but evaluates again: evaluate.json names the
    # drafters by path, and the report would look the new ones up in it
    assert changed(run_dir="runs/y") == ["evaluate", "smoke"]


def test_a_stage_whose_output_format_grew_reruns_with_the_stages_after_it(monkeypatch):
    """An evaluate.json written before the report read `prompts` from it is made again, not read and failed on."""
    import launch.pipeline
    from launch.pipeline import STAGES, fingerprints
    base = fingerprints(config_with())
    monkeypatch.setitem(launch.pipeline.OUTPUT_VERSION, "evaluate", launch.pipeline.OUTPUT_VERSION["evaluate"] + 1)
    prints = fingerprints(config_with())
    assert [s for s in STAGES if prints[s] != base[s]] == ["evaluate", "smoke"]


def test_multi_node_commands(tmp_path):
    from data.config import ConfigError
    from launch.pipeline import stage_commands
    cfg = config_with(launch={"nnodes": 2, "rdzv_endpoint": "node0:29400", "hostfile": "/etc/hosts.ds",
                              "master_port": 29600},
                      extract={"nproc_per_node": 8}, train={"nproc_per_node": 8})
    [extract] = stage_commands(cfg, "extract", "run.yaml", [])
    assert extract[extract.index("torch.distributed.run") + 1:extract.index("-m", 3)] == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id",
        extract[extract.index("--rdzv-id") + 1], "--nproc-per-node", "8"]
    assert extract[extract.index("--rdzv-id") + 1].startswith("eyrie-")  # the same on every node
    [train] = stage_commands(cfg, "train", "run.yaml", ["--train.epochs", "2"])
    i = train.index("--hostfile")
    assert train[i:i + 6] == ["--hostfile", "/etc/hosts.ds", "--num_gpus", "8", "--master_port", "29600"]
    assert train[-4:] == ["--config", "run.yaml", "--train.epochs", "2"] and train[-5].endswith("train/main.py")
    single = config_with()
    assert "--standalone" in stage_commands(single, "extract", "run.yaml", [])[0]
    assert "--hostfile" not in stage_commands(single, "train", "run.yaml", [])[0]
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        stage_commands(config_with(launch={"nnodes": 2, "hostfile": "h"}), "extract", "run.yaml", [])
    with pytest.raises(ConfigError, match="hostfile"):
        stage_commands(config_with(launch={"nnodes": 2, "rdzv_endpoint": "a:1"}), "train", "run.yaml", [])


def test_the_config_reference_is_generated_from_the_config_classes():
    from launch.config_reference import REFERENCE_PAGE, reference
    assert reference() in REFERENCE_PAGE.read_text(), "run: python -m launch.config_reference --write"
    undocumented = [line.split("|")[1] for line in reference().splitlines()
                    if line.startswith("| `") and not line.rstrip(" |").split("|")[-1].strip()]
    assert not undocumented, undocumented


def test_shipped_configs_and_the_slurm_template(tmp_path):
    import re
    from data.config import load_config
    for config in (ROOT / "launch" / "configs").glob("*.yaml"):
        load_config(config)  # every shipped config is valid
    sbatch = ROOT / "launch" / "slurm" / "eyrie.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    keys = re.findall(r"--((?:launch|extract|train)\.[a-z_]+) ", sbatch.read_text())
    assert len(keys) == 5
    cfg = load_config(ROOT / "launch" / "configs" / "llama3-8b.yaml", [x for k in keys for x in (f"--{k}", "2")])
    assert cfg.launch.nnodes == 2 and cfg.train.nproc_per_node == 2


def test_smoke_stage_command_serves_the_run_drafter_with_the_decoders_chain():
    from launch.pipeline import DECODE_STEPS, DEFAULT_STAGES, stage_commands
    cfg = config_with(serve={"tp": 8, "concurrency": [1, 64], "server_args": ["--attention-backend=triton"]})
    [smoke] = stage_commands(cfg, "smoke", "run.yaml", [])
    assert smoke[1:3] == ["-m", "serve.smoke"] and "smoke" not in DEFAULT_STAGES
    flag = {smoke[i]: smoke[i + 1] for i in range(3, len(smoke) - 1) if smoke[i].startswith("--")}
    assert flag["--drafter"] == "runs/x/drafter" and flag["--run"] == "runs/x" and flag["--tp"] == "8"
    assert flag["--steps"] == str(DECODE_STEPS) and flag["--concurrency"] == "1,64"
    assert smoke[-1] == "--server-arg=--attention-backend=triton"


def test_no_target_server_starts_when_every_prompt_is_already_answered(tmp_path, capsys):
    """A regenerate stage killed after its last answer (the partial file complete, no record) reruns without
    the 1-2 minute SGLang start."""
    from data.regenerate import pending
    from launch.pipeline import served_target
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_with(run_dir=str(tmp_path / "run"),
                      data={"inputs": [str(convs)], "regenerate": {"enabled": True, "launch_server": True}})
    assert pending(cfg) == 3
    partial = cfg.layout.regenerated_partial
    partial.parent.mkdir(parents=True)
    partial.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n" + '{"id": "c2", "mess')  # cut by a kill
    assert pending(cfg) == 1
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pending(cfg) == 0
    with served_target(cfg):  # on this CPU machine a server start would fail
        pass
    assert "every conversation already answered; no server started" in capsys.readouterr().out


def test_regenerate_server_graphs_every_batch_the_client_makes():
    """The regenerate server's CUDA graphs cover regenerate.concurrency (the smoke test's 128 in serve.server_args
    left 256 requests decoding eagerly at 6-8K tokens/s on the H200) in 9 sizes, not SGLang's 36 (each one captured
    at start-up), read back through SGLang's own parser."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from launch.pipeline import regenerate_server_args
    cfg = config_with(target={"path": "runs/x/target"}, data={"inputs": ["c.jsonl"], "regenerate": {
        "enabled": True, "launch_server": True, "concurrency": 256}},
        serve={"server_args": ["--cuda-graph-max-bs-decode=128", "--attention-backend=triton"]})
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(regenerate_server_args(cfg))
    assert parsed.model_path == "runs/x/target" and parsed.attention_backend == "triton"
    assert parsed.cuda_graph_bs_decode == [1, 2, 4, 8, 16, 32, 64, 128, 256] and parsed.max_running_requests == 256


def test_regenerate_is_its_own_stage_when_enabled():
    from launch.pipeline import DEFAULT_STAGES, UPSTREAM, stage_commands
    assert DEFAULT_STAGES[:2] == ("regenerate", "data") and UPSTREAM["data"] == "regenerate"
    on = config_with(data={"inputs": ["c.jsonl"], "regenerate": {"enabled": True, "backend": "local"}})
    assert stage_commands(on, "regenerate", "run.yaml", ["--seed", "1"]) == [
        [sys.executable, "-m", "data.regenerate", "--config", "run.yaml", "--seed", "1"]]
    assert stage_commands(config_with(), "regenerate", "run.yaml", []) == []  # disabled: nothing to run


def test_more_ranks_than_gpus_is_refused_before_a_stage_starts(monkeypatch):
    """A second rank on a one-GPU machine would die in the stage with 'invalid device ordinal'; the check says
    which key to lower. On a CPU the same config runs (gloo ranks)."""
    import torch

    from launch.check import rank_problem
    cfg = config_with(extract={"nproc_per_node": 2}, train={"nproc_per_node": 1})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_problem(cfg, "extract") == ("extract.nproc_per_node is 2 but this machine shows 1 GPU(s): each rank "
                                            "takes one GPU; set --extract.nproc_per_node 1 (or fewer)")
    assert rank_problem(cfg, "train") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_problem(cfg, "extract") is None


def test_the_demo_takes_one_rank_per_gpu_where_it_has_fewer_than_two(monkeypatch):
    import torch

    from launch.demo import rank_overrides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_overrides([]) == ["--extract.nproc_per_node", "1", "--train.nproc_per_node", "1"]
    assert rank_overrides(["--train.nproc_per_node=1"]) == ["--extract.nproc_per_node", "1"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_overrides([]) == ["--extract.nproc_per_node", "2", "--train.nproc_per_node", "2"]
