"""Load a drafter (or target) directory through SGLang's own loader, on CPU, and prove every tensor landed.

    python -m serve.sglang_check DIR [DIR ...]
        (prints a JSON report per directory; exit 1 when any check fails)

`ModelConfig.from_server_args(..., is_draft_model=True)` + `get_model` resolve the architecture the way the
server does. Loading without an error proves nothing: `load_weights` silently skips unknown names and a
missing `d2t`. So every parameter is filled with NaN first (by wrapping `load_weights`), and afterwards
every parameter must be finite, every tensor of the file must have been consumed, and the hot-token map
must equal d2t. Runs in another interpreter (check_in_subprocess: one worker per calling process, kept for
its later checks): SGLang's process-wide state (server args, process groups) stays out of the caller.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import torch


def _stub_modules() -> None:
    """Imports SGLang makes on its way that cannot be satisfied on a CPU machine (never called there)."""
    custom_ops = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*_args, **_kwargs):
        raise RuntimeError("vllm rotary kernel is not available on CPU")
    custom_ops.rotary_embedding = rotary_embedding
    vllm = sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    vllm._custom_ops = custom_ops
    sys.modules["vllm._custom_ops"] = custom_ops
    import transformers  # noqa: F401  (before the torchvision probe: transformers checks it itself)
    try:
        import torchvision  # noqa: F401
    except Exception:  # missing (its wheels pull a CUDA torch): vision configs only name it at import
        import importlib.abc
        import importlib.machinery

        class Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return type(name, (), {})

        class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name == "torchvision" or name.startswith("torchvision."):
                    return importlib.machinery.ModuleSpec(name, self, is_package=True)
                return None

            def create_module(self, spec):
                module = Stub(spec.name)
                module.__path__ = []
                return module

            def exec_module(self, module):
                pass
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, Finder())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(directory: str | Path) -> dict:
    from safetensors import safe_open
    _stub_modules()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs

    directory = str(Path(directory).resolve())
    args = ServerArgs(model_path=directory, device="cpu", dtype="bfloat16")
    try:  # newer SGLang: a runtime context with this process's place in the topology
        from sglang.srt.runtime_context import SpawnRanks, publish
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    except ImportError:  # 0.5.14: the global server args
        from sglang.srt.server_args import set_global_server_args_for_scheduler
        set_global_server_args_for_scheduler(args)
    if not torch.distributed.is_initialized():  # once per process: several directories share it
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        initialize_model_parallel(backend="gloo")

    file_names: set[str] = set()
    for f in Path(directory).glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            file_names |= set(fh.keys())
    consumed: set[str] = set()
    drafter_classes = (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM, DFlashDraftModel)
    config = json.loads((Path(directory) / "config.json").read_text())
    architectures = config.get("architectures") or []
    is_drafter = any(a in {c.__name__ for c in drafter_classes} for a in architectures)
    checked_classes = drafter_classes if is_drafter else (ModelRegistry.resolve_model_cls(architectures)[0],)
    originals = {cls: cls.load_weights for cls in checked_classes}

    def checked(original):
        def load_weights(self, weights):
            with torch.no_grad():
                for p in self.parameters():
                    p.fill_(float("nan"))

            def seen():
                for name, tensor in weights:
                    consumed.add(name)
                    yield name, tensor
            return original(self, seen())
        return load_weights

    for cls, original in originals.items():
        cls.load_weights = checked(original)
    try:
        model_config = ModelConfig.from_server_args(args, model_path=directory, is_draft_model=is_drafter)
        model = get_model(model_config=model_config, load_config=LoadConfig(load_format="auto"),
                          device_config=DeviceConfig(device="cpu"))
    finally:
        for cls, original in originals.items():
            cls.load_weights = original

    unwritten = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    # the embedding is the target's unless the drafter ships one; SGLang shares it at serve time
    unwritten = [n for n in unwritten if not (n.endswith("embed_tokens.weight") and
                                              "embed_tokens.weight" not in file_names)]
    problems = [f"parameter {n} was not written by the file (NaN left)" for n in unwritten]
    problems += [f"tensor {n} in the file was never read" for n in sorted(file_names - consumed)]
    report = {"architecture": type(model).__name__, "parameters": sum(1 for _ in model.named_parameters()),
              "tensors_in_file": len(file_names)}
    if not is_drafter:  # a target (a widened one, say): its attention as SGLang built it, against the config
        attention = model.model.layers[0].self_attn
        built = {"layers": len(model.model.layers), "heads": attention.num_heads, "kv_heads": attention.num_kv_heads,
                 "head_dim": attention.head_dim}
        written = {"layers": config["num_hidden_layers"], "heads": config["num_attention_heads"],
                   "kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
                   "head_dim": config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])}
        problems += [f"config says {k}={written[k]}, SGLang built the target with {k}={built[k]}"
                     for k in written if written[k] != built[k]]
        return report | {"target": built, "problems": problems, "ok": not problems}
    if isinstance(model, DFlashDraftModel):  # no draft vocab, no EAGLE options: the block and its context
        built = {"block_size": model.block_size, "context_features": model.num_context_features}
        written = {"block_size": config["dflash_config"]["block_size"],
                   "context_features": len(config["dflash_config"]["target_layer_ids"])}
        problems += [f"config says {k}={written[k]}, SGLang built the drafter with {k}={built[k]}"
                     for k in written if written[k] != built[k]]
        return report | {"dflash": built, "problems": problems, "ok": not problems}
    hot = model.get_hot_token_id()
    with safe_open(str(next(Path(directory).glob("*.safetensors"))), "pt") as fh:
        d2t = fh.get_tensor("d2t") if "d2t" in fh.keys() else None
    if hot is None or d2t is None:
        problems.append("no d2t: SGLang would draft over target ids with a draft-vocab head")
    elif not torch.equal(hot.cpu(), d2t + torch.arange(len(d2t))):
        problems.append("SGLang's hot-token map differs from d2t")
    # the EAGLE-3.1 options as SGLang built the model, against the config's (a key it ignores is never written)
    from train.drafter import eagle31_options
    from transformers import PretrainedConfig
    written = eagle31_options(PretrainedConfig(**config))
    built = {"fc_norm": getattr(model.model, "fc_norm", None) is not None,
             "norm_output": bool(getattr(model.model, "norm_output", False))}
    problems += [f"config says {k}={written[k]}, SGLang built the drafter with {k}={built[k]}"
                 for k in written if written[k] != built[k]]
    return report | {"eagle31_options": built, "problems": problems, "ok": not problems}


def check_each(directories: list[str]) -> list[dict]:
    """check() for each directory in this process (SGLang imports its model registry once: ~8 s on a CPU); a
    loader that raises is that directory's problem, not the end of the others' checks."""
    reports = []
    for directory in directories:
        try:
            reports.append(check(directory))
        except Exception as e:  # noqa: BLE001  (SGLang's loader raises what it raises: shape asserts, KeyErrors)
            reports.append({"architecture": None, "problems": [f"SGLang's loader raised {type(e).__name__}: {e}"],
                            "ok": False})
        reports[-1]["directory"] = str(directory)
    return reports


REPORTS = "sglang_check reports: "  # marks the worker's answer among whatever SGLang prints to stdout


class _Worker:
    """One interpreter that checks directories for the life of the calling process: `python -m
    serve.sglang_check --worker` reads a JSON list of directories per line and answers with one marked line of
    reports, so SGLang's imports (~8 s on a CPU) are paid once per process, not once per export. A worker that
    dies or runs past its time is stopped, its output goes into the error, and the next check starts a new one."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.lock = threading.Lock()

    def start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.log = tempfile.TemporaryFile(mode="w+")  # stderr to a file: a full pipe would block the worker
            self.proc = subprocess.Popen([sys.executable, "-m", "serve.sglang_check", "--worker"], text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                         cwd=Path(__file__).resolve().parents[1])
        return self.proc

    def check(self, paths: list[str], timeout: float) -> list[dict]:
        with self.lock:
            proc, printed, hung = self.start(), [], threading.Event()

            def stop_hung_worker():  # ends the worker, and the read below with it
                hung.set()
                proc.kill()
            timer = threading.Timer(timeout, stop_hung_worker)
            timer.start()
            try:
                proc.stdin.write(json.dumps(paths) + "\n")
                proc.stdin.flush()
                for line in proc.stdout:
                    if line.startswith(REPORTS):
                        return json.loads(line[len(REPORTS):])
                    printed.append(line)
            except (BrokenPipeError, ValueError):
                pass
            finally:
                timer.cancel()
            proc.kill()
            exit_code = proc.wait()  # reaped here, so the worker is gone when the error reaches the caller
            self.log.seek(0)
            how = f"ran past {timeout:g} s" if hung.is_set() else f"crashed (worker exit {exit_code})"
            raise RuntimeError(f"SGLang loader check {how} for {', '.join(paths)}:\n{''.join(printed)[-3000:]}\n"
                               f"{self.log.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the worker's loop ends at the end of its input
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def check_in_subprocess(*directories: str | Path, timeout: float = 600, raise_on_problem: bool = True) -> list[dict]:
    """check_each's reports, from a separate interpreter (the worker above: SGLang's process-wide state stays out
    of this one). A failed check raises DrafterDirError naming its problems unless `raise_on_problem` is false."""
    paths = [str(Path(d).resolve()) for d in directories]  # the worker runs from the repository root
    reports = _WORKER.check(paths, timeout)
    failed = [r for r in reports if not r["ok"]]
    if failed and raise_on_problem:
        from .drafter_dir import DrafterDirError
        raise DrafterDirError("\n".join(f"{r['directory']}: SGLang's loader check failed:\n  " +
                                         "\n  ".join(r["problems"]) for r in failed))
    return reports


def serve_checks() -> int:
    """--worker: a JSON list of directories per input line, check_each's reports as one marked line each."""
    for line in sys.stdin:
        print(REPORTS + json.dumps(check_each(json.loads(line))), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m serve.sglang_check DIR [DIR ...]`: one JSON report per directory; exit 1 if any fails."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--worker"]:
        return serve_checks()
    results = check_each(argv)
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
