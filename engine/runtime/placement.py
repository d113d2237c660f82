"""Placement check without the provider: which nodes of a graph a provider has no kernel for.

:func:`unplaced` reads a graph's nodes (not its weights), works out every tensor's element type from the
graph inputs, initializers and onnxruntime's operator signatures, and matches each node against the
provider's committed kernel table (:mod:`engine.runtime.kernel_table`). On a device provider it also finds
**device→host copies inside a step**: a kernel input that onnxruntime reads from host memory (a shape, TopK's
``K``, GroupQueryAttention's ``total_sequence_length``) fed by a value computed from tensor data rather than
from shapes, constants or a graph input directly — a synchronising copy per call, and a value frozen into a
captured CUDA graph. :func:`choose_device` turns the findings into the load decision, a pure function of
the graphs, the available providers and the requested device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from engine.runtime.kernel_table import Formal, KernelTable, OpKernels, Signature, kernel_table, op_key, signature

NO_KERNEL = "no kernel"
HOST_COPY = "device→host copy inside a step"
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# single-data-input ops a data value passes through on its way to a host input (to name where it comes from)
_PASS_THROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Add", "Sub", "Mul", "Min", "Max"}

# a graph as a loaded ModelProto or the path of its .onnx file
GraphSource = onnx.ModelProto | str | os.PathLike[str]


@dataclass(frozen=True)
class Finding:
    """One node that cannot run as placed on the provider."""
    node: str
    op: str
    module: str                       # the node's module path (its name up to the last '/')
    kind: str                         # NO_KERNEL | HOST_COPY
    types: tuple[str, ...]            # element types of the node's inputs ("" = absent, "?" = unknown)
    why: str
    graph: str = ""

    def line(self) -> str:
        where = f"{self.graph}: " if self.graph else ""
        return f"{where}{self.node} ({self.op}) [{', '.join(t or '-' for t in self.types)}]: {self.kind}: {self.why}"


def _elem(t: int) -> str:
    return TensorProto.DataType.Name(t).lower() if t else "?"


def _load(model: GraphSource) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model), load_external_data=False)


def _formal(formals: Sequence[Formal], i: int) -> Formal | None:
    """The formal parameter of position ``i`` (the last one repeats when it is variadic)."""
    if i < len(formals):
        return formals[i]
    return formals[-1] if formals and formals[-1].variadic else None


def _bind(formals: Sequence[Formal], names: Sequence[str], types: dict[str, str]) -> dict[str, str]:
    """Type constraint → the element type of the node's tensor in that position (the first one wins)."""
    bound: dict[str, str] = {}
    for i, name in enumerate(names):
        f = _formal(formals, i)
        if name and f is not None and not f.type.startswith("tensor(") and name in types:
            bound.setdefault(f.type, types[name])
    return bound


# Output constraints that no present input may bind, and the constraint whose type they take then (what
# onnxruntime's own type inference does): GroupQueryAttention without a past cache writes its present in T.
_UNBOUND_AS = {"GroupQueryAttention": {"T_CACHE": "T"}}


def _output_type(node: onnx.NodeProto, sig: Signature | None, bound: dict[str, str], i: int) -> str | None:
    if node.op_type == "Cast":
        return _elem(next(a.i for a in node.attribute if a.name == "to"))
    if node.op_type == "ConstantOfShape":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return _elem(value.data_type) if value is not None else "float"
    if sig is None:
        return None
    f = _formal(sig.outputs, i)
    if f is None:
        return None
    if f.type.startswith("tensor("):
        return f.type[len("tensor("):-1]
    if f.type in bound:
        return bound[f.type]
    alias = _UNBOUND_AS.get(node.op_type, {}).get(f.type)
    if alias in bound:                        # a constraint no input binds, whose type another one decides
        return bound[alias]
    allowed = sig.allowed.get(f.type, frozenset())
    return next(iter(allowed)) if len(allowed) == 1 else None


class _Walk:
    """Element types and host-known values of a graph, node by node in (topological) order.

    A value is *static* when it is known without reading device data: an initializer, a Constant, a Shape
    or Size output, or anything computed from static values only."""

    def __init__(self, g: onnx.GraphProto) -> None:
        self.types: dict[str, str] = {vi.name: _elem(vi.type.tensor_type.elem_type)
                                      for vi in [*g.input, *g.value_info, *g.output] if vi.type.tensor_type.elem_type}
        self.types.update({init.name: _elem(init.data_type) for init in g.initializer})
        self.static = {init.name for init in g.initializer}
        self.graph_inputs = {i.name for i in g.input} - self.static
        self.producer: dict[str, onnx.NodeProto] = {}

    def visit(self, node: onnx.NodeProto, sig: Signature | None) -> dict[str, str]:
        """Record the node's outputs; returns its constraint bindings (inputs and outputs)."""
        for name in node.output:
            self.producer[name] = node
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            self.types[node.output[0]] = _elem(value.data_type) if value is not None else "?"
            self.static.add(node.output[0])
            return {}
        bound = _bind(sig.inputs, node.input, self.types) if sig else {}
        for i, name in enumerate(node.output):
            t = _output_type(node, sig, bound, i)
            if name and t:
                self.types.setdefault(name, t)
        inputs = [x for x in node.input if x]
        if node.op_type in ("Shape", "Size") or (inputs and all(x in self.static for x in inputs)):
            self.static.update(x for x in node.output if x)
        return {**(_bind(sig.outputs, node.output, self.types) if sig else {}), **bound}

    def from_device_data(self, value: str) -> bool:
        """True when a host-read input would need device data (not static, not fed by the host directly)."""
        return value not in self.static and value not in self.graph_inputs

    def origin(self, value: str) -> onnx.NodeProto:
        """The node that first turns tensor data into ``value`` (skipping casts, unsqueezes, +constant ...)."""
        node = self.producer[value]
        while node.op_type in _PASS_THROUGH:
            data = [x for x in node.input if x and x not in self.static]
            if len(data) != 1 or data[0] not in self.producer:
                break
            node = self.producer[data[0]]
        return node


def unplaced(model: GraphSource, provider: str, graph: str = "", table: KernelTable | None = None) -> list[Finding]:
    """Every node of ``model`` (a path or ModelProto) that ``provider`` ("cpu" or "cuda") cannot run as
    exported: no kernel for its op, opset or input types, or (device providers) a device→host copy.
    ``table``: another kernel table of the provider than the committed one (the installed registry's)."""
    m = _load(model)
    table = table or kernel_table(provider)
    opsets = {(o.domain or "ai.onnx"): o.version for o in m.opset_import}
    walk = _Walk(m.graph)
    findings: list[Finding] = []
    for node in m.graph.node:
        key = op_key(node.op_type, node.domain)
        opset = opsets.get(node.domain or "ai.onnx", 1)
        sig = signature(key, opset)
        bound = walk.visit(node, sig)
        if node.op_type == "Constant":
            continue
        in_types = tuple((walk.types.get(x, "?") if x else "") for x in node.input)
        module = node.name.rsplit("/", 1)[0] if "/" in node.name else ""

        def finding(kind: str, why: str) -> None:
            findings.append(Finding(node.name, node.op_type, module, kind, in_types, why, graph))

        entry = table.ops.get(key)
        if entry is None:
            finding(NO_KERNEL, f"{key} is not in the {provider} kernel table ({table.package} {table.version})")
            continue
        why = _kernel_mismatch(table, entry, sig, opset, bound, in_types)
        if why:
            finding(NO_KERNEL, why)
        if table.device and sig is not None:
            for i in sorted(entry.host_inputs):
                if i < len(node.input) and node.input[i] and walk.from_device_data(node.input[i]):
                    formal = _formal(sig.inputs, i)
                    origin = walk.origin(node.input[i])
                    finding(HOST_COPY, f"input {i} ({formal.name if formal else '?'}) is read on the host but "
                                       f"computed from tensor data on the device, by {origin.name} "
                                       f"({origin.op_type}); feed it from a graph input or derive it from shapes")
    return findings


def _kernel_mismatch(table: KernelTable, entry: OpKernels, sig: Signature | None, opset: int,
                     bound: dict[str, str], in_types: tuple[str, ...]) -> str | None:
    """Why no kernel of ``entry`` runs a node with these bindings (None when one does)."""
    if sig is None or "?" in in_types:
        return "the element types of its inputs cannot be worked out"
    if not entry.kernels:
        return f"{table.ep} ({table.package} {table.version}) has no kernel for this op"
    in_range = [k for k in entry.kernels if k.covers(opset)]
    if not in_range:
        return f"{table.ep} has no kernel for opset {opset}"

    def runs(binding: dict[str, str]) -> bool:
        return any(all(t in k.types.get(c, (t,)) for c, t in binding.items()) for k in in_range)

    as_float = {c: "float" if t == "float16" else t for c, t in bound.items()}
    if runs(bound) or (table.float16_via_float and runs(as_float)):
        return None
    wanted = ", ".join(f"{c}={t}" for c, t in sorted(bound.items()))
    offered = " or ".join(", ".join(f"{c} in {{{', '.join(sorted(v))}}}" for c, v in sorted(k.types.items()))
                          for k in in_range)
    return f"{table.ep} ({table.package} {table.version}) has no kernel for {wanted}; it offers {offered}"


def bundle_unplaced(graphs: dict[str, Path], provider: str, table: KernelTable | None = None) -> list[Finding]:
    """:func:`unplaced` over every graph of a bundle (``{graph name: onnx file}``)."""
    return [f for name, path in sorted(graphs.items()) for f in unplaced(path, provider, graph=name, table=table)]


# ---------------------------------------------------------------------------------------------- load decision
@dataclass(frozen=True)
class DeviceChoice:
    device: str                        # "cpu" | "cuda"
    providers: list[str]
    reason: str


class PlacementRefused(ValueError):
    """The requested provider cannot run the bundle as exported (or no provider can)."""


def _advice(findings: list[Finding], provider: str) -> str:
    if provider == "cuda":
        return "export with --compute-dtype bf16 (or fp16) for CUDA"
    if any("bfloat16" in f.types for f in findings):
        return "bf16 bundles run on CUDA only; export with --compute-dtype fp16 or fp32 for CPU"
    return "re-export the bundle with this version of mossrt"


def refusal(findings: list[Finding], provider: str) -> str:
    """One message: how many nodes, the first few by name, and what to export instead."""
    shown = "; ".join(f.line() for f in findings[:2])
    more = (f" (and {len(findings) - 2} more: 'mossrt verify --provider {provider}' lists them)"
            if len(findings) > 2 else "")
    return (f"{len(findings)} node(s) cannot run on the {provider} provider: {shown}{more}; "
            f"{_advice(findings, provider)}")


def choose_device(requested: str, available: list[str], check: Callable[[str], list[Finding]]) -> DeviceChoice:
    """The provider to load on. ``check(provider) -> list[Finding]`` is the bundle's placement check (called
    before onnxruntime is asked for anything); ``available`` is ``onnxruntime.get_available_providers()``.

    ``cpu``/``cuda``: that provider, refused (PlacementRefused) when a node cannot run there or the provider is
    not installed. ``auto``: CUDA when installed and the bundle runs there entirely, else CPU; ``reason`` says
    which and why. Never a silent fallback: a bundle that runs nowhere is refused."""
    if requested not in ("auto", "cpu", "cuda"):
        raise PlacementRefused(f"unknown device {requested!r}: use cpu, cuda or auto")
    if requested in ("cpu", "cuda"):
        findings = check(requested)
        if findings:
            raise PlacementRefused(refusal(findings, requested))
        if PROVIDER_NAMES[requested] not in available:
            raise PlacementRefused(f"device {requested!r} requested but onnxruntime offers only {available} "
                                   "(install the 'cuda' extra: onnxruntime-gpu)")
        return DeviceChoice(requested, _providers(requested), f"requested {requested}; every node has a kernel there")
    why_not_cuda = "onnxruntime has no CUDA provider here"
    if PROVIDER_NAMES["cuda"] in available:
        cuda_findings = check("cuda")
        if not cuda_findings:
            return DeviceChoice("cuda", _providers("cuda"),
                                "auto: the CUDA provider is installed and every node of the bundle has a CUDA kernel")
        why_not_cuda = f"the CUDA provider is installed but {refusal(cuda_findings, 'cuda')}"
    cpu_findings = check("cpu")
    if cpu_findings:
        raise PlacementRefused(f"auto: no provider can run this bundle: {why_not_cuda}; "
                               f"and {refusal(cpu_findings, 'cpu')}")
    return DeviceChoice("cpu", _providers("cpu"), f"auto: cpu, because {why_not_cuda}")


def _providers(device: str) -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
