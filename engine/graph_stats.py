"""Node counts of a bundle's graphs: what each call launches (one kernel per node, before onnxruntime's
own fusions), the figure the GPU work is measured by."""

from __future__ import annotations

from collections import Counter

import onnx

from .bundle import Bundle


def node_counts(bundle: Bundle) -> dict[str, Counter]:
    """Per graph of ``bundle``, its nodes by op type (the graph file only: weights are not read)."""
    counts = {}
    for name, entry in sorted(bundle.info.graphs.items()):
        model = onnx.load(str(bundle.file_path(entry.file)), load_external_data=False)
        counts[name] = Counter(node.op_type for node in model.graph.node)
    return counts


def node_count_lines(counts: dict[str, Counter], top: int = 6) -> list[str]:
    """One line per graph: total nodes and its most frequent op types."""
    return [f"  {name:<22} {sum(c.values()):6,} nodes  ("
            + ", ".join(f"{op} {n}" for op, n in c.most_common(top)) + ")" for name, c in counts.items()]
