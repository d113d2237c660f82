"""Audio files: reading any format soundfile reads, and writing with the format chosen by the file's
extension — checked before any work, so a bad output path never costs a whole synthesis."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from engine.errors import InputError, UnreadableAudioError

# extension -> soundfile format; only those libsndfile can write here are offered (see writable_formats)
_EXTENSIONS = {"wav": "WAV", "flac": "FLAC", "ogg": "OGG", "oga": "OGG", "mp3": "MP3", "aiff": "AIFF",
               "aif": "AIFF", "au": "AU", "caf": "CAF", "w64": "W64", "rf64": "RF64"}
_FLOAT_FORMATS = {"WAV", "AIFF", "AU", "CAF", "W64", "RF64"}   # exact 32-bit float samples


@dataclass(frozen=True)
class AudioTarget:
    path: Path
    format: str
    subtype: str


def writable_formats() -> list[str]:
    available = sf.available_formats()
    return sorted(ext for ext, fmt in _EXTENSIONS.items() if fmt in available)


def check_writable_file(path: str | Path, what: str = "output") -> Path:
    """The parent directory exists and accepts a new file there; ``path`` is not a directory."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {p} is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{what} {p}: the directory {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".mossrt-check-"):
            pass
    except OSError as e:
        raise InputError(f"{what} {p}: cannot write in {parent} ({e.strerror or e})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError(f"{what} {p} exists and is not writable")
    return p


def audio_target(path: str | Path, pcm16: bool = False) -> AudioTarget:
    """Format and sample type for an output file, from its extension: 32-bit float where the format has
    it (16-bit PCM with ``pcm16``), 24-bit FLAC, Vorbis in Ogg, MPEG layer III in .mp3."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"output {p} is a directory")
    ext = p.suffix.lower().lstrip(".")
    formats = writable_formats()
    if not ext:
        raise InputError(f"cannot tell the audio format of {p}: give it an extension ({', '.join(formats)})")
    if ext not in formats:
        raise InputError(f"cannot write .{ext} audio ({p}); supported: {', '.join(formats)}")
    fmt = _EXTENSIONS[ext]
    if fmt in _FLOAT_FORMATS:
        subtype = "PCM_16" if pcm16 else "FLOAT"
    elif fmt == "FLAC":
        subtype = "PCM_16" if pcm16 else "PCM_24"
    else:
        subtype = sf.default_subtype(fmt)
    check_writable_file(p)
    return AudioTarget(p, fmt, subtype)


def write_audio(target: AudioTarget | str | Path, wav: np.ndarray, sample_rate: int, pcm16: bool = False) -> Path:
    """Write mono samples; integer and lossy formats get the samples clipped to [-1, 1]."""
    if not isinstance(target, AudioTarget):
        target = audio_target(target, pcm16)
    data = np.asarray(wav, dtype=np.float32)
    if target.subtype != "FLOAT":
        data = np.clip(data, -1.0, 1.0)
    try:
        sf.write(str(target.path), data, sample_rate, format=target.format, subtype=target.subtype)
    except (sf.LibsndfileError, OSError, RuntimeError, TypeError) as e:
        raise InputError(f"{target.path}: cannot write the audio file ({e})") from None
    return target.path


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file with soundfile; unreadable or empty files raise InputError."""
    try:
        wav, sr = sf.read(str(path), dtype="float32", always_2d=False)
    except Exception as e:  # soundfile raises several types (LibsndfileError, RuntimeError, TypeError)
        raise UnreadableAudioError(f"{path}: not a readable audio file ({str(e)[:200]})") from None
    if wav.size == 0:
        raise InputError(f"{path}: the audio file holds no samples")
    return wav, int(sr)
