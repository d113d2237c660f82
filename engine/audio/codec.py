"""MOSS-Audio-Tokenizer on onnxruntime: encode, one-pass decode and an exact streaming decoder."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
import soxr

from engine.audio.codec_stream import StreamingDecoder
from engine.audio.rings import RingStage, RingState
from engine.errors import InputError
from engine.runtime.bundle import Bundle

# Frames per graph call when the caller does not chunk: bounds the [T, context+T] attention scores.
MAX_FRAMES_PER_CALL = 250


class Codec:
    """Codec graphs of a bundle. Thread-safe: every call owns its state (decoders are per caller)."""

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle
        self.spec = bundle.section("codec").spec
        self.sample_rate: int = self.spec.sample_rate
        self.samples_per_frame: int = self.spec.samples_per_frame
        self.num_quantizers: int = self.spec.num_quantizers
        self.codebook_size: int = self.spec.codebook_size
        self.encoder_stages = [RingStage.from_spec(s) for s in self.spec.encoder]
        self.decoder_stages = [RingStage.from_spec(s) for s in self.spec.decoder]

    @property
    def frame_seconds(self) -> float:
        return self.samples_per_frame / self.sample_rate

    def decoder_bytes_per_stream(self) -> int:
        """Host memory of one stream's decoder state (its KV rings)."""
        return RingState.bytes_per_stream(self.decoder_stages)

    # ------------------------------------------------------------------ validation helpers
    def check_n_quantizers(self, n_quantizers: int) -> int:
        """``n_quantizers`` as an int, or an InputError when it is not an integer in 1..num_quantizers."""
        if not isinstance(n_quantizers, (int, np.integer)) or not 1 <= n_quantizers <= self.num_quantizers:
            raise InputError(f"n_quantizers must be an integer in 1..{self.num_quantizers}, got {n_quantizers!r}")
        return int(n_quantizers)

    def default_n_quantizers(self, codes: np.ndarray) -> int:
        """All levels the codes carry (at most the codec's); rank errors are reported by check_codes."""
        return max(1, min(codes.shape[-1], self.num_quantizers)) if codes.ndim else 1

    def check_codes(self, codes: npt.ArrayLike, n_quantizers: int, batched: bool = False) -> npt.NDArray[np.int64]:
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

    def prepare_waveform(self, wav: npt.ArrayLike, sample_rate: int) -> npt.NDArray[np.float32]:
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
    def encode(self, wav: npt.ArrayLike, sample_rate: int,
               chunk_frames: int = MAX_FRAMES_PER_CALL) -> npt.NDArray[np.int64]:
        """Waveform → codes ``[ceil(N/1920), num_quantizers]`` int64 (upstream rule: zero-pad the tail).

        Runs the streaming encoder in chunks; the ring state makes any chunking equal to one pass.
        """
        self.check_chunk_sizes([chunk_frames])
        x = self.prepare_waveform(wav, sample_rate)
        hop = self.samples_per_frame
        total = -(-x.size // hop)
        full = x.size // hop
        padded = np.zeros(total * hop, np.float32)
        padded[: x.size] = x
        sess = self.bundle.session("codec_encoder")
        state = RingState("encoder", self.encoder_stages, 1, self.bundle.device, self.bundle.providers)
        out: list[npt.NDArray[np.int64]] = []
        for f0 in range(0, total, chunk_frames):
            n = min(chunk_frames, total - f0)
            binding = sess.io_binding()
            binding.bind_cpu_input("waveform", padded[None, f0 * hop:(f0 + n) * hop])
            binding.bind_cpu_input("valid_frames", np.array([min(max(full - f0, 0), n)], np.int64))
            binding.bind_output("codes", "cpu")   # first bound: get_outputs()[0]
            state.bind(binding, 1, n)
            sess.run_with_iobinding(binding)
            codes: npt.NDArray[np.int64] = binding.get_outputs()[0].numpy()
            state.advance(1, np.array([n], np.int64), n)
            out.append(codes[0])
        return np.concatenate(out, 0)

    # ------------------------------------------------------------------ decode
    def streaming_decoder(self, slots: int = 1, n_quantizers: int = 16) -> StreamingDecoder:
        """A decoder of ``slots`` streams of its own (its rings on the bundle's device)."""
        return StreamingDecoder(self, slots, n_quantizers)

    @staticmethod
    def check_chunk_sizes(sizes: Iterable[int]) -> list[int]:
        """Frames per decoder/encoder call: integers in 1..MAX_FRAMES_PER_CALL (bounded attention scores)."""
        chunks = list(sizes)
        if not chunks or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                            or not 1 <= n <= MAX_FRAMES_PER_CALL for n in chunks):
            raise InputError(f"chunk sizes must be integers in 1..{MAX_FRAMES_PER_CALL}, got {chunks[:8]}")
        return [int(n) for n in chunks]

    def decode(self, codes: npt.ArrayLike, n_quantizers: int | None = None,
               max_frames_per_call: int = MAX_FRAMES_PER_CALL, schedule: list[int] | None = None,
               decoder: StreamingDecoder | None = None) -> npt.NDArray[np.float32]:
        """Codes ``[frames, K]`` → waveform ``[frames * 1920]`` float32 using the first n_quantizers (default K).

        The frames go through the streaming decoder (``decoder``, a fresh one by default) in calls of
        ``max_frames_per_call`` frames, or of the ``schedule``'s sizes (its last size repeats); the audio
        is the same for every chunking.
        """
        arr = np.asarray(codes)
        nq = self.check_n_quantizers(self.default_n_quantizers(arr) if n_quantizers is None else n_quantizers)
        checked = self.check_codes(arr, nq)
        sizes = self.check_chunk_sizes(schedule if schedule else [max_frames_per_call])
        dec = decoder if decoder is not None else self.streaming_decoder(1, nq)
        parts: list[npt.NDArray[np.float32]] = []
        f = 0
        while f < checked.shape[1]:
            n = sizes[min(len(parts), len(sizes) - 1)]
            parts.append(dec.decode_checked(checked[:, f:f + n]))
            f += n
        audio: npt.NDArray[np.float32] = np.concatenate(parts, 1)[0]
        return audio


