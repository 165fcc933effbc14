"""Durable file writing: write to a temporary name, fsync, rename; checksums; early writeback.

Every file the project writes that another stage trusts (shards, manifests, records, checkpoints' JSON) goes
through here, so a killed writer never leaves a file that looks complete.
"""
from __future__ import annotations

import ctypes
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import xxhash

# How much of a file a `ChecksummedFile` lets accumulate before it asks the kernel to start the disk write (see
# `start_writeback`); 0 leaves it all to the fsync at close.
WRITEBACK_BYTES = 256 << 20
SYNC_FILE_RANGE_WRITE = 2  # sync_file_range flag: start writing the range's dirty pages, do not wait for them


def file_checksum(path: str | Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def os_reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else str(e)  # Arrow's messages wrap the errno in prose


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | Path) -> Any | None:
    """A JSON file's content, or None when the file does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


class UnreadableFile(ValueError):
    pass


@contextmanager
def safetensors_reader(path: str | Path, written_by: str) -> Iterator[Any]:
    """`safe_open`, whose failures name the file, its size and what writes it (the library alone says
    "incomplete metadata"): a truncated copy or an interrupted download reads as what it is."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as fh:
            yield fh
    except (SafetensorError, OSError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else None
        raise UnreadableFile(f"{path}: not a readable safetensors file ({e}; {size if size is not None else 'no'} "
                             f"bytes on disk). It is written by {written_by}: copy or write it again") from None


def load_safetensors(path: str | Path, written_by: str) -> dict[str, Any]:
    with safetensors_reader(path, written_by) as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def atomic_write_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"writing {path} failed: {e.strerror}", str(path)) from e
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _sync_file_range():
    """Linux's sync_file_range, or None where the C library has none (it is not in Python's `os`)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
# Starting a writeback blocks while the disk's request queue is full: done on a thread of its own, so the writer
# goes on copying rows into the page cache meanwhile (on the writer's thread it slowed writing 1.3x on a CPU host).
_WRITEBACK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="writeback")


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Start (not wait for) the disk write of a range already written. Without it the kernel holds a file's
    pages until its fsync (or until dirty memory passes vm.dirty_background_ratio, 13 GB on a 128 GiB host),
    so the disk idles while rows arrive, then the last shard's fsync is a tail nothing overlaps. False where
    it is not available; the fsync at close stays the durability point either way."""
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0


class ChecksummedFile:
    """A file opened for writing that hashes what is written (xxh3-128: no second read of the file at close,
    which would be work nothing overlaps) and starts the disk write of every `writeback_bytes` written.
    Arrow writes through it as a `pa.PythonFile`."""

    def __init__(self, path: Path, writeback_bytes: int | None = None):
        self.fh = open(path, "wb", buffering=0)
        self.xxh3 = xxhash.xxh3_128()
        self.writeback_bytes = WRITEBACK_BYTES if writeback_bytes is None else writeback_bytes
        self.written_back = 0  # bytes of the file whose disk write has been asked for
        self._writeback: Future | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.xxh3.update(view)
        n = len(view)
        while view:  # a raw write may take less than it was given
            view = view[self.fh.write(view):]
        end = self.fh.tell()
        if self.writeback_bytes and end - self.written_back >= self.writeback_bytes:
            if self._writeback is not None and self._writeback.done() and not self._writeback.result():
                self.writeback_bytes = 0  # not on this system or file system: the fsync at close does it all
            else:
                self._writeback = _WRITEBACK_THREAD.submit(start_writeback, self.fh.fileno(), self.written_back,
                                                           end - self.written_back)
                self.written_back = end
        return n

    def _wait_for_writeback(self) -> None:
        if self._writeback is not None:  # the last request's FIFO predecessors are done before it
            self._writeback.result()

    def tell(self) -> int:
        return self.fh.tell()

    def fsync(self) -> None:
        self._wait_for_writeback()
        os.fsync(self.fh.fileno())

    def checksum(self) -> str:
        return self.xxh3.hexdigest()

    def flush(self) -> None:
        pass  # unbuffered

    def close(self) -> None:
        self._wait_for_writeback()  # its requests name this file's descriptor
        self.fh.close()

    @property
    def closed(self) -> bool:
        return self.fh.closed
