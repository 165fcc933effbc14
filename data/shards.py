"""The Arrow shard format: the only code that knows how samples and hidden states lie on disk.

A dataset is a directory: `manifest.json` plus shards `*.arrow`. One shard is one Arrow IPC **stream**
(the format `datasets.Dataset.from_file` reads), one row per sample:
  sample_id     string
  input_ids     list<int32>
  loss_mask     list<uint8>       1 = an assistant token that carries loss
  aux_hidden    large_binary      [T, len(aux_layer_ids) * H] in `aux_encoding` (data/aux_codec.py; features only)
  final_hidden  large_binary      [T, H] in `dtype`, see `final_hidden` in the meta (features shards only)
Raw little-endian tensor bytes keep bf16 lossless and let readers view them without a copy.
The schema metadata (key b"eyrie", JSON) carries schema_version, kind, target id and config hash, aux layer
ids (SGLang convention), hidden size, dtype and encodings; new encodings (fp8 aux states, a top-k teacher)
are new metadata values and optional columns, not a new layout.

Writers write to a temporary name, fsync and rename, so a killed writer never leaves a shard that looks
complete; the manifest (also renamed into place) records rows, tokens, bytes and an xxh3-128 checksum (hashed
as the bytes are written). A writer starts the disk write of every `files.WRITEBACK_BYTES` it has written, so
the fsync at close waits for the last stretch only.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch

from . import aux_codec
from .files import ChecksummedFile, atomic_write_json, file_checksum, fsync_dir, os_reason

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
META_KEY = b"eyrie"
STREAM_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream marker, written on close
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Fields two shards must agree on to be read as one dataset.
COMPAT_FIELDS = ("schema_version", "kind", "target_id", "target_config_hash", "aux_layer_ids",
                 "hidden_size", "dtype", "aux_encoding", "final_hidden")
# Tensors are views of read-only memory maps; the trainer only reads them (and copies when it moves them).
warnings.filterwarnings("ignore", message=".*not writable.*")


class ShardError(RuntimeError):
    pass


class ShardWriteError(ShardError):
    """The disk refused a write (full, quota, file-size limit); names the file. The shard is left unsealed."""


@dataclass
class ShardMeta:
    kind: str = "tokens"                  # "tokens" (prepared samples) or "features" (with hidden states)
    target_id: str = ""                   # target model path or name
    target_config_hash: str = ""          # hash of the target's config.json
    target_quantization: str = ""         # the target's quantized weights, described ("" = none; TargetInfo)
    aux_layer_ids: list[int] = field(default_factory=list)  # SGLang convention: output of decoder layer i
    hidden_size: int = 0
    dtype: str = "bfloat16"               # of final_hidden (and aux_hidden when aux_encoding == "raw")
    aux_encoding: str = "raw"             # "raw" = `dtype`, or "fp8_e4m3_rowscale" (data/aux_codec.py)
    final_hidden: str = ""                # "post_norm" (after the target's final norm) or "pre_norm"
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # producer details that need not match

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ShardMeta":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def schema_for(meta: ShardMeta) -> pa.Schema:
    fields = [pa.field("sample_id", pa.string()), pa.field("input_ids", pa.list_(pa.int32())),
              pa.field("loss_mask", pa.list_(pa.uint8()))]
    if meta.kind == "features":
        fields += [pa.field("aux_hidden", pa.large_binary()), pa.field("final_hidden", pa.large_binary())]
    return pa.schema(fields, metadata={META_KEY: json.dumps(meta.to_json()).encode()})


def _binary_array(data: pa.Buffer, row_bytes: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(row_bytes) + 1, dtype=np.int64)
    np.cumsum(row_bytes, out=offsets[1:])
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(row_bytes), [None, pa.py_buffer(offsets), data])


def _checked(t: torch.Tensor, dtype: torch.dtype, width: int, name: str, sample_id: str) -> torch.Tensor:
    if t.dtype != dtype or t.dim() != 2 or t.shape[1] != width:
        raise ShardError(f"sample {sample_id}: {name} must be [T, {width}] {dtype}, got {list(t.shape)} {t.dtype}")
    return t


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype, width: int, name: str, sample_id: str) -> memoryview:
    t = _checked(t, dtype, width, name, sample_id).detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class ShardWriter:
    """Writes one shard; rows are batched into record batches of about `batch_bytes`."""

    def __init__(self, path: str | Path, meta: ShardMeta, batch_bytes: int = 64 << 20,
                 writeback_bytes: int | None = None):
        self.path, self.meta, self.batch_bytes = Path(path), meta, batch_bytes
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.schema = schema_for(meta)
        self._file = ChecksummedFile(self.tmp, writeback_bytes)
        self._sink = pa.PythonFile(self._file, mode="w")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self._rows: list[tuple] = []
        self._pending_bytes = 0
        self.rows = self.tokens = self.loss_tokens = 0
        self._dtype = DTYPES[meta.dtype]
        self._aux_width = len(meta.aux_layer_ids) * meta.hidden_size
        self._aux_row_bytes = aux_codec.row_bytes(meta.aux_encoding, len(meta.aux_layer_ids), meta.hidden_size,
                                                  self._dtype)

    def _aux_bytes(self, aux_hidden: torch.Tensor, what: str) -> memoryview:
        """The aux states as stored: raw, or fp8 codes (encoded here unless the caller passed them encoded)."""
        if self.meta.aux_encoding == "raw":
            return _tensor_bytes(aux_hidden, self._dtype, self._aux_width, "aux_hidden", what)
        if aux_hidden.dtype != torch.uint8:
            aux_hidden = aux_codec.encode_fp8(
                _checked(aux_hidden, self._dtype, self._aux_width, "aux_hidden", what), len(self.meta.aux_layer_ids))
        return _tensor_bytes(aux_hidden, torch.uint8, self._aux_row_bytes, "encoded aux_hidden", what)

    def write(self, sample_id: str, input_ids, loss_mask, aux_hidden: torch.Tensor | None = None,
              final_hidden: torch.Tensor | None = None) -> None:
        ids = np.asarray(input_ids, dtype=np.int32)
        mask = np.asarray(loss_mask, dtype=np.uint8)
        if ids.ndim != 1 or ids.shape != mask.shape:
            raise ShardError(f"sample {sample_id}: input_ids and loss_mask must be 1-D of equal length")
        row: tuple = (sample_id, ids, mask)
        if self.meta.kind == "features":
            if aux_hidden is None or final_hidden is None:
                raise ShardError(f"sample {sample_id}: a features shard needs aux_hidden and final_hidden")
            aux = self._aux_bytes(aux_hidden, sample_id)
            fin = _tensor_bytes(final_hidden, self._dtype, self.meta.hidden_size, "final_hidden", sample_id)
            if aux.nbytes != len(ids) * self._aux_row_bytes or aux_hidden.shape[0] != len(ids) \
                    or final_hidden.shape[0] != len(ids):
                raise ShardError(f"sample {sample_id}: hidden states must have one row per token ({len(ids)})")
            row += (aux, fin)
            self._pending_bytes += aux.nbytes + fin.nbytes
        self._rows.append(row)
        self._pending_bytes += ids.nbytes + mask.nbytes
        self.rows += 1
        self.tokens += len(ids)
        self.loss_tokens += int(mask.sum())
        if self._pending_bytes >= self.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        cols = list(zip(*self._rows))
        arrays = [pa.array(cols[0], pa.string()),
                  pa.array(list(cols[1]), pa.list_(pa.int32())),
                  pa.array(list(cols[2]), pa.list_(pa.uint8()))]
        if self.meta.kind == "features":
            arrays += [_binary_array(pa.py_buffer(b"".join(cols[c])), np.array([len(x) for x in cols[c]]))
                       for c in (3, 4)]
        self._write_batch(arrays)
        self._rows, self._pending_bytes = [], 0

    def _write_batch(self, arrays: list[pa.Array]) -> None:
        try:
            self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        except OSError as e:
            raise ShardWriteError(f"{self.tmp}: write failed ({os_reason(e)}) after {self._file.tell():,} "
                                  f"bytes of this shard") from e

    def write_packed(self, sample_ids: list[str], input_ids: list[np.ndarray], loss_masks: list[np.ndarray],
                     aux_hidden: torch.Tensor, final_hidden: torch.Tensor) -> None:
        """Consecutive samples whose states lie packed `[sum of lengths, width]` in host memory, as extraction
        produces them: written as one record batch straight from the tensors' memory (no per-row copies)."""
        if self.meta.kind != "features":
            raise ShardError(f"{self.path}: write_packed writes features shards, this one is {self.meta.kind}")
        lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        what = f"samples {sample_ids[0]}..{sample_ids[-1]}"
        aux = self._aux_bytes(aux_hidden, what)
        fin = _tensor_bytes(final_hidden, self._dtype, self.meta.hidden_size, "final_hidden", what)
        if aux_hidden.shape[0] != lengths.sum() or final_hidden.shape[0] != lengths.sum():
            raise ShardError(f"{what}: hidden states must have one row per token ({lengths.sum()})")
        masks = [np.asarray(m, dtype=np.uint8) for m in loss_masks]
        self._flush()  # rows written one by one before this keep their order
        arrays = [pa.array(sample_ids, pa.string()),
                  pa.array([np.asarray(x, dtype=np.int32) for x in input_ids], pa.list_(pa.int32())),
                  pa.array(masks, pa.list_(pa.uint8())),
                  _binary_array(pa.py_buffer(aux), lengths * self._aux_row_bytes),
                  _binary_array(pa.py_buffer(fin), lengths * self.meta.hidden_size * self._dtype.itemsize)]
        self._write_batch(arrays)
        self.rows += len(sample_ids)
        self.tokens += int(lengths.sum())
        self.loss_tokens += int(sum(m.sum() for m in masks))

    def close(self) -> dict:
        """Finish the shard and move it into place; returns its manifest entry."""
        self._flush()
        try:
            self._writer.close()
            self._file.fsync()
            self._sink.close()
        except OSError as e:
            raise ShardWriteError(f"{self.tmp}: finishing the shard failed ({os_reason(e)})") from e
        info = {"file": self.path.name, "rows": self.rows, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "bytes": self.tmp.stat().st_size, "xxh3_128": self._file.checksum()}
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return info

    def abort(self) -> None:
        try:
            with contextlib.suppress(OSError, pa.ArrowException):  # the disk may be what failed
                self._writer.close()
            self._sink.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self.abort()


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor             # [T] int32
    loss_mask: torch.Tensor             # [T] uint8
    aux_hidden: torch.Tensor | None     # [T, n_aux * H]
    final_hidden: torch.Tensor | None   # [T, H]


class ShardReader:
    """Memory-maps one shard; `reader[i]` is O(1) and its tensors are views of the map (fp8 aux states: decoded)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                fh.seek(-len(STREAM_EOS), os.SEEK_END)
                if fh.read() != STREAM_EOS:
                    raise ShardError(f"{self.path}: truncated shard (no end-of-stream marker)")
            self._map = pa.memory_map(str(self.path))
            stream = pa.ipc.open_stream(self._map)
            self.meta = ShardMeta.from_json(json.loads(stream.schema.metadata[META_KEY]))
            self._batches = list(stream)
        except ShardError:
            raise
        except (pa.ArrowInvalid, OSError, KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{self.path}: corrupted or truncated shard ({type(e).__name__}: {e})") from None
        if self.meta.schema_version != SCHEMA_VERSION:
            raise ShardError(f"{self.path}: schema version {self.meta.schema_version}, this reader knows "
                             f"{SCHEMA_VERSION}")
        if self.meta.aux_encoding not in aux_codec.ENCODINGS or self.meta.dtype not in DTYPES:
            raise ShardError(f"{self.path}: encoding {self.meta.aux_encoding}/{self.meta.dtype} is not supported by "
                             "this reader")
        self._dtype = DTYPES[self.meta.dtype]
        self._aux_row_bytes = aux_codec.row_bytes(self.meta.aux_encoding, len(self.meta.aux_layer_ids),
                                                  self.meta.hidden_size, self._dtype)
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])
        self._views = [self._batch_views(b) for b in self._batches]

    @staticmethod
    def _batch_views(batch: pa.RecordBatch) -> dict[str, Any]:
        views: dict[str, Any] = {"sample_id": batch.column("sample_id")}
        for name in ("input_ids", "loss_mask"):
            col = batch.column(name)
            views[name] = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=True))
        for name in ("aux_hidden", "final_hidden"):
            if name in batch.schema.names:
                col = batch.column(name)
                offsets = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1]
                views[name] = (offsets, col.buffers()[2])
        return views

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _tensor(self, view: tuple, r: int, width: int, encoding: str = "raw") -> torch.Tensor:
        offsets, data = view
        start, end = int(offsets[r]), int(offsets[r + 1])
        if end == start:
            return torch.empty(0, width, dtype=self._dtype)
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=end - start, offset=start))
        if encoding == "raw":
            return raw.view(self._dtype).view(-1, width)
        return aux_codec.decode_fp8(raw.view(-1, self._aux_row_bytes), len(self.meta.aux_layer_ids),
                                    self.meta.hidden_size, self._dtype)

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: row {i} out of range 0..{len(self) - 1}")
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        r = i - int(self._starts[b])
        v = self._views[b]
        ids_off, ids = v["input_ids"]
        mask_off, mask = v["loss_mask"]
        aux = fin = None
        if "aux_hidden" in v:
            h = self.meta.hidden_size
            aux = self._tensor(v["aux_hidden"], r, len(self.meta.aux_layer_ids) * h, self.meta.aux_encoding)
            fin = self._tensor(v["final_hidden"], r, h)
        return Sample(v["sample_id"][r].as_py(), torch.from_numpy(ids[ids_off[r]:ids_off[r + 1]]),
                      torch.from_numpy(mask[mask_off[r]:mask_off[r + 1]]), aux, fin)

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))


def check_compatible(expected: dict, got: dict, what: str) -> None:
    for key in COMPAT_FIELDS:
        if expected.get(key) != got.get(key):
            raise ShardError(f"{what}: {key} is {got.get(key)!r}, but the dataset has {expected.get(key)!r}")


def write_manifest(directory: str | Path, meta: ShardMeta, shards: list[dict], **extra: Any) -> dict:
    tokens = sum(s["tokens"] for s in shards)
    nbytes = sum(s["bytes"] for s in shards)
    manifest = {"format": "eyrie-shards", "meta": meta.to_json(), "shards": shards,
                "totals": {"shards": len(shards), "rows": sum(s["rows"] for s in shards), "tokens": tokens,
                           "loss_tokens": sum(s["loss_tokens"] for s in shards), "bytes": nbytes,
                           "bytes_per_token": nbytes / max(tokens, 1)},
                **extra}
    atomic_write_json(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: no manifest (the dataset was never completed, or this is not a dataset)") from None
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: corrupted manifest ({e})") from None
    if manifest.get("format") != "eyrie-shards":
        raise ShardError(f"{path}: not an Eyrie shard manifest")
    return manifest


class ShardDataset:
    """All shards of one or more dataset directories as one indexable dataset (the one shard reader).

    Every shard is checked against its manifest entry (rows; checksum with `verify=True`) and against the
    first dataset's metadata (schema version, target, layer ids, dtype), and errors name the shard.
    """

    def __init__(self, *directories: str | Path, verify: bool = False):
        if not directories:
            raise ValueError("no dataset directory given")
        self.manifests = [read_manifest(d) for d in directories]
        self.meta = self.manifests[0]["meta"]
        self.readers: list[ShardReader] = []
        for directory, manifest in zip(directories, self.manifests):
            check_compatible(self.meta, manifest["meta"], f"{Path(directory) / MANIFEST}")
            for entry in manifest["shards"]:
                name = str(entry.get("file", ""))
                if Path(name).name != name or name in ("", ".", ".."):  # a shard is a file in its dataset dir
                    raise ShardError(f"{Path(directory) / MANIFEST}: shard path {name!r} is not a file name inside "
                                     "the dataset directory (refused)")
                path = Path(directory) / name
                if not path.exists():
                    raise ShardError(f"{path}: listed in the manifest but missing")
                if path.stat().st_size != entry["bytes"]:
                    raise ShardError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                                     "(truncated or replaced)")
                if verify and file_checksum(path) != entry["xxh3_128"]:
                    raise ShardError(f"{path}: checksum mismatch (corrupted)")
                reader = ShardReader(path)
                check_compatible(self.meta, reader.meta.to_json(), str(path))
                if len(reader) != entry["rows"]:
                    raise ShardError(f"{path}: {len(reader)} rows, the manifest says {entry['rows']}")
                self.readers.append(reader)
        self._starts = np.cumsum([0] + [len(r) for r in self.readers])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range 0..{len(self) - 1}")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.readers[s][i - int(self._starts[s])]

    def lengths(self) -> np.ndarray:
        """Token count of every sample, without touching the hidden states (for length grouping)."""
        out = []
        for reader in self.readers:
            for v in reader._views:
                out.append(np.diff(v["input_ids"][0]))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
