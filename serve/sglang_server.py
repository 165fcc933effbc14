"""An SGLang server's whole life, in one place: `python -m sglang.launch_server` with the given flags on 127.0.0.1,
readiness with a timeout (the server's log tail on failure), `/generate`, and a stop of the whole process group
that checks the port and the GPU memory are released. The smoke test and the pipeline's regenerate stage use it.

    with serving(args, port, log, timeout) as server:   # started and ready, stopped on leaving
        server.generate(input_ids, max_new)
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

LOG_TAIL_CHARS = 3000


def port_free(port: int) -> bool:
    """Whether a new server could bind the port (SO_REUSEADDR, as uvicorn binds: TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def gpu_memory_used_mib() -> list[int]:
    """Per GPU, as nvidia-smi reports it; [] where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [int(x) for x in out.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []


def server_command(port: int, args: list[str]) -> list[str]:
    """Bound to 127.0.0.1: Eyrie's servers are not reachable from other machines unless the user's server args
    say otherwise."""
    return [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]


def decode_graph_args(concurrency: list[int]) -> list[str]:
    """`--cuda-graph-bs-decode` with the batch sizes clients at these concurrencies make: powers of two up to the
    largest (a batch shrinks as its requests finish and runs in the next captured size up) and each concurrency.
    SGLang's own lists are captured size by size at every server start: 36 sizes up to 256 (46 s of a 71 s start on
    the H200, JIT cache warm) where 9 cover the same batches; in speculative mode 35 sizes up to 128, each with
    draft and verify graphs, where 8 do. An explicit list replaces `--cuda-graph-max-bs-decode` (SGLang 0.5.14)."""
    largest = max(concurrency)
    sizes = {1 << i for i in range(largest.bit_length())} | set(concurrency)
    return ["--cuda-graph-bs-decode", *map(str, sorted(sizes))]


class Server:
    """A started `sglang.launch_server` process (its own process group) logging to `log`."""

    def __init__(self, args: list[str], port: int, log: Path, timeout: float):
        self.port, self.log, self.timeout = port, Path(log), timeout
        if not port_free(port):
            raise RuntimeError(f"port {port} is in use; pass another port")
        self.cmd = server_command(port, args)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        self.ready_s: float | None = None

    def log_tail(self) -> str:
        self.fh.flush()
        return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def wait_ready(self) -> float:
        """Seconds until `/health_generate` answers; the log's tail in the error when the server dies or the
        timeout passes."""
        start = time.time()
        with tqdm(desc=f"waiting for {self.log.stem}", unit="s", bar_format="{desc}: {elapsed}") as bar:
            while time.time() - start < self.timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; log {self.log}:\n{self.log_tail()}")
                try:
                    if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                        self.ready_s = time.time() - start
                        return self.ready_s
                except requests.RequestException:
                    pass
                time.sleep(2)
                bar.update(2)
        raise TimeoutError(f"server not ready after {self.timeout:.0f} s; log {self.log}:\n{self.log_tail()}")

    def generate(self, input_ids: list[int], max_new: int) -> dict:
        """Greedy completion of token ids (SGLang's native API: meta_info carries the speculative counters)."""
        r = requests.post(self.url + "/generate", json={"input_ids": input_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new}}, timeout=600)
        r.raise_for_status()
        return r.json()

    def stream(self, input_ids: list[int], max_new: int) -> list[tuple[float, int, int]]:
        """One greedy request streamed to its end, ignoring EOS so that it runs max_new tokens: (arrival time,
        cumulative completion tokens, cumulative verify count) per chunk, for serve.timing.decode_ms."""
        body = {"input_ids": input_ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
        chunks, pending = [], b""
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=600) as r:
            r.raise_for_status()
            # whatever the socket delivers, as it arrives (urllib3's read1): iter_lines() waits for 512 bytes, and
            # several steps' events read at once got one time (the mission run timed 0.02 ms "cycles" that way)
            read = getattr(r.raw, "read1", None)
            reads = iter(lambda: read(65536), b"") if read else r.iter_content(chunk_size=None)
            for data in reads:
                arrived = time.perf_counter()
                pending += data
                *events, pending = pending.split(b"\n\n")
                events = [e.strip() for e in events if e.strip().startswith(b"data:") and e.strip() != b"data: [DONE]"]
                if events:  # events read together are one chunk: its counters are the last event's (cumulative)
                    meta = json.loads(events[-1][len(b"data:"):])["meta_info"]
                    chunks.append((arrived, meta["completion_tokens"], meta.get("spec_verify_ct", 0)))
        return chunks

    def stop(self) -> dict:
        """SIGTERM to the process group (SGLang's scheduler and detokenizer are children), SIGKILL after 60 s;
        then whether the port is free again and the GPU memory in use."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.fh.close()
        for _ in range(30):
            if port_free(self.port):
                break
            time.sleep(1)
        return {"port_free": port_free(self.port), "gpu_memory_used_mib": gpu_memory_used_mib()}


@contextlib.contextmanager
def sigterm_raises():
    """While inside, SIGTERM raises SystemExit(143) in this (main) thread, so that `finally` blocks run: `timeout`,
    Slurm's time limit and preemption stop a job with SIGTERM, and Python's default action ends the process
    without them. A server left running then holds the port and the GPU memory, and the next server (a smoke test
    resumed by the next time-limited command) cannot start."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread can set handlers
        yield
        return

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def serving(args: list[str], port: int, log: Path, timeout: float, stopped: dict | None = None):
    """A ready server, stopped on leaving (also on errors, and on SIGTERM); `stopped` receives what the stop
    checked."""
    with sigterm_raises():
        server = Server(args, port, log, timeout)
        try:
            server.wait_ready()
            yield server
        finally:
            released = server.stop()
            if stopped is not None:
                stopped |= released
