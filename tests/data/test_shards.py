import json
import os
import signal
import subprocess
import sys
import textwrap

import datasets
import pytest
import torch

from data.files import file_checksum
from data.shards import MANIFEST, ShardDataset, ShardError, ShardMeta, ShardReader, ShardWriter, write_manifest

H = 16
LAYERS = [1, 3, 5]


def meta(**kw) -> ShardMeta:
    base = dict(kind="features", target_id="tiny", target_config_hash="abc", aux_layer_ids=LAYERS, hidden_size=H,
                dtype="bfloat16", final_hidden="post_norm")
    return ShardMeta(**(base | kw))


def make_dataset(directory, n_shards=2, rows=7, dtype=torch.bfloat16, seed=0, **meta_kw):
    g = torch.Generator().manual_seed(seed)
    m = meta(dtype=str(dtype).split(".")[1], **meta_kw)
    directory.mkdir(parents=True, exist_ok=True)
    samples, infos = [], []
    for s in range(n_shards):
        with ShardWriter(directory / f"shard-{s:05d}.arrow", m, batch_bytes=2000) as w:
            for r in range(rows):
                T = 3 + (s * rows + r) % 11
                ids = torch.randint(0, 1000, (T,), generator=g)
                mask = torch.randint(0, 2, (T,), generator=g)
                aux = torch.randn(T, 3 * H, generator=g).to(dtype)
                fin = torch.randn(T, H, generator=g).to(dtype)
                w.write(f"s{s}-{r}", ids.tolist(), mask.tolist(), aux, fin)
                samples.append((f"s{s}-{r}", ids, mask, aux, fin))
            infos.append(w.close())
    write_manifest(directory, m, infos)
    return samples


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    samples = make_dataset(tmp_path / "ds", dtype=dtype)
    ds = ShardDataset(tmp_path / "ds", verify=True)
    assert len(ds) == len(samples) == 14
    for i in [13, 0, 7, 3]:  # random access
        got, (sid, ids, mask, aux, fin) = ds[i], samples[i]
        assert got.sample_id == sid
        assert torch.equal(got.input_ids.long(), ids) and torch.equal(got.loss_mask.long(), mask)
        assert got.aux_hidden.dtype == dtype and torch.equal(got.aux_hidden.view(torch.uint8), aux.view(torch.uint8))
        assert torch.equal(got.final_hidden.view(torch.uint8), fin.view(torch.uint8))
    assert ds.lengths().tolist() == [len(s[1]) for s in samples]


def test_reads_are_views_of_the_memory_map(tmp_path):
    make_dataset(tmp_path / "ds", n_shards=1)
    reader = ShardReader(tmp_path / "ds" / "shard-00000.arrow")
    sample = reader[5]
    buffers = [b.column("aux_hidden").buffers()[2] for b in reader._batches]
    assert any(buf.address <= sample.aux_hidden.data_ptr() < buf.address + buf.size for buf in buffers)
    assert not any(buf.is_mutable for buf in buffers)  # mapped read-only from the file, not copied to the heap


def test_datasets_opens_shards(tmp_path):
    samples = make_dataset(tmp_path / "ds", n_shards=1)
    ds = datasets.Dataset.from_file(str(tmp_path / "ds" / "shard-00000.arrow"))
    assert ds.num_rows == 7 and ds[2]["sample_id"] == samples[2][0]
    assert ds[2]["input_ids"] == samples[2][1].tolist()
    raw = torch.frombuffer(bytearray(ds[2]["aux_hidden"]), dtype=torch.bfloat16).view(-1, 3 * H)
    assert torch.equal(raw, samples[2][3])


@pytest.mark.parametrize("keep_fraction", [0.1, 0.5, 0.9, 0.999])
def test_truncated_shard_is_named(tmp_path, keep_fraction):
    make_dataset(tmp_path / "ds", n_shards=1)
    path = tmp_path / "ds" / "shard-00000.arrow"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep_fraction)])
    with pytest.raises(ShardError, match="shard-00000.arrow: truncated shard"):
        ShardReader(path)
    with pytest.raises(ShardError, match="shard-00000.arrow"):
        ShardDataset(tmp_path / "ds")


def test_flipped_byte_fails_checksum(tmp_path):
    make_dataset(tmp_path / "ds", n_shards=2)
    path = tmp_path / "ds" / "shard-00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    ShardDataset(tmp_path / "ds")  # size and structure still look fine...
    with pytest.raises(ShardError, match="shard-00001.arrow: checksum mismatch"):
        ShardDataset(tmp_path / "ds", verify=True)


@pytest.mark.parametrize("field,value,message", [
    ("aux_layer_ids", [2, 30, 58], "aux_layer_ids is \\[2, 30, 58\\], but the dataset has \\[1, 3, 5\\]"),
    ("target_config_hash", "other", "target_config_hash is 'other'"),
    ("schema_version", 99, "schema version 99"),
])
def test_mismatched_shard_is_named(tmp_path, field, value, message):
    make_dataset(tmp_path / "ds", n_shards=2)
    make_dataset(tmp_path / "other", n_shards=1, **{field: value})
    # Swap a foreign shard into the dataset under the name the manifest expects.
    manifest = json.loads((tmp_path / "ds" / MANIFEST).read_text())
    os.replace(tmp_path / "other" / "shard-00000.arrow", tmp_path / "ds" / "shard-00001.arrow")
    other = json.loads((tmp_path / "other" / MANIFEST).read_text())["shards"][0]
    manifest["shards"][1] |= {"bytes": other["bytes"], "rows": other["rows"]}
    (tmp_path / "ds" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=f"shard-00001.arrow: {message}" if field == "schema_version" else message):
        ShardDataset(tmp_path / "ds")


def test_two_datasets_from_different_targets_are_refused(tmp_path):
    make_dataset(tmp_path / "a")
    make_dataset(tmp_path / "b", target_config_hash="zzz")
    with pytest.raises(ShardError, match=f"{tmp_path / 'b' / MANIFEST}: target_config_hash"):
        ShardDataset(tmp_path / "a", tmp_path / "b")


def test_wrong_tensor_shape_is_refused(tmp_path):
    with pytest.raises(ShardError, match="sample bad: aux_hidden"), ShardWriter(tmp_path / "x.arrow", meta()) as w:
        w.write("bad", [1, 2], [1, 1], torch.zeros(2, H, dtype=torch.bfloat16), torch.zeros(2, H, dtype=torch.bfloat16))
    assert not list(tmp_path.iterdir())  # the aborted writer left nothing behind


def test_killed_writer_leaves_no_complete_looking_shard(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from data.shards import ShardMeta, ShardWriter
        m = ShardMeta(kind="features", aux_layer_ids=[1, 3, 5], hidden_size={H}, dtype="bfloat16")
        w = ShardWriter({str(tmp_path / 'shard-00000.arrow')!r}, m, batch_bytes=1000)
        for i in range(50):
            w.write(str(i), [1] * 8, [1] * 8, torch.zeros(8, {3 * H}, dtype=torch.bfloat16),
                    torch.zeros(8, {H}, dtype=torch.bfloat16))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd())
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "shard-00000.arrow").exists()
    assert [p.name.startswith(".shard-00000.arrow.tmp-") for p in tmp_path.iterdir()] == [True]
    with pytest.raises(ShardError, match="no manifest"):
        ShardDataset(tmp_path)


@pytest.mark.skipif(sys.platform != "linux", reason="a file size limit stands in for a full disk (Linux rlimits)")
def test_a_failed_write_names_the_shard_and_how_far_it_got(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from data.shards import ShardMeta, ShardWriteError, ShardWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        m = ShardMeta(kind="features", aux_layer_ids=[1, 3, 5], hidden_size={H}, dtype="bfloat16")
        w = ShardWriter({str(tmp_path / 'shard-00000.arrow')!r}, m, batch_bytes=1000)
        try:
            for i in range(100):
                w.write(str(i), [1] * 8, [1] * 8, torch.zeros(8, {3 * H}, dtype=torch.bfloat16),
                        torch.zeros(8, {H}, dtype=torch.bfloat16))
        except ShardWriteError as e:
            print(e)
            w.abort()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert ".shard-00000.arrow.tmp-" in proc.stdout and "write failed (File too large) after " in proc.stdout, proc.stdout
    written = int(proc.stdout.split(" after ")[1].split(" bytes")[0].replace(",", ""))
    assert 18000 < written <= 20000
    assert list(tmp_path.iterdir()) == []  # aborted: no temporary left, no shard


def test_bytes_per_token_for_a_4096_hidden_target(tmp_path):
    m = meta(hidden_size=4096)
    with ShardWriter(tmp_path / "s.arrow", m) as w:
        for i in range(4):
            w.write(str(i), [1] * 256, [1] * 256, torch.zeros(256, 3 * 4096, dtype=torch.bfloat16),
                    torch.zeros(256, 4096, dtype=torch.bfloat16))
        info = w.close()
    per_token = info["bytes"] / info["tokens"]
    # 3 aux layers + final state, bf16: 4 * 4096 * 2 = 32768 B, plus 4 B id + 1 B mask, plus framing.
    assert 32773 <= per_token < 32773 * 1.01


def test_packed_rows_read_back_like_rows_written_one_by_one(tmp_path):
    """Extraction writes a batch's states packed [sum T, D] straight from host memory; after single rows,
    in order."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9]
    ids = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    masks = [torch.randint(0, 2, (n,), generator=g) for n in lengths]
    aux = torch.randn(sum(lengths), 3 * H, generator=g).to(torch.bfloat16)
    fin = torch.randn(sum(lengths), H, generator=g).to(torch.bfloat16)
    with ShardWriter(tmp_path / "shard-00000.arrow", meta()) as w:
        w.write("single", [7, 8], [0, 1], aux[:2], fin[:2])
        w.write_packed(["a", "b", "c"], [x.numpy() for x in ids], [m.numpy() for m in masks], aux, fin)
        with pytest.raises(ShardError, match="one row per token"):
            w.write_packed(["d"], [ids[0].numpy()], [masks[0].numpy()], aux, fin)
        info = w.close()
    assert info["rows"] == 4 and info["tokens"] == 2 + sum(lengths)
    reader = ShardReader(tmp_path / "shard-00000.arrow")
    assert [reader[i].sample_id for i in range(4)] == ["single", "a", "b", "c"]
    start = 0
    for r, n in enumerate(lengths):
        got = reader[r + 1]
        assert torch.equal(got.input_ids.long(), ids[r]) and torch.equal(got.loss_mask.long(), masks[r])
        assert torch.equal(got.aux_hidden.view(torch.uint8), aux[start:start + n].view(torch.uint8))
        assert torch.equal(got.final_hidden.view(torch.uint8), fin[start:start + n].view(torch.uint8))
        start += n


def test_fp8_aux_states_round_trip_within_e4m3s_precision_at_half_the_bytes(tmp_path):
    """fp8_e4m3_rowscale: the aux states come back in the shard's dtype, each value within e4m3's relative
    precision (3 mantissa bits: half a step is 2^-4) of the original, also next to a large outlier in its row;
    the final state stays bit-exact; the bytes shrink to H + 4 per aux layer per token."""
    from data import aux_codec
    from extract.job import bytes_per_token
    g = torch.Generator().manual_seed(2)
    lengths = [6, 3]
    aux = torch.randn(sum(lengths), 3 * H, generator=g).to(torch.bfloat16)
    aux[0, 5] = 300.0  # a massive activation: the row's other values keep their relative precision
    fin = torch.randn(sum(lengths), H, generator=g).to(torch.bfloat16)
    m = meta(aux_encoding="fp8_e4m3_rowscale")
    encoded = aux_codec.encode_fp8(aux, len(LAYERS))  # what extraction sends from the device
    assert encoded.dtype == torch.uint8 and encoded.shape == (sum(lengths), 3 * H + 4 * 3)
    with ShardWriter(tmp_path / "shard-00000.arrow", m) as w:
        w.write("on-the-host", [1] * 6, [1] * 6, aux[:6], fin[:6])  # encoded by the writer
        w.write_packed(["from-the-device"], [torch.ones(3, dtype=torch.int32).numpy()],
                       [torch.ones(3, dtype=torch.uint8).numpy()], encoded[6:], fin[6:])
        info = w.close()
    reader = ShardReader(tmp_path / "shard-00000.arrow")
    got = torch.cat([reader[0].aux_hidden, reader[1].aux_hidden])
    assert got.dtype == torch.bfloat16 and got.shape == aux.shape
    original = aux.float()
    # relative 2^-4 down to absmax / 28,672 (e4m3's smallest normal, 2^-6, times the scale absmax / 448); below
    # that the subnormals' absolute half-step, 2^-10 times the scale
    scale = original.view(-1, 3, H).abs().amax(-1, keepdim=True).expand(-1, 3, H).reshape(original.shape) / 448
    assert ((got.float() - original).abs() <= torch.maximum(original.abs() * 2 ** -4, scale * 2 ** -10)).all()
    assert got[0, 5] == 300.0 and ((got[0, :5].float() - original[0, :5]).abs() <= original[0, :5].abs() / 16).all()
    assert torch.equal(reader[1].final_hidden, fin[6:])
    assert bytes_per_token(m) == 3 * (H + 4) + H * 2 + 5 < bytes_per_token(meta())
    with pytest.raises(ShardError, match="encoded aux_hidden must be"):
        ShardWriter(tmp_path / "bad.arrow", m).write("x", [1], [1], encoded[:1, :-1], fin[:1])
    assert info["rows"] == 2


def test_writer_starts_writeback_of_each_written_range_in_order(tmp_path, monkeypatch):
    """Rows reach the disk while the shard grows, not all at the fsync on close; the bytes do not change, and the
    checksum hashed as they were written is the file's."""
    import data.files
    calls, start_writeback = [], data.files.start_writeback

    def recording(fd, offset, nbytes):
        calls.append((offset, nbytes, start_writeback(fd, offset, nbytes)))
        return calls[-1][2]

    monkeypatch.setattr(data.files, "start_writeback", recording)
    files = {}
    for writeback in (0, 4096):
        g = torch.Generator().manual_seed(0)
        path = tmp_path / f"shard-{writeback}.arrow"
        with ShardWriter(path, meta(), batch_bytes=2000, writeback_bytes=writeback) as w:
            for r in range(40):
                w.write(f"s{r}", list(range(9)), [1] * 9, torch.randn(9, 3 * H, generator=g).bfloat16(),
                        torch.randn(9, H, generator=g).bfloat16())
            info = w.close()
        files[writeback] = path.read_bytes()
        assert info["xxh3_128"] == file_checksum(path) and info["bytes"] == len(files[writeback])  # hashed as written
    assert files[0] == files[4096]
    size, covered = len(files[0]), calls[-1][0] + calls[-1][1]
    assert len(calls) >= 5  # all with writeback 4096: none with 0
    assert [c[0] for c in calls] == [0] + [o + n for o, n, _ in calls[:-1]]  # contiguous ranges, in order
    assert all(n >= 4096 for _, n, _ in calls)
    assert size - max(n for _, n, _ in calls) - 4096 < covered <= size  # all but the last unfinished range
    if sys.platform == "linux":  # the kernel accepted each request
        assert all(ok for *_, ok in calls)
