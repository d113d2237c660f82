"""Audio uploads (voice samples, user audio) in any common format, decoded within the length limits.

soundfile reads WAV/FLAC/Ogg/MP3 from their headers; other containers (WebM, MP4/M4A, AAC) go through
PyAV, whose decoding stops as soon as the audio passes the limit, so a long upload costs nothing.
"""

from __future__ import annotations

import io

import av
import numpy as np

from engine.audio.voices import read_reference_audio
from engine.errors import InputError, UnreadableAudioError
from engine.limits import Limits


def decode_upload(data: bytes, limits: Limits, what: str = "audio_sample", user_audio: bool = False) \
        -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate, after the limit checks (duration, rate, decoded size)."""
    if not data:
        raise InputError(f"{what} is empty")
    try:
        return read_reference_audio(data, limits, what, user_audio=user_audio)
    except UnreadableAudioError:       # not for soundfile (mp3 in old libsndfile, aac, opus in mp4...): PyAV
        return _decode_with_av(data, limits, what, user_audio)


def _decode_with_av(data: bytes, limits: Limits, what: str, user_audio: bool) -> tuple[np.ndarray, int]:
    """Frame by frame, each mixed to mono at once; the decoded size (channels x frames) is checked from the
    container's header and counted as it decodes, so a file of many channels never costs more than a frame."""
    limit = limits.max_user_audio_seconds if user_audio else limits.max_voice_seconds
    max_decoded = limits.max_decoded_samples(user_audio)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise InputError(f"{what}: the file holds no audio stream")
            stream = streams[0]
            rate = int(stream.codec_context.sample_rate or 0)
            limits.check_sample_rate(rate, what)
            channels = int(stream.codec_context.channels or 1)
            if container.duration is not None:
                seconds = container.duration / av.time_base
                limits.check_audio_seconds(seconds, what, user_audio=user_audio)
                limits.check_decoded_samples(channels, int(seconds * rate), what, user_audio=user_audio)
            parts, total, decoded = [], 0, 0
            for frame in container.decode(stream):
                frame_channels = len(frame.layout.channels)
                decoded += frame.samples * frame_channels
                if decoded > max_decoded:         # a header without a duration, or one that lied
                    limits.check_decoded_samples(frame_channels, decoded // frame_channels, what, user_audio=user_audio)
                chunk: np.ndarray = frame.to_ndarray()         # [channels, samples] (planar) or [1, samples*ch]
                if frame.format.is_planar:
                    mono = chunk.astype(np.float32).mean(axis=0)
                else:
                    mono = chunk.reshape(-1, len(frame.layout.channels)).astype(np.float32).mean(axis=1)
                if np.issubdtype(chunk.dtype, np.integer):
                    mono /= float(np.iinfo(chunk.dtype).max) + 1.0
                parts.append(mono)
                total += mono.size
                if total > (limit + 1) * rate:
                    break                                      # over the limit: stop decoding now
    except InputError:
        raise
    except Exception as e:  # PyAV raises its own error types for unreadable data
        raise InputError(f"{what}: not a readable audio file ({str(e)[:200]})") from None
    if not parts or total == 0:
        raise InputError(f"{what}: the file holds no samples")
    limits.check_audio_seconds(total / rate, what, user_audio=user_audio)
    return np.concatenate(parts), rate
