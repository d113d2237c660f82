"""Node counts of a bundle's graphs: what each call launches (one kernel per node, before onnxruntime's
own fusions), the figure the GPU work is measured by."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import onnx

from engine.runtime.bundle import Bundle


def node_counts(bundle: Bundle) -> dict[str, Counter[str]]:
    """Per graph of ``bundle``, its nodes by op type (the graph file only: weights are not read)."""
    counts: dict[str, Counter[str]] = {}
    for name, entry in sorted(bundle.info.graphs.items()):
        model = onnx.load(str(bundle.file_path(entry.file)), load_external_data=False)
        counts[name] = Counter(node.op_type for node in model.graph.node)
    return counts


def node_count_lines(counts: dict[str, Counter[str]], top: int = 6) -> list[str]:
    """One line per graph: total nodes and its most frequent op types."""
    return [f"  {name:<22} {sum(c.values()):6,} nodes  ("
            + ", ".join(f"{op} {n}" for op, n in c.most_common(top)) + ")" for name, c in counts.items()]


# what a weight widened by one of these nodes costs: onnxruntime folds them at load (an initializer in,
# an initializer out), so every consumer reads the widened tensor
_WIDENING = ("Cast", "DequantizeLinear")
# inputs that are tables a call reads a few rows of (by ids or positions): not counted
_ROW_TABLES = {("Gather", 0), ("RotaryEmbedding", 2), ("RotaryEmbedding", 3)}


def _tensor_bytes(dims: Sequence[int], elem_type: int) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n * onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def weight_bytes_per_call(model: onnx.ModelProto) -> int:
    """Bytes of weights one call of ``model`` reads: each initializer once per node that reads it (an
    unrolled loop reads a weight once per unrolled step), a weight widened by a ``Cast`` or
    ``DequantizeLinear`` of initializers counted in its widened size once per reader of the widened value,
    and tables a call reads a few rows of (``Gather``'s embeddings, ``RotaryEmbedding``'s cos/sin caches)
    not at all. Read from the graph's
    initializer shapes (``load_external_data=False`` is enough)."""
    graph = model.graph
    sizes = {t.name: (list(t.dims), t.data_type) for t in graph.initializer}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))

    def reads(value: str, dims: Sequence[int], elem_type: int) -> int:
        total = 0
        for node, i in readers.get(value, []):
            if (node.op_type, i) in _ROW_TABLES:
                continue
            if node.op_type in _WIDENING and i == 0 and all(v in sizes or not v for v in node.input):
                out_type = (next(a.i for a in node.attribute if a.name == "to") if node.op_type == "Cast"
                            else onnx.TensorProto.FLOAT if len(node.input) < 2 else sizes[node.input[1]][1])
                total += reads(node.output[0], dims, out_type)
            else:
                total += _tensor_bytes(dims, elem_type)
        return total

    widened_parts = {v for node in graph.node if node.op_type in _WIDENING for v in node.input[1:]}
    return sum(reads(name, dims, t) for name, (dims, t) in sizes.items() if name not in widened_parts)


def bundle_weight_bytes(bundle: Bundle) -> dict[str, int]:
    """Per graph of ``bundle``, :func:`weight_bytes_per_call` (the graph files only: weights are not read)."""
    return {name: weight_bytes_per_call(onnx.load(str(bundle.file_path(entry.file)), load_external_data=False))
            for name, entry in sorted(bundle.info.graphs.items())}
