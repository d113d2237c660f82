"""MOSS-TTS-Realtime graphs on onnxruntime: the backbone with a host-owned KV cache, and the depth
graph that samples one 16-code frame per call."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .bundle import Bundle
from .codec import CallTiming, Codec
from .errors import InputError
from .prompt import GridIds, PromptBuilder
from .sampling import SamplingParams
from .tokenizer import TextTokenizer

MIN_CAPACITY = 256


class ContextLimitError(InputError):
    """A stream would exceed its configured maximum context (rows)."""


class BackboneCache:
    """KV buffers ``[layers, 2, batch, kv_heads, capacity, head_dim]`` and filled lengths per stream.

    Each layer's K and V are bound to the graph zero-copy; only the new rows come back from a call and
    are written at ``length..``. Capacity grows by doubling up to ``max_rows`` (one copy per doubling),
    so attention never scans much more than the filled part of the buffer.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, batch: int = 1, max_rows: int = 8192):
        self.shape = (layers, 2, batch, kv_heads, 0, head_dim)
        self.batch, self.max_rows = batch, max_rows
        self.lengths = np.zeros(batch, np.int64)
        self.kv = np.zeros(self.shape, np.float32)
        self._values: list[tuple[ort.OrtValue, ort.OrtValue]] = []

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` more rows in every stream, or raise ContextLimitError."""
        need = int(self.lengths.max()) + rows
        if need > self.max_rows:
            raise ContextLimitError(f"context limit: {need} rows needed, the maximum context is {self.max_rows} rows")
        if need <= self.capacity:
            return
        cap = max(MIN_CAPACITY, self.capacity)
        while cap < need:
            cap *= 2
        cap = min(cap, self.max_rows)
        grown = np.zeros(self.shape[:4] + (cap,) + self.shape[5:], np.float32)
        grown[:, :, :, :, : self.capacity] = self.kv
        self.kv = grown
        self._values = [(ort.OrtValue.ortvalue_from_numpy(grown[l, 0]), ort.OrtValue.ortvalue_from_numpy(grown[l, 1]))
                        for l in range(self.shape[0])]

    def bind(self, binding: ort.IOBinding) -> None:
        for l, (k, v) in enumerate(self._values):
            binding.bind_ortvalue_input(f"past_key.{l}", k)
            binding.bind_ortvalue_input(f"past_value.{l}", v)

    def append(self, present: np.ndarray) -> None:
        """Write the call's new rows ``present[l, kv, b, h, t, d]`` after each stream's filled part."""
        rows = present.shape[4]
        for b in range(self.batch):
            n = int(self.lengths[b])
            self.kv[:, :, b, :, n:n + rows] = present[:, :, b]
        self.lengths += rows

    def reset(self) -> None:
        self.lengths[:] = 0

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


@dataclass
class FrameOutput:
    codes: np.ndarray    # [batch, 16] int64
    logits: np.ndarray   # [batch, 16, audio_vocab] raw head logits


class TTSModel:
    """The TTS graphs of a bundle plus everything derived from its manifest (ids, defaults, tokenizer)."""

    def __init__(self, bundle: Bundle, codec: Codec | None = None):
        self.bundle = bundle
        tts = bundle.section("tts")
        self.config = tts["config"]
        self.tokenizer = TextTokenizer(bundle)
        gen = bundle.section("generation")
        self.codec = codec or Codec(bundle)
        self.ids = GridIds(
            rvq=self.config["rvq"], codebook_size=self.codec.codebook_size, audio_pad=self.config["audio_pad"],
            audio_bos=self.config["audio_bos"], audio_eos=self.config["audio_eos"],
            text_pad=self.tokenizer.special_ids["text_pad"], audio_pad_text=self.tokenizer.special_ids["audio_pad"],
            prefill_text_tokens=gen["prefill_text_tokens"])
        self.prompt = PromptBuilder(self.tokenizer, self.ids)
        self.history_pad = self.config["history_pad"]
        self.vocab = self.config["vocab"]
        self._backbone = bundle.session("backbone")
        self._depth = bundle.session("depth")
        self.backbone_timing = CallTiming()
        self.depth_timing = CallTiming()

    def voice_codes_from_wav(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording as prompt codes: every ``ceil(N/1920)`` frame, first 16 levels (upstream)."""
        return self.codec.encode(wav, sample_rate)[:, : self.ids.rvq]

    def default_sampling(self, **overrides) -> SamplingParams:
        return SamplingParams.from_manifest(self.bundle.manifest, **overrides)

    def new_cache(self, batch: int = 1, max_rows: int = 8192) -> BackboneCache:
        c = self.config
        return BackboneCache(c["layers"], c["kv_heads"], c["head_dim"], batch, max_rows)

    def check_text_ids(self, ids) -> np.ndarray:
        """Token ids as a flat int64 array, each a valid row of the text embedding."""
        try:
            arr = np.asarray(list(ids))
        except TypeError:
            raise InputError("token ids must be a list of integers") from None
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise InputError("token ids must be a flat list of integers")
        if arr.min() < 0 or arr.max() >= self.vocab:
            raise InputError(f"token ids must lie in 0..{self.vocab - 1}")
        return arr.astype(np.int64)

    # ------------------------------------------------------------------ graph calls
    def backbone(self, grid: np.ndarray, cache: BackboneCache) -> np.ndarray:
        """Feed rows ``[batch, rows, 17]`` on top of the cache; returns their hidden states ``[batch, rows, H]``."""
        t0 = time.perf_counter()
        cache.reserve(grid.shape[1])
        binding = self._backbone.io_binding()
        binding.bind_cpu_input("grid", np.ascontiguousarray(grid, dtype=np.int64))
        binding.bind_cpu_input("past_len", cache.lengths)
        cache.bind(binding)
        binding.bind_output("hidden", "cpu")
        binding.bind_output("present", "cpu")
        t1 = time.perf_counter()
        self._backbone.run_with_iobinding(binding)
        t2 = time.perf_counter()
        hidden, present = (v.numpy() for v in binding.get_outputs())
        cache.append(present)
        self.backbone_timing.add(time.perf_counter() - t0, t2 - t1)
        return hidden

    def depth(self, hidden: np.ndarray, history: np.ndarray, params: list[SamplingParams],
              uniform: np.ndarray, first_frame: bool) -> FrameOutput:
        """One frame per stream from its last hidden state ``[batch, H]``.

        ``history`` ``[batch, window, 16]`` holds earlier frames of the turn (``history_pad`` where none);
        on a turn's first frame no penalty applies, as upstream.
        """
        t0 = time.perf_counter()
        feeds = {
            "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
            "history": np.ascontiguousarray(history, dtype=np.int64),
            "repetition_penalty": np.array([1.0 if first_frame else p.repetition_penalty for p in params], np.float32),
            "temperature": np.array([p.temperature if p.temperature > 0 else 1.0 for p in params], np.float32),
            "top_k": np.array([p.top_k for p in params], np.int64),
            "top_p": np.array([p.top_p for p in params], np.float32),
            "greedy": np.array([p.is_greedy for p in params], np.bool_),
            "uniform": np.ascontiguousarray(uniform, dtype=np.float32),
        }
        t1 = time.perf_counter()
        codes, logits = self._depth.run(["codes", "logits"], feeds)
        t2 = time.perf_counter()
        self.depth_timing.add(time.perf_counter() - t0, t2 - t1)
        return FrameOutput(codes, logits)
