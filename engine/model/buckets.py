"""Batch buckets: the batched backbone step and the depth call run at a few fixed batch sizes, each with
every input and output bound once to device memory at a fixed address.

A tick's step and depth run at the smallest bucket (1, 2, 4, … up to the slot count) that covers the
highest slot with work, over slots ``0..B-1``: rows with nothing to do ride along (the backbone writes
their dummy row past their valid KV rows, or into a free slot's rows, which no stream reads; their depth
outputs are ignored). Per bucket a :class:`BucketBuffers` holds device ``OrtValue``s for every step input
(grid row ids, positions, lengths; the sampler's per-row settings, uniforms and history) and output
(``hidden``, shared by the backbone step's output and the depth call's input, so it never leaves the
device; codes; logits; finiteness), bound once into one IOBinding per graph. Per step the host fills small
host staging arrays, copies them into those buffers (``OrtValue.update_inplace``) and reads back only the
codes and the per-row finiteness flags. A prefill's hidden states stay on the device as well
(:class:`PrefillBuffers`): its last row is copied into its slot's row of the bucket's ``hidden``. On the
CPU provider the very same buffers and bindings run.

With fixed addresses and shapes, a bucket's two calls are what a CUDA graph can capture and replay
(:class:`GraphRegistry` keeps each captured id's shapes: onnxruntime itself does not check them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import helper

from engine.errors import InputError
from engine.kv.pool import BackboneKVPool
from engine.model.prompt import GridLayout
from engine.model.sampling import MAX_REPETITION_WINDOW, SamplingParams
from engine.runtime.bundle import Bundle
from engine.runtime.device import ELEMENT, BindFn, DeviceTensor, LastRow
from engine.runtime.manifest import TTSConfig


class BucketModel(Protocol):
    """What a bucket's buffers read of the model (:class:`engine.model.tts.TTSModel`, which imports this
    module: a protocol here keeps the import one way)."""

    bundle: Bundle
    config: TTSConfig
    layout: GridLayout
    history_pad: int

    @property
    def backbone_session(self) -> ort.InferenceSession: ...

    @property
    def depth_session(self) -> ort.InferenceSession: ...


MIN_HISTORY_WINDOW = 64     # depth history windows are bound in power-of-two sizes from here
# runs of each call in a warm-up that captures: onnxruntime's CUDA provider captures a graph id after its
# regular runs (min_num_runs_before_cuda_graph_capture_: 1 in older releases, 2 in newer), and one more
# replays it
CAPTURE_WARM_RUNS = 3


def bucket_sizes(slots: int) -> tuple[int, ...]:
    """The batch sizes a runner of ``slots`` slots runs its step at: powers of two below ``slots``, then
    ``slots`` itself."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InputError(f"slots must be an integer >= 1, got {slots!r}")
    sizes: list[int] = []
    b = 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return (*sizes, slots)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket of ``sizes`` holding ``rows`` rows."""
    for b in sizes:
        if b >= rows:
            return b
    raise InputError(f"{rows} rows exceed the largest bucket ({sizes[-1]})")


def window_for(window: int) -> int:
    """The bound history window for a batch whose longest history is ``window`` frames: a power of two
    >= MIN_HISTORY_WINDOW (shorter histories are padded on the left with the history pad, which the
    sampler ignores, so results do not depend on it)."""
    w = MIN_HISTORY_WINDOW
    while w < window:
        w *= 2
    return w


def history_windows(longest: int = MAX_REPETITION_WINDOW) -> list[int]:
    """Every bound history window a history of up to ``longest`` frames can take (64, 128, ... 4,096 for the
    longest repetition window a request may set): the depth call shapes a warm-up makes."""
    return [MIN_HISTORY_WINDOW << i for i in range((window_for(longest) // MIN_HISTORY_WINDOW).bit_length())]


# ---------------------------------------------------------------------------------------------- graph ids
@dataclass(frozen=True)
class GraphKey:
    graph: str                              # "backbone" or "depth"
    bucket: int
    window: int = 0                         # the depth's bound history window (0 for the backbone)


@dataclass
class GraphRegistry:
    """Our own ``gpu_graph_id`` → shapes registry. onnxruntime replays whatever graph an id captured, even
    when the bound shapes changed since; every captured run asks :meth:`id_for` with the shapes (and
    addresses) it binds, and a mismatch is refused loudly instead of replaying a graph over the wrong
    memory."""

    _ids: dict[GraphKey, int] = field(default_factory=dict)
    _shapes: dict[int, dict[str, tuple[int, ...]]] = field(default_factory=dict)

    def id_for(self, key: GraphKey, shapes: dict[str, tuple[int, ...]]) -> int:
        """The graph id of ``key`` (a new one, from 1, the first time; onnxruntime's -1 means uncaptured and
        0 is its default), checked against the shapes it was first registered with."""
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        gid = self._ids.get(key)
        if gid is None:
            gid = len(self._ids) + 1
            self._ids[key] = gid
            self._shapes[gid] = shapes
        elif self._shapes[gid] != shapes:
            raise RuntimeError(f"CUDA graph {gid} ({key}) was captured with shapes {self._shapes[gid]}, "
                               f"now bound with {shapes}: refusing to replay it")
        return gid

    def shapes(self, gid: int) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes[gid])

    def __len__(self) -> int:
        return len(self._ids)


def capture_decision(requested: bool | None, device: str, unplaced: dict[str, list[str]]) -> tuple[bool, str]:
    """Whether the step graphs are captured as CUDA graphs, and why (a line for the log).

    ``requested``: the ``--cuda-graphs`` choice (None: on with CUDA, off otherwise); ``unplaced``: per step
    graph, the nodes the placement check does not put on CUDA. Capture needs every node on CUDA: a graph
    with one host node would replay without it, so it is refused and the steps run uncaptured.
    """
    if device != "cuda":
        if requested:
            return False, f"CUDA graphs refused: the graphs run on {device}, not CUDA; running uncaptured"
        return False, "CUDA graphs off (not on CUDA)"
    if requested is False:
        return False, "CUDA graphs off (--cuda-graphs off)"
    bad = {g: nodes for g, nodes in unplaced.items() if nodes}
    if bad:
        detail = "; ".join(f"{g}: {len(n)} nodes off CUDA (e.g. {', '.join(n[:3])})" for g, n in bad.items())
        return False, f"CUDA graphs refused, running uncaptured: {detail}"
    return True, "CUDA graphs on: one captured graph per bucket for the backbone step and the depth call"


# ---------------------------------------------------------------------------------------------- buffers
@dataclass
class BufferStats:
    """Counts for tests and diagnostics: device buffers allocated and binding calls made. After warm-up
    (every bucket and window used once) neither grows."""
    allocations: int = 0
    bindings: int = 0


class _Buffer:
    """A device OrtValue and its host staging array of the same shape and type."""

    def __init__(self, shape: tuple[int, ...], dtype: npt.DTypeLike, device: str, stats: BufferStats,
                 fill: float = 0) -> None:
        self.host = np.full(shape, fill, dtype)
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.host.dtype, device, 0)
        self.value.update_inplace(self.host)        # device memory starts defined (no NaN from garbage)
        stats.allocations += 1

    def upload(self) -> None:
        """Copy the host staging array into the device value."""
        self.value.update_inplace(self.host)


class BucketBuffers:
    """Everything one bucket's step and depth calls bind, allocated and bound once (see the module doc).
    ``capture``: its calls run as captured CUDA graphs when the model captures (one runner per model does:
    the scheduler's; a captured graph replays at the addresses it was captured with)."""

    def __init__(self, bucket: int, model: BucketModel, pool: BackboneKVPool, stats: BufferStats,
                 capture: bool = False) -> None:
        self.bucket, self.model, self.pool, self.stats, self.capture = bucket, model, pool, stats, capture
        device = model.bundle.device
        self.device = device
        B, H, N = bucket, model.config.hidden, model.layout.codebooks
        self.grid = _Buffer((B, 1, N + 1), np.int64, device, stats)
        self.positions = _Buffer((B, 1), np.int64, device, stats)
        self.seqlens = _Buffer((B,), np.int32, device, stats)
        # a shape input (GroupQueryAttention reads it on the host): the slot capacity, constant per pool
        self.total = np.array(pool.capacity, np.int32)
        self.hidden = _Buffer((B, 1, H), np.float32, device, stats)
        self.backbone = model.backbone_session.io_binding()
        self._bind_backbone()
        self.sampler = {
            "repetition_penalty": _Buffer((B,), np.float32, device, stats, 1.0),
            "temperature": _Buffer((B,), np.float32, device, stats, 1.0),
            "top_k": _Buffer((B,), np.int64, device, stats),
            "top_p": _Buffer((B,), np.float32, device, stats, 1.0),
            "greedy": _Buffer((B,), np.bool_, device, stats, True),
            "uniform": _Buffer((B, N), np.float32, device, stats, 0.5),
        }
        self.codes = _Buffer((B, N), np.int64, device, stats)
        self.logits = _Buffer((B, N, model.config.audio_vocab), np.float32, device, stats)
        self.finite = _Buffer((B,), np.bool_, device, stats)
        self._depth: dict[int, tuple[ort.IOBinding, _Buffer]] = {}     # per bound history window
        self.depth_layout: dict[int, dict[str, tuple[int, ...]]] = {}

    # ------------------------------------------------------------------ per-step staging (host arrays)
    def stage_step(self, rows: dict[int, npt.NDArray[np.int64]], lengths: npt.NDArray[np.int64],
                   rider_row: npt.NDArray[np.int64]) -> None:
        """Stage a backbone step: ``rows[slot]`` (a grid row) for the slots that feed one, ``rider_row``
        elsewhere (written at the slot's length: past a stream's valid rows, or into a free slot's rows);
        ``lengths`` are the bucket's slots' current KV lengths."""
        self.grid.host[:] = rider_row
        for slot, row in rows.items():
            self.grid.host[slot, 0] = row
        self.positions.host[:, 0] = lengths
        self.seqlens.host[:] = lengths      # one row per slot: the last valid KV row after the call is `lengths`

    def stage_depth(self, rows: list[tuple[int, npt.NDArray[np.int64], SamplingParams, npt.NDArray[np.float32], bool]],
                    history_pad: int, window: int = 0) -> int:
        """Stage a depth call: per ``(slot, history, params, uniform, first_frame)``; the other rows get
        greedy settings, no penalty and an empty window (their codes are ignored). Returns the bound history
        window to run with: the one the longest history needs, or ``window``'s if that is longer (how a
        warm-up makes each window's call shape on padding rows)."""
        window = window_for(max([window] + [h.shape[0] for _, h, _, _, _ in rows]))
        _, history = self.depth_binding(window)
        s = {name: buf.host for name, buf in self.sampler.items()}
        history.host[:] = history_pad
        s["repetition_penalty"][:], s["temperature"][:], s["top_k"][:], s["top_p"][:] = 1.0, 1.0, 0, 1.0
        s["greedy"][:], s["uniform"][:] = True, 0.5
        for i, h, p, uniform, first in rows:
            history.host[i, window - h.shape[0]:] = h
            s["repetition_penalty"][i] = 1.0 if first else p.repetition_penalty
            s["temperature"][i] = p.temperature if p.temperature > 0 else 1.0
            s["top_k"][i], s["top_p"][i], s["greedy"][i] = p.top_k, p.top_p, p.is_greedy
            s["uniform"][i] = uniform
        return window

    def hidden_row(self, slot: int) -> int:
        """The device address of slot ``slot``'s row of ``hidden`` (where a prefill's last row is copied)."""
        return int(self.hidden.value.data_ptr() + slot * self.hidden.host[0].nbytes)

    # ------------------------------------------------------------------ binding
    def _bind(self, bind: BindFn, name: str, buf: _Buffer, shape: list[int] | None = None) -> None:
        v = buf.value
        element = ELEMENT.get(buf.host.dtype) or helper.np_dtype_to_tensor_dtype(buf.host.dtype)
        bind(name, self.device, 0, element, shape or list(buf.host.shape), v.data_ptr())
        self.stats.bindings += 1

    def _bind_backbone(self) -> None:
        b = self.backbone
        self._bind(b.bind_input, "grid", self.grid)
        self._bind(b.bind_input, "position_ids", self.positions)
        self._bind(b.bind_input, "seqlens_k", self.seqlens)
        b.bind_cpu_input("total_sequence_length", self.total)
        self._bind(b.bind_output, "hidden", self.hidden)
        self.pool.bind(b, 0, self.bucket)
        # what a captured graph bakes in: every bound shape and address (KV as its first layer's key)
        kv = self.pool.tensors[0]
        buffers = _layout({"grid": self.grid, "position_ids": self.positions, "seqlens_k": self.seqlens,
                           "hidden": self.hidden})
        self.backbone_layout = buffers | {"kv": (self.bucket, *kv.shape[1:], kv.view(0, 1)[0])}
        self.stats.bindings += 2 + 2 * len(self.pool.tensors)

    def depth_binding(self, window: int) -> tuple[ort.IOBinding, _Buffer]:
        """The depth call's binding for a bound history ``window`` (made the first time it is used)."""
        if window not in self._depth:
            B, N = self.bucket, self.model.layout.codebooks
            history = _Buffer((B, window, N), np.int64, self.device, self.stats, self.model.history_pad)
            b = self.model.depth_session.io_binding()
            self._bind(b.bind_input, "hidden", self.hidden, [B, self.model.config.hidden])
            self._bind(b.bind_input, "history", history)
            for name, buf in self.sampler.items():
                self._bind(b.bind_input, name, buf)
            for name, buf in (("codes", self.codes), ("logits", self.logits), ("finite", self.finite)):
                self._bind(b.bind_output, name, buf)
            self._depth[window] = (b, history)
            self.depth_layout[window] = _layout({"history": history, "hidden": self.hidden, "codes": self.codes,
                                                 "logits": self.logits, "finite": self.finite, **self.sampler})
        return self._depth[window]


class PrefillBuffers:
    """A runner's prefill outputs, on the device and allocated once: the hidden states of one chunk
    (``chunk_rows`` rows, reused by every chunk of every stream) and per slot the last row of its last
    chunk, kept there until the tick's depth call. The tick's backbone step writes every row of the
    bucket's ``hidden``, riders' too, so that row is copied into the bucket after the step
    (:meth:`to_bucket`). Only row copies on the device: no hidden state goes to the host."""

    def __init__(self, model: BucketModel, slots: int, chunk_rows: int, stats: BufferStats) -> None:
        H, self.device = model.config.hidden, model.bundle.device
        self.hidden = DeviceTensor((chunk_rows, H), self.device)      # float32, as the backbone's output
        self.last = DeviceTensor((slots, H), self.device)
        stats.allocations += 2
        self._copy = LastRow(H, model.bundle.providers)

    def keep_last(self, slot: int, rows: int) -> None:
        """Keep the last of the ``rows`` hidden rows of the chunk just run as slot ``slot``'s."""
        self._copy(self.device, self.hidden.view(0, rows)[0], rows, self.last.view(slot, 1)[0])

    def to_bucket(self, bufs: BucketBuffers, slots: list[int]) -> None:
        """Copy the kept rows of ``slots`` into their rows of the bucket's ``hidden`` (the depth call's input)."""
        for slot in slots:
            self._copy(self.device, self.last.view(slot, 1)[0], 1, bufs.hidden_row(slot))


def _layout(buffers: dict[str, _Buffer]) -> dict[str, tuple[int, ...]]:
    """Each buffer's shape and device address, as the graph registry compares them."""
    return {name: (*buf.host.shape, int(buf.value.data_ptr())) for name, buf in buffers.items()}
