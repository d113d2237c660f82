"""Incremental audio encoders for streamed TTS responses.

The engine yields mono float32 audio (24 kHz, 80 ms chunks) while it generates; a response must
carry encoded bytes as soon as they exist. `StreamEncoder` turns those chunks into one of
`FORMATS` chunk by chunk, optionally time-stretched (pitch preserved) by ffmpeg's `atempo`.
Memory stays bounded: at most one codec frame of input plus atempo's small window is held, and
encoded bytes are handed back on every call.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from typing import Any, cast

import av
import av.error
import numpy as np
import soxr

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# Headerless 8-bit G.711 for telephony (Twilio, SIP): any rate, 8000 Hz in practice.
TELEPHONY_FORMATS: tuple[str, ...] = ("ulaw", "alaw")
ENCODINGS: tuple[str, ...] = FORMATS + TELEPHONY_FORMATS
CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
}
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MIN_OUT_RATE, MAX_OUT_RATE = 8000, 48000

# Bitrates for speech: transparent enough for a 24 kHz voice and cheap to stream.
MP3_BITRATE = 64_000
OPUS_BITRATE = 32_000
AAC_BITRATE = 64_000
# Ogg writes a page only when it spans this much audio (ffmpeg's default is 1 s, far too
# late for a live stream); 100 ms costs ~30 bytes of page header per page.
OGG_PAGE_DURATION_US = 100_000

# atempo accepts 0.5..100 per instance; slower speeds chain instances of 0.5.
_ATEMPO_MIN = 0.5
# AV_CODEC_CAP_SMALL_LAST_FRAME: the encoder takes a short final frame (no padding needed).
_CAP_SMALL_LAST_FRAME = 1 << 6


class _CodecSpec:
    """How one compressed format maps onto ffmpeg: muxer, encoder, sample format and options."""

    __slots__ = ("muxer", "codec", "sample_fmt", "bit_rate", "muxer_options")

    def __init__(
        self,
        muxer: str,
        codec: str,
        sample_fmt: str,
        bit_rate: int | None,
        muxer_options: dict[str, str] | None = None,
    ) -> None:
        self.muxer = muxer
        self.codec = codec
        self.sample_fmt = sample_fmt
        self.bit_rate = bit_rate
        self.muxer_options = muxer_options or {}


_CODECS: dict[str, _CodecSpec] = {
    "mp3": _CodecSpec("mp3", "libmp3lame", "fltp", MP3_BITRATE),
    "opus": _CodecSpec(
        "ogg", "libopus", "flt", OPUS_BITRATE, {"page_duration": str(OGG_PAGE_DURATION_US)}
    ),
    "aac": _CodecSpec("adts", "aac", "fltp", AAC_BITRATE),
    # The flac muxer reserves 8 KiB of PADDING for a later in-place metadata rewrite; a
    # non-seekable stream can never use it, so don't send it.
    "flac": _CodecSpec("flac", "flac", "s16", None, {"metadata_header_padding": "0"}),
    "ulaw": _CodecSpec("mulaw", "pcm_mulaw", "s16", None),
    "alaw": _CodecSpec("alaw", "pcm_alaw", "s16", None),
}


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """float32 [-1, 1] -> s16le bytes: clip to [-1, 1], multiply by 32767, round half to even (np.rint), int16
    little endian."""
    return _to_int16(np.asarray(samples, dtype=np.float32)).tobytes()


def _to_int16(samples: np.ndarray) -> np.ndarray:
    scaled = np.rint(np.clip(samples, -1.0, 1.0) * np.float32(32767.0))
    return scaled.astype("<i2")


def wav_stream_header(sample_rate: int = 24000, channels: int = 1) -> bytes:
    """44-byte RIFF/WAVE header, PCM 16-bit, with RIFF and data sizes 0xFFFFFFFF (a streaming WAV whose length is
    unknown)."""
    block_align = channels * 2
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def whole_file(fmt: str, data: bytes) -> bytes:
    """A whole reply's bytes: a WAV's streaming header given its real sizes (every other format is whole as
    it is streamed)."""
    if fmt != "wav" or len(data) < 44:
        return data
    return data[:4] + struct.pack("<I", len(data) - 8) + data[8:40] + struct.pack("<I", len(data) - 44) + data[44:]


class _ByteSink:
    """Write-only, non-seekable file object for the muxer.

    Having no seek/tell (and seekable() False) makes ffmpeg treat the output as a pipe: muxers
    then never seek back to patch bytes already sent (mp3 Xing/LAME header, FLAC STREAMINFO).
    """

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data: Any) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def take(self) -> bytes:
        """Everything written since the last take()."""
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


def _atempo_factors(speed: float) -> list[float]:
    """Split `speed` into atempo instances that each stay within atempo's 0.5..100 range."""
    if not (math.isfinite(speed) and speed > 0):  # else the loop below never ends
        raise ValueError(f"speed must be a positive finite number, got {speed!r}")
    factors: list[float] = []
    while speed < _ATEMPO_MIN:
        factors.append(_ATEMPO_MIN)
        speed /= _ATEMPO_MIN
    factors.append(speed)
    return factors


class _TimeStretch:
    """Streaming pitch-preserving tempo change: abuffer -> atempo [-> atempo] -> abuffersink."""

    def __init__(self, sample_rate: int, speed: float) -> None:
        self._rate = sample_rate
        self._pts = 0
        self._graph = av.filter.Graph()
        nodes = [
            self._graph.add_abuffer(
                sample_rate=sample_rate, format="flt", layout="mono", time_base=Fraction(1, sample_rate)
            )
        ]
        for factor in _atempo_factors(speed):
            nodes.append(self._graph.add("atempo", tempo=repr(factor)))
        nodes.append(self._graph.add("abuffersink"))
        self._graph.link_nodes(*nodes)
        self._graph.configure()

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        """Feed samples; return the stretched audio the filter has ready."""
        if samples.size == 0:
            return []
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate = self._rate
        frame.time_base = Fraction(1, self._rate)
        frame.pts = self._pts
        self._pts += samples.size
        self._graph.push(frame)
        return self._pull()

    def flush(self) -> list[np.ndarray]:
        """Signal end of input and return the filter's remaining output."""
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, EOFError):  # EAGAIN: needs more input; EOF: drained
                return out
            out.append(np.asarray(frame.to_ndarray(), dtype=np.float32).reshape(-1))


class _PcmBackend:
    """s16le PCM, optionally behind a streaming WAV header (sent with the first bytes)."""

    def __init__(self, header: bytes) -> None:
        self._header = header

    def encode(self, samples: np.ndarray) -> bytes:
        return self._take_header() + _to_int16(samples).tobytes()

    def finish(self) -> bytes:
        # Even an empty stream is a valid (empty) WAV.
        return self._take_header()

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header


class _AvBackend:
    """One ffmpeg encoder + muxer writing to a non-seekable in-memory sink."""

    def __init__(self, spec: _CodecSpec, sample_rate: int, bit_rate: int | None = None) -> None:
        codec = av.codec.Codec(spec.codec, "w")
        rates = codec.audio_rates
        if rates and sample_rate not in rates:
            raise ValueError(f"sample_rate {sample_rate} is not supported by {spec.codec} (supported: {sorted(rates)})")
        self._rate = sample_rate
        self._sample_fmt = spec.sample_fmt
        self._sink = _ByteSink()
        self._container = av.open(
            self._sink,
            "w",
            format=spec.muxer,
            # Push every packet to the sink at once instead of filling a 32 KiB AVIO buffer.
            container_options={"flush_packets": "1", **spec.muxer_options},
        )
        # an audio codec's name gives an audio stream (PyAV types add_stream by codec name only for some)
        self._stream = cast(av.AudioStream, self._container.add_stream(spec.codec, rate=sample_rate, layout="mono"))
        ctx = self._stream.codec_context
        ctx.format = spec.sample_fmt
        if bit_rate or spec.bit_rate:
            ctx.bit_rate = bit_rate or spec.bit_rate
        # Opens the encoder and writes the container header now, so the first write() already
        # returns it and even a stream with no audio is well formed.
        self._container.start_encoding()
        self._frame_size: int = ctx.frame_size  # 0: the encoder takes any frame length
        self._pad_last = bool(self._frame_size) and not (int(ctx.codec.capabilities) & _CAP_SMALL_LAST_FRAME)
        self._pending = np.zeros(0, dtype=np.float32)  # < one codec frame of input
        self._pts = 0

    def encode(self, samples: np.ndarray) -> bytes:
        if self._frame_size == 0:
            self._encode_frame(samples)
        else:
            buf = np.concatenate([self._pending, samples]) if self._pending.size else samples
            n_full = buf.size - buf.size % self._frame_size
            for start in range(0, n_full, self._frame_size):
                self._encode_frame(buf[start : start + self._frame_size])
            self._pending = buf[n_full:].copy()
        return self._sink.take()

    def finish(self) -> bytes:
        if self._pending.size:
            last = self._pending
            if self._pad_last:
                last = np.concatenate([last, np.zeros(self._frame_size - last.size, dtype=np.float32)])
            self._encode_frame(last)
            self._pending = np.zeros(0, dtype=np.float32)
        self._container.mux(self._stream.encode(None))  # drain encoder delay (lame/opus/aac lookahead)
        self._container.close()  # trailer; with a non-seekable sink nothing is rewritten
        return self._sink.take()

    def _encode_frame(self, samples: np.ndarray) -> None:
        if samples.size == 0:
            return
        if self._sample_fmt == "s16":
            data = _to_int16(samples).astype(np.int16)[None, :]
        else:
            data = np.clip(samples, -1.0, 1.0)[None, :]
        frame = av.AudioFrame.from_ndarray(data, format=self._sample_fmt, layout="mono")
        frame.sample_rate = self._rate
        frame.time_base = Fraction(1, self._rate)
        frame.pts = self._pts
        self._pts += samples.size
        self._container.mux(self._stream.encode(frame))


class StreamEncoder:
    """Encodes one response's audio incrementally.

    `write()` takes mono float samples in [-1, 1] (any chunk length) and returns the encoded
    bytes that are ready now, possibly b"" while a codec fills its frame; `close()` returns the
    rest. Concatenating every returned chunk gives one complete file/stream in `fmt`.
    `speed` != 1 time-stretches the audio (pitch preserved) before encoding. `out_rate` (default:
    `sample_rate`) resamples it with soxr's streaming resampler, whose state carries across chunks
    (no clicks at chunk edges; its few ms of filter delay come out at `close()`). `bit_rate`
    overrides the lossy codecs' default.
    """

    content_type: str

    def __init__(self, fmt: str, sample_rate: int = 24000, speed: float = 1.0, out_rate: int | None = None,
                 bit_rate: int | None = None) -> None:
        if fmt not in ENCODINGS:
            raise ValueError(f"unsupported audio format {fmt!r}; expected one of {', '.join(ENCODINGS)}")
        if out_rate is not None and (isinstance(out_rate, bool) or not isinstance(out_rate, (int, np.integer))
                                     or not MIN_OUT_RATE <= out_rate <= MAX_OUT_RATE):
            raise ValueError(f"the output sample rate must be an integer from {MIN_OUT_RATE} to {MAX_OUT_RATE}, "
                             f"got {out_rate!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer, got {sample_rate!r}")
        try:
            speed_value = float(speed)
        except (TypeError, ValueError):
            raise ValueError(f"speed must be a number, got {speed!r}") from None
        if not math.isfinite(speed_value) or not MIN_SPEED <= speed_value <= MAX_SPEED:
            raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")

        self.fmt = fmt
        self.sample_rate = int(out_rate or sample_rate)
        self.speed = speed_value
        self._resample = soxr.ResampleStream(int(sample_rate), self.sample_rate, 1, dtype="float32", quality="HQ") \
            if self.sample_rate != int(sample_rate) else None
        self.content_type = CONTENT_TYPES[fmt]
        self._closed = False
        # Exactly 1.0 bypasses the filter so pcm/wav stay bit-exact.
        self._stretch = _TimeStretch(int(sample_rate), speed_value) if speed_value != 1.0 else None
        self._backend: _PcmBackend | _AvBackend
        if fmt == "pcm":
            self._backend = _PcmBackend(b"")
        elif fmt == "wav":
            self._backend = _PcmBackend(wav_stream_header(self.sample_rate, 1))
        else:
            self._backend = _AvBackend(_CODECS[fmt], self.sample_rate, bit_rate)

    def write(self, samples: np.ndarray) -> bytes:
        """Encode a chunk of mono float samples; return the encoded bytes ready now (may be b"").

        Raises ValueError for input that is not 1-D, contains NaN/inf, or after close().
        """
        if self._closed:
            raise ValueError("write() on a closed StreamEncoder")
        try:
            x = np.asarray(samples, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"samples must be convertible to float32: {exc}") from None
        if x.ndim != 1:
            raise ValueError(f"samples must be 1-D (mono), got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("samples contain NaN or infinite values")
        x = np.ascontiguousarray(x)
        parts = [x] if self._stretch is None else self._stretch.push(x)
        return b"".join(self._backend.encode(self._resampled(part)) for part in parts)

    def _resampled(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        if self._resample is None:
            return samples
        return self._resample.resample_chunk(samples, last=last)

    def close(self) -> bytes:
        """Flush the time-stretch filter and the encoder, write any trailer; return the last bytes.

        Idempotent: a second call returns b"".
        """
        if self._closed:
            return b""
        self._closed = True
        out: list[bytes] = []
        if self._stretch is not None:
            out.extend(self._backend.encode(self._resampled(part)) for part in self._stretch.flush())
        if self._resample is not None:
            out.append(self._backend.encode(self._resampled(np.zeros(0, np.float32), last=True)))
        out.append(self._backend.finish())
        return b"".join(out)
