"""scripts/gpu-check's stages on the CPU provider (``--device cpu --smoke``), so the GPU command cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"
STAGES = ["install", "checkpoint", "export-fp16", "export-int4", "verify-fp16", "verify-int4", "parity",
          "bench-compare-fp16", "bench-streams-fp16", "serve-loadtest-fp16", "bench-compare-int4",
          "bench-streams-int4"]


def test_gpu_check_smoke_on_cpu_writes_every_stage(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--python", sys.executable,
                           "--out", str(out), "--work", str(tmp_path / "work"), "--budget", "900"],
                          capture_output=True, text=True, timeout=1200)
    summary = json.loads((out / "summary.json").read_text())
    statuses = {r["stage"]: r["status"] for r in summary["stages"]}
    failed = {r["stage"]: (r.get("reason"), r.get("log_tail", "")[-1500:]) for r in summary["stages"]
              if r["status"] != "passed"}
    assert not failed, failed
    assert list(statuses) == STAGES and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["stages.jsonl", "summary.json", "table.txt"]
    lines = (out / "stages.jsonl").read_text().splitlines()   # one line per stage, as each ended
    assert [json.loads(line) for line in lines] == summary["stages"]
    assert (out / "table.txt").read_text().strip() in proc.stdout   # the printed table
    stage = {r["stage"]: r["figures"] for r in summary["stages"]}
    assert "CPUExecutionProvider" in stage["install"]["providers"]
    assert stage["parity"]["tests"] > 0 and stage["parity"]["failures"] == stage["parity"]["errors"] == 0
    assert stage["parity"]["compute_dtype"] == "fp16"
    assert stage["parity"]["skipped"] >= 4   # the exact-greedy-code tests: conftest saw MOSSRT_TEST_COMPUTE_DTYPE
    assert stage["export-int4"]["dtype"] == "int4" and stage["export-int4"]["compute_dtype"] == "fp16"
    assert stage["bench-compare-fp16"]["result"]["time_to_first_audio_ms"]
    # the largest stream count runs alone (out of memory there keeps the smaller counts' figures)
    streams = stage["bench-streams-fp16"]
    assert list(streams) == ["streams=1", "streams=2"] and streams["streams=2"]["runs"][0]["streams"] == 2
    assert stage["serve-loadtest-fp16"]["report"]
    assert "summary.json" in proc.stdout
