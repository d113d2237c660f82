"""Tensors that live on the sessions' device, and the row copies the host asks of them.

KV memory is allocated as onnxruntime ``OrtValue``s on the bundle's provider (host memory on CPU, GPU
memory on CUDA) and bound to the graphs by pointer, so a step moves none of it across the PCIe bus. The
few operations the host needs on it — keep a slot's first rows as a cached prefix and start a slot with
them, move a stream to another slot, copy a prefill's last hidden row, read rows back — run as tiny graphs
on the same provider that write in place (an output bound to the memory of its input: onnxruntime then
updates only the rows it scatters). One code path: on CPU
the very same graphs run, and every test exercises them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from engine.runtime.threads import give_pool

# the float types a bundle computes in (its manifest's compute_dtype) and their ONNX element types
KV_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
ELEMENT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
           np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16}

# an IOBinding's bind_input or bind_output: (name, device type, device id, element type, shape, address)
BindFn = Callable[[str, str, int, int, list[int], int], None]
# binds one output of a read (an IOBinding, the output's name) to where its rows go
BindOutput = Callable[[Any, str], None]


class DeviceTensor:
    """A tensor of ``dtype`` (a float type of :data:`ELEMENT`) on ``device`` whose leading axis can be bound
    in contiguous pieces. Its address (``value.data_ptr()``) is fixed for its life."""

    def __init__(self, shape: tuple[int, ...], device: str, dtype: np.dtype = np.dtype(np.float32)):
        self.shape = tuple(int(s) for s in shape)
        self.device = device
        self.dtype = np.dtype(dtype)
        if self.dtype not in ELEMENT:
            raise ValueError(f"device tensors hold {sorted(str(d) for d in ELEMENT)}, not {self.dtype}")
        # element types as ONNX ints: onnxruntime's Python API takes no numpy bfloat16
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), ELEMENT[self.dtype], device, 0)
        # bytes of one index of the leading axis
        self.row_bytes = int(np.prod(self.shape[1:])) * self.dtype.itemsize

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: str, fill: "ZeroFill",
              dtype: np.dtype = np.dtype(np.float32)) -> "DeviceTensor":
        """A tensor set to zero now, by ``fill`` on its device, on every provider. Fresh memory is
        uninitialised on a GPU; on CPU, zero pages the OS maps lazily (np.zeros) would be faulted in on their
        first use instead, and a codec ring is read whole by its stream's first decode, so those faults would
        land in the first frame of every slot's first stream (measured in docs/performance.md). So the memory
        is resident from the start: what every slot needs at full load anyway."""
        tensor = cls(shape, device, dtype)
        fill(tensor)
        return tensor

    def view(self, start: int, count: int) -> tuple[int, list[int]]:
        """(pointer, shape) of ``tensor[start:start+count]``."""
        return self.value.data_ptr() + start * self.row_bytes, [count, *self.shape[1:]]

    def bind_input(self, binding: ort.IOBinding, name: str, start: int, count: int) -> None:
        ptr, shape = self.view(start, count)
        binding.bind_input(name, self.device, 0, ELEMENT[self.dtype], shape, ptr)

    def bind_output(self, binding: ort.IOBinding, name: str, start: int, count: int) -> None:
        ptr, shape = self.view(start, count)
        binding.bind_output(name, self.device, 0, ELEMENT[self.dtype], shape, ptr)

    def bind_shaped(self, bind: BindFn, name: str, shape: list[int]) -> None:
        """Bind the tensor's first ``prod(shape)`` elements as ``shape`` (``bind`` is a binding's
        ``bind_input`` or ``bind_output``): one buffer serves calls of any size up to its own."""
        if int(np.prod(shape)) > int(np.prod(self.shape)):
            raise ValueError(f"shape {shape} does not fit a device tensor of shape {list(self.shape)}")
        bind(name, self.device, 0, ELEMENT[self.dtype], list(shape), self.value.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


def _graph(name: str, nodes: Sequence[onnx.NodeProto], inputs: Sequence[onnx.ValueInfoProto],
           outputs: Sequence[onnx.ValueInfoProto]) -> bytes:
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18)], producer_name="mossrt-engine")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def helper_options() -> ort.SessionOptions:
    """Options of the engine's small in-place graphs (fills, slot and ring copies): one thread, the caller's,
    or the process's shared pool when it has one (every session must then use it). They move memory; a
    default intra-op pool would only spin its threads after every run, taking CPU from the step graphs."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    give_pool(opts, 1)
    return opts


class ZeroFill:
    """Sets device tensors to zero in place (ConstantOfShape written into their memory). Fresh device
    memory is uninitialised, and attention masks a key by giving it probability 0: 0 × a NaN left in a
    never-written row is still NaN, so KV memory that masked reads may touch is zeroed once at allocation."""

    def __init__(self, providers: list[str]) -> None:
        self._sessions: dict[tuple[np.dtype, int], ort.InferenceSession] = {}   # per (dtype, rank)
        self._providers = providers

    def __call__(self, tensor: DeviceTensor) -> None:
        key = (tensor.dtype, len(tensor.shape))
        if key not in self._sessions:
            shape = helper.make_tensor_value_info("shape", TensorProto.INT64, ["rank"])
            out = helper.make_tensor_value_info("zeros", ELEMENT[tensor.dtype],
                                                [f"d{i}" for i in range(len(tensor.shape))])
            node = helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                                    value=helper.make_tensor("zero", ELEMENT[tensor.dtype], [1], [0]))
            self._sessions[key] = ort.InferenceSession(_graph("zero_fill", [node], [shape], [out]), helper_options(),
                                                                providers=self._providers)
        session = self._sessions[key]
        binding = session.io_binding()
        binding.bind_cpu_input("shape", np.array(tensor.shape, np.int64))
        tensor.bind_shaped(binding.bind_output, "zeros", list(tensor.shape))
        session.run_with_iobinding(binding)


class LastRow:
    """Copies the last row of ``[1, T, width]`` float32 device memory into a ``[1, 1, width]`` row of other
    device memory (a prefill chunk's last hidden state into the row the depth call reads): a Slice whose
    output is bound to the destination, so nothing crosses to the host."""

    def __init__(self, width: int, providers: list[str]) -> None:
        f, i64 = TensorProto.FLOAT, TensorProto.INT64

        def const(name: str, v: int) -> onnx.NodeProto:
            return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, i64, [1], [v]))

        nodes = [const("start", -1), const("end", 2**62), const("axis", 1),
                 helper.make_node("Slice", ["rows", "start", "end", "axis"], ["last"])]
        graph = _graph("last_row", nodes, [helper.make_tensor_value_info("rows", f, [1, "T", width])],
                       [helper.make_tensor_value_info("last", f, [1, 1, width])])
        self.width = width
        self._session = ort.InferenceSession(graph, helper_options(), providers=providers)

    def __call__(self, device: str, src: int, rows: int, dst: int) -> None:
        """Row ``rows - 1`` of the ``rows`` rows at address ``src`` into the row at address ``dst``."""
        binding = self._session.io_binding()
        binding.bind_input("rows", device, 0, TensorProto.FLOAT, [1, rows, self.width], src)
        binding.bind_output("last", device, 0, TensorProto.FLOAT, [1, 1, self.width], dst)
        self._session.run_with_iobinding(binding)


# ``count`` views ``[1, heads, rows, dim]`` of one layout, each (tensor, index on its leading axis): a slot
# of every layer's K and V (``slot_rows``), or the ``count`` indices of one tensor (``stacked_rows``)
Rows = list[tuple[DeviceTensor, int]]


def slot_rows(tensors: list[DeviceTensor], slot: int) -> Rows:
    """Slot ``slot`` of each of ``tensors`` (``[slots, heads, rows, dim]``)."""
    return [(t, slot) for t in tensors]


def stacked_rows(tensor: DeviceTensor) -> Rows:
    """Every index of ``tensor``'s leading axis (``[count, heads, rows, dim]``): one tensor holding what
    ``count`` slots hold, e.g. a cached prefix."""
    return [(tensor, k) for k in range(tensor.shape[0])]


class SlotRows:
    """Row operations on ``count`` views ``[1, heads, rows, dim]`` that share a layout (:data:`Rows`: a slot of
    each layer's K and V, or a stacked tensor of them): write host rows into them, copy their first rows to
    other views (slot to slot, slot to a stacked tensor and back: all on the device), read them back.
    Rows move in the tensors' own ``dtype`` (host copies too: a float16 slot's rows are float16)."""

    def __init__(self, count: int, heads: int, dim: int, providers: list[str],
                 dtype: np.dtype = np.dtype(np.float32)) -> None:
        self.count, self.heads, self.dim, self.dtype = count, heads, dim, np.dtype(dtype)
        f, i64 = ELEMENT[self.dtype], TensorProto.INT64

        def slot(n: str) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(n, f, [1, heads, "rows", dim])

        def rows(n: str) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(n, f, [1, heads, "n", dim])

        n_in = helper.make_tensor_value_info("n", i64, [1])

        def index_nodes(src: str) -> list[onnx.NodeProto]:
            # row indices 0..n-1 broadcast to the updates' shape, for ScatterElements along the rows axis
            return [helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", i64, [], [0])),
                    helper.make_node("Constant", [], ["one"], value=helper.make_tensor("o", i64, [], [1])),
                    helper.make_node("Squeeze", ["n"], ["n_scalar"]),
                    helper.make_node("Range", ["zero", "n_scalar", "one"], ["r"]),
                    helper.make_node("Constant", [], ["col"], value=helper.make_tensor("c", i64, [4], [1, 1, -1, 1])),
                    helper.make_node("Reshape", ["r", "col"], ["r4"]),
                    helper.make_node("Shape", [src], ["upd_shape"]),
                    helper.make_node("Expand", ["r4", "upd_shape"], ["idx"])]

        # write: dst.k (in place) <- upd.k at rows 0..n-1
        nodes = index_nodes("upd.0")
        nodes += [helper.make_node("ScatterElements", [f"dst.{k}", "idx", f"upd.{k}"], [f"out.{k}"], axis=2)
                  for k in range(count)]
        write = _graph("slot_write", nodes, [slot(f"dst.{k}") for k in range(count)]
                       + [rows(f"upd.{k}") for k in range(count)] + [n_in],
                       [slot(f"out.{k}") for k in range(count)])
        # copy: dst.k (in place) <- src.k[:, :, :n]
        nodes = [helper.make_node("Constant", [], ["zeros"], value=helper.make_tensor("zz", i64, [1], [0])),
                 helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("ax", i64, [1], [2]))]
        nodes += [helper.make_node("Slice", [f"src.{k}", "zeros", "n", "axis"], [f"upd.{k}"]) for k in range(count)]
        nodes += index_nodes("upd.0")
        nodes += [helper.make_node("ScatterElements", [f"dst.{k}", "idx", f"upd.{k}"], [f"out.{k}"], axis=2)
                  for k in range(count)]
        copy = _graph("slot_copy", nodes, [slot(f"dst.{k}") for k in range(count)]
                      + [slot(f"src.{k}") for k in range(count)] + [n_in], [slot(f"out.{k}") for k in range(count)])
        # read: src.k[:, :, :n]
        nodes = [helper.make_node("Constant", [], ["zeros"], value=helper.make_tensor("zz", i64, [1], [0])),
                 helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("ax", i64, [1], [2]))]
        nodes += [helper.make_node("Slice", [f"src.{k}", "zeros", "n", "axis"], [f"rows.{k}"]) for k in range(count)]
        read = _graph("slot_read", nodes, [slot(f"src.{k}") for k in range(count)] + [n_in],
                      [rows(f"rows.{k}") for k in range(count)])
        opts = helper_options()
        self._sessions = {name: ort.InferenceSession(g, opts, providers=providers)
                          for name, g in (("write", write), ("copy", copy), ("read", read))}

    def _bind_dst(self, binding: ort.IOBinding, dst: Rows) -> None:
        for k, (t, i) in enumerate(dst):
            t.bind_input(binding, f"dst.{k}", i, 1)
            t.bind_output(binding, f"out.{k}", i, 1)          # in place: only the scattered rows change

    def write(self, dst: Rows, rows: np.ndarray) -> None:
        """``rows`` [count, heads, n, dim] (host) into rows 0..n-1 of every view of ``dst``."""
        session = self._sessions["write"]
        binding = session.io_binding()
        self._bind_dst(binding, dst)
        host = np.ascontiguousarray(rows, dtype=self.dtype)
        for k in range(len(dst)):
            self._bind_host(binding.bind_input, f"upd.{k}", host[k][None])
        binding.bind_cpu_input("n", np.array([rows.shape[2]], np.int64))
        session.run_with_iobinding(binding)

    def copy(self, src: Rows, dst: Rows, n: int) -> None:
        """Rows 0..n-1 of every view of ``src`` into the same rows of ``dst`` (on the device)."""
        if n == 0:
            return
        session = self._sessions["copy"]
        binding = session.io_binding()
        self._bind_dst(binding, dst)
        for k, (t, i) in enumerate(src):
            t.bind_input(binding, f"src.{k}", i, 1)
        binding.bind_cpu_input("n", np.array([n], np.int64))
        session.run_with_iobinding(binding)

    def read(self, src: Rows, n: int) -> np.ndarray:
        """Rows 0..n-1 of every view of ``src``, on the host: [count, heads, n, dim]."""
        out = np.empty((len(src), 1, self.heads, n, self.dim), self.dtype)

        def to_host(k: int) -> BindOutput:
            return lambda binding, name: self._bind_host(binding.bind_output, name, out[k])

        self._read(src, n, [to_host(k) for k in range(len(src))])
        return out[:, 0]

    def read_into(self, src: Rows, n: int, dst: Rows) -> None:
        """Rows 0..n-1 of every view of ``src`` as the whole of ``dst``'s views (``n`` rows each), on the
        device: no host round trip."""

        def to_view(t: DeviceTensor, i: int) -> BindOutput:
            return lambda binding, name: t.bind_output(binding, name, i, 1)

        self._read(src, n, [to_view(t, i) for t, i in dst])

    def _read(self, src: Rows, n: int, bind_outputs: Sequence[BindOutput]) -> None:
        session = self._sessions["read"]
        binding = session.io_binding()
        for k, ((t, i), bind_out) in enumerate(zip(src, bind_outputs)):
            t.bind_input(binding, f"src.{k}", i, 1)
            bind_out(binding, f"rows.{k}")
        binding.bind_cpu_input("n", np.array([n], np.int64))
        session.run_with_iobinding(binding)

    def _bind_host(self, bind: BindFn, name: str, array: np.ndarray) -> None:
        """Bind a contiguous host array by pointer with the ONNX element type (so bfloat16 works too); the
        caller keeps ``array`` alive until the run ends."""
        bind(name, "cpu", 0, ELEMENT[self.dtype], list(array.shape), array.ctypes.data)
