"""``mossrt doctor`` on the CPU provider: every check runs (the device and the reference are then one
provider, so these prove the checks' own wiring and that each can fail), its verdicts and its exit status.
On a GPU ``scripts/gpu-check`` runs the same command with ``--device cuda``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mossrt import doctor


def mossrt(*args):
    return subprocess.run([sys.executable, "-m", "mossrt.cli", *map(str, args)], capture_output=True, text=True)


def test_doctor_on_cpu_passes_and_writes_what_it_found(full_bundle_dir, tmp_path):
    out, registry = tmp_path / "doctor.json", tmp_path / "registry.json"
    proc = mossrt("doctor", "--device", "cpu", "--bundle", full_bundle_dir, "--json", out, "--registry-out", registry)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    status = {c["check"]: c["status"] for c in result["checks"]}
    assert status == {"provider": "passed", "kernels": "passed", "placement": "passed", "graphs": "skipped",
                      "semantics": "passed"}
    figures = {c["check"]: c["figures"] for c in result["checks"]}
    assert figures["provider"]["session_providers"] == ["CPUExecutionProvider"]
    assert figures["kernels"]["differences"] == {}
    placed = figures["placement"]["graphs"]
    assert placed["depth"]["nodes_by_provider"] == {"CPUExecutionProvider": placed["depth"]["nodes_by_provider"]
                                                    ["CPUExecutionProvider"]} and not placed["depth"]["off_device"]
    # the registry file is the committed table's format: the placement check reads it back
    from engine.runtime.kernel_table import DATA, TABLES

    written, committed = json.loads(registry.read_text()), json.loads((DATA / TABLES["cpu"]).read_text())
    assert written["ops"] == committed["ops"]
    assert "5 of 5 checks passed or skipped" in proc.stdout


def test_doctor_refuses_unknown_checks_and_bundles(tmp_path):
    proc = mossrt("doctor", "--checks", "provider,x-ray")
    assert proc.returncode == 2 and "unknown check(s) ['x-ray']" in proc.stderr
    proc = mossrt("doctor", "--bundle", tmp_path)
    assert proc.returncode == 2 and "not a bundle" in proc.stderr


def test_a_failed_check_fails_the_command(tmp_path):
    # the CUDA provider is not installed here: the provider check must fail, not fall back to the CPU
    proc = mossrt("doctor", "--device", "cuda", "--checks", "provider", "--json", tmp_path / "d.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    check = json.loads((tmp_path / "d.json").read_text())["checks"][0]
    assert check["status"] == "failed" and "not CUDAExecutionProvider" in check["reason"]


def test_kernel_diff_names_what_the_table_claims_beyond_the_registry():
    from engine.runtime.kernel_table import Kernel, OpKernels, coverage_diff, kernel_table, registry_table

    committed = kernel_table("cpu")
    registry = registry_table("cpu")
    assert coverage_diff(committed, registry, doctor.GRAPH_OPSETS) == {}
    key = "TopK@ai.onnx"
    # a table claiming bfloat16 TopK the registry lacks, and a registry with a type the table omits
    claim = replace(committed, ops={**committed.ops, key: OpKernels(
        committed.ops[key].kernels
        + (Kernel(11, 2147483647, {"T": frozenset({"bfloat16"}), "I": frozenset({"int64"})}),),
        committed.ops[key].host_inputs)})
    diff = coverage_diff(claim, registry, doctor.GRAPH_OPSETS)
    assert diff == {key: {"opset": 18, "table_only": {"T": ["bfloat16"]}, "registry_only": {}, "in_registry": True}}
    narrow = replace(committed, ops={**committed.ops, key: OpKernels(
        tuple(replace(k, types={**k.types, "T": frozenset({"float"})}) for k in committed.ops[key].kernels),
        committed.ops[key].host_inputs)})
    assert coverage_diff(narrow, registry, doctor.GRAPH_OPSETS)[key]["registry_only"]["T"]


def test_placement_log_parsing():
    # onnxruntime's lines (session_state.cc VerifyEachNodeIsAssignedToAnEp; its format strings are
    # " All nodes placed on [", " Node(s) placed on [", "]. Number of nodes: "), mixed placement as on CUDA
    prefix = "2026-12-01 20:02:19.46 [V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]"
    log = "\n".join([f"{prefix} Node placements",
                     f"{prefix}  Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 2",
                     f"{prefix}   MatMul (layers.0/MatMul_1)", f"{prefix}   Add (layers.0/Add_2)",
                     f"{prefix}  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 1",
                     f"{prefix}   Shape (layers.0/Shape_3)", "unrelated line"])
    assert doctor.parse_placement_log(log) == {
        "CUDAExecutionProvider": [("MatMul", "layers.0/MatMul_1"), ("Add", "layers.0/Add_2")],
        "CPUExecutionProvider": [("Shape", "layers.0/Shape_3")]}
    one = f"{prefix}  All nodes placed on [CPUExecutionProvider]. Number of nodes: 3"
    assert doctor.parse_placement_log(one) == {"CPUExecutionProvider": [("", "")] * 3}


def test_semantics_probes_fail_on_a_difference(monkeypatch):
    """Each probe compares the device with the CPU provider: a device that answers otherwise fails it."""
    real = doctor._session
    monkeypatch.setattr(doctor, "_providers", lambda device: ["device-under-test"])

    def skewed(model, providers, threads=1):
        if providers != ["device-under-test"]:
            return real(model, providers, threads)
        session = real(model, ["CPUExecutionProvider"], threads)

        class Off:                                  # the "device": one ulp-scale error, indices rolled
            def run(self, names, feeds):
                out = session.run(names, feeds)
                return [np.roll(o, 1, axis=0) if o.dtype == np.int64 else o * np.float32(1.01) for o in out]
        return Off()

    monkeypatch.setattr(doctor, "_session", skewed)
    with pytest.raises(doctor.CheckFailed) as failed:
        doctor.check_semantics("cpu")
    assert "topk_ties_k1027" in str(failed.value) and "gather_nd_batch_dims_2" in str(failed.value)
    assert "branchwise_rms_norm fp32" in str(failed.value)


def test_graph_comparison_runs_streams_of_different_lengths(model):
    """The CUDA-graph check's comparison, on two uncaptured runs of one model: the same codes per stream,
    and per-call figures (on CUDA one of the two captures)."""
    texts = [model.tokenizer.encode(t) for t in ("one two three four five six seven eight nine ten eleven twelve",
                                                 "a b c d e f g h i j k l m n o")]
    a, timing = doctor._greedy_codes(model, texts, 6)
    b, _ = doctor._greedy_codes(model, texts, 6)
    assert [x.shape for x in a] == [(6, 16), (6, 16)] and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert timing["step_calls"] > 0 and timing["depth_ms_per_call"] > 0
