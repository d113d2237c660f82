"""A small ONNX graph writer: nodes from ops, weights streamed to an external data file.

Graphs are written directly from checkpoint tensors (the onnxruntime-genai model-builder approach).
Every weight goes to ``<graph>.onnx.data`` as soon as it is added, so a multi-GB graph never sits
in memory as protobuf, and the 2 GB protobuf limit never applies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
_ALIGN = 4096  # page-aligned tensors let onnxruntime memory-map external data

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}
ONNX_TO_NAME = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}

Dim = int | str | None


class WeightFile:
    """Appends tensors to one external-data file and hands back TensorProtos that point into it."""

    def __init__(self, path: Path):
        self.path = path
        self._fh = open(path, "wb")
        self._offset = 0

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        pad = (-self._offset) % _ALIGN
        if pad:
            self._fh.write(b"\0" * pad)
            self._offset += pad
        data = array.tobytes()
        self._fh.write(data)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = NP_TO_ONNX[array.dtype]
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self._offset)), ("length", str(len(data)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self._offset += len(data)
        return tensor

    def close(self) -> None:
        self._fh.close()


class GraphBuilder:
    """Builds one ONNX graph. Op helpers return output names; weights go to the external data file.

    ``weight_dtype`` is the storage type of large float weights: with float16 they are stored half-size
    and cast to float32 inside the graph (activations, norms, softmax and RoPE stay float32).
    """

    def __init__(self, name: str, path: Path, weight_dtype: np.dtype = np.dtype(np.float32)):
        self.name = name
        self.path = Path(path)
        self.weight_dtype = np.dtype(weight_dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._weights = WeightFile(self.path.with_name(self.path.name + ".data"))
        self._counter = 0
        self._const_cache: dict[tuple, str] = {}

    # ------------------------------------------------------------------ names and values
    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def input(self, name: str, dtype: int, shape: Sequence[Dim]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, value: str, name: str, dtype: int, shape: Sequence[Dim]) -> str:
        self.op("Identity", [value], out=name)
        self.outputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """A large float weight, stored in ``weight_dtype`` in the external data file, float32 in the graph."""
        array = np.asarray(array, dtype=np.float32)
        # vectors (norm weights, biases, layer scales) stay float32: tiny, and precision-sensitive
        if self.weight_dtype == np.float32 or array.ndim < 2:
            self.initializers.append(self._weights.add(name, array))
            return name
        self.initializers.append(self._weights.add(name + ".stored", array.astype(self.weight_dtype)))
        return self.op("Cast", [name + ".stored"], out=name, to=TensorProto.FLOAT)

    def tensor(self, name: str, array: np.ndarray) -> str:
        """A tensor kept exactly as given (tables, int data) in the external data file."""
        self.initializers.append(self._weights.add(name, np.asarray(array)))
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A small inline constant (scalars, shapes, axes); identical constants are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, n_out: int = 1, **attrs):
        outs = [out] if out is not None else [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    # ------------------------------------------------------------------ op families
    def linear(self, x: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        """``x @ weight.T (+ bias)`` for a torch-layout ``[out, in]`` weight."""
        y = self.op("MatMul", [x, self.weight(name + ".weight_t", np.asarray(weight).T)])
        if bias is not None:
            y = self.op("Add", [y, self.weight(name + ".bias", bias)])
        return y

    def layer_norm(self, x: str, weight: np.ndarray, bias: np.ndarray, name: str, eps: float) -> str:
        return self.op(
            "LayerNormalization",
            [x, self.weight(name + ".weight", weight), self.weight(name + ".bias", bias)],
            axis=-1,
            epsilon=eps,
        )

    def rms_norm(self, x: str, weight: np.ndarray, name: str, eps: float) -> str:
        """``w * x / sqrt(mean(x^2) + eps)`` over the last axis (Qwen3 RMSNorm, float32)."""
        var = self.op("ReduceMean", [self.op("Mul", [x, x]), self.const([-1], np.int64)], keepdims=1)
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [var, self.const(eps)])])])
        return self.op("Mul", [self.weight(name + ".weight", weight), self.op("Mul", [x, inv])])

    def gelu_erf(self, x: str) -> str:
        """Exact GELU: ``0.5 x (1 + erf(x / sqrt 2))``."""
        e = self.op("Erf", [self.op("Div", [x, self.const(np.sqrt(2.0))])])
        return self.op("Mul", [self.op("Mul", [x, self.const(0.5)]), self.op("Add", [e, self.const(1.0)])])

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        return self.op("Reshape", [x, self.const(list(shape), np.int64)])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", [x, self.const(list(axes), np.int64)])

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Squeeze", [x, self.const(list(axes), np.int64)])

    def concat(self, xs: Sequence[str], axis: int) -> str:
        return self.op("Concat", list(xs), axis=axis)

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def arange(self, n: str, dtype=np.int64) -> str:
        """``[0, 1, ..., n-1]`` for a scalar value ``n``."""
        return self.op("Range", [self.const(0, dtype), n, self.const(1, dtype)])

    def dim(self, x: str, axis: int) -> str:
        """Scalar int64 size of ``x`` along ``axis``."""
        return self.squeeze(self.op("Shape", [x], start=axis, end=axis + 1), [0])

    def attention(self, q: str, k: str, v: str, bias: str, scale: float) -> str:
        """``softmax(q k^T * scale + bias) v`` over [B, H, T, D] tensors (k, v may have fewer heads: GQA
        is expanded by the caller)."""
        scores = self.op("MatMul", [q, self.transpose(k, [0, 1, 3, 2])])
        scores = self.op("Add", [self.op("Mul", [scores, self.const(scale)]), bias])
        return self.op("MatMul", [self.op("Softmax", [scores], axis=-1), v])

    # ------------------------------------------------------------------ save
    def save(self, doc: str = "") -> onnx.ModelProto:
        self._weights.close()
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="mossrt-export",
            doc_string=doc,
        )
        model.ir_version = 9
        tmp = self.path.with_name(self.path.name + ".tmp")
        onnx.save_model(model, tmp)
        os.replace(tmp, self.path)
        onnx.checker.check_model(str(self.path))
        return model


def value_info_summary(values: Sequence[onnx.ValueInfoProto]) -> list[dict]:
    """Name, dtype and shape (ints or symbolic names) of graph inputs/outputs, for the manifest."""
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        out.append({"name": v.name, "dtype": ONNX_TO_NAME[t.elem_type], "shape": shape})
    return out
