"""The service's named voices on disk: a registry of prompt codes by name and id, shared by every process
that serves the same folder (the HTTP service, the LocalAI backend, a second replica)."""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.errors import InputError, VoiceExistsError, VoiceGoneError, VoiceLimitError

VOICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.\-]{0,63}$"
_NAME = re.compile(VOICE_NAME_PATTERN)
# a folder ``.voice_<hex>.tmp`` (a write) or ``.voice_<hex>.deleted`` (a delete) this much older than the start
# and locked by no process (where the filesystem has locks) is what a killed process left: removed at start
ABANDONED_AFTER_S = 60.0


def _write_synced(path: Path, write) -> None:
    """A new file written by ``write(file)``, on disk (fsync) before this returns."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _open_dir(path: Path, follow: bool = False) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW))


def _lock(fd: int, wait: bool = True) -> bool:
    """An exclusive flock on ``fd``: False when another process holds it (``wait=False``). A filesystem
    without locks (some network ones) counts as locked by us: the age of a leftover decides alone there."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def _sync_dir(path: Path) -> None:
    """A folder's entries on disk (best effort: some filesystems cannot sync a folder)."""
    try:
        fd = _open_dir(path, follow=True)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class VoiceRecord:
    id: str
    name: str
    created_at: int          # unix seconds
    frames: int
    bundle: str              # identity of the bundle whose codec encoded it

    def public(self) -> dict:
        """OpenAI's voice object."""
        return {"object": "audio.voice", "id": self.id, "name": self.name, "created_at": self.created_at}


class VoiceRegistry:
    """Named voices on disk: ``<dir>/<id>/codes.npy`` ([frames, 16] int64) and ``meta.json``. Thread-safe.

    A voice appears whole or not at all: its files are written and synced in a temp folder (locked while
    written) that is then renamed into place, and a delete renames it away before removing it; what a
    killed process leaves (temp folders, a prefix's temp file) is removed at start, never listed.

    Names are restricted to letters, digits, space, ``_.-`` (64 characters): they never become paths;
    ids are generated (``voice_<hex>``). Codes depend on the codec, so a voice remembers the bundle that
    encoded it and is refused by another bundle.

    Lookups use an in-memory index (id -> record, name -> id) built from the directory at start: O(1),
    no disk. Another process sharing the directory (a LocalAI backend, a second replica) is seen too: a
    lookup that misses rebuilds the index when the directory's modification time changed since the last
    build. At most ``max_voices`` voices (None: no limit); ``add`` raises VoiceLimitError beyond.
    """

    def __init__(self, directory: str | Path, bundle_identity: str, max_voices: int | None = None):
        self.dir = Path(directory)
        self.bundle_identity = bundle_identity
        self.max_voices = max_voices
        self._lock = threading.Lock()
        self._by_id: dict[str, VoiceRecord] = {}
        self._by_name: dict[str, str] = {}
        self._scanned_mtime: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"voices directory {self.dir}: {e}") from None
        with self._lock:
            self._sweep()
            self._rebuild()

    @staticmethod
    def check_name(name) -> str:
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError("voice name must be 1-64 characters: letters, digits, space, '_', '.', '-' "
                             "(starting with a letter or digit)")
        return name

    # ------------------------------------------------------------------ the index (callers hold the lock)
    def _dir_mtime(self) -> int | None:
        try:
            return self.dir.stat().st_mtime_ns
        except OSError:
            return None

    def _rebuild(self) -> None:
        """The index from the directory (the one place that reads every ``meta.json``)."""
        self._scanned_mtime = self._dir_mtime()
        found = []
        for meta in self.dir.glob("voice_*/meta.json"):
            try:
                # written once, before its folder is renamed into place: its time orders voices made within
                # one second (created_at's resolution) as they were made
                found.append((VoiceRecord(**json.loads(meta.read_text(encoding="utf-8"))), meta.stat().st_mtime_ns))
            except (OSError, ValueError, TypeError):
                continue   # a damaged entry is skipped, never fatal
        found.sort(key=lambda x: (x[0].created_at, x[1], x[0].id))
        records = [r for r, _ in found]
        self._by_id = {r.id: r for r in records}
        self._by_name = {}
        for r in records:
            self._by_name.setdefault(r.name, r.id)     # the oldest of a (hand-made) duplicate name wins

    def _sweep(self) -> None:
        """Remove what a killed process left: a write's temp folder (never renamed, so never a voice), a
        delete's, and prefix temp files. A folder another process is still writing is locked and left alone."""
        now = time.time()
        for leftover in self.dir.glob(".voice_*"):
            try:
                if leftover.is_symlink() or not leftover.is_dir() or now - leftover.stat().st_mtime < ABANDONED_AFTER_S:
                    continue
                fd = _open_dir(leftover)
            except OSError:
                continue
            try:
                if _lock(fd, wait=False):                # else a write in progress in another process
                    shutil.rmtree(leftover, ignore_errors=True)
            finally:
                os.close(fd)
        for tmp in self.dir.glob("voice_*/prefix-kv-*.tmp.npy"):   # a cache: its writer tolerates the loss
            try:
                if now - tmp.stat().st_mtime >= ABANDONED_AFTER_S:
                    tmp.unlink()
            except OSError:
                continue

    def _lookup(self, key: str) -> VoiceRecord | None:
        rec = self._by_id.get(key)
        return rec if rec is not None else self._by_id.get(self._by_name.get(key, ""))

    def _insert(self, rec: VoiceRecord) -> None:
        self._by_id[rec.id] = rec
        self._by_name.setdefault(rec.name, rec.id)
        self._stale_after_own_change()

    def _remove(self, rec: VoiceRecord) -> None:
        self._by_id.pop(rec.id, None)
        if self._by_name.get(rec.name) == rec.id:
            del self._by_name[rec.name]
        self._stale_after_own_change()

    def _stale_after_own_change(self) -> None:
        # the next lookup rebuilds: the folder's time read after our change would hide another process's
        # change made between our last build and it (API workers add voices concurrently)
        self._scanned_mtime = None

    def _refresh_if_changed(self) -> bool:
        """Rebuild when another process changed the directory since the last build; whether it did."""
        if self._dir_mtime() == self._scanned_mtime:
            return False
        self._rebuild()
        return True

    # ------------------------------------------------------------------ public
    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def list(self) -> list[VoiceRecord]:
        with self._lock:
            self._refresh_if_changed()
            return list(self._by_id.values())

    def find(self, key: str) -> VoiceRecord | None:
        """A voice by id or by name."""
        if not isinstance(key, str):
            return None
        with self._lock:
            rec = self._lookup(key)
            if rec is None and self._refresh_if_changed():
                rec = self._lookup(key)
            return rec

    def check_room(self) -> None:
        """VoiceLimitError when the registry is full (checked again, under the lock, by ``add``)."""
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:
        if self.max_voices is not None and len(self._by_id) >= self.max_voices:
            raise VoiceLimitError(f"the server holds its limit of {self.max_voices} voices; delete one first")

    def add(self, name: str, codes: np.ndarray) -> VoiceRecord:
        self.check_name(name)
        codes = np.ascontiguousarray(codes, dtype=np.int64)
        with self._lock:
            self._refresh_if_changed()
            if name in self._by_name:
                raise VoiceExistsError(f"a voice named {name!r} already exists; delete it first or pick another name")
            self._check_room()
            vid = "voice_" + secrets.token_hex(8)
            rec = VoiceRecord(id=vid, name=name, created_at=int(_dt.datetime.now(_dt.timezone.utc).timestamp()),
                              frames=int(codes.shape[0]), bundle=self.bundle_identity)
            tmp = self.dir / f".{vid}.tmp"
            tmp.mkdir()
            fd = _open_dir(tmp)
            try:
                _lock(fd)                                 # while written: another process's start leaves it
                _write_synced(tmp / "codes.npy", lambda f: np.save(f, codes))
                _write_synced(tmp / "meta.json", lambda f: f.write(json.dumps(asdict(rec)).encode()))
                _sync_dir(tmp)
                os.replace(tmp, self.dir / vid)       # atomic: a crash never leaves a half-written voice
                _sync_dir(self.dir)                   # the rename itself on disk
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                os.close(fd)
            self._insert(rec)
            return rec

    def codes(self, rec: VoiceRecord) -> np.ndarray:
        if rec.bundle != self.bundle_identity:
            raise InputError(f"voice {rec.name!r} was encoded by another bundle's codec; register it again")
        try:
            return np.load(self.dir / rec.id / "codes.npy", allow_pickle=False)
        except FileNotFoundError:
            if not (self.dir / rec.id).is_dir():         # deleted since it was looked up
                raise VoiceGoneError(f"voice {rec.name!r} was deleted") from None
            raise InputError(f"voice {rec.name!r} is damaged on disk (no codes); register it again") from None
        except (OSError, ValueError) as e:
            raise InputError(f"voice {rec.name!r} is damaged on disk ({e}); register it again") from None

    def _prefix_path(self, rec: VoiceRecord) -> Path:
        return self.dir / rec.id / f"prefix-kv-{self.bundle_identity}.npy"

    def save_prefix(self, rec: VoiceRecord, kv: np.ndarray) -> None:
        """Keep the voice's prefix KV (system block + assistant header) beside it (keyed by the bundle: another
        bundle never reads it)."""
        path = self._prefix_path(rec)
        tmp = path.with_suffix(".tmp.npy")
        try:
            np.save(tmp, kv)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)   # a cache: failing to persist it only costs a recomputation

    def load_prefix(self, rec: VoiceRecord, dtype: np.dtype) -> np.ndarray | None:
        """The persisted prefix KV if it is of ``dtype`` (the bundle's compute dtype), else None (recompute).
        numpy saves bfloat16 as raw 2-byte voids: those are read back as ``dtype`` when the sizes agree."""
        try:
            kv = np.load(self._prefix_path(rec), allow_pickle=False)
        except (OSError, ValueError):
            return None
        dtype = np.dtype(dtype)
        if kv.dtype.kind == "V" and kv.dtype.itemsize == dtype.itemsize and dtype.kind == "V":
            kv = kv.view(dtype)
        return kv if kv.dtype == dtype else None

    def delete(self, key: str) -> VoiceRecord | None:
        """The voice deleted (None: no such voice, or another request deleted it first). Its folder is
        renamed away first (atomic: a reader gets the whole voice or VoiceGoneError), then removed."""
        rec = self.find(key)
        if rec is None:
            return None
        with self._lock:
            if rec.id not in self._by_id:                # deleted meanwhile: one delete reports it
                return None
            trash = self.dir / f".{rec.id}.deleted"
            try:
                os.replace(self.dir / rec.id, trash)
            except FileNotFoundError:                  # deleted by another process sharing the folder
                self._remove(rec)
                return None
            shutil.rmtree(trash, ignore_errors=True)
            self._remove(rec)
        return rec
