"""Every path under a run directory, in one place. Stages and the pipeline ask `RunLayout(run_dir)`; none spells a
path under RUN_DIR itself, and none imports another stage's module to learn one.

    RUN_DIR/
      data/regenerated.jsonl (+ .partial, .report.json)   the target's own answers (regenerate stage)
      data/samples/              token shards + manifest.json (data stage)
      data/draft_vocab.safetensors                         d2t, t2d, token counts (data stage)
      data/split.json            the held-out split: rule, counts, overlap, held-out ids and prompts (data stage)
      features/                  aux hidden-state shards + manifest.json (extract stage)
      train/checkpoints/         DeepSpeed checkpoints, latest, best.json; train/drafter_config.json,
      train/log.jsonl, train/summary.json                  (train stage)
      drafter/, drafter-untrained/                         SGLang drafter dirs (export stage)
      evaluate/evaluate.json, acceptance.png               (evaluate stage)
      smoke/report.json + server logs                      (smoke stage, GPU)
      tensorboard/STAGE/START_TIME/                        TensorBoard: one log dir per stage and command
      pipeline/STAGE.json                                  what the pipeline ran (fingerprint, commands, seconds)
      config/STAGE.yaml                                    the config each stage last ran with, defaults filled in
      report.json                                          the run's summary
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

# one TensorBoard run per command: a rerun's events go beside the earlier ones, not into them
STARTED = time.strftime("%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class RunLayout:
    root: Path

    def __init__(self, run_dir: str | Path):
        object.__setattr__(self, "root", Path(run_dir))

    # data stage
    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def samples(self) -> Path:
        return self.data / "samples"

    @property
    def draft_vocab(self) -> Path:
        return self.data / "draft_vocab.safetensors"

    @property
    def split(self) -> Path:
        return self.data / "split.json"

    @property
    def regenerated(self) -> Path:
        return self.data / "regenerated.jsonl"

    @property
    def regenerated_partial(self) -> Path:
        return partial_of(self.regenerated)

    @property
    def regenerated_report(self) -> Path:
        return report_of(self.regenerated)

    # extract stage
    @property
    def features(self) -> Path:
        return self.root / "features"

    # train stage
    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def checkpoints(self) -> Path:
        return self.train / "checkpoints"

    @property
    def drafter_config(self) -> Path:
        return self.train / "drafter_config.json"

    @property
    def train_summary(self) -> Path:
        return self.train / "summary.json"

    # export, evaluate, smoke
    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def untrained_drafter(self) -> Path:
        return self.root / "drafter-untrained"

    @property
    def evaluate(self) -> Path:
        return self.root / "evaluate"

    @property
    def evaluate_report(self) -> Path:
        return self.evaluate / "evaluate.json"

    @property
    def smoke(self) -> Path:
        return self.root / "smoke"

    @property
    def smoke_report(self) -> Path:
        return self.smoke / "report.json"

    # the pipeline
    @property
    def pipeline(self) -> Path:
        return self.root / "pipeline"

    def stage_record(self, stage: str) -> Path:
        return self.pipeline / f"{stage}.json"

    def resolved_config(self, stage: str) -> Path:
        """The config a stage's last command ran with, every default filled in."""
        return self.root / "config" / f"{stage}.yaml"

    @property
    def report(self) -> Path:
        return self.root / "report.json"

    def tensorboard(self, stage: str) -> Path:
        """This command's TensorBoard log dir: RUN_DIR/tensorboard/STAGE/START_TIME, so that
        `tensorboard --logdir RUN_DIR/tensorboard` shows every stage, and each rerun or resume beside the others."""
        return self.root / "tensorboard" / stage / STARTED


def partial_of(answers: Path) -> Path:
    """A killed regenerate run's answers so far, appended as they come."""
    return answers.with_name(answers.name + ".partial")


def report_of(answers: Path) -> Path:
    """The report written beside finished answers (the regenerate stage's completion marker)."""
    return answers.with_name(answers.name + ".report.json")


def write_scalars(run_dir: str | Path, stage: str, by_step: dict[int, dict[str, float]]) -> None:
    """A stage's summary numbers (extraction throughput, offline acceptance) beside the trainer's curves."""
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(str(RunLayout(run_dir).tensorboard(stage))) as writer:
        for step, scalars in by_step.items():
            for name, value in scalars.items():
                writer.add_scalar(f"{stage}/{name}", value, step)
