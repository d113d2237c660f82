"""scripts/gpu-check's stages on the CPU provider (``--device cpu --smoke``), so the GPU command cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"
STAGES = ["install", "provider", "kernels", "tiny-bundle", "placement", "graphs", "semantics", "parity-fp16",
          "parity-fp32", "checkpoint", "export-fp16", "verify-fp16", "bench-compare-fp16", "bench-streams-fp16",
          "serve-loadtest-fp16", "export-int4", "verify-int4", "bench-compare-int4", "bench-streams-int4"]


def test_gpu_check_smoke_on_cpu_writes_every_stage(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--python", sys.executable,
                           "--out", str(out), "--work", str(tmp_path / "work"), "--budget", "900"],
                          capture_output=True, text=True, timeout=1200)
    summary = json.loads((out / "summary.json").read_text())
    statuses = {r["stage"]: r["status"] for r in summary["stages"]}
    failed = {r["stage"]: (r.get("reason"), r.get("log_tail", "")[-1500:]) for r in summary["stages"]
              if r["status"] != "passed" and r["stage"] != "graphs"}
    assert not failed, failed
    assert statuses["graphs"] == "n/a"                       # CUDA graphs: nothing to capture on the CPU
    assert list(statuses) == STAGES and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["kernels-cpu-registry.json", "stages.jsonl", "summary.json",
                                                     "table.txt"]
    lines = (out / "stages.jsonl").read_text().splitlines()   # one line per stage, as each ended
    assert [json.loads(line) for line in lines] == summary["stages"]
    assert (out / "table.txt").read_text().strip() in proc.stdout   # the printed table
    stage = {r["stage"]: r["figures"] for r in summary["stages"]}
    assert "CPUExecutionProvider" in stage["install"]["providers"]
    parity = stage["parity-fp16"]
    assert parity["tests"] > 0 and parity["failures"] == parity["errors"] == 0
    assert parity["compute_dtype"] == "fp16"
    assert parity["skipped"] >= 4   # the exact-greedy-code tests: conftest saw MOSSRT_TEST_COMPUTE_DTYPE
    # the figures the parity tests record come back per dtype
    precision = {d: stage[f"parity-{d}"]["recorded"]["test_precision_against_the_goldens"]["precision"]
                 for d in ("fp16", "fp32")}
    assert precision["fp32"]["codes"] == 1.0 and 0.9 < precision["fp16"]["codes"] < 1.0
    assert precision["fp16"]["compute_dtype"] == "fp16" and len(precision["fp16"]["per_codebook"]) == 16
    # the doctor's checks: the provider ran a graph, the registry matched the table, every node on the CPU
    assert stage["provider"]["lazy"]["session_providers"] == ["CPUExecutionProvider"]
    assert stage["kernels"]["differences"] == {} and stage["kernels"]["ops_registered"] > 50
    registry = json.loads((out / "kernels-cpu-registry.json").read_text())
    assert registry["provider"] == "CPUExecutionProvider" and "GroupQueryAttention@com.microsoft" in registry["ops"]
    placed = stage["placement"]["graphs"]
    assert set(placed) >= {"backbone", "depth", "codec_decoder"}
    assert all(list(g["nodes_by_provider"]) == ["CPUExecutionProvider"] for g in placed.values())
    assert all(v["ok"] for k, v in stage["semantics"].items() if isinstance(v, dict) and "ok" in v)
    assert stage["export-int4"]["dtype"] == "int4" and stage["export-int4"]["compute_dtype"] == "fp16"
    assert stage["bench-compare-fp16"]["result"]["time_to_first_audio_ms"]
    # the largest stream count runs alone (out of memory there keeps the smaller counts' figures)
    streams = stage["bench-streams-fp16"]
    assert list(streams) == ["streams=1", "streams=2"] and streams["streams=2"]["runs"][0]["streams"] == 2
    assert stage["serve-loadtest-fp16"]["report"]
    assert "summary.json" in proc.stdout
