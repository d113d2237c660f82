"""A wheelhouse as one ``tar.xz`` in parts of a fixed size, with a manifest; and back.

The wheels go into the archive *stored* (re-zipped without compression, every member and its metadata as it
was): a wheel is already deflated, and xz over deflated bytes gains almost nothing, while xz over the raw
bytes of a shared library gains a third or more (onnxruntime-gpu's stripped CUDA provider: 90 MB under gzip,
52 MB under xz). pip installs a stored wheel as it installs a deflated one; the RECORD hashes are of the
files' contents, which do not change (except where :mod:`fatbin` rewrote a library: its RECORD line is
rewritten too).

``manifest.json`` beside the parts gives each part's size and sha256 and the whole archive's, so
:func:`join` names the part that is missing, short or damaged before it unpacks anything.

Standard library only (the ``xz`` command, when present, compresses on every core).
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHIVE = "mossrt-wheelhouse.tar.xz"
MANIFEST = "manifest.json"
MIB = 1 << 20
FORMAT = 1


class PartsError(RuntimeError):
    """A part is missing, of the wrong size or damaged; or the archive does not unpack."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def record_hash(data: bytes) -> str:
    """A wheel RECORD's hash field: ``sha256=`` + urlsafe base64 without padding."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack_wheel(src: Path, dst: Path, replace: dict[str, bytes] | None = None) -> None:
    """``src`` re-zipped uncompressed to ``dst``, member order, names, dates and permissions kept; members
    named in ``replace`` get the new bytes and their RECORD line is rewritten to match."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        missing = sorted(set(replace) - set(names))
        if missing:
            raise PartsError(f"{src.name} has no member {missing[0]}")
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        tmp = dst.with_name(dst.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = replace.get(info.filename)
                if data is None:
                    data = zin.read(info)
                    if info.filename == record and replace:
                        data = _rewrite_record(data, replace)
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr, out.create_system = info.external_attr, info.create_system
                out.compress_type = zipfile.ZIP_STORED
                zout.writestr(out, data)
    tmp.replace(dst)


def _rewrite_record(record: bytes, replace: dict[str, bytes]) -> bytes:
    lines = []
    for line in record.decode("utf-8").splitlines():
        path = line.rsplit(",", 2)[0]
        if path in replace:
            line = f"{path},{record_hash(replace[path])},{len(replace[path])}"
        lines.append(line)
    return ("\n".join(lines) + "\n").encode("utf-8")


def compress(members: list[tuple[Path, str]], out: Path, preset: int = 6) -> float:
    """A tar of ``(file, name in archive)`` as ``out`` (xz). Returns seconds taken."""
    t0 = time.monotonic()
    tmp = out.with_name(out.name + ".tmp")
    xz = shutil.which("xz")
    with tmp.open("wb") as f:
        if xz:      # same .xz format, every core
            proc = subprocess.Popen([xz, f"-{preset}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=f)
            assert proc.stdin is not None                  # stdin=PIPE
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for path, name in members:
                    tar.add(path, arcname=name, recursive=False, filter=_plain)
            proc.stdin.close()
            if proc.wait() != 0:
                raise PartsError(f"xz exited with status {proc.returncode}")
        else:
            with lzma.open(f, "wb", preset=preset) as zf, tarfile.open(fileobj=zf, mode="w|",
                                                                       format=tarfile.PAX_FORMAT) as tar:
                for path, name in members:
                    tar.add(path, arcname=name, recursive=False, filter=_plain)
    tmp.replace(out)
    return time.monotonic() - t0


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def split(archive: Path, parts_dir: Path, part_mib: float, extra: dict) -> dict:
    """``archive`` cut into ``parts_dir/<archive>.NNN`` of at most ``part_mib`` MiB each, and the manifest
    (``extra`` is stored in it as ``wheelhouse``). The archive itself is removed."""
    limit = int(part_mib * MIB)
    if limit < MIB:
        raise PartsError(f"--part-mib must be at least 1 (got {part_mib})")
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob(f"{ARCHIVE}.*"):
        old.unlink()
    whole = hashlib.sha256()
    parts: list[dict[str, Any]] = []                       # the manifest's entries: name, bytes, sha256
    with archive.open("rb") as f:
        index = 1
        while True:
            block = f.read(limit)
            if not block:
                break
            whole.update(block)
            name = f"{ARCHIVE}.{index:03d}"
            (parts_dir / name).write_bytes(block)
            parts.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            index += 1
    manifest = {"format": FORMAT, "archive": {"name": ARCHIVE, "bytes": sum(p["bytes"] for p in parts),
                                              "sha256": whole.hexdigest()},
                "part_limit_bytes": limit, "parts": parts, "wheelhouse": extra}
    (parts_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    archive.unlink()
    return manifest


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    if not path.is_file():
        raise PartsError(f"{path}: no manifest (send {MANIFEST} with the first part)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PartsError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise PartsError(f"{path}: manifest format {found!r}, this script reads {FORMAT}")
    check_manifest(manifest, path)
    return manifest


def plain_name(name: object) -> bool:
    """A file name and nothing else: no folder (``/``, ``\\``), not ``.`` / ``..``, no NUL, not empty."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and name == name.strip())


def check_manifest(manifest: dict, path: Path) -> None:
    """Every name a plain file name in its folder (the archive's, each part's, each once), every size a count
    and every hash a sha256; else a :class:`PartsError` naming the entry. Called before anything is written
    or removed: a manifest is data from the other side of a transfer, never a path to follow."""
    def bad(what: str) -> PartsError:
        return PartsError(f"{path}: refused: {what}")

    def sized(entry: object, what: str) -> dict:
        if not isinstance(entry, dict):
            raise bad(f"{what} is not an object")
        if not plain_name(entry.get("name")):
            raise bad(f"{what} name {entry.get('name')!r} is not a plain file name (no folder, no '..')")
        if not isinstance(entry.get("bytes"), int) or isinstance(entry["bytes"], bool) or entry["bytes"] < 0:
            raise bad(f"{what} {entry['name']!r}: bytes {entry.get('bytes')!r} is not a count")
        digest = entry.get("sha256")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise bad(f"{what} {entry['name']!r}: sha256 {digest!r} is not a sha256")
        return entry

    sized(manifest.get("archive"), "the archive")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise bad("no list of parts")
    names = [sized(p, f"part {i + 1}")["name"] for i, p in enumerate(parts)]
    twice = sorted({n for n in names if names.count(n) > 1} | ({MANIFEST} & set(names)))
    if twice:
        raise bad(f"part name {twice[0]!r} is named twice (or is the manifest)")
    limit = manifest.get("part_limit_bytes")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise bad(f"part_limit_bytes {limit!r} is not a count")


@dataclass(frozen=True)
class PartState:
    name: str
    bytes: int
    sha256: str
    state: str          # "ok" | "missing" | "short" | "long" | "damaged" | "over the limit"


def check_parts(parts_dir: Path, manifest: dict, hashes: bool = True) -> list[PartState]:
    """Each part of the manifest as found in ``parts_dir`` (size, then sha256 when ``hashes``)."""
    out, limit = [], manifest["part_limit_bytes"]
    for p in manifest["parts"]:
        path = parts_dir / p["name"]
        try:
            st = os.lstat(path)             # the part itself: a symbolic link is not followed
        except FileNotFoundError:
            st = None
        if st is None:
            state = "missing"
        elif stat.S_ISLNK(st.st_mode):
            state = "a symbolic link"
        elif not stat.S_ISREG(st.st_mode):
            state = "not a regular file"
        elif st.st_size != p["bytes"]:
            state = "short" if st.st_size < p["bytes"] else "long"
        elif p["bytes"] > limit:
            state = "over the limit"
        elif hashes and sha256_file(path) != p["sha256"]:
            state = "damaged"
        else:
            state = "ok"
        out.append(PartState(p["name"], p["bytes"], p["sha256"], state))
    return out


def join(parts_dir: Path, dest: Path) -> dict:
    """Verify every part and the whole against the manifest, then unpack the archive into ``dest``.
    Returns figures (bytes, seconds). A bad part is named; nothing is unpacked then."""
    t0 = time.monotonic()
    manifest = read_manifest(parts_dir)
    bad = [s for s in check_parts(parts_dir, manifest) if s.state != "ok"]
    if bad:
        raise PartsError("; ".join(f"part {s.name} is {s.state} (expected {s.bytes} bytes, sha256 {s.sha256[:16]}…)"
                                   for s in bad))
    whole = hashlib.sha256()
    dest.mkdir(parents=True, exist_ok=True)
    # the joined archive is a new file of our own in dest (created exclusively, never an existing name or a
    # link the manifest points at): the only file this removes
    fd, tmp_name = tempfile.mkstemp(dir=dest, prefix=".join-", suffix=".tar.xz")
    archive = Path(tmp_name)
    with os.fdopen(fd, "wb") as out:
        for p in manifest["parts"]:
            with open(parts_dir / p["name"], "rb", opener=_no_follow) as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    whole.update(block)
                    out.write(block)
    if whole.hexdigest() != manifest["archive"]["sha256"]:
        archive.unlink()
        raise PartsError("the joined archive's sha256 is not the manifest's: the parts are from different builds")
    verified = time.monotonic()
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise PartsError(f"{manifest['archive']['name']} does not unpack: {e}") from None
    finally:
        archive.unlink(missing_ok=True)
    return {"archive_bytes": manifest["archive"]["bytes"], "parts": len(manifest["parts"]),
            "verify_s": round(verified - t0, 2), "unpack_s": round(time.monotonic() - verified, 2),
            "unpacked_bytes": sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())}


def _no_follow(path: str, flags: int) -> int:
    """``open``'s opener: a part swapped for a symbolic link after the check is not followed."""
    return os.open(path, flags | os.O_NOFOLLOW)


def read_wheelhouse(directory: Path) -> dict:
    """``wheelhouse.json`` of an unpacked (or built) wheelhouse."""
    path = directory / "wheelhouse.json"
    if not path.is_file():
        raise PartsError(f"{directory}: not a wheelhouse (no wheelhouse.json); build one with "
                         "'scripts/gpu-wheelhouse build' or join its parts with 'scripts/gpu-wheelhouse join'")
    return json.loads(path.read_text())


def stored_size(path: Path) -> int:
    """Bytes of a wheel's members uncompressed."""
    with zipfile.ZipFile(path) as z:
        return sum(i.file_size for i in z.infolist())


def read_member(path: Path, name: str) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(name)


def member_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return z.namelist()


__all__ = ["ARCHIVE", "MANIFEST", "MIB", "PartsError", "check_parts", "compress", "join", "read_manifest",
           "read_wheelhouse", "repack_wheel", "split", "sha256_file"]
