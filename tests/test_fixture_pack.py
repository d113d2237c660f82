"""The golden fixtures' pack (tests/fixture_pack.py): what it unpacks is the upstream files byte for byte."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import struct
import zipfile

import numpy as np
import pytest
from fixture_pack import PACK, SET_A, FixturePackError, ensure_unpacked, pack, read_pack, unpack


def upstream_manifest() -> dict[str, dict]:
    return {e["path"]: e for e in json.loads((SET_A / "manifest.json").read_text())}


def test_the_pack_holds_every_checkpoint_and_golden_array_with_the_upstream_sha256():
    header, _ = read_pack()
    upstream = upstream_manifest()
    packed = {e["path"]: e for e in header["files"]}
    assert sorted(packed) == sorted(p for p in upstream if p.endswith((".safetensors", ".npz")))
    for path, entry in packed.items():
        assert (entry["sha256"], entry["bytes"]) == (upstream[path]["sha256"], upstream[path]["bytes"]), path


def test_unpacked_goldens_are_the_upstream_bytes(tmp_path):
    written = unpack(PACK, tmp_path)
    upstream = upstream_manifest()
    assert len(written) == 10
    for path in written:
        rel = path.relative_to(tmp_path).as_posix()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == upstream[rel]["sha256"], rel


def small_set(root):
    """A safetensors file (fp32, fp16, int64 tensors) and an npz (float and int arrays) as upstream writes them."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    (root / "ckpt").mkdir(parents=True)
    save_file({"w": rng.normal(0, 0.02, (64, 33)).astype(np.float32),
               "e": rng.normal(0, 0.02, (50, 8)).astype(np.float16), "i": np.arange(7, dtype=np.int64)},
              str(root / "ckpt" / "model.safetensors"))
    arrays = {"wav": rng.normal(size=4001).astype(np.float32), "codes": rng.integers(0, 1024, (16, 9)),
              "flag": np.array([True, False])}
    # the goldens' zip layout (members deflated in one piece, as upstream's files are)
    with zipfile.ZipFile(root / "g.npz", "w", zipfile.ZIP_DEFLATED) as z:
        for key, value in arrays.items():
            buf = io.BytesIO()
            np.save(buf, value)
            z.writestr(zipfile.ZipInfo(f"{key}.npy", (1980, 1, 1, 0, 0, 0)), buf.getvalue(), zipfile.ZIP_DEFLATED)
    # numpy's own streamed zip64 layout, which the pack does not rebuild: stored as it is, still exact
    np.savez_compressed(root / "streamed.npz", **arrays)
    (root / "README.md").write_text("not packed\n")


def test_pack_round_trip_is_byte_identical(tmp_path):
    small_set(tmp_path / "src")
    header = pack(tmp_path / "src", tmp_path / "p.xz")
    kinds = {e["path"]: ("raw" if e.get("raw") else "members" if "members" in e else "planes")
             for e in header["files"]}
    assert kinds == {"ckpt/model.safetensors": "planes", "g.npz": "members", "streamed.npz": "raw"}
    unpack(tmp_path / "p.xz", tmp_path / "out")
    for rel in kinds:
        assert (tmp_path / "out" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes(), rel
    assert not (tmp_path / "out" / "README.md").exists()
    assert ensure_unpacked(tmp_path / "p.xz", tmp_path / "fresh") is True
    assert ensure_unpacked(tmp_path / "p.xz", tmp_path / "fresh") is False       # the stamp names this pack


def test_a_damaged_pack_or_a_wrong_file_is_refused_by_name(tmp_path):
    small_set(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "p.xz")
    data = (tmp_path / "p.xz").read_bytes()
    (tmp_path / "flipped.xz").write_bytes(data[:200] + bytes([data[200] ^ 1]) + data[201:])
    with pytest.raises(FixturePackError, match="damaged"):
        unpack(tmp_path / "flipped.xz", tmp_path / "out1")
    # a pack whose recorded sha256 is not what its payload unpacks to
    raw = lzma.decompress(data)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["files"][1]["sha256"] = "0" * 64                    # g.npz
    text = json.dumps(header).encode()
    (tmp_path / "wrong.xz").write_bytes(lzma.compress(struct.pack("<Q", len(text)) + text + raw[8 + n:]))
    with pytest.raises(FixturePackError, match=r"g\.npz: unpacked to .* recorded"):
        unpack(tmp_path / "wrong.xz", tmp_path / "out2")
