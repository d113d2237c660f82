"""``mossrt doctor``: does this machine's onnxruntime run mossrt's graphs the way the engine assumes?

Five checks, each a yes/no answer with its figures, cheapest first:

* ``provider``: the provider's library loads and runs a graph on the device (onnxruntime falls back to the CPU
  silently when the CUDA provider cannot load; here that is a failure), and on CUDA a captured graph replays
  with new input data at the same address;
* ``kernels``: the installed onnxruntime's own kernel registry against the committed kernel table the
  placement check reads (at the opsets our graphs use): a kernel the table claims and the registry lacks
  fails; ``--registry-out`` writes the registry in the table's format, to replace the table with;
* ``placement``: onnxruntime's own node placement (its verbose log, read while each session of the bundle is
  made) against ``mossrt verify --provider``: a node onnxruntime puts on another provider than the check
  predicts fails (on CUDA such a node is a copy per step and makes capture impossible);
* ``graphs`` (CUDA): the batched step and depth calls captured as CUDA graphs give the codes the uncaptured
  calls give, frame by frame over changing lengths (GroupQueryAttention reads ``total_sequence_length``
  on the host: a captured graph must not freeze it), and what capture saves per call and per node;
* ``semantics``: the kernels whose device results no CPU run shows, against the CPU provider: TopK's order
  of ties over the whole 1,027-code vocabulary, the codec rings' ScatterND writing in place,
  BranchwiseRMSNorm, RotaryEmbedding at a one-element position and GatherND with ``batch_dims=2``.

On the CPU provider every check runs too (the device and the reference are then the same provider: the
checks prove their own wiring, as ``scripts/gpu-check --device cpu --smoke`` does in CI); ``graphs`` is
skipped there. Without ``--bundle`` a tiny random bundle is exported to a temporary directory in the
device's compute dtype (bf16 on CUDA, fp32 on CPU).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHECKS = ("provider", "kernels", "placement", "graphs", "semantics")
PROVIDER_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# opsets our graphs import (export/graph.py's OPSET, the engine's helper graphs, the contrib domain)
GRAPH_OPSETS = {"ai.onnx": 18, "com.microsoft": 1}


class CheckFailed(Exception):
    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


class CheckSkipped(Exception):
    pass


@dataclass
class CheckResult:
    name: str
    status: str                   # passed | failed | skipped
    seconds: float
    reason: str = ""
    figures: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"check": self.name, "status": self.status, "seconds": round(self.seconds, 2),
                "reason": self.reason, "figures": self.figures}


# ---------------------------------------------------------------------------------------------- helpers
def _model_bytes(nodes, inputs, outputs, opsets=(("", 18),)) -> bytes:
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, "doctor", inputs, outputs),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
                              producer_name="mossrt-doctor")
    model.ir_version = 9
    return model.SerializeToString()


def _session(model: bytes, providers: list, threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model, opts, providers=providers)


def _providers(device: str) -> list[str]:
    return [PROVIDER_NAMES[device]]      # no CPU fallback: a node the device cannot take must fail, not move


@contextmanager
def _captured_stderr():
    """The process's file descriptor 2 (where onnxruntime's C++ logger writes) into a buffer."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        box: list[str] = []
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode("utf-8", "replace"))


def parse_placement_log(log: str) -> dict[str, list[tuple[str, str]]]:
    """onnxruntime's verbose "Node placements" lines → {provider: [(op type, node name), ...]} ("All nodes
    placed on [X]. Number of nodes: N" gives N unnamed entries)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"All nodes placed on \[(\w+)\]\. Number of nodes: (\d+)", line)
        if m:
            out.setdefault(m.group(1), []).extend([("", "")] * int(m.group(2)))
            current = None
            continue
        m = re.search(r"Node\(s\) placed on \[(\w+)\]\. Number of nodes: (\d+)", line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
            continue
        m = re.search(r"VerifyEachNodeIsAssignedToAnEp\]\s{2,}(\S+) \((.*)\)\s*$", line)
        if m and current is not None:
            out[current].append((m.group(1), m.group(2)))
    return out


# ---------------------------------------------------------------------------------------------- checks
def check_provider(device: str, bundle=None, registry_out=None) -> dict:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    ep = PROVIDER_NAMES[device]
    figures = {"onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
               "available": ort.get_available_providers()}
    if ep not in figures["available"]:
        raise CheckFailed(f"onnxruntime {ort.__version__} offers {figures['available']}, not {ep}", figures)
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [4096])
    model = _model_bytes([helper.make_node("Mul", ["x", "x"], ["y"])], [vi("x")], [vi("y")])
    t0 = time.perf_counter()
    try:
        session = _session(model, [ep])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own kinds for a provider that does not load
        raise CheckFailed(f"the {ep} session does not start: {str(e).strip()[:600]}", figures) from None
    figures["first_session_s"] = round(time.perf_counter() - t0, 3)
    figures["session_providers"] = session.get_providers()
    if session.get_providers()[0] != ep:
        raise CheckFailed(f"onnxruntime made the session on {session.get_providers()} instead of {ep}", figures)
    x = np.linspace(-4, 4, 4096, dtype=np.float32)
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y", device)
    session.run_with_iobinding(binding)
    if not np.array_equal(binding.get_outputs()[0].numpy(), x * x):
        raise CheckFailed("a one-node graph on the device gives wrong results", figures)
    if device == "cuda":
        figures["capture_replay"] = _capture_replay(model)
    return figures


def _capture_replay(model: bytes) -> dict:
    """One captured graph (enable_cuda_graph) run on fixed device buffers, then replayed after the input
    changed in place: the replay must read the new data."""
    import onnxruntime as ort

    session = _session(model, [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    xin = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    yout = ort.OrtValue.ortvalue_from_shape_and_type([4096], np.float32, "cuda", 0)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", xin)
    binding.bind_ortvalue_output("y", yout)
    for _ in range(4):        # onnxruntime runs a graph uncaptured a few times before it captures it
        session.run_with_iobinding(binding)
    first = yout.numpy().copy()
    replays = []
    for shift in (1.0, -0.5):
        xin.update_inplace(x + np.float32(shift))
        session.run_with_iobinding(binding)       # a replay: it must read the new data at the same address
        replays.append(np.array_equal(yout.numpy(), (x + np.float32(shift)) * (x + np.float32(shift))))
    if not (np.array_equal(first, x * x) and all(replays)):
        raise CheckFailed("a captured CUDA graph does not replay with the new input data at its address")
    return {"captured": True, "replayed_new_input": True}


def check_kernels(device: str, bundle=None, registry_out=None) -> dict:
    import onnxruntime as ort

    from engine.runtime.kernel_table import coverage_diff, installed_kernels, kernel_table, registry_table

    committed = kernel_table(device)
    try:
        rows = installed_kernels(list(committed.ops), committed.ep)
    except Exception as e:  # noqa: BLE001 - a GPU build lists its CUDA kernels only with a device present
        raise CheckFailed(f"the kernel registry does not list: {str(e).strip()[:400]}") from None
    registered = sum(1 for v in rows.values() if v)
    figures = {"table": f"{committed.package} {committed.version}", "onnxruntime": ort.__version__,
               "ops_in_table": len(committed.ops), "ops_registered": registered}
    if registered == 0:
        raise CheckFailed(f"onnxruntime {ort.__version__} registers none of the table's ops for {committed.ep}",
                          figures)
    diff = coverage_diff(committed, registry_table(device, rows), GRAPH_OPSETS)
    figures["differences"] = diff
    if registry_out:
        payload = {"format": 1, "provider": committed.ep, "package": committed.package, "version": ort.__version__,
                   "device": committed.device,
                   "source": f"onnxruntime {ort.__version__} get_all_opkernel_def() on this machine (mossrt doctor); "
                             "host_inputs from the committed table",
                   "notes": "the registered kernels of every op of the committed table, one row per registration",
                   "float16_via_float": committed.float16_via_float,
                   "ops": {k: {"kernels": rows[k], **({"host_inputs": sorted(committed.ops[k].host_inputs)}
                                                      if committed.ops[k].host_inputs else {})}
                           for k in sorted(rows)}}
        Path(registry_out).write_text(json.dumps(payload, indent=1) + "\n")
        figures["registry_written"] = str(registry_out)
    claimed = {k: d for k, d in diff.items() if d["table_only"] or not d["in_registry"]}
    if claimed:
        named = "; ".join(f"{k} {d['table_only'] or 'not registered'}" for k, d in list(claimed.items())[:8])
        raise CheckFailed(f"the committed {device} table claims kernels the installed registry lacks: {named}", figures)
    return figures


def check_placement(device: str, bundle=None, registry_out=None) -> dict:
    import onnxruntime as ort

    from engine.runtime.kernel_table import registry_table
    from engine.runtime.placement import bundle_unplaced

    ep = PROVIDER_NAMES[device]
    ours = bundle.unplaced(device)
    graphs = {n: bundle.file_path(g.file) for n, g in bundle.info.graphs.items()}
    try:
        by_registry = bundle_unplaced(graphs, device, table=registry_table(device))
    except Exception as e:  # noqa: BLE001 - no registry (see the kernels check): the comparison is left out
        by_registry = None
        registry_error = str(e)[:200]
    figures: dict = {"predicted_off_device": [f.line() for f in ours],
                     "predicted_by_registry": None if by_registry is None else [f.line() for f in by_registry],
                     "graphs": {}}
    if by_registry is None:
        figures["registry_error"] = registry_error
    surprises = []
    for name in sorted(graphs):
        opts = bundle.session_options(name)
        opts.log_severity_level = 0
        opts.log_verbosity_level = 0
        with _captured_stderr() as box:
            session = ort.InferenceSession(str(graphs[name]), opts, providers=bundle.session_providers())
        placed = parse_placement_log(box[0])
        placement_lines = [line.split("] ", 1)[-1] for line in box[0].splitlines()
                           if "VerifyEachNodeIsAssignedToAnEp" in line]
        del session
        off = [(op, node) for p, nodes in placed.items() if p != ep for op, node in nodes]
        predicted = {f.node for f in ours if f.graph == name}
        figures["graphs"][name] = {"nodes_by_provider": {p: len(n) for p, n in placed.items()},
                                   "off_device": [f"{op} ({node})" for op, node in off][:50]}
        if off or not placed:      # onnxruntime's own lines, in case its format differs from what we parse
            figures["graphs"][name]["log"] = placement_lines[:60]
        if not placed:
            surprises.append(f"{name}: onnxruntime logged no node placement")
        elif off and not predicted:
            surprises.append(f"{name}: {len(off)} node(s) on {', '.join(p for p in placed if p != ep)}, e.g. "
                             + ", ".join(f"{op} ({node})" for op, node in off[:4]))
    if surprises:
        raise CheckFailed("onnxruntime places nodes off the device that the placement check does not predict: "
                          + "; ".join(surprises), figures)
    return figures


def _greedy_codes(model, texts: list[list[int]], frames: int) -> tuple[list[np.ndarray], dict]:
    """Each text's codes through a scheduler on ``model`` (greedy, all streams at once), and per-call timing."""
    import threading

    from engine.serving.scheduler import FrameEvent, Scheduler, StreamError, TurnEnd

    scheduler = Scheduler(model, slots=len(texts), warm_buckets=True)
    scheduler.wait_warm()
    timing = scheduler.runner.timing
    before = {k: getattr(timing, k).snapshot() for k in ("step", "depth")}
    out: list = [None] * len(texts)

    def one(i: int) -> None:
        h = scheduler.open_stream(params=model.default_sampling(greedy=True), seed=i)
        h.begin_turn(max_frames=frames, wait=120)
        h.push_token_ids(texts[i])
        h.end_text()
        codes = []
        while True:
            event = h.get(timeout=300)
            if isinstance(event, FrameEvent):
                codes.append(event.frame.codes)
            elif isinstance(event, StreamError):
                out[i] = event.error
                break
            elif isinstance(event, TurnEnd):
                break
        h.close()
        out[i] = out[i] if isinstance(out[i], Exception) else np.array(codes)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = {k: getattr(timing, k).since(before[k]) for k in before}
    scheduler.stop()
    for r in out:
        if isinstance(r, Exception):
            raise CheckFailed(f"a stream failed: {type(r).__name__}: {r}")
    per_call = {f"{k}_ms_per_call": 1000 * v.run_s / max(v.calls, 1) for k, v in spent.items()}
    per_call.update({f"{k}_calls": v.calls for k, v in spent.items()})
    return out, per_call


def check_graphs(device: str, bundle=None, registry_out=None) -> dict:
    if device != "cuda":
        raise CheckSkipped("CUDA graphs are CUDA-only")
    from engine.model.buckets import capture_decision
    from engine.model.tts import STEP_GRAPHS, TTSModel
    from engine.runtime.graph_stats import node_counts

    unplaced = {g: [f.node for f in bundle.unplaced("cuda") if f.graph == g] for g in STEP_GRAPHS}
    capture, why = capture_decision(True, "cuda", unplaced)
    if not capture:
        raise CheckFailed(why)
    on = TTSModel(bundle, cuda_graphs=True, warm_buckets=True)
    if not on.cuda_graphs:
        raise CheckFailed("onnxruntime refused the CUDA-graph sessions (see the log)")
    off = TTSModel(bundle, cuda_graphs=False, warm_buckets=True)
    words = "the quick brown fox jumps over the lazy dog while streams of different lengths share one batch"
    texts = [on.tokenizer.encode(" ".join(words.split()[i:] + words.split()[:i])) for i in range(3)]
    frames = 24
    captured, t_on = _greedy_codes(on, texts, frames)
    plain, t_off = _greedy_codes(off, texts, frames)
    counts = node_counts(bundle)
    nodes = {g: sum(counts[g].values()) for g in STEP_GRAPHS}
    figures = {"streams": len(texts), "frames": frames, "captured": t_on, "uncaptured": t_off, "nodes": nodes}
    for g in ("step", "depth"):
        graph = "backbone" if g == "step" else "depth"
        saved = t_off[f"{g}_ms_per_call"] - t_on[f"{g}_ms_per_call"]
        figures[f"{g}_saved_us_per_node"] = round(1000 * saved / max(nodes.get(graph, 1), 1), 3)
    # the codec decoder is never captured: at tiny dimensions its call is launches, so per node it is what
    # an uncaptured node costs (the figure that decides whether the last nodes of a frame matter)
    figures["codec_decoder"] = _codec_call(off, sum(counts["codec_decoder"].values()))
    for i, (a, b) in enumerate(zip(captured, plain)):
        if a.shape != b.shape or not np.array_equal(a, b):
            bad = next((f for f in range(min(len(a), len(b))) if not np.array_equal(a[f], b[f])), min(len(a), len(b)))
            raise CheckFailed(f"stream {i}: captured codes differ from uncaptured ones from frame {bad}", figures)
    return figures


def _codec_call(model, nodes: int, calls: int = 30) -> dict:
    """ms per one-frame streaming decode call (uncaptured) and that per node."""
    codes = np.random.default_rng(5).integers(0, model.codec.codebook_size, size=(calls + 3, 16), dtype=np.int64)
    decoder = model.codec.streaming_decoder(1, 16)
    for f in range(3):                               # first calls: allocations
        decoder.decode(codes[f:f + 1])
    t0 = time.perf_counter()
    for f in range(3, calls + 3):
        decoder.decode(codes[f:f + 1])
    ms = 1000 * (time.perf_counter() - t0) / calls
    return {"nodes": nodes, "ms_per_call": round(ms, 3), "us_per_node": round(1000 * ms / max(nodes, 1), 3)}


# semantics: each probe runs one small graph on the device and on the CPU provider
def _probe(device: str, model: bytes, feeds: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    got = _session(model, _providers(device)).run(None, feeds)
    ref = _session(model, ["CPUExecutionProvider"]).run(None, feeds)
    return got, ref


def _topk_ties(device: str) -> dict:
    from onnx import TensorProto, helper

    vocab = 1027                      # export/tts.py AUDIO_VOCAB: the sampler sorts the whole vocabulary
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(4, 16, vocab)).astype(np.float32) / 4     # 8 values: every value ties
    x[:, :, ::97] = -np.inf
    k = helper.make_node("Constant", [], ["k"], value=helper.make_tensor("kv", TensorProto.INT64, [1], [vocab]))
    topk = helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=-1, largest=0, sorted=1)
    model = _model_bytes([k, topk], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, vocab])],
                         [helper.make_tensor_value_info("values", TensorProto.FLOAT, [4, 16, vocab]),
                          helper.make_tensor_value_info("indices", TensorProto.INT64, [4, 16, vocab])])
    (gv, gi), (rv, ri) = _probe(device, model, {"x": x})
    stable = np.argsort(x, axis=-1, kind="stable")
    return {"ok": bool(np.array_equal(gi, ri) and np.array_equal(gv, rv)),
            "reference_is_stable": bool(np.array_equal(ri, stable)),
            "rows_in_other_order": int((gi != ri).any(axis=-1).sum()), "rows": 4 * 16}


def _scaled(x: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    return x.astype({"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]).astype(np.float32)


TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}


def _cast_graph(nodes, dtype: str, inputs: list[tuple[str, list, bool]], out_shape: list, attrs_opsets):
    """A graph taking float32 inputs (``(name, shape, cast)``), casting the float ones to ``dtype``, running
    ``nodes`` (whose float inputs are ``<name>.c``) and returning ``out`` as float32."""
    from onnx import TensorProto, helper

    t = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[dtype]
    pre, ins = [], []
    for name, shape, cast in inputs:
        ins.append(helper.make_tensor_value_info(name, TensorProto.FLOAT if cast else TensorProto.INT64, shape))
        if cast:
            pre.append(helper.make_node("Cast", [name], [f"{name}.c"], to=t))
    post = [helper.make_node("Cast", ["out.c"], ["out"], to=TensorProto.FLOAT)]
    return _model_bytes(pre + nodes + post, ins, [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
                        attrs_opsets)


def _float_probe(device: str, dtypes: list[str], build, feeds) -> dict:
    out = {}
    for dtype in dtypes:
        model = build(dtype)
        got = _session(model, _providers(device)).run(None, feeds)[0]
        # the reference: the CPU provider in float32 on the same (rounded) inputs
        ref = _session(build("fp32"), ["CPUExecutionProvider"]).run(None, feeds)[0]
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(got - ref).max()) / scale
        out[dtype] = {"max_err": err, "tolerance": TOLERANCE[dtype], "ok": bool(err <= TOLERANCE[dtype])}
    return out


def _branchwise_rms_norm(device: str, dtypes: list[str]) -> dict:
    from onnx import helper

    heads, dim, eps = 16, 128, 1e-6                  # H + 2 KV heads of head_dim 128, as the backbone's
    rng = np.random.default_rng(1)
    feeds = {"x": _scaled(rng.standard_normal((2, 3, heads * dim)).astype(np.float32) * 3, "bf16"),
             "scale": _scaled(rng.standard_normal((heads, dim)).astype(np.float32), "bf16")}

    def build(dtype):
        node = helper.make_node("BranchwiseRMSNorm", ["x.c", "scale.c"], ["out.c"], domain="com.microsoft",
                                num_branches=heads, epsilon=eps)
        return _cast_graph([node], dtype, [("x", [2, 3, heads * dim], True), ("scale", [heads, dim], True)],
                           [2, 3, heads * dim], (("", 18), ("com.microsoft", 1)))

    out = _float_probe(device, dtypes, build, feeds)
    # and the formula itself, in float64
    x, w = feeds["x"].reshape(2, 3, heads, dim).astype(np.float64), feeds["scale"].astype(np.float64)
    want = (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).reshape(2, 3, heads * dim)
    ref = _session(build("fp32"), ["CPUExecutionProvider"]).run(None, feeds)[0]
    out["cpu_fp32_vs_formula"] = float(np.abs(ref - want).max() / max(1.0, np.abs(want).max()))
    return out


def _rotary_one_position(device: str, dtypes: list[str]) -> dict:
    from onnx import helper

    heads, dim, positions = 8, 64, 32                # a depth position's RoPE: one position for every row
    rng = np.random.default_rng(2)
    angles = np.arange(positions)[:, None] / (10000.0 ** (np.arange(0, dim, 2) / dim))[None]
    feeds = {"x": _scaled(rng.standard_normal((4, 1, heads * dim)).astype(np.float32), "bf16"),
             "position": np.array([5], np.int64),
             "cos": _scaled(np.cos(angles).astype(np.float32), "bf16"),
             "sin": _scaled(np.sin(angles).astype(np.float32), "bf16")}

    def build(dtype):
        node = helper.make_node("RotaryEmbedding", ["x.c", "position", "cos.c", "sin.c"], ["out.c"],
                                domain="com.microsoft", interleaved=0, num_heads=heads)
        return _cast_graph([node], dtype, [("x", [4, 1, heads * dim], True), ("position", [1], False),
                                           ("cos", [positions, dim // 2], True), ("sin", [positions, dim // 2], True)],
                           [4, 1, heads * dim], (("", 18), ("com.microsoft", 1)))

    out = _float_probe(device, dtypes, build, feeds)
    x = feeds["x"].reshape(4, 1, heads, dim).astype(np.float64)
    c, s = feeds["cos"][5].astype(np.float64), feeds["sin"][5].astype(np.float64)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(4, 1, heads * dim)
    ref = _session(build("fp32"), ["CPUExecutionProvider"]).run(None, feeds)[0]
    out["cpu_fp32_vs_formula"] = float(np.abs(ref - want).max() / max(1.0, np.abs(want).max()))
    return out


def _gather_nd_batch_dims_2(device: str) -> dict:
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    data = np.stack([rng.permutation(1027) for _ in range(6)])[:, None, :].astype(np.int64)     # [B, 1, V]
    index = rng.integers(0, 1027, size=(6, 1, 1)).astype(np.int64)
    node = helper.make_node("GatherND", ["data", "index"], ["out"], batch_dims=2)
    model = _model_bytes([node], [helper.make_tensor_value_info("data", TensorProto.INT64, [6, 1, 1027]),
                                  helper.make_tensor_value_info("index", TensorProto.INT64, [6, 1, 1])],
                         [helper.make_tensor_value_info("out", TensorProto.INT64, [6, 1])])
    (got,), (ref,) = _probe(device, model, {"data": data, "index": index})
    expected = np.take_along_axis(data[:, 0], index[:, 0], 1)
    return {"ok": bool(np.array_equal(got, ref) and np.array_equal(ref, expected))}


def _rings_in_place(device: str) -> dict:
    """The codec's ring writes (engine.audio.rings.RingState: ScatterND into the ring bound as its own output)
    on the device and on the CPU, the same calls on each: the rings must end byte-identical, at the same
    address."""
    from engine.audio.rings import RingStage, RingState

    stages = [RingStage(layers=2, heads=2, head_dim=4, rows=6, tokens_per_frame=2),
              RingStage(layers=1, heads=3, head_dim=2, rows=5, tokens_per_frame=1)]
    rng = np.random.default_rng(4)
    calls = [(3, np.array([1, 1, 0])), (3, np.array([2, 0, 1])), (2, np.array([1, 1])), (3, np.array([3, 3, 3])),
             (3, np.array([1, 0, 2]))]
    presents = [[rng.standard_normal(int(np.prod(s.layers * 2 * n * s.heads * 3 * s.tokens_per_frame * s.head_dim)))
                 .astype(np.float32) for s in stages] for n, _ in calls]

    def run(dev: str) -> tuple[list[np.ndarray], list[int], list[int]]:
        providers = ["CPUExecutionProvider"] if dev == "cpu" else _providers(dev) + ["CPUExecutionProvider"]
        state = RingState("decoder", stages, 3, dev, providers)
        addresses = [r.value.data_ptr() for r in state.rings]
        state.reset(1)
        for (n, frames), values in zip(calls, presents):
            state.prepare(n, 3)
            for si, present in enumerate(state._presents):
                assert present is not None, "prepare() made every stage's buffer"
                host = np.zeros(present.shape, np.float32)
                host[: values[si].size] = values[si]
                present.value.update_inplace(host)
            state.advance(n, frames.astype(np.int64), 3)
        return [r.value.numpy().copy() for r in state.rings], addresses, [r.value.data_ptr() for r in state.rings]

    got, before, after = run(device)
    ref, _, _ = run("cpu")
    return {"ok": all(np.array_equal(a, b) for a, b in zip(got, ref)) and before == after,
            "address_kept": before == after, "rows_written": int(sum((r != 0).any(-1).sum() for r in ref))}


def check_semantics(device: str, bundle=None, registry_out=None) -> dict:
    dtypes = ["fp32", "fp16", "bf16"] if device == "cuda" else ["fp32", "fp16"]
    figures = {"reference": "CPUExecutionProvider" + (" (the device itself: wiring only)" if device == "cpu" else ""),
               "topk_ties_k1027": _topk_ties(device),
               "scatternd_rings_in_place": _rings_in_place(device),
               "branchwise_rms_norm": _branchwise_rms_norm(device, dtypes),
               "rotary_embedding_one_position": _rotary_one_position(device, dtypes),
               "gather_nd_batch_dims_2": _gather_nd_batch_dims_2(device)}
    bad = []
    for name, result in figures.items():
        if not isinstance(result, dict):
            continue
        if "ok" in result and not result["ok"]:
            bad.append(name)
        bad += [f"{name} {d}" for d, r in result.items() if isinstance(r, dict) and not r.get("ok", True)]
    if bad:
        raise CheckFailed(f"the device differs from the CPU provider: {', '.join(bad)}", figures)
    return figures


CHECK_FUNCTIONS = {"provider": check_provider, "kernels": check_kernels, "placement": check_placement,
                   "graphs": check_graphs, "semantics": check_semantics}
NEEDS_BUNDLE = {"placement", "graphs"}


def tiny_bundle(out: Path, compute_dtype: str, progress=lambda msg: None) -> Path:
    """A tiny random bundle (the demo bundle's sizes) whose TTS graphs compute in ``compute_dtype``."""
    from export.bundle import BundleWriter
    from export.codec_export import export_codec
    from export.demo import DEMO_SEED, TOKENIZER_JSON
    from export.random_checkpoint import make_codec_checkpoint, make_tts_checkpoint
    from export.tokenizer_export import export_tokenizer
    from export.tts_export import export_tts

    with tempfile.TemporaryDirectory() as tmp:
        codec = make_codec_checkpoint(Path(tmp) / "codec", seed=DEMO_SEED, preset="tiny")
        tts = make_tts_checkpoint(Path(tmp) / "tts", seed=DEMO_SEED + 1, preset="tiny")
        writer = BundleWriter(out)
        export_codec(codec, writer, progress=progress)
        export_tts(tts, writer, compute_dtype, progress, compute_dtype=compute_dtype)
        export_tokenizer(TOKENIZER_JSON, writer)
        writer.finish()
    return out


def run_checks(device: str, checks: list[str], bundle_dir: Path | None = None, compute_dtype: str | None = None,
               registry_out: str | None = None, threads: int | None = None, progress=lambda msg: None,
               on_result=lambda r: None) -> list[CheckResult]:
    """Run ``checks`` in order on ``device``; each result is passed to ``on_result`` as it ends."""
    from engine.runtime.bundle import Bundle

    results, bundle, tmp = [], None, None
    try:
        for name in checks:
            t0 = time.perf_counter()
            try:
                if name in NEEDS_BUNDLE and bundle is None:
                    if bundle_dir is None:
                        tmp = tempfile.TemporaryDirectory(prefix="mossrt-doctor-")
                        dtype = compute_dtype or ("bf16" if device == "cuda" else "fp32")
                        progress(f"exporting a tiny random bundle ({dtype} compute) to {tmp.name}")
                        bundle_dir = tiny_bundle(Path(tmp.name), dtype)
                    bundle = Bundle(bundle_dir, device=device, threads=threads)
                figures = CHECK_FUNCTIONS[name](device, bundle, registry_out)
                result = CheckResult(name, "passed", time.perf_counter() - t0, figures=figures)
            except CheckSkipped as e:
                result = CheckResult(name, "skipped", time.perf_counter() - t0, str(e))
            except CheckFailed as e:
                result = CheckResult(name, "failed", time.perf_counter() - t0, str(e), e.figures)
            except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check; the next one runs
                result = CheckResult(name, "failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:1000])
            results.append(result)
            on_result(result)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return results
