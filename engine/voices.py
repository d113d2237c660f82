"""Voice references: reading reference audio within limits, resolving a voice to prompt codes (the one
place that does it), and the on-disk registry of named voices the service offers.

Length and sample-rate limits are checked from the audio header (or the code count) before any sample
is decoded or encoded, so an hour-long upload costs nothing.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import re
import secrets
import shutil
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from .errors import InputError, UnreadableAudioError, VoiceExistsError
from .limits import Limits

Source = str | Path | bytes


def _info(source: Source, what: str) -> sf._SoundFileInfo:
    try:
        return sf.info(io.BytesIO(source) if isinstance(source, bytes) else str(source))
    except Exception as e:  # soundfile raises LibsndfileError, RuntimeError, TypeError...
        name = "the upload" if isinstance(source, bytes) else str(source)
        raise UnreadableAudioError(f"{what}: {name} is not a readable audio file ({str(e)[:200]})") from None


def read_reference_audio(source: Source, limits: Limits, what: str = "voice reference",
                         user_audio: bool = False) -> tuple[np.ndarray, int]:
    """Read reference audio (a path or the file's bytes) as float32 samples and its rate, after checking
    its duration and sample rate from the header against ``limits``."""
    info = _info(source, what)
    limits.check_sample_rate(int(info.samplerate), what)
    if info.frames <= 0:
        raise InputError(f"{what}: the audio file holds no samples")
    limits.check_audio_seconds(info.frames / info.samplerate, what, user_audio=user_audio)
    try:
        wav, sr = sf.read(io.BytesIO(source) if isinstance(source, bytes) else str(source), dtype="float32",
                          always_2d=False)
    except Exception as e:
        raise InputError(f"{what}: the audio could not be decoded ({str(e)[:200]})") from None
    if wav.size == 0:
        raise InputError(f"{what}: the audio file holds no samples")
    return wav, int(sr)


def resolve_voice(model, limits: Limits, wav: tuple[np.ndarray, int] | None = None, codes=None,
                  what: str = "voice reference", user_audio: bool = False) -> np.ndarray | None:
    """A reference as ``[frames, 16]`` prompt codes: from samples ``(wav, sample_rate)`` (encoded by the
    bundle's codec: every ``ceil(N/1920)`` frame, first 16 levels, as upstream) or from codes
    ``[frames, K >= 16]`` (validated). Lengths are checked against ``limits`` before encoding."""
    if wav is not None and codes is not None:
        raise InputError(f"give the {what} as audio or as codes, not both")
    codec = model.codec
    if wav is not None:
        samples, rate = wav
        samples = np.asarray(samples)
        if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool):
            raise InputError(f"{what}: invalid sample rate {rate!r}")
        limits.check_sample_rate(int(rate), what)
        n = samples.shape[0] if samples.ndim else 0
        limits.check_audio_seconds(n / int(rate), what, user_audio=user_audio)
        return codec.encode(samples, int(rate))[:, : model.layout.codebooks]
    if codes is not None:
        checked = model.prompt.check_codes(codes, f"{what} codes")
        limits.check_audio_seconds(len(checked) * codec.samples_per_frame / codec.sample_rate, what,
                                   user_audio=user_audio)
        return checked
    return None


# ---------------------------------------------------------------------------------------------- registry
VOICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.\-]{0,63}$"
_NAME = re.compile(VOICE_NAME_PATTERN)


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

    Names are restricted to letters, digits, space, ``_.-`` (64 characters): they never become paths;
    ids are generated (``voice_<hex>``). Codes depend on the codec, so a voice remembers the bundle that
    encoded it and is refused by another bundle.
    """

    def __init__(self, directory: str | Path, bundle_identity: str):
        self.dir = Path(directory)
        self.bundle_identity = bundle_identity
        self._lock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"voices directory {self.dir}: {e}") from None

    @staticmethod
    def check_name(name) -> str:
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError("voice name must be 1-64 characters: letters, digits, space, '_', '.', '-' "
                             "(starting with a letter or digit)")
        return name

    def _records(self) -> list[VoiceRecord]:
        out = []
        for meta in sorted(self.dir.glob("voice_*/meta.json")):
            try:
                out.append(VoiceRecord(**json.loads(meta.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError):
                continue   # a damaged entry is skipped, never fatal
        return sorted(out, key=lambda r: (r.created_at, r.id))

    def list(self) -> list[VoiceRecord]:
        with self._lock:
            return self._records()

    def find(self, key: str) -> VoiceRecord | None:
        """A voice by id or by name."""
        if not isinstance(key, str):
            return None
        with self._lock:
            for rec in self._records():
                if key in (rec.id, rec.name):
                    return rec
        return None

    def add(self, name: str, codes: np.ndarray) -> VoiceRecord:
        self.check_name(name)
        codes = np.ascontiguousarray(codes, dtype=np.int64)
        with self._lock:
            if any(r.name == name for r in self._records()):
                raise VoiceExistsError(f"a voice named {name!r} already exists; delete it first or pick another name")
            vid = "voice_" + secrets.token_hex(8)
            rec = VoiceRecord(id=vid, name=name, created_at=int(_dt.datetime.now(_dt.timezone.utc).timestamp()),
                              frames=int(codes.shape[0]), bundle=self.bundle_identity)
            tmp = self.dir / f".{vid}.tmp"
            tmp.mkdir()
            np.save(tmp / "codes.npy", codes)
            (tmp / "meta.json").write_text(json.dumps(asdict(rec)), encoding="utf-8")
            os.replace(tmp, self.dir / vid)       # atomic: a crash never leaves a half-written voice
            return rec

    def codes(self, rec: VoiceRecord) -> np.ndarray:
        if rec.bundle != self.bundle_identity:
            raise InputError(f"voice {rec.name!r} was encoded by another bundle's codec; register it again")
        try:
            return np.load(self.dir / rec.id / "codes.npy", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(f"voice {rec.name!r} is damaged on disk ({e}); register it again") from None

    def _prefix_path(self, rec: VoiceRecord) -> Path:
        return self.dir / rec.id / f"prefix-kv-{self.bundle_identity}.npy"

    def save_prefix(self, rec: VoiceRecord, kv: np.ndarray) -> None:
        """Keep the voice's prefix KV (system block + assistant header) beside it (keyed by the bundle: another bundle never reads it)."""
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
        rec = self.find(key)
        if rec is None:
            return None
        with self._lock:
            shutil.rmtree(self.dir / rec.id, ignore_errors=True)
        return rec
