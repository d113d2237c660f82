"""Host-owned KV memory: the backbone's slot pool and the codec's sliding-window rings.

The backbone's slots and the codec's rings are tensors on the sessions' device (``engine/device.py``),
bound by pointer, and changed on the device by small in-place graphs. Streams live in slots; a call binds a contiguous prefix of slots (or one slot) so no per-step copy
ever grows with the context. When a stream leaves, the last slot's stream is
moved into the hole (one copy of its filled rows) so the active slots stay a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from onnx import TensorProto, helper, numpy_helper

from .device import ELEMENT, DeviceTensor, SlotRows, ZeroFill, _graph, helper_options, slot_rows, stacked_rows


# ---------------------------------------------------------------------------------------------- backbone
class BackboneKVPool:
    """KV of ``slots`` streams, on the sessions' device: per layer K and V ``[slots, kv_heads, rows + 1,
    head_dim]``.

    ``lengths[s]`` rows of slot ``s`` are valid. The graph (GroupQueryAttention) writes a call's new rows
    at ``lengths[s]..`` of the bound memory itself and reads only the valid rows, so the host only moves
    ``lengths``. The extra row is scratch: a stream that rides along in a batched step without being
    fed (it waits for text) has its dummy row written there or beyond its valid rows, never over them.
    Host memory is allocated lazily by the OS, so untouched slots cost no resident memory.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, rows: int,
                 device: str = "cpu", providers: list[str] | None = None, dtype: np.dtype = np.dtype(np.float32)):
        self.layers, self.slots, self.rows = layers, slots, rows
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, device
        self.capacity = rows + 1          # rows per slot in memory, the backbone's total_sequence_length
        self.dtype = np.dtype(dtype)      # the bundle's compute dtype: cached prefixes are kept in it too
        self.tensors = [DeviceTensor((slots, kv_heads, rows + 1, head_dim), device, self.dtype)
                        for _ in range(2 * layers)]
        self._providers = providers or ["CPUExecutionProvider"]
        self._rows = SlotRows(2 * layers, kv_heads, head_dim, self._providers, self.dtype)
        self._blocks: ort.InferenceSession | None = None     # the park/resume copy graph, made at first use
        self.lengths = np.zeros(slots, np.int64)

    @staticmethod
    def bytes_per_slot(layers: int, kv_heads: int, head_dim: int, rows: int,
                       dtype: np.dtype = np.dtype(np.float32)) -> int:
        return layers * 2 * kv_heads * (rows + 1) * head_dim * np.dtype(dtype).itemsize

    @property
    def nbytes_per_slot(self) -> int:
        return sum(t.row_bytes for t in self.tensors)

    def bind(self, binding: ort.IOBinding, lo: int, hi: int) -> None:
        """Bind slots ``lo..hi-1`` as each layer's past and present (the same memory: in place)."""
        for layer in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                t = self.tensors[2 * layer + j]
                t.bind_input(binding, f"past_{kind}.{layer}", lo, hi - lo)
                t.bind_output(binding, f"present_{kind}.{layer}", lo, hi - lo)

    def move(self, src: int, dst: int) -> None:
        """Move the stream of slot ``src`` into slot ``dst``: :meth:`copy_slot`, then the lengths."""
        self.copy_slot(src, dst)
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def copy_slot(self, src: int, dst: int, n: int | None = None) -> None:
        """Copy the first ``n`` rows (default: the filled ones) of slot ``src`` over slot ``dst``, on the device,
        and nothing else: the lengths stay as they are, so a caller moving a stream commits them only once
        every copy of the move succeeded (a failure leaves ``src`` whole and the bookkeeping as it was: the
        retry is exact). One plain copy per (layer, K/V, head) block, as a park's (an indexed scatter took 7x
        as long: 177 against 26 ms for 1,000 rows at real dimensions)."""
        n = int(self.lengths[src]) if n is None else n
        if n:
            self._copy_blocks(n, lambda t, h: (self.device, self._block_ptr(t, src, h)),
                              lambda t, h: (self.device, self._block_ptr(t, dst, h)))

    def host_bytes(self, n: int) -> int:
        """Bytes of a host copy of ``n`` rows (:meth:`park_rows`), known before making it."""
        return 2 * self.layers * self.kv_heads * n * self.head_dim * self.dtype.itemsize

    # A prefix is a device tensor [layers * 2, kv_heads, n, head_dim] of the pool's dtype: index 2 * layer + j
    # holds what the layer's K (j = 0) or V (j = 1) slot holds in its first n rows.
    @staticmethod
    def prefix_rows(prefix: DeviceTensor) -> int:
        """Rows of a prefix."""
        return prefix.shape[2]

    def copy_rows(self, prefix: DeviceTensor, slot: int, n: int | None = None) -> None:
        """Start slot ``slot`` with the first ``n`` (default: all) rows of ``prefix``, on the device."""
        n = self.prefix_rows(prefix) if n is None else n
        self._rows.copy(stacked_rows(prefix), slot_rows(self.tensors, slot), n)
        self.lengths[slot] = n

    def prefix_of(self, slot: int, n: int) -> DeviceTensor:
        """A new prefix holding the first ``n`` rows of slot ``slot`` (a device-to-device copy)."""
        prefix = self._new_prefix(n)
        self._rows.read_into(slot_rows(self.tensors, slot), n, stacked_rows(prefix))
        return prefix

    def upload_prefix(self, rows: np.ndarray) -> DeviceTensor:
        """A new prefix from host rows [layers, 2, kv_heads, n, head_dim] (of the pool's dtype)."""
        prefix = self._new_prefix(rows.shape[3])
        self._rows.write(stacked_rows(prefix), rows.reshape(-1, *rows.shape[2:]))
        return prefix

    def download_prefix(self, prefix: DeviceTensor) -> np.ndarray:
        """A host copy of a prefix, [layers, 2, kv_heads, n, head_dim]."""
        rows = self._rows.read(stacked_rows(prefix), self.prefix_rows(prefix))
        return rows.reshape(self.layers, 2, *rows.shape[1:])

    def _new_prefix(self, n: int) -> DeviceTensor:
        return DeviceTensor((2 * self.layers, self.kv_heads, n, self.head_dim), self.device, self.dtype)

    def park_rows(self, slot: int, n: int) -> np.ndarray:
        """A compact host copy of the first ``n`` rows of a slot, [layers, 2, kv_heads, n, head_dim] (a parked
        stream's context): device to host, one contiguous block per layer, K/V and head."""
        host = np.empty((self.layers, 2, self.kv_heads, n, self.head_dim), self.dtype)
        if n:
            flat = host.reshape(-1, self.kv_heads, n, self.head_dim)       # a view: the same memory
            self._copy_blocks(n, lambda t, h: (self.device, self._block_ptr(t, slot, h)),
                              lambda t, h: ("cpu", flat[t, h].ctypes.data))
        return host

    def write_rows(self, slot: int, rows: np.ndarray, set_length: bool = True) -> None:
        """Start slot ``slot`` with host rows [layers, 2, kv_heads, n, head_dim] (a parked stream's, from
        :meth:`park_rows`): host to device; then its length (``set_length`` False: the caller commits it)."""
        n = rows.shape[3]
        if n:
            flat = np.ascontiguousarray(rows, self.dtype).reshape(-1, self.kv_heads, n, self.head_dim)
            self._copy_blocks(n, lambda t, h: ("cpu", flat[t, h].ctypes.data),
                              lambda t, h: (self.device, self._block_ptr(t, slot, h)))
        if set_length:
            self.lengths[slot] = n

    def _block_ptr(self, tensor: int, slot: int, head: int) -> int:
        """Address of row 0 of one (layer, K/V) tensor's block of ``slot`` and ``head``: its rows are contiguous."""
        t = self.tensors[tensor]
        return t.value.data_ptr() + ((slot * self.kv_heads + head) * self.capacity) * self.head_dim * self.dtype.itemsize

    def _copy_blocks(self, n: int, src, dst) -> None:
        """Copy rows 0..n-1 of every (layer, K/V, head) block from ``src(t, h)`` to ``dst(t, h)`` (each a
        (device, address) pair) in one call of an Identity graph bound to both sides by pointer: a plain copy
        (host to device, device to host, device to device, or a memcpy on CPU), no index tensors. The two sides
        never overlap (different slots, or a host buffer)."""
        if self._blocks is None:
            f = ELEMENT[self.dtype]
            count = 2 * self.layers * self.kv_heads
            io = lambda name: helper.make_tensor_value_info(name, f, ["n", self.head_dim])
            self._blocks = ort.InferenceSession(_graph(
                "kv_blocks", [helper.make_node("Identity", [f"x.{i}"], [f"y.{i}"]) for i in range(count)],
                [io(f"x.{i}") for i in range(count)], [io(f"y.{i}") for i in range(count)]),
                helper_options(), providers=self._providers)
        binding = self._blocks.io_binding()
        f, shape = ELEMENT[self.dtype], [n, self.head_dim]
        for t in range(len(self.tensors)):
            for h in range(self.kv_heads):
                i = t * self.kv_heads + h
                (src_dev, src_ptr), (dst_dev, dst_ptr) = src(t, h), dst(t, h)
                binding.bind_input(f"x.{i}", src_dev, 0, f, shape, src_ptr)
                binding.bind_output(f"y.{i}", dst_dev, 0, f, shape, dst_ptr)
        self._blocks.run_with_iobinding(binding)

    def rows_of(self, slot: int, n: int | None = None) -> np.ndarray:
        """A host copy of the first ``n`` (default: all valid) rows of a slot, [layers, 2, kv_heads, n, head_dim]."""
        n = int(self.lengths[slot]) if n is None else n
        if n == 0:
            return np.zeros((self.layers, 2, self.kv_heads, 0, self.head_dim), self.dtype)
        rows = self._rows.read(slot_rows(self.tensors, slot), n)
        return rows.reshape(self.layers, 2, *rows.shape[1:])


# ---------------------------------------------------------------------------------------------- codec
@dataclass(frozen=True)
class RingStage:
    layers: int
    heads: int
    head_dim: int
    rows: int              # context - 1
    tokens_per_frame: int

    @classmethod
    def from_spec(cls, spec) -> "RingStage":
        return cls(spec.layers, spec.heads, spec.head_dim, spec.context - 1, spec.tokens_per_frame)


class RingState:
    """KV rings and frame positions of ``slots`` independent codec streams (one codec side).

    Per stage a ring ``[layers, 2, slots + 1, heads, context-1, head_dim]`` on the sessions' device: slot
    ``b`` row ``j`` holds stream ``b``'s token at position ``p ≡ j (mod context-1)`` among its last
    ``context-1`` tokens; slot ``slots`` is scratch. The graph derives row positions from the stream's frame
    position alone, so one stream's state is these rows plus one int, and streams at any positions share a
    call. A call binds each layer's rows of streams ``0..n-1`` by pointer as the graph's past, its new rows
    (``present``) go to a device buffer, and :meth:`advance` then scatters them into the rings with one
    small in-place graph, after the call's attention has read the rings: written inside the decode,
    nothing would order a write after the reads of an earlier query whose window still holds that row.
    Riders (0 frames) and rows that fall out of the window write to the scratch slot. The frame positions
    are device memory too, moved on by an in-place add after the write. Only the codes and the frame
    counts (8 bytes per stream) go up and the audio comes down.
    """

    def __init__(self, side: str, stages: list[RingStage], slots: int, device: str = "cpu",
                 providers: list[str] | None = None):
        self.side, self.stages, self.slots, self.device = side, stages, slots, device
        providers = providers or ["CPUExecutionProvider"]
        zero = ZeroFill(providers)
        # [layers * 2 * (slots + 1), heads, rows, head_dim]: a layer's K (V) of streams 0..n-1 is one view.
        # Zeroed: masked rows are read with probability 0, and never-written memory must not be NaN (on CPU
        # from untouched zero pages, so rings cost resident memory only as streams write them)
        self.rings = [DeviceTensor.zeros((s.layers * 2 * (slots + 1), s.heads, s.rows, s.head_dim), device, zero)
                      for s in stages]
        self._presents: list[DeviceTensor | None] = [None] * len(stages)    # grown to the largest call
        # frame positions on the device (the graphs read them there); the host keeps a mirror it never
        # uploads, for frame_positions and for moves
        self.positions = ort.OrtValue.ortvalue_from_shape_and_type([slots + 1], TensorProto.INT64, device, 0)
        self.frame_pos = np.zeros(slots, np.int64)
        self._frames = np.zeros(slots, np.int64)          # the host buffer a call's frame counts go up from
        self.generation = 0                               # bumped when a call buffer is reallocated
        self._writer = _RingWriter(stages, slots, providers)
        self._writer.set_positions(self, np.arange(slots + 1), np.zeros(slots + 1, np.int64))

    @staticmethod
    def bytes_per_stream(stages: list[RingStage]) -> int:
        return sum(s.layers * 2 * s.heads * s.rows * s.head_dim * 4 for s in stages)

    @property
    def nbytes_per_stream(self) -> int:
        return self.bytes_per_stream(self.stages)

    def bind_positions(self, bind, name: str, n: int) -> None:
        """Bind the device positions of streams ``0..n-1`` (``bind``: a binding's bind_input/bind_output)."""
        bind(name, self.device, 0, TensorProto.INT64, [n], self.positions.data_ptr())

    def device_buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of every device buffer the state holds: fixed once each call size has run."""
        return [(t.value.data_ptr(), int(np.prod(t.shape)) * t.dtype.itemsize)
                for t in self.rings + [p for p in self._presents if p is not None]]

    def _ring_shape(self, si: int, n: int) -> list[int]:
        s = self.stages[si]
        return [s.layers, 2, n, s.heads, s.rows, s.head_dim]

    def present_shape(self, si: int, n: int, frames: int) -> list[int]:
        s = self.stages[si]
        return [s.layers, 2, n, s.heads, frames * s.tokens_per_frame, s.head_dim]

    def prepare(self, n: int, frames: int) -> None:
        """Make the new-row buffers large enough for a call of ``n`` streams and ``frames`` frames; growing
        one bumps :attr:`generation` (bindings made before point at freed memory)."""
        for si in range(len(self.stages)):
            size = int(np.prod(self.present_shape(si, n, frames)))
            present = self._presents[si]
            if present is None or int(np.prod(present.shape)) < size:
                self._presents[si] = DeviceTensor((size,), self.device)
                self.generation += 1

    def bind(self, binding: ort.IOBinding, n: int, frames: int) -> None:
        """Bind the rings and frame positions of streams ``0..n-1`` and the device buffers that receive a
        ``frames``-frame call's new rows (allocated when a call is larger than any before)."""
        self.prepare(n, frames)
        self.bind_positions(binding.bind_input, "frame_pos", n)
        for si, (stage, ring) in enumerate(zip(self.stages, self.rings)):
            for layer in range(stage.layers):
                for kv, kind in ((0, "key"), (1, "value")):
                    ring.bind_input(binding, f"{self.side}.past_{kind}.{si}.{layer}",
                                    (2 * layer + kv) * (self.slots + 1), n)
            self._presents[si].bind_shaped(binding.bind_output, f"{self.side}.present.{si}",
                                           self.present_shape(si, n, frames))

    def advance(self, n: int, frames: np.ndarray, call_frames: int) -> None:
        """After a call bound with :meth:`bind` (``n`` streams, ``call_frames`` frames) ran: write each stream's
        first ``frames[b]`` frames of new rows into its ring (on the device) and move its position on;
        streams with 0 frames (riders) are untouched."""
        self._frames[:n] = frames
        self._writer.write(self, n, call_frames)
        self.frame_pos[:n] += self._frames[:n]

    def reset(self, index: int | None = None) -> None:
        """Start stream ``index`` (all when None) afresh at frame 0. Ring rows need no clearing: the graph
        masks every slot a position-0 stream has not written."""
        index_ = np.arange(self.slots) if index is None else np.array([index])
        self._writer.set_positions(self, index_, np.zeros(len(index_), np.int64))
        self.frame_pos[index_] = 0

    def move(self, src: int, dst: int) -> None:
        """Move stream ``src``'s state into slot ``dst`` (its rings on the device); slot ``src`` starts afresh."""
        self._writer.move(self, src, dst)
        self._writer.set_positions(self, np.array([dst, src]), np.array([self.frame_pos[src], 0]))
        self.frame_pos[dst] = self.frame_pos[src]
        self.frame_pos[src] = 0

    def copy_stream(self, src: int, dst: int) -> None:
        """The device half of a move: stream ``src``'s rings and position copied over slot ``dst``, slot ``src``
        left as it is and the host mirror unchanged (a failure leaves ``src`` whole; the retry is exact).
        :meth:`commit_copy` then records it."""
        self._writer.move(self, src, dst)
        self._writer.set_positions(self, np.array([dst]), np.array([self.frame_pos[src]]))

    def commit_copy(self, src: int, dst: int) -> None:
        """The host half of :meth:`copy_stream` (cannot fail): slot ``dst``'s mirrored position. Slot ``src``
        keeps its own, as on the device (it is left to a stream that resets it before its next audio)."""
        self.frame_pos[dst] = self.frame_pos[src]


MAX_CACHED_SHAPES = 64     # call shapes whose bindings are kept (the runner uses a handful)


class _RingWriter:
    """The in-place device graphs on one side's rings: scatter a call's new rows into their ring rows, and
    copy one stream's rings to another slot.

    Ring writes are a ScatterND of the whole present (``[L, 2, n, H, T, Dh]``) into the ring
    ``[L, 2, slots + 1, H, C, Dh]``: token ``k`` of stream ``b`` lands at row ``(frame_pos[b] * tpf + k) mod C``
    of slot ``b`` when it is one of the stream's real tokens and among its last ``C``, else in the scratch
    slot, so the indices are computed on the device and the shapes are fixed per call size."""

    def __init__(self, stages: list[RingStage], slots: int, providers: list[str]):
        i64, f = TensorProto.INT64, TensorProto.FLOAT
        gb_nodes, inputs, outputs = [], [helper.make_tensor_value_info("frame_pos", i64, ["n"]),
                                         helper.make_tensor_value_info("frames", i64, ["n"])], []
        const = lambda name, arr: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.asarray(arr, np.int64), name))
        node = helper.make_node
        gb_nodes += [node("Shape", ["frame_pos"], ["n_vec"]),
                     const("zero", 0), const("one", 1), const("axis1", [1]), const("axis0", [0]),
                     node("Squeeze", ["n_vec"], ["n_scalar"]),
                     node("Range", ["zero", "n_scalar", "one"], ["stream"]),
                     node("Unsqueeze", ["stream", "axis1"], ["stream_col"]),             # [n, 1]
                     node("Unsqueeze", ["frame_pos", "axis1"], ["pos_col"]),
                     node("Unsqueeze", ["frames", "axis1"], ["frames_col"])]
        for si, s in enumerate(stages):
            p = f"stage{si}."
            ring = lambda n: helper.make_tensor_value_info(n, f, [s.layers, 2, slots + 1, s.heads, s.rows, s.head_dim])
            inputs += [ring(p + "ring"),
                       helper.make_tensor_value_info(p + "present", f, [s.layers, 2, "n", s.heads, "T", s.head_dim])]
            outputs.append(ring(p + "out"))
            gb_nodes += [
                node("Shape", [p + "present"], [p + "T_vec"], start=4, end=5),
                node("Squeeze", [p + "T_vec"], [p + "T"]),
                node("Range", ["zero", p + "T", "one"], [p + "k_row"]),
                node("Unsqueeze", [p + "k_row", "axis0"], [p + "k"]),                 # [1, T]
                const(p + "tpf", s.tokens_per_frame), const(p + "C", s.rows), const(p + "scratch", slots),
                node("Mul", ["frames_col", p + "tpf"], [p + "real"]),                   # [n, 1] real tokens
                node("Less", [p + "k", p + "real"], [p + "is_real"]),
                node("Sub", [p + "real", p + "C"], [p + "first"]),
                node("GreaterOrEqual", [p + "k", p + "first"], [p + "in_window"]),
                node("And", [p + "is_real", p + "in_window"], [p + "keep"]),            # [n, T]
                node("Mul", ["pos_col", p + "tpf"], [p + "pos0"]),
                node("Add", [p + "pos0", p + "k"], [p + "pos"]),
                node("Mod", [p + "pos", p + "C"], [p + "row"], fmod=0),
                node("Where", [p + "keep", "stream_col", p + "scratch"], [p + "slot"]),
                const(p + "at", [0, 1, 3, 5]),                                       # [n, T] -> [1, 1, n, 1, T, 1]
                node("Shape", [p + "present"], [p + "lead"], start=0, end=5),
                const(p + "one_vec", [1]),
                node("Concat", [p + "lead", p + "one_vec"], [p + "idx_shape"], axis=0),
            ]
            grids = {"layer": np.arange(s.layers).reshape(-1, 1, 1, 1, 1, 1),
                     "kv": np.arange(2).reshape(1, -1, 1, 1, 1, 1),
                     "head": np.arange(s.heads).reshape(1, 1, 1, -1, 1, 1)}
            parts = []
            for axis in ("layer", "kv", "slot", "head", "row"):
                if axis in grids:
                    gb_nodes.append(const(p + axis + "_grid", grids[axis]))
                    src = p + axis + "_grid"
                else:
                    gb_nodes.append(node("Unsqueeze", [p + axis, p + "at"], [p + axis + "_grid"]))
                    src = p + axis + "_grid"
                gb_nodes.append(node("Expand", [src, p + "idx_shape"], [p + axis + "_idx"]))
                parts.append(p + axis + "_idx")
            gb_nodes += [node("Concat", parts, [p + "indices"], axis=5),
                         node("ScatterND", [p + "ring", p + "indices", p + "present"], [p + "out"])]
        opts = helper_options()
        self._write = ort.InferenceSession(_graph("ring_write", gb_nodes, inputs, outputs), opts, providers=providers)
        # move: every (stage, layer, K/V) row block of one slot copied into another slot's memory
        blocks = [(si, i) for si, s in enumerate(stages) for i in range(2 * s.layers)]
        block = lambda n, s: helper.make_tensor_value_info(n, f, [1, s.heads, s.rows, s.head_dim])
        self._copy = ort.InferenceSession(_graph(
            "ring_copy", [node("Identity", [f"src.{si}.{i}"], [f"dst.{si}.{i}"]) for si, i in blocks],
            [block(f"src.{si}.{i}", stages[si]) for si, i in blocks],
            [block(f"dst.{si}.{i}", stages[si]) for si, i in blocks]), opts, providers=providers)
        self._blocks, self._slots = blocks, slots
        self._bound: dict[tuple[int, int], tuple[int, ort.IOBinding, ort.IOBinding]] = {}
        vec = lambda name, dim: helper.make_tensor_value_info(name, i64, [dim])
        self._advance = ort.InferenceSession(_graph(
            "positions_advance", [node("Add", ["pos", "frames"], ["next"])],
            [vec("pos", "n"), vec("frames", "n")], [vec("next", "n")]), opts, providers=providers)
        self._set = ort.InferenceSession(_graph(
            "positions_set", [node("ScatterElements", ["pos", "index", "values"], ["out"], axis=0)],
            [vec("pos", slots + 1), vec("index", "k"), vec("values", "k")], [vec("out", slots + 1)]),
            opts, providers=providers)

    def write(self, state: RingState, n: int, call_frames: int) -> None:
        """Rows of the call just run (``n`` streams, ``call_frames`` frames; counts in ``state._frames``) into
        the rings, then the positions on. The bindings are made once per call shape (fixed addresses:
        only the frame counts' host buffer changes between calls)."""
        key = (n, call_frames)
        cached = self._bound.get(key)
        if cached is None or cached[0] != state.generation:
            if len(self._bound) > MAX_CACHED_SHAPES:
                self._bound.clear()
            frames = lambda binding, name: binding.bind_input(name, "cpu", 0, TensorProto.INT64, [n],
                                                              state._frames.ctypes.data)
            write = self._write.io_binding()
            state.bind_positions(write.bind_input, "frame_pos", n)
            frames(write, "frames")
            for si, ring in enumerate(state.rings):
                full = state._ring_shape(si, self._slots + 1)
                ring.bind_shaped(write.bind_input, f"stage{si}.ring", full)
                ring.bind_shaped(write.bind_output, f"stage{si}.out", full)         # in place
                state._presents[si].bind_shaped(write.bind_input, f"stage{si}.present",
                                                state.present_shape(si, n, call_frames))
            # the positions move on in a graph of their own: an in-place add inside the write graph would
            # be unordered against the write's reads of the old positions
            advance = self._advance.io_binding()
            state.bind_positions(advance.bind_input, "pos", n)
            frames(advance, "frames")
            state.bind_positions(advance.bind_output, "next", n)
            cached = self._bound[key] = (state.generation, write, advance)
        self._write.run_with_iobinding(cached[1])
        self._advance.run_with_iobinding(cached[2])

    def set_positions(self, state: RingState, index: np.ndarray, values: np.ndarray) -> None:
        """Device positions ``index`` (slots, the scratch slot included) := ``values``, in place."""
        binding = self._set.io_binding()
        state.bind_positions(binding.bind_input, "pos", self._slots + 1)
        binding.bind_cpu_input("index", np.ascontiguousarray(index, np.int64))
        binding.bind_cpu_input("values", np.ascontiguousarray(values, np.int64))
        state.bind_positions(binding.bind_output, "out", self._slots + 1)
        self._set.run_with_iobinding(binding)

    def move(self, state: RingState, src: int, dst: int) -> None:
        binding = self._copy.io_binding()
        for si, i in self._blocks:
            ring = state.rings[si]
            ring.bind_input(binding, f"src.{si}.{i}", i * (self._slots + 1) + src, 1)
            ring.bind_output(binding, f"dst.{si}.{i}", i * (self._slots + 1) + dst, 1)
        self._copy.run_with_iobinding(binding)
