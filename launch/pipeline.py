"""`python -m launch.pipeline --config run.yaml [--run-dir DIR] [--stages data,extract] [--section.key value ...]`

Runs the stages in order as the commands a user could type, printing each one. A stage is skipped when its
output exists and its fingerprint is unchanged: a hash of the config sections it depends on, of its external
inputs (conversation files and the target's files, by path, size and modification time, as make does) and of
the upstream stage's fingerprint, so a change re-runs exactly the stages downstream of it. What a re-run stage
would resume from is moved aside (NAME.prev-N) when it was made for other inputs.

Stages: regenerate (self-distillation: the target answers the prompts again, when data.regenerate.enabled),
data (tokenize, loss masks, draft vocab), extract (torchrun), train (deepspeed),
export (RUN_DIR/drafter from the best checkpoint, and RUN_DIR/drafter-untrained: the same shape untrained, the
baseline), evaluate (offline acceptance and the reference speculative decoder on held-out prompts, both
drafters), and, when asked for (`--stages ...,smoke`, GPU machines), smoke: SGLang serving the drafter
(serve.smoke, configured by the `serve` section). With data.regenerate.launch_server the regenerate stage
serves the target itself with `sglang.launch_server` (GPU machines) and stops it afterwards.
Writes RUN_DIR/report.json; the records are in RUN_DIR/pipeline/.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from data.config import ConfigError, EyrieConfig, load_config
from data.files import atomic_write_json
from data.shards import MANIFEST, read_manifest
from data.split import primary_group, read_split

from . import stage_process
from .check import launch_problem
from .check import report as check_report

ROOT = Path(__file__).resolve().parents[1]
DECODE_PROMPTS, DECODE_STEPS = 16, 3  # the reference decoder's chain: 3 steps, top-k 1, 4 draft tokens


def outputs(cfg: EyrieConfig) -> dict[str, Path]:
    """The file whose presence says a stage finished."""
    run = cfg.layout
    return {"regenerate": run.regenerated_report, "data": run.samples / MANIFEST, "extract": run.features / MANIFEST,
            "train": run.train_summary,
            "export": (run.untrained_drafter if cfg.train.drafter.family == "eagle3" else run.drafter) / "config.json",
            "evaluate": run.evaluate_report, "smoke": run.smoke_report}


STAGES = ("regenerate", "data", "extract", "train", "export", "evaluate", "smoke")
DEFAULT_STAGES = STAGES[:-1]  # smoke needs a GPU machine with SGLang: run it by name
UPSTREAM = dict(zip(STAGES[1:], STAGES[:-1]))  # each stage reads what the one before it wrote
SECTIONS = {"regenerate": ("target", "data"), "data": ("target", "data"), "extract": ("target", "data", "extract"),
            "train": ("seed", "target", "data", "extract", "train"), "export": (),
            "evaluate": ("run_dir",),  # its report names the drafters by path: a moved or copied run evaluates again
            "smoke": ("serve",)}
# Bumped when a stage's output gains fields that later stages or the report read (evaluate 2: the same prompts
# decoded offline; data 2: split.json, evaluate 3: figures per held-out group; smoke 2: repeated timings): a run
# made before re-runs that stage and the ones after it instead of failing on the old file
OUTPUT_VERSION = {"data": 2, "evaluate": 3, "smoke": 2}


def _external_inputs(cfg: EyrieConfig, stage: str) -> list[str]:
    if stage == "regenerate":
        return [*cfg.data.inputs, cfg.target.path]
    if stage == "data":
        return [*cfg.data.inputs, cfg.target.path, cfg.target.tokenizer_path]
    if stage in ("extract", "train"):  # the target's weights (features; the teacher's LM head)
        return [cfg.target.path]
    return []


def files_signature(path: str) -> str:
    """Path, size and mtime of a file or of every file below a directory (no content read: corpora are large)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.exists() else []
    return json.dumps([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files] or [(path, "missing")])


def fingerprints(cfg: EyrieConfig) -> dict[str, str]:
    """Every stage's fingerprint, in stage order: each folds in its upstream's. The stages never write their
    external inputs, so one computation serves a whole pipeline run (and each input is stat'ed once)."""
    dumped, signatures, out = cfg.model_dump(mode="json"), {}, {}
    for stage in STAGES:
        h = hashlib.sha256(stage.encode())
        h.update(json.dumps({s: dumped[s] for s in SECTIONS[stage]}, sort_keys=True).encode())
        if stage in OUTPUT_VERSION:
            h.update(f"output version {OUTPUT_VERSION[stage]}".encode())
        for path in _external_inputs(cfg, stage):
            h.update(signatures.setdefault(path, files_signature(path)).encode())
        if stage in UPSTREAM:
            h.update(out[UPSTREAM[stage]].encode())
        out[stage] = h.hexdigest()[:16]
    return out


def _record(cfg: EyrieConfig, stage: str) -> Path:
    return cfg.layout.stage_record(stage)


def stage_done(cfg: EyrieConfig, stage: str, prints: dict[str, str]) -> bool:
    record = _record(cfg, stage)
    return outputs(cfg)[stage].exists() and record.exists() and \
        json.loads(record.read_text()).get("fingerprint") == prints[stage]


def resumable_work(cfg: EyrieConfig) -> dict[str, list[Path]]:
    """What a stage resumes from when it finds it (answers, shards, checkpoints). The stages know their own
    config but not the target's weights, so the pipeline, whose fingerprints do, moves it aside when it was
    made for other inputs: a retrained target at the same path must not resume from the old one's work."""
    run = cfg.layout
    return {"regenerate": [run.regenerated, run.regenerated_partial, run.regenerated_report],
            "extract": [run.features], "train": [run.train]}


def made_for(cfg: EyrieConfig, stage: str) -> str | None:
    """The fingerprint of the inputs a stage's existing work was started (or finished) for."""
    for record in (_record(cfg, stage).with_suffix(".started.json"), _record(cfg, stage)):
        if record.exists():
            return json.loads(record.read_text()).get("fingerprint")
    return None


def set_aside_work_of_other_inputs(cfg: EyrieConfig, stage: str, fingerprint: str) -> list[Path]:
    """Before a stage runs: move aside (kept, not deleted) what it would resume from if that was made for other
    inputs, then record the inputs it now starts for (a killed run of the same inputs resumes)."""
    moved = []
    if made_for(cfg, stage) not in (None, fingerprint):
        for path in filter(Path.exists, resumable_work(cfg).get(stage, [])):
            moved.append(_move_aside(path))
            print(f"[pipeline] {stage}: {path} was made for other inputs; moved to {moved[-1]}", flush=True)
    started = _record(cfg, stage).with_suffix(".started.json")
    started.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(started, {"fingerprint": fingerprint})
    return moved


def _move_aside(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.prev-{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.prev-{n}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def not_run_because(cfg: EyrieConfig, stage: str) -> str | None:
    """Why a stage has nothing to run with this config, or None."""
    if stage == "regenerate" and not cfg.data.regenerate.enabled:
        return "not enabled (data.regenerate.enabled is false)"
    return None


def stage_commands(cfg: EyrieConfig, stage: str, config: str, overrides: list[str]) -> list[list[str]]:
    """The commands a stage runs, in order (what a user would type to run it by hand)."""
    run, launch = cfg.layout, cfg.launch
    problem = launch_problem(cfg, stage)
    if problem:
        raise ConfigError(problem)
    if not_run_because(cfg, stage):
        return []
    if stage == "extract":
        if launch.nnodes == 1:
            rendezvous = ["--standalone"]
        else:
            rendezvous = ["--nnodes", str(launch.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          launch.rdzv_endpoint, "--rdzv-id", "eyrie-" + fingerprints(cfg)["extract"]]
        return [[sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node",
                 str(cfg.extract.nproc_per_node), "-m", "extract", "--config", config, *overrides]]
    if stage == "train":
        found = Path(sys.executable).parent / "deepspeed"
        launcher = [str(found)] if found.exists() else [shutil.which("deepspeed")] if shutil.which("deepspeed") \
            else [sys.executable, "-m", "deepspeed.launcher.runner"]
        hosts = ["--hostfile", launch.hostfile] if launch.hostfile else []
        return [[*launcher, *hosts, "--num_gpus", str(cfg.train.nproc_per_node),
                 "--master_port", str(launch.master_port or free_port()), str(ROOT / "train" / "main.py"),
                 "--config", config, *overrides]]
    if stage == "export":  # an EAGLE-3 drafter also gets its untrained twin, the evaluate stage's baseline
        twin = ["--untrained-out", str(run.untrained_drafter), "--seed", str(cfg.seed)] \
            if cfg.train.drafter.family == "eagle3" else []
        return [[sys.executable, "-m", "serve.export", "--checkpoint", str(run.root), "--tag", "best",
                 "--out", str(run.drafter), *twin]]
    if stage == "evaluate":  # an EAGLE-3 drafter beside its untrained twin; a DFlash drafter alone
        twin = ["--drafter", str(run.untrained_drafter)] if cfg.train.drafter.family == "eagle3" else []
        return [[sys.executable, "-m", "serve.evaluate", "--drafter", str(run.drafter), *twin,
                 "--run", str(run.root), "--steps", str(cfg.train.ttt_steps),
                 "--decode", str(DECODE_PROMPTS), "--decode-steps", str(DECODE_STEPS)]]
    if stage == "smoke":
        sv = cfg.serve
        # a DFlash drafter is served at its own block size: no chain lengths to choose
        steps = [] if cfg.train.drafter.family == "dflash" else \
            ["--steps", ",".join(map(str, [DECODE_STEPS, *sv.extra_steps]))]
        return [[sys.executable, "-m", "serve.smoke", "--target", cfg.target.path, "--drafter", str(run.drafter),
                 "--run", str(run.root), "--out", str(run.smoke), "--tp", str(sv.tp), *steps,
                 "--concurrency", ",".join(map(str, sv.concurrency)), "--timeout", str(sv.timeout_s),
                 "--repeats", str(sv.repeats), "--pass-seconds", str(sv.pass_seconds),
                 "--timing-max-new-tokens", str(sv.timing_max_new_tokens),
                 *[f"--server-arg={a}" for a in sv.server_args],
                 *(["--deterministic-parity"] if sv.deterministic_parity else [])]]
    if stage == "regenerate":
        return [[sys.executable, "-m", "data.regenerate", "--config", config, *overrides]]
    return [[sys.executable, "-m", stage, "--config", config, *overrides]]


def regenerate_server_args(cfg: EyrieConfig) -> list[str]:
    """serve.server_args, then CUDA graphs and running requests sized to regenerate.concurrency (later flags win):
    decode batches past the graphs' largest size run eagerly, launch-bound. On the mission run's H200, 256
    requests under graphs captured up to 128 decoded at 6-8K tokens/s, 48 under a graph at 19.9K."""
    from serve.sglang_server import decode_graph_args
    n = cfg.data.regenerate.concurrency
    return ["--model-path", cfg.target.path, "--tp", str(cfg.serve.tp), *cfg.serve.server_args,
            *decode_graph_args([n]), "--max-running-requests", str(n)]


@contextlib.contextmanager
def served_target(cfg: EyrieConfig):
    """With data.regenerate.launch_server: `sglang.launch_server` with the target on the port of
    data.regenerate.endpoint (local only) for the regenerate stage, stopped after it (serve/ owns the launch)."""
    regen = cfg.data.regenerate
    if not (regen.enabled and regen.launch_server):
        yield
        return
    url = urlparse(regen.endpoint)
    if regen.backend != "openai" or url.hostname not in ("127.0.0.1", "localhost") or not url.port:
        raise ConfigError(f"data.regenerate.launch_server needs backend openai and a local endpoint with a port "
                          f"(http://127.0.0.1:PORT/v1), not {regen.backend} {regen.endpoint}")
    from data.regenerate import pending
    if pending(cfg) == 0:  # a killed run's partial file already answers every prompt
        print("[pipeline] regenerate: every conversation already answered; no server started", flush=True)
        yield
        return
    from serve.sglang_server import serving
    log = cfg.layout.pipeline / "regenerate-server.log"
    print(f"[pipeline] regenerate: serving the target (log {log})", flush=True)
    with serving(regenerate_server_args(cfg), url.port, log, cfg.serve.timeout_s) as server:
        print(f"[pipeline] regenerate: {shlex.join(server.cmd)} ready after {server.ready_s:.0f} s", flush=True)
        yield


def eagle3_group_figures(ev: dict, drafter: str, group: str, steps: int = DECODE_STEPS) -> dict:
    """An EAGLE-3 drafter's figures on one held-out group of a serve.evaluate report (run with --decode): the
    reference decoder's accept length on the group's first prompts, the offline evaluator's on the same prompts
    (at `steps`) and over every held-out position (tau and alpha by chain position)."""
    decoded, offline = ev["decode"][drafter][group], ev["drafters"][drafter][group]
    return {"prompts": len(decoded["prompts"]), "completion_tokens": decoded["completion_tokens"],
            "reference_decoder": decoded["accept_length"],
            "offline_same_prompts": offline["prompts"]["decoded_accept_length_by_steps"][steps - 1],
            "offline_tau_by_steps": [round(x, 3) for x in offline["accept_length_by_steps"]],
            "offline_alpha_by_position": [round(x, 3) for x in offline["alpha_by_position"]],
            "heldout_samples": ev["groups"][group]["samples"], "heldout_tokens": ev["groups"][group]["tokens"]}


def dflash_summary(cfg: EyrieConfig, ev: dict) -> dict:
    """A DFlash drafter's figures: the reference decoder's accept length by held-out group (blocks drafted over
    the target, verified, lossless check) beside the offline one (stored features, teacher-forced context)."""
    trained = str(cfg.layout.drafter)
    decoded, offline = ev["decode"][trained], ev["dflash_drafters"][trained]
    by_group = {g: {"prompts": len(decoded[g]["prompts"]), "completion_tokens": decoded[g]["completion_tokens"],
                    "reference_decoder": decoded[g]["accept_length"],
                    "offline_blocks": offline.get(g, {}).get("accept_length"),
                    "heldout_samples": ev["groups"][g]["samples"]} for g in ev["groups"]}
    group = primary_group(by_group)
    return {"drafter_dir": trained, "family": "dflash",
            "heldout": {"rule": ev["split_rule"], "groups": ev["groups"],
                        "heldout_overlap_with_training": ev["heldout_overlap_with_training"]},
            "accept_length": by_group[group]["reference_decoder"], "offline_accept_length":
                by_group[group]["offline_blocks"], "accept_length_by_group": by_group,
            "lossless": all(decoded[g]["identical_to_greedy"] for g in by_group),
            "accept_length_formula": "completion tokens / target verify steps (SGLang's spec_accept_length): "
                                     f"{decoded[group]['chain']}, on the '{group}' held-out "
                                     "group's first prompts; offline: 1 + drafts of a block equal to the sample's "
                                     "tokens in a row, over blocks anchored in the group's stored samples"}


def summarize(cfg: EyrieConfig, report: dict, prints: dict[str, str]) -> dict:
    """report.json: the acceptance numbers on top, then what each finished stage recorded."""
    run = cfg.layout
    if stage_done(cfg, "data", prints):
        manifest = read_manifest(run.samples)
        split = read_split(run.split)  # the held-out rule and overlap, whatever stage runs next
        report |= {"samples": manifest["totals"]["rows"], "tokens": manifest["totals"]["tokens"],
                   "loss_tokens": manifest["totals"]["loss_tokens"], "draft_vocab": manifest["vocab"],
                   "split": {k: split[k] for k in ("rule", "training_samples", "heldout_samples", "groups",
                                                   "heldout_overlap_with_training")}}
    if stage_done(cfg, "extract", prints):
        features = read_manifest(run.features)
        report["features"] = {"dir": str(run.features), **features["totals"], "skipped": features["skipped"],
                              "tokens_per_s_by_rank": [r["tokens_per_s"] for r in features["ranks"]]}
    if stage_done(cfg, "train", prints):
        trained = json.loads(outputs(cfg)["train"].read_text())
        report["train"] = {k: trained[k] for k in ("steps", "tokens", "world_size", "latest", "best", "eval")}
    if stage_done(cfg, "evaluate", prints) and cfg.train.drafter.family == "dflash":
        report |= dflash_summary(cfg, json.loads(outputs(cfg)["evaluate"].read_text()))
    elif stage_done(cfg, "evaluate", prints):
        ev = json.loads(outputs(cfg)["evaluate"].read_text())
        trained, untrained = str(run.drafter), str(run.untrained_drafter)
        decoded = ev["decode"]
        chain = f"chain {DECODE_STEPS} steps / top-k 1 / {DECODE_STEPS + 1} draft tokens, greedy"
        by_group = {g: eagle3_group_figures(ev, trained, g)
                    | {"reference_decoder_untrained": decoded[untrained][g]["accept_length"]} for g in ev["groups"]}
        group = primary_group(by_group)
        primary = by_group[group]
        report |= {
            "drafter_dir": trained,
            "heldout": {"rule": ev["split_rule"], "groups": ev["groups"],
                        "heldout_overlap_with_training": ev["heldout_overlap_with_training"]},
            "accept_length": primary["reference_decoder"],
            "accept_length_untrained": primary["reference_decoder_untrained"],
            "offline_accept_length": primary["offline_same_prompts"],
            "accept_length_by_group": by_group,
            "lossless": all(decoded[d][g]["identical_to_greedy"] for d in (trained, untrained) for g in by_group),
            "accept_length_formula": f"completion tokens / target verify steps (SGLang's spec_accept_length). "
                                     f"accept_length: reference decoder, {chain}, on the '{group}' held-out "
                                     "group's first prompts; offline: the same prompts' stored answers decoded on "
                                     f"their features, {chain}; tau: mean over every held-out position, "
                                     f"{cfg.train.ttt_steps} steps",
            "speedup_wall_clock": {"value": decoded[trained][group]["speedup_wall_clock"],
                                   "device": decoded[trained][group]["device"]}}
    if stage_done(cfg, "smoke", prints):
        smoke = json.loads(outputs(cfg)["smoke"].read_text())
        served = "dflash" if "dflash" in smoke else "eagle3"
        spec = smoke[served]
        report["sglang"] = {"chain": spec["chain"], "accept_length_by_group": spec["accept_length_by_group"],
                            "parity_with_baseline": spec["parity"], "speedup": spec["speedup"],
                            "verdict": spec["verdict"], "costs": spec["costs"],
                            "tokens_per_s": {"baseline": smoke["baseline"]["tokens_per_s"],
                                             served: spec["tokens_per_s"]},
                            "deterministic": smoke.get("deterministic"), "environment": smoke["environment"]}
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", help="same as --run_dir DIR: where every stage writes")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (default: all but smoke)")
    args, overrides = p.parse_known_args(argv)
    if args.run_dir:
        overrides += ["--run_dir", args.run_dir]
    try:
        cfg = load_config(args.config, overrides)
        stages = [s for s in args.stages.split(",") if s]
        unknown = set(stages) - set(STAGES)
        if unknown:
            raise ConfigError(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
        if ("smoke" in stages or "regenerate" in stages and cfg.data.regenerate.launch_server) \
                and shutil.which("nvidia-smi") is None:
            raise ConfigError("the smoke stage and data.regenerate.launch_server start SGLang servers: run them on "
                              "a GPU machine with sglang installed")
        commands = {s: stage_commands(cfg, s, args.config, overrides) for s in stages}
    except ConfigError as e:
        p.exit(2, f"error: {e}\n")
    prints = fingerprints(cfg)
    to_run = [s for s in stages if commands[s] and not stage_done(cfg, s, prints)]
    if to_run and check_report(cfg, args.config):  # before any work: every problem with its key
        raise SystemExit(2)
    cfg.layout.pipeline.mkdir(parents=True, exist_ok=True)
    report_path = cfg.layout.report
    for stage in stages:
        if not commands[stage]:
            print(f"[pipeline] {stage}: {not_run_because(cfg, stage)}; nothing to run", flush=True)
            continue
        if stage_done(cfg, stage, prints):
            print(f"[pipeline] {stage}: complete, inputs unchanged; skipped", flush=True)
            continue
        set_aside_work_of_other_inputs(cfg, stage, prints[stage])
        start = time.time()
        with served_target(cfg) if stage == "regenerate" else contextlib.nullcontext():
            for cmd in commands[stage]:
                print(f"[pipeline] {stage}: {shlex.join(cmd)}", flush=True)
                stage_process.run(stage, cmd)
        atomic_write_json(_record(cfg, stage), {"fingerprint": prints[stage], "commands": commands[stage],
                                                "seconds": round(time.time() - start, 2),
                                                "config": cfg.model_dump(mode="json")})
    # the times of the runs that made the current outputs, also those of earlier (resumed or killed) invocations
    report = {"stage_seconds": {s: json.loads(_record(cfg, s).read_text())["seconds"]
                                for s in STAGES if stage_done(cfg, s, prints)}}
    report = summarize(cfg, report, prints)
    atomic_write_json(report_path, report)
    print(f"[pipeline] report: {report_path}")
    if "accept_length" in report and report.get("family") == "dflash":
        print(f"[pipeline] DFlash accept length {report['accept_length']:.2f} (reference decoder; offline "
              f"{report['offline_accept_length']:.2f}), lossless: {report['lossless']}; drafter: "
              f"{report['drafter_dir']}; held-out overlap with training "
              f"{report['heldout']['heldout_overlap_with_training']}")
    elif "accept_length" in report:
        print(f"[pipeline] accept length {report['accept_length']:.2f} (untrained drafter "
              f"{report['accept_length_untrained']:.2f}; offline {report['offline_accept_length']:.2f}), "
              f"lossless: {report['lossless']}; drafter: {report['drafter_dir']}")
        print(f"[pipeline] reference decoder, chain {DECODE_STEPS} steps / top-k 1, by held-out group: " + "; ".join(
            f"{g} {v['reference_decoder']:.2f} ({v['prompts']} prompts, {v['completion_tokens']} tokens)"
            for g, v in report["accept_length_by_group"].items())
            + f"; held-out overlap with training {report['heldout']['heldout_overlap_with_training']}")
    return report


if __name__ == "__main__":
    main()
