"""onnxruntime's kernel tables as committed data: which (op, domain, opset range, input types) a provider runs.

``engine/runtime/data/kernels_<provider>_<package>-<version>.json`` lists, per op our graphs use (``"Op@domain"``), the
provider's kernels (``since``/``until`` opset and the allowed types of each type constraint) and, for a device
provider, the inputs its kernel reads from host memory (shape-like inputs: a Reshape's shape, TopK's ``K``,
GroupQueryAttention's ``total_sequence_length``). ``op_signatures_onnxruntime-<version>.json`` maps each op's
inputs and outputs to their type constraints (from onnxruntime's operator schemas), which is what binds a
node's tensor types to a kernel's constraints. The CPU table and the signatures are read from the installed
onnxruntime's own registry (:func:`installed_cpu_kernels`, :func:`installed_signatures`; a test keeps them
equal); the CUDA table is transcribed from onnxruntime's published ``docs/OperatorKernels.md``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
TABLES = {"cpu": "kernels_cpu_onnxruntime-1.32.0.json", "cuda": "kernels_cuda_onnxruntime-gpu-1.31.1.json"}
SIGNATURES = "op_signatures_onnxruntime-1.32.0.json"
ONNX_DOMAIN = "ai.onnx"
OPEN_END = 2147483647          # onnxruntime's "and every later opset"

# one kernel or one schema version in the committed files' JSON form (parsed JSON: its values are not typed)
JsonRow = dict[str, Any]


def op_key(op_type: str, domain: str) -> str:
    """``"Op@domain"``, the default ONNX domain spelled ``ai.onnx``."""
    return f"{op_type}@{domain or ONNX_DOMAIN}"


@dataclass(frozen=True)
class Kernel:
    since: int
    until: int                                   # inclusive; OPEN_END = no upper bound
    types: dict[str, frozenset[str]]             # constraint → allowed element types ("float16", "int64", ...)

    def covers(self, opset: int) -> bool:
        return self.since <= opset <= self.until


@dataclass(frozen=True)
class OpKernels:
    kernels: tuple[Kernel, ...]
    host_inputs: frozenset[int]                  # input indices the kernel reads from host memory


@dataclass(frozen=True)
class Formal:
    name: str
    type: str                                    # a constraint name, or "tensor(x)" for a fixed type
    variadic: bool


@dataclass(frozen=True)
class Signature:
    since: int
    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    allowed: dict[str, frozenset[str]]           # the schema's allowed types per constraint


@dataclass(frozen=True)
class KernelTable:
    provider: str                                # "cpu" | "cuda"
    ep: str                                      # onnxruntime's provider name
    package: str
    version: str
    source: str
    device: bool                                 # memory other than the host's (host inputs mean copies)
    ops: dict[str, OpKernels]
    float16_via_float: bool = False              # float16 nodes without a float16 kernel run as float (Casts)


def element_type(type_str: str) -> str:
    """``tensor(float16)`` → ``float16``; sequence and other kinds stay as written."""
    return type_str[len("tensor("):-1] if type_str.startswith("tensor(") and type_str.endswith(")") else type_str


@lru_cache(maxsize=None)
def kernel_table(provider: str) -> KernelTable:
    """The committed table of ``cpu`` or ``cuda``."""
    if provider not in TABLES:
        raise ValueError(f"no kernel table for provider {provider!r}: use one of {sorted(TABLES)}")
    raw = json.loads((DATA / TABLES[provider]).read_text(encoding="utf-8"))
    ops = {key: OpKernels(tuple(Kernel(k["since"], k["until"], {c: frozenset(t) for c, t in k["types"].items()})
                                for k in entry["kernels"]), frozenset(entry.get("host_inputs", ())))
           for key, entry in raw["ops"].items()}
    return KernelTable(provider, raw["provider"], raw["package"], raw["version"], raw["source"], raw["device"], ops,
                       raw.get("float16_via_float", False))


@lru_cache(maxsize=None)
def signatures() -> dict[str, tuple[Signature, ...]]:
    """Every covered op's schema versions, oldest first."""
    raw = json.loads((DATA / SIGNATURES).read_text(encoding="utf-8"))

    def formals(rows: list[list[str]]) -> tuple[Formal, ...]:
        return tuple(Formal(name, type_, option == "variadic") for name, type_, option in rows)

    return {key: tuple(Signature(s["since"], formals(s["inputs"]), formals(s["outputs"]),
                                 {c: frozenset(t) for c, t in s["allowed"].items()}) for s in versions)
            for key, versions in raw["ops"].items()}


def signature(key: str, opset: int) -> Signature | None:
    """The schema in force at ``opset`` (the newest version not after it)."""
    found = None
    for s in signatures().get(key, ()):
        if s.since <= opset:
            found = s
    return found


# ---------------------------------------------------------------------------------------------- from onnxruntime
def installed_kernels(keys: Iterable[str], ep: str = "CPUExecutionProvider") -> dict[str, list[JsonRow]]:
    """The installed onnxruntime's registered kernels of ``ep`` for ``keys``, in the table's JSON form (on a
    GPU build, listing the CUDA provider's kernels needs a CUDA device: the registry is read from it)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    out: dict[str, list[JsonRow]] = {k: [] for k in keys}
    for k in ort_c.get_all_opkernel_def():
        key = op_key(k.op_name, k.domain)
        if k.provider == ep and key in out:
            since, until = k.version_range
            out[key].append({"since": since, "until": until,
                             "types": {c: sorted(element_type(t) for t in ts)
                                       for c, ts in sorted(k.type_constraints.items())}})
    for entries in out.values():
        entries.sort(key=lambda e: (e["since"], json.dumps(e["types"], sort_keys=True)))
    return out


def installed_cpu_kernels(keys: Iterable[str]) -> dict[str, list[JsonRow]]:
    """The installed onnxruntime's registered CPU kernels of ``keys``, in the table's JSON form."""
    return installed_kernels(keys, "CPUExecutionProvider")


def registry_table(provider: str, rows: dict[str, list[JsonRow]] | None = None) -> KernelTable:
    """The committed table of ``provider`` with its kernels replaced by the installed onnxruntime's own
    registry (``rows``: :func:`installed_kernels` output, read now when None); the host inputs stay the
    committed ones (the registry does not expose them)."""
    committed = kernel_table(provider)
    rows = installed_kernels(list(committed.ops), committed.ep) if rows is None else rows
    import onnxruntime

    ops = {key: OpKernels(tuple(Kernel(k["since"], k["until"], {c: frozenset(t) for c, t in k["types"].items()})
                                for k in rows.get(key, [])), entry.host_inputs)
           for key, entry in committed.ops.items()}
    return KernelTable(provider, committed.ep, committed.package, onnxruntime.__version__,
                       "the installed onnxruntime's kernel registry", committed.device, ops,
                       committed.float16_via_float)


def coverage(table: KernelTable, key: str, opset: int) -> dict[str, frozenset[str]]:
    """Per type constraint, the element types some kernel of ``key`` covering ``opset`` takes."""
    out: dict[str, set[str]] = {}
    entry = table.ops.get(key)
    for k in (entry.kernels if entry else ()):
        if k.covers(opset):
            for c, types in k.types.items():
                out.setdefault(c, set()).update(types)
    return {c: frozenset(t) for c, t in out.items()}


def coverage_diff(committed: KernelTable, registry: KernelTable, opsets: dict[str, int]) -> dict[str, JsonRow]:
    """Where the committed table and the registry disagree at the opsets a bundle uses (``{"ai.onnx": 18,
    "com.microsoft": 1}``): per op, the types only the table claims (the placement check would accept a node
    onnxruntime cannot place there) and the types only the registry has (it would refuse a node that runs)."""
    out: dict[str, JsonRow] = {}
    for key in sorted(committed.ops):
        opset = opsets.get(key.split("@", 1)[1], 1)
        ours, theirs = coverage(committed, key, opset), coverage(registry, key, opset)
        table_only = {c: sorted(t - theirs.get(c, frozenset()))
                      for c, t in ours.items() if t - theirs.get(c, frozenset())}
        registry_only = {c: sorted(t - ours.get(c, frozenset()))
                         for c, t in theirs.items() if t - ours.get(c, frozenset())}
        if table_only or registry_only or (ours and not theirs):
            out[key] = {"opset": opset, "table_only": table_only, "registry_only": registry_only,
                        "in_registry": bool(theirs)}
    return out


def installed_signatures(keys: Iterable[str]) -> dict[str, list[JsonRow]]:
    """The installed onnxruntime's operator schemas of ``keys`` (every version), in the signatures' JSON form."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    option = {0: "single", 1: "optional", 2: "variadic"}
    out: dict[str, list[JsonRow]] = {k: [] for k in keys}
    for s in ort_c.get_all_operator_schema():
        key = op_key(s.name, s.domain)
        if key in out:
            out[key].append({
                "since": s.since_version,
                "inputs": [[f.name, f.typeStr, option[int(f.option.value)]] for f in s.inputs],
                "outputs": [[f.name, f.typeStr, option[int(f.option.value)]] for f in s.outputs],
                "allowed": {c.type_param_str: sorted(element_type(t) for t in c.allowed_type_strs)
                            for c in sorted(s.type_constraints, key=lambda c: c.type_param_str)}})
    for versions in out.values():
        versions.sort(key=lambda v: v["since"])
    return out
