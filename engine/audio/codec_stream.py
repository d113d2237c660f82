"""Exact streaming decode of many codec streams at once (the codec decoder's step graph + device rings)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from onnx import TensorProto

from engine.audio.rings import MAX_CACHED_SHAPES, RingStage, RingState
from engine.errors import GraphError, InputError
from engine.runtime.bundle import Bundle
from engine.runtime.timing import CallTiming


class DecodingCodec(Protocol):
    """What a streaming decoder uses of its codec (:class:`engine.audio.codec.Codec`, which imports this
    module: a protocol here keeps the import one way)."""

    bundle: Bundle
    decoder_stages: list[RingStage]
    num_quantizers: int
    samples_per_frame: int

    def check_n_quantizers(self, n_quantizers: int) -> int: ...

    def check_codes(self, codes: npt.ArrayLike, n_quantizers: int, batched: bool = False) -> npt.NDArray[np.int64]: ...


# one call shape's fixed binding: (the state's generation it was made at, the IOBinding, codes in, audio out)
_CallBinding = tuple[int, Any, npt.NDArray[np.int64], npt.NDArray[np.float32]]


class StreamingDecoder:
    """Frames in, their audio out at once, for ``slots`` independent streams at any positions.

    A call decodes ``N`` frames for streams ``0..n-1``; each stream advances by its own count (0 for a
    stream that rides along without frames: its audio is ignored and its state untouched; fewer than
    N: only its first frames are real, and causality makes their audio exact). The output equals the
    one-pass decode of each stream's whole code sequence, whatever the chunking. Not thread-safe: one
    owner (a runner, or one caller).
    """

    def __init__(self, codec: DecodingCodec, slots: int = 1, n_quantizers: int = 16) -> None:
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
            raise InputError(f"slots must be an integer >= 1, got {slots!r}")
        self.codec = codec
        self.slots = int(slots)
        self.n_quantizers = codec.check_n_quantizers(n_quantizers)
        self.state = RingState("decoder", codec.decoder_stages, self.slots, codec.bundle.device,
                               codec.bundle.providers)
        self._session = codec.bundle.session("codec_decoder")
        self._nq = np.array(self.n_quantizers, np.int64)
        self.timing = CallTiming()
        self.call_shapes: Counter[tuple[int, int]] = Counter()   # (streams, frames) of every call
        self._calls: dict[tuple[int, int], _CallBinding] = {}     # per call shape: its fixed binding

    @property
    def frame_positions(self) -> npt.NDArray[np.int64]:
        return self.state.frame_pos.copy()

    @property
    def state_bytes_per_stream(self) -> int:
        return self.state.nbytes_per_stream

    def decode(self, codes: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Codes ``[slots, N, K]`` (or ``[N, K]`` with one slot) → audio ``[slots, N*1920]`` (``[N*1920]``)."""
        arr = np.asarray(codes)
        unbatched = arr.ndim == 2 and self.slots == 1
        checked = self.codec.check_codes(arr, self.n_quantizers, batched=not unbatched)
        if checked.shape[0] != self.slots:
            raise InputError(f"codes are for {checked.shape[0]} streams; this decoder has {self.slots}")
        audio = self.decode_checked(checked)
        return audio[0] if unbatched else audio

    def decode_checked(self, codes: npt.NDArray[np.int64],
                       frames: npt.ArrayLike | None = None) -> npt.NDArray[np.float32]:
        """Hot path: validated int64 codes ``[n, N, num_quantizers]`` for streams ``0..n-1``; ``frames[b]``
        of them are real for stream ``b`` (default: all N). Returns audio ``[n, N*1920]``."""
        t0 = time.perf_counter()
        n, N = codes.shape[0], codes.shape[1]
        counts = np.full(n, N, np.int64) if frames is None else np.asarray(frames, np.int64)
        binding, codes_in, audio_out = self._call(n, N)
        codes_in[...] = codes
        t1 = time.perf_counter()
        self._session.run_with_iobinding(binding)
        t2 = time.perf_counter()
        audio = audio_out.copy()              # the buffer is the next call's too
        real = counts > 0
        if not np.isfinite(audio[real]).all():
            raise GraphError("the codec decoder produced NaN/Inf audio (damaged bundle?)")
        self.state.advance(n, counts, N)
        self.call_shapes[(n, N)] += 1
        self.timing.add(time.perf_counter() - t0, t2 - t1)
        return audio

    def warm(self, shapes: list[tuple[int, int]]) -> None:
        """Bind and run each call shape ``(streams, frames)`` once with every stream riding along (0 frames):
        its buffers and bindings exist from now on, and no stream's rings or position change. The largest
        new-row buffers are made first, so no later call grows (and rebinds) them."""
        if not shapes:
            return
        largest = max(shapes, key=lambda shape: shape[0] * shape[1])
        self.state.prepare(*largest)
        for n, N in shapes:
            binding, codes, _ = self._call(n, N)
            codes[...] = 0
            self._session.run_with_iobinding(binding)
            self.state.advance(n, np.zeros(n, np.int64), N)

    def _call(self, n: int, N: int) -> tuple[Any, npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """(binding, codes buffer, audio buffer) of a call shape, made once (and again after the state's
        call buffers grew): every input and output at a fixed address, so a call only fills the codes."""
        self.state.prepare(n, N)
        cached = self._calls.get((n, N))
        if cached is None or cached[0] != self.state.generation:
            if len(self._calls) > MAX_CACHED_SHAPES:
                self._calls.clear()
            codes = np.zeros((n, N, self.codec.num_quantizers), np.int64)
            audio = np.empty((n, N * self.codec.samples_per_frame), np.float32)
            binding = self._session.io_binding()
            binding.bind_input("codes", "cpu", 0, TensorProto.INT64, list(codes.shape), codes.ctypes.data)
            binding.bind_input("n_quantizers", "cpu", 0, TensorProto.INT64, [], self._nq.ctypes.data)
            binding.bind_output("audio", "cpu", 0, TensorProto.FLOAT, list(audio.shape), audio.ctypes.data)
            self.state.bind(binding, n, N)
            cached = self._calls[(n, N)] = (self.state.generation, binding, codes, audio)
        return cached[1], cached[2], cached[3]

    def reset(self, index: int | None = None) -> None:
        """Start stream ``index`` (every stream when None) afresh at frame 0."""
        if index is not None and not 0 <= index < self.slots:
            raise InputError(f"stream index {index} out of range 0..{self.slots - 1}")
        self.state.reset(index)

    def move(self, src: int, dst: int) -> None:
        """Move stream ``src`` into slot ``dst`` (rings and position); slot ``src`` starts afresh."""
        self.state.move(src, dst)

    def copy_stream(self, src: int, dst: int) -> None:
        """The device half of a move (``RingState.copy_stream``): nothing recorded until :meth:`commit_copy`."""
        self.state.copy_stream(src, dst)

    def commit_copy(self, src: int, dst: int) -> None:
        """The host half of :meth:`copy_stream` (``RingState.commit_copy``)."""
        self.state.commit_copy(src, dst)
