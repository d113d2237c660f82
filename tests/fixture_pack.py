"""The golden fixtures' large files (tiny checkpoints, golden arrays) stored as one xz pack, unpacked on first
use into the folder they belong in (where git ignores them).

Why: every file git tracks travels with each call to a lent GPU machine (64 MiB a call, the repository
included; docs/gpu.md), so 33 MB of fixtures stored as they came cost a wheelhouse transfer. Random weights
and waveforms hardly compress as they are (xz over the safetensors: 57 %; over the already deflated npz:
93 %), so the pack stores each number's bytes grouped by position (byte-plane order: the sign-and-exponent
bytes together, compressible; the low mantissa bytes together), and each npz's arrays as raw ``.npy``
bytes, re-deflated on unpack with the zip fields as they were (a file that would not come back byte for
byte that way is stored as it is). Every unpacked file is checked against the
sha256 recorded when packing (the upstream manifest's, tests/test_fixture_pack.py checks both agree): the
goldens are the upstream files byte for byte, or the unpack fails naming the file.

    python tests/fixture_pack.py unpack            # what tests/conftest.py does before any test
    python tests/fixture_pack.py pack              # after replacing a golden file: rewrites the pack

Standard library and numpy only.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import lzma
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SET_A = FIXTURES / "set-a"
PACK = FIXTURES / "set-a.pack.xz"
STAMP = ".unpacked"                     # in the unpacked folder: the sha256 of the pack it came from
FORMAT = 1
PACKED_SUFFIXES = (".safetensors", ".npz")
# safetensors dtype -> bytes per element
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
              "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class FixturePackError(RuntimeError):
    """The pack is damaged, or an unpacked file is not the one recorded."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def planes(data: bytes, item: int) -> bytes:
    """Element bytes regrouped by position: all first bytes, then all second bytes, ..."""
    if item == 1 or not data:
        return data
    return np.frombuffer(data, np.uint8).reshape(-1, item).T.tobytes()


def unplanes(data: bytes, item: int) -> bytes:
    if item == 1 or not data:
        return data
    return np.frombuffer(data, np.uint8).reshape(item, -1).T.tobytes()


def _safetensors_regions(data: bytes) -> list[tuple[int, int, int]]:
    """(start, end, element bytes) of each tensor's data; the header itself stays as it is."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    return [(base + t["data_offsets"][0], base + t["data_offsets"][1], ITEM_BYTES[t["dtype"]])
            for k, t in header.items() if k != "__metadata__"]


def _transform_safetensors(data: bytes, forward: bool) -> bytes:
    out = bytearray(data)
    for start, end, item in _safetensors_regions(data):
        out[start:end] = (planes if forward else unplanes)(data[start:end], item)
    return bytes(out)


def _npy_split(npy: bytes) -> tuple[int, int]:
    """(header length, element bytes) of one ``.npy`` member."""
    arr = np.load(io.BytesIO(npy), allow_pickle=False)
    return len(npy) - arr.nbytes, arr.dtype.itemsize


def _pack_npz(data: bytes) -> tuple[bytes, list[dict]]:
    payload, members = [], []
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            npy = z.read(info)
            head, item = _npy_split(npy)
            payload.append(npy[:head] + planes(npy[head:], item))
            members.append({"name": info.filename, "date_time": list(info.date_time),
                            "external_attr": info.external_attr, "create_system": info.create_system,
                            "compress_type": info.compress_type, "bytes": len(npy), "header": head, "item": item})
    return b"".join(payload), members


def _unpack_npz(payload: bytes, members: list[dict]) -> bytes:
    buf, at = io.BytesIO(), 0
    with zipfile.ZipFile(buf, "w") as z:
        for m in members:
            npy = payload[at:at + m["bytes"]]
            at += m["bytes"]
            info = zipfile.ZipInfo(m["name"], tuple(m["date_time"]))
            info.external_attr, info.create_system = m["external_attr"], m["create_system"]
            info.compress_type = m["compress_type"]
            z.writestr(info, npy[:m["header"]] + unplanes(npy[m["header"]:], m["item"]))
    return buf.getvalue()


def pack(src: Path = SET_A, out: Path = PACK) -> dict:
    """Every ``.safetensors`` and ``.npz`` under ``src`` into the pack ``out``; returns its header."""
    entries, payloads = [], []
    for path in sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in PACKED_SUFFIXES):
        data = path.read_bytes()
        entry = {"path": path.relative_to(src).as_posix(), "bytes": len(data), "sha256": sha256(data)}
        if path.suffix == ".npz":
            body, entry["members"] = _pack_npz(data)
        else:
            body = _transform_safetensors(data, forward=True)
        if unpack_entry(entry, body) != data:      # a zip this module does not rebuild exactly: stored as it is
            entry.pop("members", None)
            entry["raw"], body = True, data
        entry["payload_bytes"] = len(body)
        entries.append(entry)
        payloads.append(body)
    header = json.dumps({"format": FORMAT, "files": entries}, indent=1).encode()
    raw = struct.pack("<Q", len(header)) + header + b"".join(payloads)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    tmp.replace(out)
    return json.loads(header)


def unpack_entry(entry: dict, body: bytes) -> bytes:
    if entry.get("raw"):
        return body
    if "members" in entry:
        return _unpack_npz(body, entry["members"])
    return _transform_safetensors(body, forward=False)


def read_pack(pack_path: Path = PACK) -> tuple[dict, bytes]:
    """(header, payload bytes) of a pack."""
    try:
        raw = lzma.decompress(pack_path.read_bytes())
    except lzma.LZMAError as e:
        raise FixturePackError(f"{pack_path}: damaged ({e})") from None
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if header.get("format") != FORMAT:
        raise FixturePackError(f"{pack_path}: format {header.get('format')}, this reader knows {FORMAT}")
    return header, raw[8 + n:]


def unpack(pack_path: Path = PACK, dest: Path = SET_A) -> list[Path]:
    """Every file of the pack written under ``dest``, each checked against its recorded sha256 first."""
    header, payload = read_pack(pack_path)
    written, at = [], 0
    for entry in header["files"]:
        body = payload[at:at + entry["payload_bytes"]]
        at += entry["payload_bytes"]
        data = unpack_entry(entry, body)
        if len(data) != entry["bytes"] or sha256(data) != entry["sha256"]:
            raise FixturePackError(f"{entry['path']}: unpacked to {len(data)} bytes with sha256 {sha256(data)}, "
                                   f"recorded {entry['bytes']} bytes with sha256 {entry['sha256']}"
                                   + (" (the npz members are re-deflated by this Python's zlib "
                                      f"{__import__('zlib').ZLIB_RUNTIME_VERSION}: one that deflates "
                                      "otherwise gives other bytes)" if "members" in entry else ""))
        path = dest / entry["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        written.append(path)
    return written


def is_unpacked(pack_path: Path = PACK, dest: Path = SET_A) -> bool:
    stamp = dest / STAMP
    return stamp.is_file() and stamp.read_text().strip() == sha256(pack_path.read_bytes())


def ensure_unpacked(pack_path: Path = PACK, dest: Path = SET_A) -> bool:
    """Unpack unless ``dest`` holds this pack's files already (its stamp names the pack's sha256); safe when
    several processes start at once. Returns whether it unpacked."""
    if is_unpacked(pack_path, dest):
        return False
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / f"{STAMP}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_unpacked(pack_path, dest):
            return False
        unpack(pack_path, dest)
        (dest / STAMP).write_text(sha256(pack_path.read_bytes()) + "\n")
    return True


def main(argv: list[str]) -> int:
    if argv == ["unpack"]:
        print(f"{'unpacked' if ensure_unpacked() else 'already unpacked'}: {SET_A}")
        return 0
    if argv == ["pack"]:
        header = pack()
        print(f"{PACK}: {len(header['files'])} files, {PACK.stat().st_size} bytes")
        return 0
    print("usage: python tests/fixture_pack.py unpack|pack", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
