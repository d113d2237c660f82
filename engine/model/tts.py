"""MOSS-TTS-Realtime graphs on onnxruntime: the backbone over host-owned KV slots, and the depth graph
that samples one 16-code frame per stream per call.

A :class:`TTSModel` holds no per-stream state: it may be shared by every thread and runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from engine.audio.codec import Codec
from engine.errors import BundleError, GraphError, InputError
from engine.kv.pool import BackboneKVPool
from engine.model.buckets import BucketBuffers, BufferStats, GraphKey, GraphRegistry, capture_decision
from engine.model.sampling import SamplingParams
from engine.model.spec import ModelSpec
from engine.runtime.bundle import Bundle
from engine.runtime.device import DeviceTensor
from engine.runtime.timing import CallTiming

log = logging.getLogger("mossrt.tts")

STEP_GRAPHS = ("backbone", "depth")      # the graphs a bucket's step captures
NON_FINITE_LOGITS = "the depth graph produced NaN/Inf logits (damaged bundle?)"


class TTSModel(ModelSpec):
    """The TTS graphs of a bundle over its :class:`ModelSpec` (layout, defaults, tokenizer)."""

    def __init__(self, bundle: Bundle, codec: Codec | None = None, cuda_graphs: bool | None = None,
                 warm_buckets: bool | None = None) -> None:
        """``cuda_graphs``: capture each bucket's backbone step and depth call as CUDA graphs (None: on with
        CUDA when every node of both graphs is placed there, see
        :func:`engine.model.buckets.capture_decision`).
        ``warm_buckets``: a scheduler on this model runs every bucket's calls once before it serves
        (``StepRunner.warm_up``; None: when capturing, so that no capture happens inside a live tick)."""
        super().__init__(bundle, codec)
        unplaced = {g: [f.node for f in bundle.unplaced("cuda") if f.graph == g] for g in STEP_GRAPHS} \
            if bundle.device == "cuda" else {}
        self.cuda_graphs, why = capture_decision(cuda_graphs, bundle.device, unplaced)
        (log.warning if "refused" in why else log.info)("%s", why)
        self.graph_ids = GraphRegistry()
        self._capture_claimed = False
        self._run_options: dict[int, ort.RunOptions] = {}
        if self.cuda_graphs:
            try:
                self._backbone, self._depth = (bundle.session(g, cuda_graph=True) for g in STEP_GRAPHS)
            except BundleError as e:      # onnxruntime refuses a CUDA-graph session it cannot place on CUDA alone
                log.warning("CUDA graphs refused by onnxruntime, running uncaptured: %s", e)
                self.cuda_graphs = False
        if not self.cuda_graphs:
            self._backbone, self._depth = (bundle.session(g) for g in STEP_GRAPHS)
        self._uncaptured = self._graph_run_options(-1) if self.cuda_graphs else None   # prefill, run_depth
        self.warm_buckets = self.cuda_graphs if warm_buckets is None else warm_buckets
        # one graph call at a time per model: a runner's scheduler thread and a StreamingSession or synth in
        # another thread share these sessions, and a CUDA-graph session must never run concurrently
        self.graph_lock = threading.Lock()

    @property
    def backbone_session(self) -> ort.InferenceSession:
        return self._backbone

    @property
    def depth_session(self) -> ort.InferenceSession:
        return self._depth

    def kv_pool(self, slots: int, rows: int) -> BackboneKVPool:
        """A backbone KV pool of ``slots`` slots of ``rows`` context rows on the bundle's device."""
        c = self.config
        positions = c.backbone.max_positions
        if positions is not None and rows + 1 > positions:
            raise InputError(f"{rows} context rows need {rows + 1} RoPE positions; this bundle's backbone has "
                             f"{positions} (max_position_embeddings): lower max_context_rows")
        return BackboneKVPool(c.layers, c.kv_heads, c.head_dim, slots, rows, self.bundle.device,
                              self.bundle.providers, self.kv_dtype)

    # ------------------------------------------------------------------ graph calls
    def run_backbone(self, grid: np.ndarray, pool: BackboneKVPool, lo: int, hi: int,
                     timing: CallTiming | None = None) -> np.ndarray:
        """Feed rows ``grid [hi-lo, T, 17]`` to slots ``lo..hi-1`` at their current lengths; the new K/V
        are written in place at those lengths (the caller advances ``pool.lengths``). Returns the rows'
        hidden states ``[hi-lo, T, H]`` on the host (synthesis tools and tests; the runner keeps them on the
        device with :meth:`run_backbone_into`)."""
        binding = self._backbone_call(grid, pool, lo, hi, lambda b, shape: b.bind_output("hidden", "cpu"), timing)
        hidden: npt.NDArray[np.float32] = binding.get_outputs()[0].numpy()
        return hidden

    def run_backbone_into(self, grid: np.ndarray, pool: BackboneKVPool, lo: int, hi: int, hidden: DeviceTensor,
                          timing: CallTiming | None = None) -> None:
        """:meth:`run_backbone` with the hidden states written into the first ``(hi-lo) * T`` rows of
        ``hidden`` (float32 ``[rows, H]`` device memory, bound by pointer): nothing comes back."""
        self._backbone_call(grid, pool, lo, hi, lambda b, shape: hidden.bind_shaped(b.bind_output, "hidden", shape),
                            timing)

    def _backbone_call(self, grid: np.ndarray, pool: BackboneKVPool, lo: int, hi: int,
                       bind_hidden: Callable[[Any, list[int]], None], timing: CallTiming | None) -> ort.IOBinding:
        """The one backbone call of a batch of rows (see :meth:`run_backbone`); ``bind_hidden(binding,
        shape)`` binds its ``hidden`` output. Returns the binding it ran."""
        t0 = time.perf_counter()
        binding = self._backbone.io_binding()
        bind_hidden(binding, [hi - lo, grid.shape[1], self.config.hidden])
        binding.bind_cpu_input("grid", np.ascontiguousarray(grid, dtype=np.int64))
        # GroupQueryAttention's lengths, from the host: each row's last valid KV row after this call, and
        # the slot capacity (a constant: the same for every call on this pool)
        positions = pool.lengths[lo:hi, None] + np.arange(grid.shape[1], dtype=np.int64)[None]
        binding.bind_cpu_input("position_ids", positions)
        binding.bind_cpu_input("seqlens_k", (pool.lengths[lo:hi] + (grid.shape[1] - 1)).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(pool.capacity, np.int32))
        pool.bind(binding, lo, hi)
        t1 = time.perf_counter()
        with self.graph_lock:
            self._backbone.run_with_iobinding(binding, self._uncaptured)
        t2 = time.perf_counter()
        if timing is not None:
            timing.add(time.perf_counter() - t0, t2 - t1)
        return binding

    def run_depth(self, hidden: np.ndarray, history: np.ndarray, params: list[SamplingParams],
                  uniform: np.ndarray, first_frame: np.ndarray, timing: CallTiming | None = None) -> np.ndarray:
        """One frame per row from its last hidden state ``[B, H]``: codes ``[B, 16]``.

        ``history`` ``[B, window, 16]`` holds earlier frames of each row's turn (``history_pad`` where none);
        rows with ``first_frame`` get no penalty, as upstream. Non-finite logits raise GraphError.
        """
        t0 = time.perf_counter()
        first = np.asarray(first_frame, bool)
        feeds = {
            "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
            "history": np.ascontiguousarray(history, dtype=np.int64),
            "repetition_penalty": np.array([1.0 if f else p.repetition_penalty for p, f in zip(params, first)],
                                           np.float32),
            "temperature": np.array([p.temperature if p.temperature > 0 else 1.0 for p in params], np.float32),
            "top_k": np.array([p.top_k for p in params], np.int64),
            "top_p": np.array([p.top_p for p in params], np.float32),
            "greedy": np.array([p.is_greedy for p in params], np.bool_),
            "uniform": np.ascontiguousarray(uniform, dtype=np.float32),
        }
        t1 = time.perf_counter()
        with self.graph_lock:
            codes, finite = self._depth.run(["codes", "finite"], feeds, self._uncaptured)
        t2 = time.perf_counter()
        if not finite.all():
            raise GraphError(NON_FINITE_LOGITS)
        if timing is not None:
            timing.add(time.perf_counter() - t0, t2 - t1)
        out: npt.NDArray[np.int64] = codes
        return out

    # ------------------------------------------------------------------ bucketed step calls
    def step_buffers(self, bucket: int, pool: BackboneKVPool, stats: BufferStats,
                     capture: bool = False) -> BucketBuffers:
        """The fixed-address buffers and bindings of one batch bucket over ``pool``'s slots ``0..bucket-1``."""
        return BucketBuffers(bucket, self, pool, stats, capture)

    def claim_capture(self) -> bool:
        """Whether the caller's runner captures its buckets' calls: true once per model (the service's
        scheduler), when capturing at all. A captured graph replays at the addresses it was captured with,
        so a second runner's buffers (a StreamingSession, another scheduler) run uncaptured."""
        with self.graph_lock:
            claimed, self._capture_claimed = self._capture_claimed, True
        return self.cuda_graphs and not claimed

    def _graph_run_options(self, gid: int) -> ort.RunOptions:
        if gid not in self._run_options:
            ro = ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(gid))       # onnxruntime's CUDA graph annotation
            self._run_options[gid] = ro
        return self._run_options[gid]

    def _captured(self, bufs: BucketBuffers, key: GraphKey,
                  layout: dict[str, tuple[int, ...]]) -> ort.RunOptions | None:
        """The run options of a bucket's call: its captured graph's id (the registry refuses an id bound with
        other shapes or addresses than it was captured with), uncaptured (-1) for buffers that do not
        capture, None when the model does not capture at all."""
        if not self.cuda_graphs:
            return None
        if not bufs.capture:
            return self._uncaptured
        return self._graph_run_options(self.graph_ids.id_for(key, layout))

    def run_step(self, bufs: BucketBuffers, timing: CallTiming | None = None) -> None:
        """The backbone step over the bucket's staged ``grid``/``positions``/``seqlens`` (host arrays, copied
        to its device buffers here); the rows' hidden states stay in ``bufs.hidden`` on the device."""
        t0 = time.perf_counter()
        for buf in (bufs.grid, bufs.positions, bufs.seqlens):
            buf.upload()
        t1 = time.perf_counter()
        with self.graph_lock:
            self._backbone.run_with_iobinding(bufs.backbone, self._captured(bufs, GraphKey("backbone", bufs.bucket),
                                                                            bufs.backbone_layout))
        t2 = time.perf_counter()
        if timing is not None:
            timing.add(t2 - t0, t2 - t1)

    def run_bucket_depth(self, bufs: BucketBuffers, window: int,
                         timing: CallTiming | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The depth call over ``bufs.hidden`` with the staged sampler inputs and history of bound ``window``;
        returns host copies of ``codes`` [B, 16] and ``finite`` [B] (nothing else comes back)."""
        t0 = time.perf_counter()
        binding, history = bufs.depth_binding(window)
        history.upload()
        for buf in bufs.sampler.values():
            buf.upload()
        t1 = time.perf_counter()
        with self.graph_lock:
            self._depth.run_with_iobinding(binding, self._captured(bufs, GraphKey("depth", bufs.bucket, window),
                                                                   bufs.depth_layout[window]))
        t2 = time.perf_counter()
        # copies: on CPU numpy() is a view of the buffer, which the next call overwrites
        codes, finite = bufs.codes.value.numpy().copy(), bufs.finite.value.numpy().copy()
        if timing is not None:
            timing.add(time.perf_counter() - t0, t2 - t1)
        return codes, finite
