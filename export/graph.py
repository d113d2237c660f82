"""A small ONNX graph writer: nodes from ops, weights streamed to an external data file.

Graphs are written directly from checkpoint tensors (the onnxruntime-genai model-builder approach).
Every weight goes to ``<graph>.onnx.data`` as soon as it is added, so a multi-GB graph never sits
in memory as protobuf, and the 2 GB protobuf limit never applies.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
_ALIGN = 4096  # page-aligned tensors let onnxruntime memory-map external data

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}
ONNX_TO_NAME: dict[int, str] = {           # keyed by TensorProto.DataType, the int a tensor type's elem_type holds
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}

Dim = int | str | None

# Compute dtypes (``mossrt export --compute-dtype``): the type of activations, KV and float constants.
COMPUTE_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}

# Quantized matmul weights (com.microsoft.MatMulNBits): symmetric, one scale per block of this many inputs of
# a weight row. accuracy_level 4 lets the CPU kernel quantize the activations to int8 per block as well (MLAS
# has no fast float32-compute path for 8-bit weights: level 1 dequantizes the whole weight every call), so the
# block also sets how often its inner loop applies a scale. 8 bits default to 64: fewer scale bytes and block
# steps than 32 with no worse agreement, and the agreement tests' floors are measured at 64. 4 bits keep 32: a
# coarser block costs them accuracy. The CUDA kernel computes in the activation type regardless. The
# measurements: docs/performance.md (int8 in blocks of 64) and docs/export.md (int8 in blocks of 128).
INT8_BLOCK = 64
# The int8 blocks `mossrt export --int8-block` offers. 128 halves the scales and the kernel's block steps again,
# for a little more error: faster on some CPUs and not on others, and a trained checkpoint may lose more than
# random weights do, so it is a choice, not the default. Larger blocks are not offered: they were no faster than
# 128 where measured (docs/export.md).
INT8_BLOCKS = (64, 128)
INT4_BLOCK = 32
INT8_ACCURACY_LEVEL = 4


def quantize_blocks(weight: np.ndarray, block: int, bits: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``bits``-bit (4 or 8) per block of ``block`` input channels of a ``[out, in]`` weight, in
    the ``MatMulNBits`` layout: packed ``[out, blocks, block * bits / 8]`` uint8 (4 bits: element 2i in the
    low nibble, zero point 8; 8 bits: zero point 128) and scales ``[out * blocks]`` (``max|w| / 7`` or
    ``/ 127`` per block, 0 for an all-zero block)."""
    n, k = weight.shape
    blocks = -(-k // block)
    top = {4: 7, 8: 127}[bits]
    w = np.zeros((n, blocks * block), np.float32)
    w[:, :k] = weight
    w = w.reshape(n, blocks, block)
    scale = (np.abs(w).max(axis=2, keepdims=True) / np.float32(top)).astype(np.float32)
    q = np.divide(w, scale, out=np.zeros_like(w), where=scale > 0)
    q = (np.clip(np.rint(q), -top - (bits == 4), top) + top + 1).astype(np.uint8)
    packed = q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale.reshape(-1)


def quantize_int4_blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_blocks` at 4 bits."""
    return quantize_blocks(weight, block, 4)


def quantize_int8(array: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one float32 scale per index of ``axis``: ``array ≈ q * scale``.

    ``scale = max|w| / 127`` over every other axis, ``q = rint(w / scale)``; an all-zero channel gets
    scale 0 and q 0 (so kernels that fold activation sums with the scale still give exactly 0).
    """
    array = np.asarray(array, dtype=np.float32)
    axis = axis % array.ndim
    others = tuple(i for i in range(array.ndim) if i != axis)
    scale = (np.abs(array).max(axis=others, keepdims=True) / np.float32(127.0)).astype(np.float32)
    q = np.divide(array, scale, out=np.zeros_like(array), where=scale > 0)
    q = np.clip(np.rint(q), -127, 127).astype(np.int8)
    return q, scale.reshape(-1)


def _register_onnxruntime_schemas() -> None:
    """Teach onnx's checker onnxruntime's ``SimplifiedLayerNormalization``: onnxruntime registers it (CPU and
    CUDA kernels) in the default ONNX domain, where onnx itself has no such op."""
    from onnx.defs import OpSchema, has, register_schema

    if has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    P, A = OpSchema.FormalParameter, OpSchema.Attribute
    optional = OpSchema.FormalParameterOption.Optional
    register_schema(OpSchema(
        "SimplifiedLayerNormalization", "", 1, "onnxruntime's RMSNorm: X / sqrt(mean(X^2) + epsilon) * scale",
        inputs=[P("X", "T"), P("scale", "V")], outputs=[P("Y", "V"), P("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", floats, ""), ("U", ["tensor(float)", "tensor(double)"], ""), ("V", floats, "")],
        attributes=[A("axis", OpSchema.AttrType.INT, "", required=False),
                    A("epsilon", OpSchema.AttrType.FLOAT, "", required=False),
                    A("stash_type", OpSchema.AttrType.INT, "", required=False)]))


_register_onnxruntime_schemas()


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
        data = array.reshape(-1).view(np.uint8)   # the array's own bytes: no copy of a multi-GB table
        self._fh.write(data.data)
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

    ``weight_dtype`` is the storage type of large float weights (float32, float16, bfloat16, or int8:
    symmetric per-channel, see :meth:`weight` and :meth:`matmul_weight`); ``compute_dtype`` the type
    everything float in the graph computes in (float32, float16 or bfloat16): weights are widened or
    narrowed to it (no Cast when storage and compute agree), float constants, zeros and norm vectors are
    made in it, and :attr:`float_type` is its ONNX type for the graph's own inputs, outputs and casts.
    A part that must stay float32 (the sampler after the logits) builds inside :meth:`computing`.
    The fused norms (SimplifiedLayerNormalization) accumulate in float32 for every compute dtype.
    """

    def __init__(self, name: str, path: Path, weight_dtype: np.dtype = np.dtype(np.float32),
                 block_size: int | None = None, int8_accuracy_level: int = INT8_ACCURACY_LEVEL,
                 matmul_bits: int = 8, compute_dtype: np.dtype = np.dtype(np.float32)):
        if np.dtype(compute_dtype) not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute dtype must be float32, float16 or bfloat16, got {np.dtype(compute_dtype)}")
        self.compute_dtype = np.dtype(compute_dtype)
        self.name = name
        # with weight_dtype int8: 8 = per-channel int8 matmul weights, 4 = per-block int4 (embeddings fp16)
        if matmul_bits not in (4, 8):
            raise ValueError(f"matmul_bits must be 4 or 8, got {matmul_bits}")
        self.matmul_bits = matmul_bits
        self.path = Path(path)
        self.weight_dtype = np.dtype(weight_dtype)
        # quantized matmul weights: one scale per block of this many inputs (a power of two, >= 16)
        self.block_size = block_size or {8: INT8_BLOCK, 4: INT4_BLOCK}[matmul_bits]
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        self.int8_accuracy_level = int8_accuracy_level
        self._nbits: dict[str, tuple[int, int]] = {}   # matmul_weight name → (K, N) of a MatMulNBits weight
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._weights = WeightFile(self.path.with_name(self.path.name + ".data"))
        self._counter = 0
        self._const_cache: dict[tuple, str] = {}
        self._scope: list[str] = []

    # ------------------------------------------------------------------ compute dtype
    @property
    def float_type(self) -> int:
        """The ONNX element type of the compute dtype (for inputs, outputs and casts)."""
        return NP_TO_ONNX[self.compute_dtype]

    @contextlib.contextmanager
    def computing(self, dtype: npt.DTypeLike) -> Iterator[None]:
        """Build the nodes made inside in ``dtype`` (e.g. a float32 sampler after float16 logits: cast the
        logits with ``gb.cast(logits, TensorProto.FLOAT)`` first)."""
        outer, self.compute_dtype = self.compute_dtype, np.dtype(dtype)
        try:
            yield
        finally:
            self.compute_dtype = outer

    def to_compute(self, x: str, dtype: npt.DTypeLike) -> str:
        """``x`` (of numpy type ``dtype``) in the compute dtype: a Cast only where the types differ."""
        return x if np.dtype(dtype) == self.compute_dtype else self.cast(x, self.float_type)

    # ------------------------------------------------------------------ names and values
    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Nodes and values made inside are named after this module path (``language_model.layers.3.self_attn``),
        so an onnxruntime profile or a graph viewer reads like the model."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def fresh(self, hint: str) -> str:
        self._counter += 1
        prefix = "/".join(self._scope) + "/" if self._scope else ""
        return f"{prefix}{hint}_{self._counter}"

    def input(self, name: str, dtype: int, shape: Sequence[Dim]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, value: str, name: str, dtype: int, shape: Sequence[Dim]) -> str:
        """Make ``value`` a graph output called ``name``: the producing node's output is renamed (and every
        consumer with it), so an output costs no node; a graph input, weight or existing output gets an
        Identity."""
        producer = next((n for n in reversed(self.nodes) if value in n.output), None)
        if producer is None or any(o.name == value for o in self.outputs):
            self.op("Identity", [value], out=name)
        else:
            for node in self.nodes:
                for field in (node.input, node.output):
                    for i, v in enumerate(field):
                        if v == value:
                            field[i] = name
        return self.declare_output(name, dtype, shape)

    def declare_output(self, name: str, dtype: int, shape: Sequence[Dim]) -> str:
        """Make an existing value (produced under this very name) a graph output, with no Identity in between:
        outputs the host binds to input memory (in-place KV) must be the producing node's own outputs."""
        self.outputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def weight(self, name: str, array: np.ndarray, channel_axis: int = -1) -> str:
        """A large float weight, stored in ``weight_dtype`` in the external data file, in the compute dtype
        in the graph (stored as is where the two agree, else cast once).

        With ``weight_dtype`` int8 the weight is stored as symmetric int8 with one scale (in the compute
        dtype) per index of ``channel_axis`` (the output channel of a ``[in, out]`` matmul weight by
        default) and widened by a per-axis ``DequantizeLinear``.
        """
        array = np.asarray(array, dtype=np.float32)
        # vectors (norm weights, biases, layer scales) are stored in the compute dtype: tiny, and the fused
        # norms take their scale in the input's type
        if self.weight_dtype == self.compute_dtype or array.ndim < 2:
            self.initializers.append(self._weights.add(name, array.astype(self.compute_dtype)))
            return name
        if self.weight_dtype == np.int8:
            axis = channel_axis % array.ndim
            q, scale = quantize_int8(array, axis)
            self.initializers.append(self._weights.add(name + ".q", q))
            self.initializers.append(self._weights.add(name + ".scale", scale.astype(self.compute_dtype)))
            return self.op("DequantizeLinear", [name + ".q", name + ".scale"], out=name, axis=axis)
        self.initializers.append(self._weights.add(name + ".stored", array.astype(self.weight_dtype)))
        return self.op("Cast", [name + ".stored"], out=name, to=self.float_type)

    def matmul_weight(self, weight: np.ndarray, name: str) -> str:
        """Store a torch-layout ``[out, in]`` linear weight once; returns a handle for :meth:`matmul`.

        For weights read by several nodes (an unrolled loop) where :meth:`linear` would store copies.
        float32/float16: the ``[in, out]`` transpose (float16 widened by a Cast). int8: symmetric
        ``matmul_bits``-bit integers with one scale per block of :attr:`block_size` inputs of each output
        row, in the ``com.microsoft.MatMulNBits`` layout so the matmul reads the quantized weight directly
        (one packed initializer can feed many nodes; a shared DequantizeLinear would be duplicated per consumer
        and re-run every call by onnxruntime).
        """
        weight = np.asarray(weight)
        if self.weight_dtype != np.int8:
            return self.weight(name + ".weight_t", weight.T, channel_axis=1)
        packed, scales = quantize_blocks(np.asarray(weight, np.float32), self.block_size, self.matmul_bits)
        self.tensor(name + ".qw", packed)
        self.tensor(name + ".qw_scale", scales.astype(self.compute_dtype))   # MatMulNBits: scales in A's type
        self._nbits[name] = weight.shape[::-1]
        return name

    def matmul(self, x: str, weight: str) -> str:
        """``x @ W^T`` for a :meth:`matmul_weight` handle (MatMulNBits for int8 weights)."""
        if weight not in self._nbits:
            return self.op("MatMul", [x, weight])
        k, n = self._nbits[weight]
        return self.op("MatMulNBits", [x, weight + ".qw", weight + ".qw_scale"], domain="com.microsoft",
                       K=k, N=n, bits=self.matmul_bits, block_size=self.block_size,
                       accuracy_level=self.int8_accuracy_level)

    def embedding(self, ids: str, table: np.ndarray, name: str) -> str:
        """Rows ``table[ids]`` in the compute dtype. Rows are gathered in storage type and cast afterwards,
        so a large table is never converted whole. Storage: ``weight_dtype``, except int8 builds keep tables
        in float16 (int8 is for matmul weights only)."""
        table = np.asarray(table)
        store = np.dtype(np.float16) if self.weight_dtype == np.int8 else self.weight_dtype
        if store == self.compute_dtype:
            return self.op("Gather", [self.tensor(name + ".weight", table.astype(store, copy=False)), ids], axis=0)
        rows = self.op("Gather", [self.tensor(name + ".stored", table.astype(store)), ids], axis=0)
        return self.cast(rows, self.float_type)

    def tensor(self, name: str, array: np.ndarray) -> str:
        """A tensor kept exactly as given (tables, int data) in the external data file."""
        self.initializers.append(self._weights.add(name, np.asarray(array)))
        return name

    def const(self, value, dtype=None) -> str:
        """A small inline constant (scalars, shapes, axes); identical constants are shared. Without
        ``dtype``, a float constant in the compute dtype."""
        array = np.asarray(value, dtype=self.compute_dtype if dtype is None else dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, n_out: int = 1,
           outs: Sequence[str] | None = None, **attrs):
        """Add a node; returns its output name (a list when ``n_out`` > 1). ``out``/``outs`` name the outputs."""
        if outs is not None:
            outs, n_out = list(outs), len(outs)
        else:
            outs = [out] if out is not None else [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # ------------------------------------------------------------------ op families
    def linear(self, x: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        """``x @ weight.T (+ bias)`` for a torch-layout ``[out, in]`` weight."""
        y = self.matmul(x, self.matmul_weight(np.asarray(weight), name))
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

    def rms_norm_named(self, x: str, weight: str, eps: float) -> str:
        """Qwen3 RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` over the last axis with an already-added weight
        (shared by several nodes): one ``SimplifiedLayerNormalization`` node (onnxruntime's RMSNorm, CPU and
        CUDA kernels for float32, float16 and bfloat16; the mean of squares accumulates in float32)."""
        return self.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps, stash_type=1)

    def skip_rms_norm(self, x: str, delta: str, weight: str, eps: float) -> tuple[str, str]:
        """RMSNorm of the residual sum ``x + delta`` and the sum itself, as one
        ``com.microsoft.SkipSimplifiedLayerNormalization`` (the residual add fused into the next norm)."""
        normed, total = self.op("SkipSimplifiedLayerNormalization", [x, delta, weight], domain="com.microsoft",
                                outs=[self.fresh("skip_rms_norm"), "", "", self.fresh("residual")], epsilon=eps)[::3]
        return normed, total

    def silu(self, x: str) -> str:
        """``x * sigmoid(x)`` as one ``com.microsoft.QuickGelu`` (alpha 1): the node onnxruntime's own fusion
        makes of Mul(x, Sigmoid(x)) at load (same kernel, same numbers), written out so the graph file says
        what runs; CPU kernels for float32/float16, CUDA for float32/float16/bfloat16."""
        return self.op("QuickGelu", [x], domain="com.microsoft", alpha=1.0)

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

    def zeros(self, shape: str) -> str:
        """Zeros in the compute dtype of the shape held in the int64 value ``shape``."""
        return self.op("ConstantOfShape", [shape],
                       value=numpy_helper.from_array(np.zeros(1, self.compute_dtype), "zero"))

    def arange(self, n: str, dtype=np.int64) -> str:
        """``[0, 1, ..., n-1]`` for a scalar value ``n``."""
        return self.op("Range", [self.const(0, dtype), n, self.const(1, dtype)])

    def dim(self, x: str, axis: int) -> str:
        """Scalar int64 size of ``x`` along ``axis``."""
        return self.squeeze(self.op("Shape", [x], start=axis, end=axis + 1), [0])

    # ------------------------------------------------------------------ save
    def save(self, doc: str = "") -> onnx.ModelProto:
        self._weights.close()
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(
            graph,
            opset_imports=opsets,
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
