"""tests/benchmarks/parts.sh: a folder too large for one device call goes out in parts over several calls and is
unpacked only when every part is there and matches its checksum (run here, as the GPU machine runs it)."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parts(*args: str, cwd: Path, out: Path | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"PARTS_MIB": "1", "PARTS_TMP": str(cwd.parent / "packed")} | ({"OUT": str(out)} if out else {})
    # the script works in the repository it sits in: run a copy inside a stand-in checkout
    return subprocess.run(["bash", "tests/benchmarks/parts.sh", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_a_folder_goes_out_in_parts_and_is_unpacked_only_whole(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests" / "benchmarks").mkdir(parents=True)
    (repo / "tests" / "benchmarks" / "parts.sh").write_text((ROOT / "tests" / "benchmarks" / "parts.sh").read_text())
    src = tmp_path / "assets"
    (src / "target").mkdir(parents=True)
    weights = os.urandom(6 * 1024 * 1024 + 123)  # 7 parts of 1 MiB: two calls of 4
    (src / "target" / "model.safetensors").write_bytes(weights)
    (src / "prompts.json").write_text("{}")
    (src / "checkpoint").mkdir()  # not named: stays behind

    for first in (0, 4):  # each call returns 4 parts and the manifest; they are kept here as .parts/NAME-FIRST
        out = tmp_path / f"out-{first}"
        done = parts("out", "assets", str(first), str(src), "target", "prompts.json", cwd=repo, out=out)
        assert done.returncode == 0, done.stderr
        carried = repo / ".parts" / f"assets-{first}"
        carried.mkdir(parents=True)
        for f in (out / "assets").iterdir():
            f.rename(carried / f.name)
    assert "next FIRST: 4" in parts("out", "assets", "0", str(src), cwd=repo, out=tmp_path / "o").stdout
    assert sorted(p.name for p in (repo / ".parts" / "assets-4").iterdir()) == \
        ["assets.sha256", "assets.tar.004", "assets.tar.005", "assets.tar.006"]

    dest = tmp_path / "unpacked"
    last = repo / ".parts" / "assets-4" / "assets.tar.006"
    kept = last.read_bytes()
    last.unlink()  # not carried yet
    missing = parts("in", "assets", str(dest), cwd=repo)
    assert missing.returncode == 1 and "assets.tar.006 not carried yet" in missing.stderr and not dest.exists()
    last.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))  # one bit off
    damaged = parts("in", "assets", str(dest), cwd=repo)
    assert damaged.returncode == 1 and "damaged" in damaged.stderr and not dest.exists()
    last.write_bytes(kept)
    whole = parts("in", "assets", str(dest), cwd=repo)
    assert whole.returncode == 0, whole.stderr
    assert (dest / "target" / "model.safetensors").read_bytes() == weights and (dest / "prompts.json").exists()
    assert not (dest / "checkpoint").exists()
