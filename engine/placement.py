"""Placement check without the provider: which nodes of a graph a provider has no kernel for.

:func:`unplaced` reads a graph's nodes (not its weights), works out every tensor's element type from the
graph inputs, initializers and onnxruntime's operator signatures, and matches each node against the
provider's committed kernel table (:mod:`engine.kernel_table`). On a device provider it also finds
**device→host copies inside a step**: a kernel input that onnxruntime reads from host memory (a shape, TopK's
``K``, GroupQueryAttention's ``total_sequence_length``) fed by a value computed from tensor data rather than
from shapes, constants or a graph input directly — a synchronising copy per call, and a value frozen into a
captured CUDA graph. :func:`choose_device` turns the findings into the load decision, a pure function of
the graphs, the available providers and the requested device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from .kernel_table import Signature, kernel_table, op_key, signature

NO_KERNEL = "no kernel"
HOST_COPY = "device→host copy inside a step"
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# single-data-input ops a data value passes through on its way to a host input (to name where it comes from)
_PASS_THROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Identity", "Add", "Sub", "Mul", "Min", "Max"}


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


def _load(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model), load_external_data=False)


def _bind(sig: Signature, names: list[str], types: dict[str, str], outputs: bool = False) -> dict[str, str]:
    """Constraint → element type of the node's actual tensors (first binding wins)."""
    formals = sig.outputs if outputs else sig.inputs
    bound: dict[str, str] = {}
    for i, name in enumerate(names):
        if not name or not formals:
            continue
        f = formals[min(i, len(formals) - 1)] if (i < len(formals) or formals[-1].variadic) else None
        if f is None or f.type.startswith("tensor(") or name not in types:
            continue
        bound.setdefault(f.type, types[name])
    return bound


def _output_types(node, sig: Signature | None, bound: dict[str, str]) -> list[str | None]:
    if node.op_type == "Cast":
        return [_elem(next(a.i for a in node.attribute if a.name == "to"))]
    if node.op_type == "ConstantOfShape":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return [_elem(value.data_type) if value is not None else "float"]
    if sig is None:
        return [None] * len(node.output)
    out = []
    for i in range(len(node.output)):
        if not sig.outputs or (i >= len(sig.outputs) and not sig.outputs[-1].variadic):
            out.append(None)
            continue
        f = sig.outputs[min(i, len(sig.outputs) - 1)]
        if f.type.startswith("tensor("):
            out.append(f.type[len("tensor("):-1])
        elif f.type in bound:
            out.append(bound[f.type])
        elif len(sig.allowed.get(f.type, ())) == 1:
            out.append(next(iter(sig.allowed[f.type])))
        else:
            out.append(None)
    return out


def unplaced(model, provider: str, graph: str = "") -> list[Finding]:
    """Every node of ``model`` (a path or ModelProto) that ``provider`` ("cpu" or "cuda") cannot run as
    exported: no kernel for its op, opset or input types, or (device providers) a device→host copy."""
    m = _load(model)
    table = kernel_table(provider)
    opsets = {(o.domain or "ai.onnx"): o.version for o in m.opset_import}
    g = m.graph
    types: dict[str, str] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.tensor_type.elem_type:
            types[vi.name] = _elem(vi.type.tensor_type.elem_type)
    static: set[str] = set()                       # values known without reading device data
    for init in g.initializer:
        types[init.name] = _elem(init.data_type)
        static.add(init.name)
    graph_inputs = {i.name for i in g.input} - static
    producer = {}
    findings: list[Finding] = []
    for node in g.node:
        key = op_key(node.op_type, node.domain)
        opset = opsets.get(node.domain or "ai.onnx", 1)
        sig = signature(key, opset)
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            types[node.output[0]] = _elem(value.data_type) if value is not None else "?"
            static.add(node.output[0])
            continue
        bound = _bind(sig, list(node.input), types) if sig else {}
        for name, t in zip(node.output, _output_types(node, sig, bound)):
            if name and t:
                types.setdefault(name, t)
        for name in node.output:
            producer[name] = node
        inputs = [x for x in node.input if x]
        if node.op_type in ("Shape", "Size") or (inputs and all(x in static for x in inputs)):
            static.update(x for x in node.output if x)
        in_types = tuple((types.get(x, "?") if x else "") for x in node.input)
        module = node.name.rsplit("/", 1)[0] if "/" in node.name else ""

        def finding(kind, why):
            findings.append(Finding(node.name, node.op_type, module, kind, in_types, why, graph))

        entry = table.ops.get(key)
        if entry is None:
            finding(NO_KERNEL, f"{key} is not in the {provider} kernel table ({table.package} {table.version})")
            continue
        why = _kernel_mismatch(entry, sig, opset, bound, node, types, in_types, table)
        if why:
            finding(NO_KERNEL, why)
        if table.device and sig is not None:
            for i in sorted(entry.host_inputs):
                if i < len(node.input) and node.input[i] and node.input[i] not in static \
                        and node.input[i] not in graph_inputs:
                    formal = sig.inputs[min(i, len(sig.inputs) - 1)].name if sig.inputs else str(i)
                    origin = _origin(node.input[i], producer, static)
                    finding(HOST_COPY, f"input {i} ({formal}) is read on the host but computed from tensor data on "
                                       f"the device, by {origin.name} ({origin.op_type}); feed it from a graph input "
                                       "or derive it from shapes")
    return findings


def _kernel_mismatch(entry, sig, opset, bound, node, types, in_types, table) -> str | None:
    """Why no kernel of ``entry`` runs this node (None when one does)."""
    if sig is None or "?" in in_types:
        return "the element types of its inputs cannot be worked out"
    in_range = [k for k in entry.kernels if k.covers(opset)]
    if not in_range:
        return f"{table.ep} has no kernel for opset {opset}"
    bound = {**_bind(sig, list(node.output), types, outputs=True), **bound}

    def runs(binding):
        return any(all(t in k.types.get(c, (t,)) for c, t in binding.items()) for k in in_range)

    if runs(bound) or (table.float16_via_float and runs({c: "float" if t == "float16" else t for c, t in bound.items()})):
        return None
    wanted = ", ".join(f"{c}={t}" for c, t in sorted(bound.items()))
    offered = " or ".join(", ".join(f"{c} in {{{', '.join(sorted(v))}}}" for c, v in sorted(k.types.items()))
                          for k in in_range)
    return f"{table.ep} ({table.package} {table.version}) has no kernel for {wanted}; it offers {offered}"


def _origin(value: str, producer: dict, static: set[str]):
    """The node that first turns tensor data into ``value`` (skipping casts, unsqueezes, +constant ...)."""
    node = producer[value]
    while node.op_type in _PASS_THROUGH:
        data = [x for x in node.input if x and x not in static]
        if len(data) != 1 or data[0] not in producer:
            break
        node = producer[data[0]]
    return node


def bundle_unplaced(graphs: dict[str, Path], provider: str) -> list[Finding]:
    """:func:`unplaced` over every graph of a bundle (``{graph name: onnx file}``)."""
    return [f for name, path in sorted(graphs.items()) for f in unplaced(path, provider, graph=name)]


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
    more = f" (and {len(findings) - 2} more: 'mossrt verify --provider {provider}' lists them)" if len(findings) > 2 else ""
    return (f"{len(findings)} node(s) cannot run on the {provider} provider: {shown}{more}; "
            f"{_advice(findings, provider)}")


def choose_device(requested: str, available: list[str], check) -> DeviceChoice:
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
        raise PlacementRefused(f"auto: no provider can run this bundle: {why_not_cuda}; and {refusal(cpu_findings, 'cpu')}")
    return DeviceChoice("cpu", _providers("cpu"), f"auto: cpu, because {why_not_cuda}")


def _providers(device: str) -> list[str]:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
