"""Voice references: reading reference audio within limits and resolving a voice to prompt codes (the one
place that does it). The service's named voices on disk are ``app/voices.py``.

Length and sample-rate limits are checked from the audio header (or the code count) before any sample
is decoded or encoded, so an hour-long upload costs nothing.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import soundfile as sf

from engine.audio.codec import Codec
from engine.errors import InputError, UnreadableAudioError
from engine.limits import Limits

Source = str | Path | bytes


class _Layout(Protocol):
    @property
    def codebooks(self) -> int: ...


class _Prompt(Protocol):
    def check_codes(self, codes: npt.ArrayLike, what: str = ...) -> npt.NDArray[np.int64]: ...


class VoiceModel(Protocol):
    """What :func:`resolve_voice` needs of the model (``engine.model.tts.TTSModel``, a package above this
    one): its codec, how many codebooks a prompt row holds, and the prompt's code check."""

    @property
    def codec(self) -> Codec: ...
    @property
    def layout(self) -> _Layout: ...
    @property
    def prompt(self) -> _Prompt: ...


def _info(source: Source, what: str) -> sf._SoundFileInfo:
    try:
        return sf.info(io.BytesIO(source) if isinstance(source, bytes) else str(source))
    except Exception as e:  # soundfile raises LibsndfileError, RuntimeError, TypeError...
        name = "the upload" if isinstance(source, bytes) else str(source)
        raise UnreadableAudioError(f"{what}: {name} is not a readable audio file ({str(e)[:200]})") from None


DECODE_BLOCK_SAMPLES = 1 << 20    # samples (all channels) decoded at a time: 4 MiB of float32


def read_reference_audio(source: Source, limits: Limits, what: str = "voice reference",
                         user_audio: bool = False) -> tuple[np.ndarray, int]:
    """Read reference audio (a path or the file's bytes) as mono float32 samples (channels averaged, as
    the codec does) and its rate, after checking its duration, sample rate and decoded size (channels x
    frames) from the header against ``limits``. Decodes in blocks of at most ``DECODE_BLOCK_SAMPLES``,
    mixing each to mono, so memory is the mono result plus one block, whatever the channel count."""
    info = _info(source, what)
    rate = int(info.samplerate)
    limits.check_sample_rate(rate, what)
    if info.frames <= 0:
        raise InputError(f"{what}: the audio file holds no samples")
    limits.check_audio_seconds(info.frames / rate, what, user_audio=user_audio)
    limits.check_decoded_samples(info.channels, info.frames, what, user_audio=user_audio)
    mono = np.empty(info.frames, np.float32)
    buffer = np.empty((max(1, DECODE_BLOCK_SAMPLES // info.channels), info.channels), np.float32)
    n = 0
    try:
        with sf.SoundFile(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as f:
            for block in f.blocks(out=buffer):      # views of ``buffer``: no copy per block
                if n + len(block) > mono.size:      # the header lied: never decode more than it declared
                    raise InputError(f"{what}: the audio holds more samples than its header declares")
                np.mean(block, axis=1, out=mono[n:n + len(block)])
                n += len(block)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{what}: the audio could not be decoded ({str(e)[:200]})") from None
    if n == 0:
        raise InputError(f"{what}: the audio file holds no samples")
    return mono[:n], rate


def resolve_voice(model: VoiceModel, limits: Limits, wav: tuple[npt.ArrayLike, int] | None = None,
                  codes: npt.ArrayLike | None = None, what: str = "voice reference",
                  user_audio: bool = False) -> npt.NDArray[np.int64] | None:
    """A reference as ``[frames, 16]`` prompt codes: from samples ``(wav, sample_rate)`` (encoded by the
    bundle's codec: every ``ceil(N/1920)`` frame, first 16 levels, as upstream) or from codes
    ``[frames, K >= 16]`` (validated). Lengths are checked against ``limits`` before encoding."""
    if wav is not None and codes is not None:
        raise InputError(f"give the {what} as audio or as codes, not both")
    codec = model.codec
    if wav is not None:
        raw, rate = wav
        samples = np.asarray(raw)
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
