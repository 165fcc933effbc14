"""The one typed config of the whole project: a YAML file plus `--section.key value` overrides.

Every stage reads its section of the same `EyrieConfig`; unknown keys and wrong types are errors that
name the key. It lives in `data/` because every stage imports `data/` (data flows one way).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .layout import RunLayout

# EAGLE-3 drafters read three aux layers: fc projects [3 x hidden] (SGLang's LlamaForCausalLMEagle3 and
# Eagle3DeepseekV2ForCausalLM both build fc for exactly three).
EAGLE3_AUX_LAYERS = 3


def aux_count_problem(ids: list[int], family: str = "eagle3") -> str | None:
    if family == "dflash":  # its fc projects as many layers as its config names
        return None if ids else "a DFlash drafter reads at least one layer; got none"
    if len(ids) == EAGLE3_AUX_LAYERS:
        return None
    return (f"EAGLE-3 drafters read exactly {EAGLE3_AUX_LAYERS} layers (their fc projects {EAGLE3_AUX_LAYERS} x "
            f"hidden); got {len(ids)} ids {ids}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(Section):
    path: str = Field(description="transformers model directory of the target (config.json, tokenizer, safetensors)")
    tokenizer: str | None = Field(None, description="tokenizer directory; default: the target's path")
    aux_layer_ids: list[int] | None = Field(
        None, description="SGLang convention: id i = output of 0-based decoder layer i; default [1, L//2-1, L-4] "
                          "(EAGLE-3: three ids), SGLang's DFlash default for train.dflash.num_layers (DFlash)")
    trust_remote_code: bool = Field(False, description="let transformers run code shipped with the checkpoint")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path



class RegenerateConfig(Section):
    enabled: bool = Field(False, description="re-answer every user turn with the target (self-distillation)")
    backend: Literal["openai", "local"] = Field(
        "openai", description="openai: an OpenAI-compatible endpoint (sglang.launch_server); local: transformers generate")
    endpoint: str = Field("http://127.0.0.1:30000/v1", description="base URL of the OpenAI-compatible API")
    model: str = Field("default", description="model name sent to the endpoint")
    concurrency: int = Field(8, ge=1, description="openai: requests in flight; local: conversations answered "
                             "together, one generate batch per turn")
    max_retries: int = Field(3, ge=0, description="retries per request after the first try")
    timeout_s: float = Field(600.0, gt=0, description="per-request timeout")
    max_new_tokens: int = Field(1024, ge=1, description="answer length cap (replies that hit it are counted)")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy, the answers the target serves at temperature 0")
    keep_reasoning: bool = Field(True, description="keep the target's reasoning_content in the training text")
    launch_server: bool = Field(False, description="the pipeline serves the target itself for this stage "
                                "(sglang.launch_server on the endpoint's port, with serve.tp and serve.server_args)")


class DataConfig(Section):
    inputs: list[str] = Field(description="conversation files/dirs: JSONL, Parquet, or a `datasets` save_to_disk dir")
    skip_malformed: bool = Field(False, description="skip and count malformed rows instead of stopping at the first")
    max_length: int = Field(2048, ge=8, description="token budget per sample")
    overflow: Literal["truncate", "drop"] = Field("truncate", description="what to do with longer samples")
    loss_on: Literal["all", "last"] = Field("all", description="assistant turns that carry loss")
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="extra variables for the chat template, e.g. {enable_thinking: false}: every render of the "
                        "data and regenerate stages gets them (and the endpoint, as chat_template_kwargs)")
    draft_vocab_size: int = Field(32000, ge=1, description="size of the drafter's output vocabulary")
    samples_per_shard: int = Field(1000, ge=1, description="samples per token shard")
    heldout_fraction: float = Field(0.05, ge=0, lt=1, description="share of prompts held out for evaluation, by a hash "
                                    "of the normalised first user turn (data/split.py); rows may also name a held-out "
                                    "group (`\"heldout\": NAME`)")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)


class ExtractConfig(Section):
    backend: Literal["auto", "sglang", "hf"] = Field(
        "auto", description="sglang: SGLang's model code in-process (GPU, the numerics that serve); hf: transformers "
                            "(CPU or GPU); auto: sglang where a GPU and a tested sglang are present, else hf")
    nproc_per_node: int = Field(1, ge=1, description="torchrun ranks the pipeline launches (one per GPU)")
    tp_size: int = Field(1, ge=1, description="sglang backend: GPUs (ranks) per target copy, tensor-parallel; "
                                              "ranks are grouped by node, a group extracts as one")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="target compute and storage dtype; auto = bfloat16 on GPU, float32 on CPU")
    device: str = Field("auto", description="auto = cuda:LOCAL_RANK when a GPU is present, else cpu")
    max_batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward (batch x longest sample)")
    samples_per_shard: int = Field(256, ge=1, description="samples per output shard (the unit of resume)")
    verify_resume: bool = Field(True, description="re-hash completed shards before skipping them")
    aux_encoding: Literal["raw", "fp8_e4m3_rowscale"] = Field(
        "raw", description="aux states on disk: raw (dtype, lossless) or fp8 e4m3 with a scale per token and layer "
                           "(~0.5x bf16's bytes, encoded on the GPU before the copy; the final state stays raw)")


class DrafterConfig(Section):
    """The drafter's shape; every unset field defaults from the target's config."""
    family: Literal["eagle3", "dflash"] = Field(
        "eagle3", description="eagle3: one layer drafting token by token (SGLang's EAGLE3); dflash: a block of "
                              "tokens per forward (SGLang's DFLASH, DFlashDraftModel; train.dflash)")
    arch: Literal["llama", "mla"] = Field("llama", description="llama: SGLang's LlamaForCausalLMEagle3; mla: "
                                          "DeepSeek-style latent attention, SGLang's Eagle3DeepseekV2ForCausalLM "
                                          "(smaller KV cache; MLA dims default from an MLA target)")
    hidden_size: int | None = Field(None, ge=8)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=2)
    intermediate_size: int | None = Field(None, ge=1)
    rms_norm_eps: float | None = Field(None, gt=0)
    q_lora_rank: int | None = Field(None, ge=1, description="mla: query latent rank")
    kv_lora_rank: int | None = Field(None, ge=1, description="mla: key/value latent rank (the cached width)")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="mla: per-head query/key dims without RoPE")
    qk_rope_head_dim: int | None = Field(None, ge=2, description="mla: per-head query/key dims with RoPE")
    v_head_dim: int | None = Field(None, ge=1, description="mla: per-head value dims")
    # EAGLE-3.1 options, as SGLang 0.5.14 reads them for both classes (config keys of the same names)
    fc_norm: bool = Field(False, description="an RMSNorm on each aux hidden state before fc (weights fc_norm.{0,1,2})")
    norm_output: bool = Field(False, description="the next draft step reads the post-norm hidden state, not the "
                                                 "pre-norm one")
    norm_before_fc: bool = Field(False, description="refused: SGLang 0.5.14 reads no such key for either class")

    @field_validator("norm_before_fc")
    @classmethod
    def _served_options_only(cls, on: bool) -> bool:
        if on:
            raise ValueError("SGLang 0.5.14's LlamaForCausalLMEagle3 and Eagle3DeepseekV2ForCausalLM read no "
                             "norm_before_fc key: a drafter trained with it would be served without it. fc_norm "
                             "(an RMSNorm on each aux state before fc) is the option SGLang serves")
        return on


class DFlashConfig(Section):
    """The DFlash drafter (train.drafter.family: dflash) and its training objective (train/dflash.py)."""
    num_layers: int = Field(1, ge=1, description="draft layers; also sets the default target.aux_layer_ids")
    block_size: int = Field(16, ge=2, description="tokens per drafted block (SGLang's speculative-num-draft-tokens)")
    mask_token_id: int | None = Field(None, ge=0, description="the target-vocabulary id a block's undrafted positions "
                                      "hold; default: the tokenizer's <|MASK|> (SGLang's), else the next free "
                                      "embedding row, else the pad token")
    blocks_per_sample: int = Field(64, ge=1, description="blocks anchored at sampled positions of each sample")
    loss_decay_gamma: float | None = Field(7.0, gt=0, description="block position k weighs exp(-(k-1)/gamma)")
    labels: Literal["tokens", "teacher"] = Field(
        "tokens", description="tokens: each drafted position learns the sample's token (SpecForge's and the DFlash "
        "paper's recipe; on self-distilled data the target's greedy choice); teacher: the target's whole "
        "next-token distribution from the stored final hidden states (soft labels: one full-vocabulary softmax "
        "per drafted position more)")


class OptimConfig(Section):
    """What the generated DeepSpeed config is made of. With `--deepspeed_config FILE` that file is the only
    source of these values, and setting any of them here too is an error (one source of truth)."""
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage")
    lr: float = Field(1e-4, gt=0, description="peak learning rate (after warmup)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    warmup_steps: int = Field(50, ge=0, description="linear warmup from 0, in optimizer steps")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="after warmup")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    clip_grad: float = Field(0.5, gt=0, description="gradient norm clipping")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")


class TrainConfig(Section):
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    dflash: DFlashConfig = Field(default_factory=DFlashConfig)
    nproc_per_node: int = Field(1, ge=1, description="ranks the pipeline launches with `deepspeed --num_gpus`")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length")
    ttt_decay: float = Field(0.8, gt=0, description="loss weight of TTT step i is ttt_decay**i")
    max_batch_tokens: int = Field(8192, ge=8, description="padded tokens per micro-batch per rank")
    epochs: int = Field(1, ge=1, description="passes over the training shards")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; default: epochs over the data")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="auto = bfloat16 on GPU (fp32 master weights), float32 on CPU")
    attention: Literal["auto", "flex", "blockwise"] = Field(
        "auto", description="TTT attention: flex (CUDA, fused) or blockwise (any device), auto: flex on CUDA; "
        "DFlash: flex (block-sparse, CUDA) or blockwise (a dense mask through SDPA, any device), auto: flex on CUDA")
    activation_checkpointing: bool = Field(False, description="recompute the drafter layer in backward")
    recompute_logits: bool = Field(False, description="recompute the draft-vocab logits in backward instead of "
                                   "keeping their gradient (22% of a llama3-8b unroll's activations), for ~8% "
                                   "more step FLOPs")
    eval_every: int = Field(200, ge=1, description="optimizer steps between evals (and at the end)")
    save_every: int = Field(500, ge=1, description="optimizer steps between checkpoints (and at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept besides the best")
    log_every: int = Field(10, ge=1, description="optimizer steps between TensorBoard / log.jsonl entries")
    warm_start: str | None = Field(None, description="exported (SGLang-format) drafter dir to start from")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict) and "eval_fraction" in data:
            raise ValueError("train.eval_fraction is now data.heldout_fraction: the data stage holds prompts out by "
                             "their content (data/split.py), not samples by id")
        return data


class ServeConfig(Section):
    """The SGLang serving smoke test the pipeline's `smoke` stage runs (GPU machines only)."""
    tp: int = Field(1, ge=1, description="tensor parallel size of both SGLang servers")
    concurrency: list[int] = Field([1, 8, 64], description="concurrencies measured (tokens/s, baseline vs EAGLE3)")
    server_args: list[str] = Field([], description="extra sglang.launch_server arguments, e.g. --attention-backend=triton")
    timeout_s: float = Field(900, gt=0, description="seconds to wait for each server to become ready")
    extra_steps: list[int] = Field([], description="deeper EAGLE3 chains also measured (one server each), e.g. [5]")
    repeats: int = Field(3, ge=1, description="timed passes per concurrency and streamed step timings per server "
                         "(figures are medians with their min-max)")
    pass_seconds: float = Field(10.0, gt=0, description="each timed pass lasts at least this long")
    timing_max_new_tokens: int = Field(256, ge=8, description="new tokens per request when timing")
    deterministic_parity: bool = Field(
        False, description="also serve plain and EAGLE3 with --enable-deterministic-inference (single-stream) and "
                           "report their output parity: tells bf16 near-ties from a speculation bug")


class LaunchConfig(Section):
    """How the pipeline launches the distributed stages; it does not change what they compute."""
    nnodes: int = Field(1, ge=1, description="nodes; more than one needs rdzv_endpoint (extract) and hostfile (train)")
    rdzv_endpoint: str | None = Field(
        None, description="HOST:PORT of torchrun's c10d rendezvous (first node); run the extract stage on every node")
    hostfile: str | None = Field(
        None, description="DeepSpeed hostfile (`host slots=8` per line): train launches on every listed host from here")
    master_port: int | None = Field(None, ge=1, le=65535, description="DeepSpeed's rendezvous port; default: a free one")


class EyrieConfig(Section):
    run_dir: str = Field("runs/default", description="every stage writes below this directory")
    seed: int = Field(0, description="seeds data order, drafter initialisation and the untrained baseline")
    target: TargetConfig
    data: DataConfig
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _drafter_family_fits(self):
        family, drafter = self.train.drafter.family, self.train.drafter
        problem = self.target.aux_layer_ids is not None and aux_count_problem(self.target.aux_layer_ids, family)
        if problem:
            raise ValueError(f"target.aux_layer_ids: {problem}")
        if family == "dflash":
            eagle_only = [k for k in ("fc_norm", "norm_output") if getattr(drafter, k)] + \
                (["arch: mla"] if drafter.arch != "llama" else [])
            if eagle_only:
                raise ValueError(f"train.drafter: {', '.join(eagle_only)} belong to EAGLE-3 drafters; a DFlash "
                                 "drafter is SGLang's DFlashDraftModel (train.dflash)")
            if drafter.hidden_size is not None:
                raise ValueError("train.drafter: hidden_size is the target's for a DFlash drafter (its blocks are "
                                 "embedded by the target's embedding and read by the target's head)")
        return self

    @property
    def layout(self) -> RunLayout:
        """Every path under run_dir (data/layout.py)."""
        return RunLayout(self.run_dir)

    def section_hash(self, *names: str) -> str:
        """Stable hash of some sections, so a stage can tell whether its inputs changed."""
        blob = json.dumps({n: getattr(self, n).model_dump(mode="json") for n in names}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class ConfigError(ValueError):
    pass


def _parse_value(text: str) -> Any:
    # Lists/maps and null are YAML; scalars stay strings so pydantic coerces them against the field's type
    # (YAML would turn a string field's "123" into an int that pydantic then refuses).
    if text.strip()[:1] in "[{":
        return yaml.safe_load(text)
    if text.strip().lower() in ("null", "none", "~"):
        return None
    return text


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply `--a.b value` / `--a.b=value` pairs to a raw config dict."""
    items = list(overrides)
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --section.key, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], items[i + 1]
            i += 2
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key}: {part} is not a section")
        node[parts[-1]] = _parse_value(value)
    return raw


def _override_keys(overrides: Sequence[str]) -> set[str]:
    keys = set()
    for arg in overrides:
        if arg.startswith("--"):
            keys.add(arg[2:].split("=", 1)[0])
    return keys


def _format_errors(err: ValidationError, path: str | Path | None, overrides: Sequence[str]) -> str:
    """One line per problem, each blamed on where its key came from: a --key on the command line or the file."""
    given = _override_keys(overrides)
    lines = ["invalid config:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        if not key:  # a check across sections (EyrieConfig's validators) names its key first: blame that key
            head, sep, rest = msg.removeprefix("Value error, ").partition(": ")
            if sep and all(part.isidentifier() for part in head.split(".")):
                key, msg = head, "Value error, " + rest
        got = "" if e["type"] in ("extra_forbidden", "missing") or not e["loc"] else f" (got {e.get('input')!r})"
        from_cli = any(key == k or key.startswith(k + ".") for k in given)
        lines.append(f"  {key}: {msg}{got}  [{'command line --' + key if from_cli else path or 'defaults'}]")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> EyrieConfig:
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    raw = apply_overrides(raw, overrides)
    try:
        return EyrieConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, path, overrides)) from None


@contextlib.contextmanager
def stage_errors(stage: str):
    """Around a stage's work: the error that stops it (Eyrie's refusals name the key, file or sample) is printed as
    one line, `[stage] error: ...`, above its traceback, where it is not lost among the launchers' tracebacks."""
    try:
        yield
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"[{stage}] error: {first}" + (" (more below)" if "\n" in str(e).strip() else ""),
              file=sys.stderr, flush=True)
        raise


def cli_config(stage: str, description: str, argv: Sequence[str] | None = None,
               arguments: dict[str, dict] | None = None) -> tuple[EyrieConfig, argparse.Namespace]:
    """Entry-point helper: `--config FILE` plus overrides; the resolved config goes to RUN_DIR/config/STAGE.yaml
    (one line on the console says where).

    `arguments` adds entry-point flags that are not config keys (name -> argparse kwargs)."""
    parser = argparse.ArgumentParser(description=description,
                                     epilog="Any config key can be overridden as --section.key value.")
    parser.add_argument("--config", required=True, help="YAML config file")
    for name, kwargs in (arguments or {}).items():
        parser.add_argument(name, **kwargs)
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    if os.environ.get("RANK", "0") == "0":  # one copy under torchrun / deepspeed
        path = cfg.layout.resolved_config(stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        print(f"[{stage}] {args.config} → run_dir {cfg.run_dir}; resolved config: {path}", flush=True)
    return cfg, args
