"""Placement without a GPU: the committed kernel tables, the check of every node against them, the device
decision at load, and its refusals from the CLI and from ``mossrt serve``."""

from __future__ import annotations

import json
import time

import httpx
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from service_helpers import Server
from test_hardening import assert_clean_error, run_cli

from engine.runtime.kernel_table import (
    DATA,
    OPEN_END,
    SIGNATURES,
    TABLES,
    installed_cpu_kernels,
    installed_signatures,
    kernel_table,
    op_key,
    signatures,
)
from engine.runtime.placement import HOST_COPY, NO_KERNEL, PlacementRefused, choose_device, unplaced

GRAPHS = ("backbone", "depth", "sampling_filter", "codec_decoder", "codec_encoder")
ELEMENT_TYPES = {TensorProto.DataType.Name(t).lower() for t in TensorProto.DataType.values()} | {"float4e2m1"}


def graphs_of(bundle_dir):
    return {g: bundle_dir / f"{g}.onnx" for g in GRAPHS if (bundle_dir / f"{g}.onnx").is_file()}


@pytest.fixture(scope="module")
def int8_bundle_dir(tmp_path_factory):
    from conftest import TTS_CHECKPOINT

    from export.bundle import BundleWriter
    from export.tts_export import export_tts

    out = tmp_path_factory.mktemp("bundle_tts_int8_placement")
    writer = BundleWriter(out)
    export_tts(TTS_CHECKPOINT, writer, dtype="int8")
    writer.finish()
    return out


# ---------------------------------------------------------------------------------------------- the tables
@pytest.mark.parametrize("provider", sorted(TABLES))
def test_kernel_table_is_well_formed(provider):
    raw = json.loads((DATA / TABLES[provider]).read_text())
    assert raw["provider"] == f"{provider.upper()}ExecutionProvider" and raw["version"] and raw["source"]
    sigs = signatures()
    for key, entry in raw["ops"].items():
        assert key in sigs and sigs[key], f"{key}: no operator signature"
        # kernels constrain type parameters, or (onnxruntime does both) a fixed-type input by its name
        constraints = {x for s in sigs[key] for f in (*s.inputs, *s.outputs) for x in (f.type, f.name)}
        max_inputs = max(len(s.inputs) for s in sigs[key])
        assert all(0 <= i < max_inputs for i in entry.get("host_inputs", [])), key
        assert provider == "cuda" or not entry.get("host_inputs"), key
        for k in entry["kernels"]:
            assert 1 <= k["since"] <= k["until"] <= OPEN_END, (key, k)
            for c, types in k["types"].items():
                assert c in constraints, f"{key}: constraint {c} is not in its signature {constraints}"
                tensors = [t for t in types if not t.startswith(("seq(", "optional("))]
                assert tensors and set(tensors) <= ELEMENT_TYPES, (key, c, types)
    assert set(raw["ops"]) == set(json.loads((DATA / TABLES["cuda"]).read_text())["ops"]), "tables cover other ops"


def test_cpu_table_and_signatures_are_the_installed_onnxruntime():
    """Regenerated from the installed onnxruntime's registry: the CPU table cannot drift from it."""
    raw = json.loads((DATA / TABLES["cpu"]).read_text())
    assert raw["version"] == ort.__version__, "re-pin the cpu extra or regenerate the CPU table"
    committed = {k: v["kernels"] for k, v in raw["ops"].items()}
    assert installed_cpu_kernels(list(committed)) == committed
    sigs = json.loads((DATA / SIGNATURES).read_text())
    assert installed_signatures(list(sigs["ops"])) == sigs["ops"]


def test_tables_cover_every_op_the_exporter_writes(full_bundle_dir, int8_bundle_dir):
    ops = kernel_table("cuda").ops
    for bundle in (full_bundle_dir, int8_bundle_dir):
        for path in graphs_of(bundle).values():
            m = onnx.load(str(path), load_external_data=False)
            missing = {op_key(n.op_type, n.domain) for n in m.graph.node} - set(ops)
            assert not missing, f"{path.name}: {missing}"


def _one_node_models(bundle_dirs, retype: str | None):
    """Each distinct (op, input types) node of the bundles as a one-node model (float tensors retyped)."""
    seen, models = set(), []
    for bundle in bundle_dirs:
        for path in graphs_of(bundle).values():
            m = onnx.load(str(path), load_external_data=False)
            types = _types(m)
            for node in m.graph.node:
                in_types = tuple(types.get(x, 0) if x else 0 for x in node.input)
                if retype:
                    new = getattr(TensorProto, retype.upper())
                    in_types = tuple(new if t == TensorProto.FLOAT else t for t in in_types)
                key = (node.op_type, node.domain, in_types, len(node.output))
                if key in seen or 0 in [t for x, t in zip(node.input, in_types) if x]:
                    continue
                seen.add(key)
                inputs = [helper.make_tensor_value_info(f"in{i}", t, None)
                          for i, (x, t) in enumerate(zip(node.input, in_types)) if x]
                names = [f"in{i}" if x else "" for i, x in enumerate(node.input)]
                outs = [f"out{i}" for i in range(len(node.output))]
                n = helper.make_node(node.op_type, names, outs, domain=node.domain, name=node.name)
                n.attribute.extend(node.attribute)
                g = helper.make_graph([n], "one", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs])
                models.append(helper.make_model(g, opset_imports=m.opset_import, ir_version=m.ir_version))
    return models


def _types(m):
    """Element types onnx's own inference finds (it stops at contrib ops: later nodes repeat earlier kinds)."""
    model = onnx.shape_inference.infer_shapes(m)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.value_info]}
    types.update({i.name: i.data_type for i in m.graph.initializer})
    return types


@pytest.mark.parametrize("retype", [None, "float16", "bfloat16"])
def test_cpu_table_matches_what_onnxruntime_loads(retype, full_bundle_dir, int8_bundle_dir):
    """Every distinct node of today's bundles (and the same nodes in fp16 and bf16) as a one-node model: the
    CPU table says it runs exactly when onnxruntime's CPU provider finds a kernel for it."""
    disagree, loaded, refused, invalid = [], 0, 0, 0
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for model in _one_node_models((full_bundle_dir, int8_bundle_dir), retype):
        node = model.graph.node[0]
        says = not [f for f in unplaced(model, "cpu") if f.kind == NO_KERNEL]
        try:
            ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            loads, loaded = True, loaded + 1
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
            if "implementation" not in str(e) and "kernel" not in str(e).lower():
                invalid += 1                                # rejected by the op's schema, before kernels
                continue
            loads, refused = False, refused + 1
        if says != loads:
            disagree.append((node.op_type, [TensorProto.DataType.Name(i.type.tensor_type.elem_type)
                                            for i in model.graph.input], says, loads))
    assert not disagree, disagree
    assert loaded >= 40 and invalid <= 5, (loaded, refused, invalid)
    assert (refused > 0) == (retype == "bfloat16"), (loaded, refused, invalid)   # both outcomes are checked


# ---------------------------------------------------------------------------------------------- the check
def test_fp32_bundle_lists_its_attention_for_cuda(tts_bundle_dir):
    """fp32 graphs: every backbone and depth GroupQueryAttention has no CUDA kernel (fp16/bf16 only); the
    lengths GQA reads on the host come from graph inputs and the sampler sorts at a fixed size, so no node
    needs a device->host copy."""
    findings = {g: unplaced(path, "cuda") for g, path in graphs_of(tts_bundle_dir).items()}
    for g in ("backbone", "depth"):
        gqa = [n.name for n in onnx.load(str(graphs_of(tts_bundle_dir)[g]), load_external_data=False).graph.node
               if n.op_type == "GroupQueryAttention"]
        assert gqa and sorted(f.node for f in findings[g]) == sorted(gqa), g
        assert all(f.kind == NO_KERNEL and f.module.endswith("self_attn") and f.types[0] == "float"
                   for f in findings[g]), g
    assert findings["sampling_filter"] == []


@pytest.mark.parametrize("compute", ["fp16", "bf16"])
def test_gpu_bundles_place_fully_on_cuda(tts_bundle_for, compute):
    """What the GPU path needs: a reduced-precision bundle has 0 nodes without a CUDA kernel and 0 device->host
    copies inside a step (the weights may be stored in the compute dtype or as int4)."""
    for dtype in (compute, "int4"):
        bundle = tts_bundle_for(dtype, compute)
        for g, path in graphs_of(bundle).items():
            assert unplaced(path, "cuda") == [], (dtype, compute, g)


def test_device_computed_shapes_are_host_copies():
    """A host-read input (TopK's K, GQA's total_sequence_length) computed from tensor data on the device is a
    device->host copy inside a step, named with the node that makes it; fed from a graph input it is not."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [2])
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("v", "w")]
    nodes = [helper.make_node("ReduceMax", ["k"], ["kmax"], name="sampling.top_k/ReduceMax_1", keepdims=1),
             helper.make_node("TopK", ["x", "kmax"], ["v", "i"], name="sampling.top_k/TopK_2"),
             helper.make_node("TopK", ["x", "k1"], ["w", "j"], name="sampling.top_p/TopK_3")]
    k1 = helper.make_tensor_value_info("k1", TensorProto.INT64, [1])
    g = helper.make_graph(nodes, "g", [x, k, k1], out)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    [f] = unplaced(m, "cuda")
    assert f.kind == HOST_COPY and f.node == "sampling.top_k/TopK_2" and f.module == "sampling.top_k"
    assert "input 1 (K)" in f.why and "ReduceMax" in f.why
    assert unplaced(m, "cpu") == []


def test_todays_bundles_place_fully_on_cpu(full_bundle_dir, int8_bundle_dir):
    for bundle in (full_bundle_dir, int8_bundle_dir):
        for name, path in graphs_of(bundle).items():
            assert unplaced(path, "cpu") == [], name


def _one_op(op, elem, domain="", **attrs):
    x = helper.make_tensor_value_info("x", elem, [2, 3])
    y = helper.make_tensor_value_info("y", elem, [3, 2])
    n = helper.make_node(op, ["x", "y"], ["z"], name=f"layers.0.mlp/{op}_1", domain=domain, **attrs)
    g = helper.make_graph([n], "g", [x, y], [helper.make_tensor_value_info("z", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_ops_outside_the_tables_are_findings():
    """An op the tables do not list is reported, never assumed to run; so is one with no kernel at all."""
    [f] = unplaced(_one_op("MatMulInteger", TensorProto.INT8), "cuda")
    assert f.kind == NO_KERNEL and "MatMulInteger@ai.onnx is not in the cuda kernel table" in f.why
    x = helper.make_tensor_value_info("q", TensorProto.FLOAT16, None)
    n = helper.make_node("PagedAttention", ["q"], ["o"], name="attn/PagedAttention_1", domain="com.microsoft")
    g = helper.make_graph([n], "g", [x], [helper.make_value_info("o", onnx.TypeProto())])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    assert unplaced(m, "cuda") == []
    [f] = unplaced(m, "cpu")
    assert "has no kernel for this op" in f.why


def test_bf16_runs_on_cuda_only():
    bf16 = _one_op("MatMul", TensorProto.BFLOAT16)
    assert unplaced(bf16, "cuda") == []
    [f] = unplaced(bf16, "cpu")
    assert f.node == "layers.0.mlp/MatMul_1" and f.module == "layers.0.mlp" and f.types == ("bfloat16", "bfloat16")
    assert unplaced(_one_op("MatMul", TensorProto.FLOAT16), "cpu") == []     # fp16 runs on CPU too


# ---------------------------------------------------------------------------------------------- the decision
CPU_ONLY = ["CPUExecutionProvider"]
WITH_CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_device_choice_never_falls_back_silently(tts_bundle_dir):
    fp32 = lambda p: [f for path in graphs_of(tts_bundle_dir).values() for f in unplaced(path, p)]  # noqa: E731
    bf16 = lambda p: unplaced(_one_op("MatMul", TensorProto.BFLOAT16), p)                           # noqa: E731
    # forced CUDA with an fp32 bundle: refused by the check, before asking whether CUDA is even installed
    for available in (CPU_ONLY, WITH_CUDA):
        with pytest.raises(PlacementRefused,
                           match=r"GroupQueryAttention.*export with --compute-dtype bf16 \(or fp16\)"):
            choose_device("cuda", available, fp32)
    with pytest.raises(PlacementRefused,
                       match="bf16 bundles run on CUDA only; export with --compute-dtype fp16 or fp32"):
        choose_device("cpu", WITH_CUDA, bf16)
    with pytest.raises(PlacementRefused, match="install the 'cuda' extra"):
        choose_device("cuda", CPU_ONLY, bf16)
    assert choose_device("cuda", WITH_CUDA, bf16).providers[0] == "CUDAExecutionProvider"
    # auto: CUDA only for a bundle that runs there, and it says why
    auto = choose_device("auto", WITH_CUDA, fp32)
    assert auto.device == "cpu" and "no kernel" in auto.reason and "GroupQueryAttention" in auto.reason
    assert choose_device("auto", CPU_ONLY, fp32).reason == "auto: cpu, because onnxruntime has no CUDA provider here"
    assert choose_device("auto", WITH_CUDA, bf16).device == "cuda"
    with pytest.raises(PlacementRefused, match="no provider can run this bundle"):
        choose_device("auto", CPU_ONLY, bf16)


# ---------------------------------------------------------------------------------------------- CLI and serve
def test_verify_lists_unplaced_nodes_with_status_2(capsys, fp32_bundle_dir):
    code, out, err = run_cli(capsys, "verify", "--bundle", fp32_bundle_dir, "--provider", "cuda")
    assert_clean_error(code, err, "node(s) cannot run on the cuda provider")
    assert "every sha256 matches" in out and "GroupQueryAttention" in out and HOST_COPY not in out
    assert "backbone: language_model.layers.0.self_attn/GroupQueryAttention" in out
    code, out, err = run_cli(capsys, "verify", "--bundle", fp32_bundle_dir, "--provider", "cpu")
    assert code == 0 and "cpu: 0 nodes without a kernel" in out, err


def test_forced_cuda_is_refused_at_load(capsys, tmp_path, fp32_bundle_dir):
    """Honest on a CPU-only machine: the placement check refuses the fp32 bundle before onnxruntime is asked."""
    code, _, err = run_cli(capsys, "synth", "--bundle", fp32_bundle_dir, "--text", "hi", "--out", tmp_path / "o.wav",
                           "--device", "cuda")
    assert_clean_error(code, err, "export with --compute-dtype bf16 (or fp16) for CUDA")
    assert "GroupQueryAttention" in err and not (tmp_path / "o.wav").exists()


def test_serve_reports_the_refusal_on_ready(tmp_path, fp32_bundle_dir):
    server = Server(fp32_bundle_dir, tmp_path / "voices", tmp_path / "serve.log", "--device", "cuda")
    try:
        deadline, body = time.monotonic() + 120, None
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                r = httpx.get(server.base + "/ready", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            body = r.json()
            if body["status"] == "failed":
                break
            time.sleep(0.2)
        assert server.proc.poll() is None, server.log()
        assert r.status_code == 503 and body["status"] == "failed", (body, server.log())
        assert "export with --compute-dtype bf16 (or fp16) for CUDA" in body["error"]
        assert "GroupQueryAttention" in body["device_reason"] and body["device"] == "none"
        assert "cannot be served on the requested device" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_serve_auto_says_what_it_picked(tmp_path, full_bundle_dir):
    """``--device auto`` here (no CUDA provider): CPU, with the reason in the log and in /ready."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this check is for a machine without the CUDA provider")
    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "serve.log", "--device", "auto") as server:
        body = httpx.get(server.base + "/ready", timeout=10).json()
        reason = "auto: cpu, because onnxruntime has no CUDA provider here"
        assert body["device"] == "cpu" and body["device_reason"] == reason, body
        assert f"device cpu: {reason}" in server.log()


def test_runtime_helper_graphs_place_on_cuda(monkeypatch, full_bundle_dir):
    """The small graphs the engine builds at run time (KV slot writes, copies and reads, zero fills, the
    codec rings' in-place write, move and position updates) have a kernel for every node on CUDA too: they
    are not in the bundle, so the load-time check never sees them. (Their row counts may come from data:
    they run between steps, never inside a captured one.)"""
    import engine.audio.rings
    import engine.kv.pool
    import engine.runtime.device
    from engine.model.tts import TTSModel
    from engine.offline.generate import generate, synthesize
    from engine.runtime.bundle import Bundle

    built: dict[str, bytes] = {}
    real = engine.runtime.device._graph

    def recording(name, nodes, inputs, outputs):
        built[name] = real(name, nodes, inputs, outputs)
        return built[name]

    monkeypatch.setattr(engine.runtime.device, "_graph", recording)
    monkeypatch.setattr(engine.kv.pool, "_graph", recording)
    monkeypatch.setattr(engine.audio.rings, "_graph", recording)
    model = TTSModel(Bundle(full_bundle_dir, device="cpu"))
    gen = generate(model, text="Hello there.", max_frames=4, params=model.default_sampling(greedy=True))
    assert synthesize(model, gen).size > 0
    codec = model.codec
    dec = codec.streaming_decoder(slots=2, n_quantizers=16)
    dec.move(1, 0)
    assert {"slot_write", "slot_copy", "slot_read", "zero_fill", "ring_write", "last_row"} <= set(built), sorted(built)
    for name, data in built.items():
        graph = onnx.load_from_string(data)
        assert [f for f in unplaced(graph, "cuda") if f.kind == NO_KERNEL] == [], name
        assert unplaced(graph, "cpu") == [], name
