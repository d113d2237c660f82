"""MOSS-Audio-Tokenizer on onnxruntime: encode, one-pass decode and an exact streaming decoder."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import soundfile as sf
import soxr

from .bundle import Bundle
from .errors import InputError
from .kv import RingStage, RingState

# Frames per graph call when the caller does not chunk: bounds the [T, context+T] attention scores.
MAX_FRAMES_PER_CALL = 250


class Codec:
    """Codec graphs of a bundle. Thread-compatible: one Codec per worker thread, or external locking."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        section = bundle.section("codec")
        self.spec = section["spec"]
        self.sample_rate: int = self.spec["sample_rate"]
        self.samples_per_frame: int = self.spec["samples_per_frame"]
        self.num_quantizers: int = self.spec["num_quantizers"]
        self.codebook_size: int = self.spec["codebook_size"]
        self.encoder_stages = [RingStage.from_spec(s) for s in self.spec["encoder"]]
        self.decoder_stages = [RingStage.from_spec(s) for s in self.spec["decoder"]]

    # ------------------------------------------------------------------ validation helpers
    def check_n_quantizers(self, n_quantizers: int) -> int:
        if not isinstance(n_quantizers, (int, np.integer)) or not 1 <= n_quantizers <= self.num_quantizers:
            raise InputError(f"n_quantizers must be an integer in 1..{self.num_quantizers}, got {n_quantizers!r}")
        return int(n_quantizers)

    def default_n_quantizers(self, codes: np.ndarray) -> int:
        """All levels the codes carry (at most the codec's); rank errors are reported by check_codes."""
        return max(1, min(codes.shape[-1], self.num_quantizers)) if codes.ndim else 1

    def check_codes(self, codes, n_quantizers: int, batched: bool = False) -> np.ndarray:
        """Validate codes ``[frames, K]`` (``[batch, frames, K]`` when batched), K >= n_quantizers, and
        return them as int64 ``[batch, frames, num_quantizers]`` (levels >= K filled with 0, never read)."""
        arr = np.asarray(codes)
        want = 3 if batched else 2
        if arr.ndim != want:
            raise InputError(f"codes must have rank {want} ([{'batch, ' if batched else ''}frames, quantizers]), "
                             f"got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"codes must be integers, got {arr.dtype}")
        if arr.shape[-2] == 0:
            raise InputError("codes have zero frames")
        if arr.shape[-1] < n_quantizers:
            raise InputError(f"codes have {arr.shape[-1]} quantizers per frame but n_quantizers={n_quantizers}")
        if arr.shape[-1] > self.num_quantizers:
            raise InputError(f"codes have {arr.shape[-1]} quantizers per frame; the codec has {self.num_quantizers}")
        used = arr[..., :n_quantizers]
        if used.min() < 0 or used.max() >= self.codebook_size:
            raise InputError(f"codes must lie in 0..{self.codebook_size - 1}; got values in "
                             f"{int(used.min())}..{int(used.max())}")
        if not batched:
            arr = arr[None]
        out = np.zeros(arr.shape[:2] + (self.num_quantizers,), np.int64)
        out[..., :n_quantizers] = arr[..., :n_quantizers]
        return out

    def prepare_waveform(self, wav, sample_rate: int) -> np.ndarray:
        """Mono float32 at the codec rate: channels ``[N, C]`` are averaged, other rates resampled (soxr)."""
        x = np.asarray(wav, dtype=np.float32)
        if x.ndim == 2:
            x = x.mean(axis=1)
        if x.ndim != 1:
            raise InputError(f"waveform must be [samples] or [samples, channels], got shape {x.shape}")
        if x.size == 0:
            raise InputError("waveform is empty")
        if not np.all(np.isfinite(x)):
            raise InputError("waveform contains NaN or infinite samples")
        if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise InputError(f"invalid sample rate {sample_rate!r}")
        if sample_rate != self.sample_rate:
            x = soxr.resample(x, sample_rate, self.sample_rate, quality="VHQ").astype(np.float32)
        return x

    # ------------------------------------------------------------------ encode
    def encode(self, wav, sample_rate: int, chunk_frames: int = MAX_FRAMES_PER_CALL) -> np.ndarray:
        """Waveform → codes ``[ceil(N/1920), num_quantizers]`` int64 (upstream rule: zero-pad the tail).

        Runs the streaming encoder in chunks; the ring state makes any chunking equal to one pass.
        """
        x = self.prepare_waveform(wav, sample_rate)
        hop = self.samples_per_frame
        total = -(-x.size // hop)
        full = x.size // hop
        padded = np.zeros(total * hop, np.float32)
        padded[: x.size] = x
        sess = self.bundle.session("codec_encoder")
        state = RingState("encoder", self.encoder_stages, 1)
        out = []
        for f0 in range(0, total, chunk_frames):
            n = min(chunk_frames, total - f0)
            binding = sess.io_binding()
            binding.bind_cpu_input("waveform", padded[None, f0 * hop:(f0 + n) * hop])
            binding.bind_cpu_input("frame_pos", state.frame_pos)
            binding.bind_cpu_input("valid_frames", np.array([min(max(full - f0, 0), n)], np.int64))
            state.bind(binding)
            for name in ["codes"] + state.output_names():
                binding.bind_output(name, "cpu")
            sess.run_with_iobinding(binding)
            codes, *presents = [v.numpy() for v in binding.get_outputs()]
            state.advance(presents, n)
            out.append(codes[0])
        return np.concatenate(out, 0)

    def encode_file(self, path: str | Path) -> np.ndarray:
        wav, sr = read_audio(path)
        return self.encode(wav, sr)

    # ------------------------------------------------------------------ decode
    def streaming_decoder(self, batch_size: int = 1, n_quantizers: int = 16) -> "StreamingDecoder":
        return StreamingDecoder(self, batch_size, n_quantizers)

    def decode(self, codes, n_quantizers: int | None = None, max_frames_per_call: int = MAX_FRAMES_PER_CALL,
               schedule: list[int] | None = None) -> np.ndarray:
        """Codes ``[frames, K]`` → waveform ``[frames * 1920]`` float32 using the first n_quantizers (default K).

        The frames go through the streaming decoder in calls of ``max_frames_per_call`` frames, or of the
        ``schedule``'s sizes (its last size repeats); the audio is the same for every chunking.
        """
        arr = np.asarray(codes)
        nq = self.check_n_quantizers(self.default_n_quantizers(arr) if n_quantizers is None else n_quantizers)
        checked = self.check_codes(arr, nq)
        sizes = list(schedule) if schedule else [max_frames_per_call]
        if any(not isinstance(n, (int, np.integer)) or n < 1 for n in sizes):
            raise InputError(f"chunk sizes must be integers >= 1, got {sizes}")
        dec = self.streaming_decoder(1, nq)
        parts, f = [], 0
        while f < checked.shape[1]:
            n = sizes[min(len(parts), len(sizes) - 1)]
            parts.append(dec.decode_checked(checked[:, f:f + n]))
            f += n
        return np.concatenate(parts, 1)[0]


@dataclass
class CallTiming:
    """Wall time of graph calls, split into time inside ``session.run`` and host time around it."""

    calls: int = 0
    total_s: float = 0.0
    run_s: float = 0.0

    def add(self, total: float, run: float) -> None:
        self.calls += 1
        self.total_s += total
        self.run_s += run

    @property
    def host_share(self) -> float:
        return (self.total_s - self.run_s) / self.total_s if self.total_s else 0.0


class StreamingDecoder:
    """Exact streaming decode for ``batch_size`` independent streams: frames in, their audio out at once.

    Each :meth:`decode` call advances every stream by the same number of frames N >= 1; streams may sit
    at different positions (after :meth:`reset` of one of them). The output equals the one-pass decode of
    each stream's whole code sequence, whatever the chunking.
    """

    def __init__(self, codec: Codec, batch_size: int = 1, n_quantizers: int = 16):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size!r}")
        self.codec = codec
        self.batch_size = int(batch_size)
        self.n_quantizers = codec.check_n_quantizers(n_quantizers)
        self.state = RingState("decoder", codec.decoder_stages, self.batch_size)
        self._session = codec.bundle.session("codec_decoder")
        self._nq = np.array(self.n_quantizers, np.int64)
        self.timing = CallTiming()
        # One binding for the decoder's life: the rings are bound once, only codes/positions per call.
        self._binding = self._session.io_binding()
        self.state.bind(self._binding)
        self._binding.bind_cpu_input("n_quantizers", self._nq)
        self._binding.bind_ortvalue_input("frame_pos", ort.OrtValue.ortvalue_from_numpy(self.state.frame_pos))

    @property
    def frame_positions(self) -> np.ndarray:
        return self.state.frame_pos.copy()

    @property
    def state_bytes_per_stream(self) -> int:
        return self.state.nbytes_per_stream

    def decode(self, codes) -> np.ndarray:
        """Codes ``[batch, N, K]`` (or ``[N, K]`` when batch_size is 1) → audio ``[batch, N*1920]``
        (``[N*1920]`` for the unbatched form)."""
        arr = np.asarray(codes)
        unbatched = arr.ndim == 2 and self.batch_size == 1
        checked = self.codec.check_codes(arr, self.n_quantizers, batched=not unbatched)
        if checked.shape[0] != self.batch_size:
            raise InputError(f"codes are for {checked.shape[0]} streams; this decoder has {self.batch_size}")
        audio = self.decode_checked(checked)
        return audio[0] if unbatched else audio

    def decode_checked(self, codes: np.ndarray) -> np.ndarray:
        """Hot path: ``codes`` already validated int64 ``[batch, N, num_quantizers]``."""
        t0 = time.perf_counter()
        binding = self._binding
        binding.bind_cpu_input("codes", codes)
        for name in ["audio"] + self.state.output_names():
            binding.bind_output(name, "cpu")
        t1 = time.perf_counter()
        self._session.run_with_iobinding(binding)
        t2 = time.perf_counter()
        audio, *presents = [v.numpy() for v in binding.get_outputs()]
        self.state.advance(presents, codes.shape[1])
        self.timing.add(time.perf_counter() - t0, t2 - t1)
        return audio

    def reset(self, index: int | None = None) -> None:
        """Start stream ``index`` (every stream when None) afresh at frame 0."""
        if index is not None and not 0 <= index < self.batch_size:
            raise InputError(f"stream index {index} out of range 0..{self.batch_size - 1}")
        self.state.reset(index)


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file with soundfile; unreadable or empty files raise InputError."""
    try:
        wav, sr = sf.read(str(path), dtype="float32", always_2d=False)
    except Exception as e:  # soundfile raises several types (LibsndfileError, RuntimeError, TypeError)
        raise InputError(f"{path}: not a readable audio file ({e})") from None
    if wav.size == 0:
        raise InputError(f"{path}: the audio file holds no samples")
    return wav, sr


def write_audio(path: str | Path, wav: np.ndarray, sample_rate: int, pcm16: bool = False) -> None:
    """WAV as 32-bit float (exact) or 16-bit PCM (clipped to [-1, 1])."""
    try:
        if pcm16:
            sf.write(str(path), np.clip(wav, -1.0, 1.0), sample_rate, subtype="PCM_16")
        else:
            sf.write(str(path), wav.astype(np.float32), sample_rate, subtype="FLOAT")
    except (sf.LibsndfileError, OSError) as e:
        raise InputError(f"{path}: cannot write the audio file ({e})") from None
