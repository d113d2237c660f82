"""The codec's sliding-window KV rings: per codec stage a ring of each stream's last ``context - 1`` tokens
on the sessions' device, written in place by small graphs (``engine/runtime/device.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from engine.runtime.device import BindFn, DeviceTensor, ZeroFill, _graph, helper_options
from engine.runtime.manifest import CodecStage


@dataclass(frozen=True)
class RingStage:
    layers: int
    heads: int
    head_dim: int
    rows: int              # context - 1
    tokens_per_frame: int

    @classmethod
    def from_spec(cls, spec: CodecStage) -> "RingStage":
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
                 providers: list[str] | None = None) -> None:
        self.side, self.stages, self.slots, self.device = side, stages, slots, device
        providers = providers or ["CPUExecutionProvider"]
        zero = ZeroFill(providers)
        # [layers * 2 * (slots + 1), heads, rows, head_dim]: a layer's K (V) of streams 0..n-1 is one view.
        # Zeroed: masked rows are read with probability 0, and never-written memory must not be NaN (zeroed
        # by a graph on every provider, so on CPU too the rings are resident from the start: DeviceTensor.zeros)
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

    def bind_positions(self, bind: BindFn, name: str, n: int) -> None:
        """Bind the device positions of streams ``0..n-1`` (``bind``: a binding's bind_input/bind_output)."""
        bind(name, self.device, 0, TensorProto.INT64, [n], self.positions.data_ptr())

    def device_buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of every device buffer the state holds: fixed once each call size has run."""
        return [(int(t.value.data_ptr()), int(np.prod(t.shape)) * t.dtype.itemsize)
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
            present = self._presents[si]
            assert present is not None, "prepare() made every stage's new-row buffer"
            present.bind_shaped(binding.bind_output, f"{self.side}.present.{si}", self.present_shape(si, n, frames))

    def advance(self, n: int, frames: npt.NDArray[np.int64], call_frames: int) -> None:
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

    def __init__(self, stages: list[RingStage], slots: int, providers: list[str]) -> None:
        i64, f = TensorProto.INT64, TensorProto.FLOAT
        gb_nodes: list[onnx.NodeProto] = []
        inputs = [helper.make_tensor_value_info("frame_pos", i64, ["n"]),
                  helper.make_tensor_value_info("frames", i64, ["n"])]
        outputs: list[onnx.ValueInfoProto] = []

        def const(name: str, arr: npt.ArrayLike) -> onnx.NodeProto:
            return helper.make_node("Constant", [], [name],
                                    value=numpy_helper.from_array(np.asarray(arr, np.int64), name))

        def ring(name: str, s: RingStage) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, f, [s.layers, 2, slots + 1, s.heads, s.rows, s.head_dim])

        def block(name: str, s: RingStage) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, f, [1, s.heads, s.rows, s.head_dim])

        def vec(name: str, dim: int | str) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, i64, [dim])

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
            inputs += [ring(p + "ring", s),
                       helper.make_tensor_value_info(p + "present", f, [s.layers, 2, "n", s.heads, "T", s.head_dim])]
            outputs.append(ring(p + "out", s))
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
            parts: list[str] = []
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
        self._write = ort.InferenceSession(_graph("ring_write", gb_nodes, inputs, outputs), opts,
                                           providers=providers)
        # move: every (stage, layer, K/V) row block of one slot copied into another slot's memory
        blocks = [(si, i) for si, s in enumerate(stages) for i in range(2 * s.layers)]
        self._copy = ort.InferenceSession(_graph(
            "ring_copy", [node("Identity", [f"src.{si}.{i}"], [f"dst.{si}.{i}"]) for si, i in blocks],
            [block(f"src.{si}.{i}", stages[si]) for si, i in blocks],
            [block(f"dst.{si}.{i}", stages[si]) for si, i in blocks]), opts, providers=providers)
        self._blocks, self._slots = blocks, slots
        self._bound: dict[tuple[int, int], tuple[int, ort.IOBinding, ort.IOBinding]] = {}
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

            def frames(binding: ort.IOBinding, name: str) -> None:
                binding.bind_input(name, "cpu", 0, TensorProto.INT64, [n], state._frames.ctypes.data)

            write = self._write.io_binding()
            state.bind_positions(write.bind_input, "frame_pos", n)
            frames(write, "frames")
            for si, ring in enumerate(state.rings):
                full = state._ring_shape(si, self._slots + 1)
                ring.bind_shaped(write.bind_input, f"stage{si}.ring", full)
                ring.bind_shaped(write.bind_output, f"stage{si}.out", full)         # in place
                present = state._presents[si]
                assert present is not None, "the call's bind() made every stage's new-row buffer"
                present.bind_shaped(write.bind_input, f"stage{si}.present", state.present_shape(si, n, call_frames))
            # the positions move on in a graph of their own: an in-place add inside the write graph would
            # be unordered against the write's reads of the old positions
            advance = self._advance.io_binding()
            state.bind_positions(advance.bind_input, "pos", n)
            frames(advance, "frames")
            state.bind_positions(advance.bind_output, "next", n)
            cached = self._bound[key] = (state.generation, write, advance)
        self._write.run_with_iobinding(cached[1])
        self._advance.run_with_iobinding(cached[2])

    def set_positions(self, state: RingState, index: npt.ArrayLike, values: npt.ArrayLike) -> None:
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
