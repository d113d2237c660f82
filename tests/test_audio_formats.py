"""Streaming audio encoders: every format decodes, streams before close, and honours speed."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest
import soundfile as sf

from app.audio_formats import (
    CONTENT_TYPES,
    ENCODINGS,
    FORMATS,
    StreamEncoder,
    float_to_pcm16,
    wav_stream_header,
)

SR = 24000
CHUNK = 1920  # the engine's 80 ms chunk
TONE_HZ = 440.0
COMPRESSED = ("mp3", "opus", "aac", "flac")
# Decoded length may exceed the input by up to one codec frame plus the encoder delay the
# container does not trim (samples at 24 kHz): lame 576-sample frames + ~1105 delay, AAC
# 1024-sample frames + 1024 priming (ADTS has no gapless info); Ogg trims Opus pre-skip and
# end padding itself; flac/wav/pcm are exact.
CODEC_SLACK = {"mp3": 576 + 1152, "aac": 1024 + 1024, "opus": 480, "flac": 0, "wav": 0, "pcm": 0}


def _signal(seconds: float = 2.5) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (0.5 * np.sin(2 * np.pi * TONE_HZ * t) + 0.01 * noise).astype(np.float32)


def _encode(fmt: str, x: np.ndarray, speed: float = 1.0, sizes: list[int] | None = None) -> tuple[list[bytes], bytes]:
    """Feed `x` in CHUNK-sized pieces (or the given sizes, cycled); return per-write bytes and close()'s."""
    enc = StreamEncoder(fmt, SR, speed)
    outs: list[bytes] = []
    i, k = 0, 0
    while i < x.size:
        n = sizes[k % len(sizes)] if sizes else CHUNK
        outs.append(enc.write(x[i : i + n]))
        i += n
        k += 1
    return outs, enc.close()


def _decode(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    """Decode with a standard decoder to (mono float64 samples, sample rate)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2") / 32767.0, SR
    if fmt == "wav":
        y, rate = sf.read(io.BytesIO(data), dtype="float64")
        assert y.ndim == 1
        return y, rate
    parts: list[np.ndarray] = []
    rate = 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            assert frame.layout.nb_channels == 1
            rate = frame.sample_rate
            a = frame.to_ndarray().reshape(-1).astype(np.float64)
            parts.append(a / 32768.0 if frame.format.name.startswith("s16") else a)
    return (np.concatenate(parts) if parts else np.zeros(0)), rate


def _dominant_hz(y: np.ndarray, rate: int) -> float:
    y = y[int(0.1 * rate) : y.size - int(0.1 * rate)]  # skip codec/filter edges
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    return float(np.argmax(spectrum)) * rate / y.size


def test_float_to_pcm16_clips_scales_rounds_little_endian() -> None:
    x = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5, 1e-6], dtype=np.float32)
    got = np.frombuffer(float_to_pcm16(x), "<i2")
    # 0.5 * 32767 = 16383.5 rounds to the even 16384 (truncation would give 16383).
    assert got.tolist() == [0, 32767, -32767, 32767, -32767, 16384, -16384, 0]
    assert float_to_pcm16(np.array([1.0], dtype=np.float32)) == b"\xff\x7f"
    r = np.random.default_rng(1).uniform(-1.2, 1.2, 1000).astype(np.float32)
    ref = np.rint(np.clip(r, -1, 1) * np.float32(32767)).astype("<i2").tobytes()
    assert float_to_pcm16(r) == ref


def test_wav_stream_header_bytes() -> None:
    assert wav_stream_header() == (
        b"RIFF\xff\xff\xff\xffWAVEfmt "
        b"\x10\x00\x00\x00"  # fmt chunk size 16
        b"\x01\x00\x01\x00"  # PCM, 1 channel
        b"\xc0\x5d\x00\x00"  # 24000 Hz
        b"\x80\xbb\x00\x00"  # 48000 bytes/s
        b"\x02\x00\x10\x00"  # block align 2, 16 bits
        b"data\xff\xff\xff\xff"
    )
    h = wav_stream_header(16000, 2)
    assert len(h) == 44
    assert struct.unpack("<HHIIHH", h[20:36]) == (1, 2, 16000, 64000, 4, 16)


def test_formats_and_content_types() -> None:
    assert FORMATS == ("mp3", "opus", "aac", "flac", "wav", "pcm")
    assert set(CONTENT_TYPES) == set(ENCODINGS) == set(FORMATS) | {"ulaw", "alaw"}
    for fmt in ENCODINGS:
        enc = StreamEncoder(fmt)
        assert enc.content_type == CONTENT_TYPES[fmt]
        enc.close()


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_pcm_and_wav_are_exact_at_speed_1(fmt: str) -> None:
    x = _signal(1.0)
    outs, last = _encode(fmt, x, sizes=[0, 1, 7, CHUNK, 3001])  # odd and empty chunks too
    data = b"".join(outs) + last
    header = wav_stream_header() if fmt == "wav" else b""
    assert data == header + float_to_pcm16(x)
    if fmt == "wav":
        assert outs[0] == header  # the header comes with the first write, even an empty one
        y, rate = sf.read(io.BytesIO(data), dtype="int16")  # sizes 0xFFFFFFFF: read to EOF
        assert rate == SR and np.array_equal(y, np.frombuffer(float_to_pcm16(x), "<i2"))


def test_flac_is_lossless_s16() -> None:
    x = _signal(1.0)
    outs, last = _encode("flac", x)
    with av.open(io.BytesIO(b"".join(outs) + last)) as container:
        y = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert np.array_equal(y, np.frombuffer(float_to_pcm16(x), "<i2"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_to_input_duration(fmt: str) -> None:
    x = _signal()
    outs, last = _encode(fmt, x)
    y, rate = _decode(fmt, b"".join(outs) + last)
    assert rate == SR or (fmt == "opus" and rate == 48000)  # Opus decoders may run at 48 kHz
    excess = y.size / rate - x.size / SR
    assert -1 / SR < excess <= CODEC_SLACK[fmt] / SR, excess
    assert abs(_dominant_hz(y, rate) - TONE_HZ) < 0.03 * TONE_HZ


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_stream_before_close(fmt: str) -> None:
    x = _signal()
    outs, last = _encode(fmt, x)
    first_400ms = b"".join(outs[:5])  # 5 chunks of 80 ms
    y, rate = _decode(fmt, first_400ms)
    assert y.size / rate >= 0.2  # real audio, not just a header, is already out
    total = sum(map(len, outs)) + len(last)
    assert len(last) <= 0.1 * total  # close() only drains codec delay, nothing was held back


def test_muxers_never_patch_bytes_already_sent() -> None:
    # On a seekable sink the mp3 muxer writes a Xing/Info frame it patches at the end, and the
    # flac muxer rewrites STREAMINFO at the end; streamed, those rewrites would land as junk
    # after the audio (and the placeholder Xing frame would carry bogus counts).
    x = _signal(1.0)
    outs, last = _encode("mp3", x)
    mp3 = b"".join(outs) + last
    assert b"Xing" not in mp3 and b"Info" not in mp3
    outs, last = _encode("flac", x)
    flac = b"".join(outs) + last
    assert flac[:4] == b"fLaC" and flac[4] & 0x7F == 0  # first metadata block: STREAMINFO
    rate_channels_bits = flac[8 + 10 : 8 + 14]  # STREAMINFO bytes 10..13
    assert flac.count(rate_channels_bits) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunking_does_not_change_audio(fmt: str) -> None:
    x = _signal(1.0)
    ref_outs, ref_last = _encode(fmt, x)
    ref = _decode(fmt, b"".join(ref_outs) + ref_last)
    outs, last = _encode(fmt, x, sizes=[0, 1, 7, 480, 3001, 0, 5000])
    got = _decode(fmt, b"".join(outs) + last)
    assert got[1] == ref[1] and np.array_equal(got[0], ref[0])


@pytest.mark.parametrize("speed", [0.5, 2.0, 0.25])
@pytest.mark.parametrize("fmt", FORMATS)
def test_speed_stretches_time_and_keeps_pitch(fmt: str, speed: float) -> None:
    x = _signal()
    outs, last = _encode(fmt, x, speed=speed)
    y, rate = _decode(fmt, b"".join(outs) + last)
    expected = x.size / SR / speed
    assert abs(y.size / rate - expected) <= 0.05 * expected + CODEC_SLACK[fmt] / SR
    assert abs(_dominant_hz(y, rate) - TONE_HZ) < 0.03 * TONE_HZ


@pytest.mark.parametrize("fmt", ["x", "ogg", "MP3", ""])
def test_bad_format(fmt: str) -> None:
    with pytest.raises(ValueError, match=repr(fmt)):
        StreamEncoder(fmt)


@pytest.mark.parametrize("speed", [0, 5, float("nan"), float("inf"), 0.2, "fast"])
def test_bad_speed(speed: object) -> None:
    with pytest.raises(ValueError, match="speed"):
        StreamEncoder("mp3", speed=speed)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_samples(bad: float) -> None:
    enc = StreamEncoder("pcm")
    x = np.zeros(100, dtype=np.float32)
    x[50] = bad
    with pytest.raises(ValueError, match="NaN"):
        enc.write(x)


def test_non_mono_samples() -> None:
    with pytest.raises(ValueError, match="1-D"):
        StreamEncoder("wav").write(np.zeros((2, 100), dtype=np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_after_close_and_close_twice(fmt: str) -> None:
    enc = StreamEncoder(fmt)
    enc.write(_signal(0.2))
    enc.close()
    assert enc.close() == b""
    with pytest.raises(ValueError, match="closed"):
        enc.write(np.zeros(10, dtype=np.float32))
