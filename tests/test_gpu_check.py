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


# ---------------------------------------------------------------------------------------------- the H200 window
REPO = SCRIPT.parent.parent
H200_ARCHIVE_MIB = 113.8       # docs/gpu.md: the stripped H200 wheelhouse (48 wheels, the normalizer's included)


def h200_parts(parts_dir: Path, part_mib: float) -> dict:
    """A parts manifest of the documented H200 wheelhouse's size, cut as `gpu-wheelhouse build --part-mib`
    cuts it (the parts themselves are not needed to plan their transfers)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from wheelhouse import pack

    total, limit = int(H200_ARCHIVE_MIB * pack.MIB), int(part_mib * pack.MIB)
    sizes = [limit] * (total // limit) + ([total % limit] if total % limit else [])
    parts = [{"name": f"{pack.ARCHIVE}.{i:03d}", "bytes": n, "sha256": f"{i:064x}"} for i, n in enumerate(sizes, 1)]
    manifest = {"format": pack.FORMAT, "archive": {"name": pack.ARCHIVE, "bytes": total, "sha256": "0" * 64},
                "part_limit_bytes": limit, "parts": parts, "wheelhouse": {"python_version": "3.12"}}
    parts_dir.mkdir(parents=True)
    (parts_dir / pack.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def plan_in_repo(part_mib: float | None, *extra: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    """`scripts/gpu-check --parts DIR --plan` on the H200 manifest, DIR in this checkout's ignored .wheelhouse
    (a transfer carries only paths inside the repository); the part size is `--part-mib auto`'s unless given."""
    import shutil
    import tempfile

    sys.path.insert(0, str(REPO / "scripts"))
    from wheelhouse import build

    part_mib = part_mib or build.auto_part_mib(REPO)
    (REPO / ".wheelhouse").mkdir(exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="test-h200-", dir=REPO / ".wheelhouse"))
    try:
        manifest = h200_parts(top / "parts", part_mib)
        proc = subprocess.run([sys.executable, str(SCRIPT), "--parts", str(top / "parts"), "--plan", *extra],
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(top)
    return proc, manifest, part_mib


def test_the_h200_wheelhouse_goes_in_three_transfers_within_the_device_budget():
    """The documented H200 wheelhouse in `--part-mib auto` parts (4: three full and a small rest) travels in
    at most 3 transfers, each under 64 MiB with the tree as it travels today (measured now), and the plan
    prints its device time against the 15-minute budget, within it."""
    import re

    sys.path.insert(0, str(REPO / "scripts"))
    from wheelhouse import plan

    proc, manifest, part_mib = plan_in_repo(None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    repo_mib = plan.travelling_bytes(REPO) / plan.MIB
    sizes = [float(m) for m in re.findall(r"transfer \d/(?:\d): ([\d.]+) MiB", proc.stdout)]
    assert 1 <= len(sizes) <= 3, proc.stdout             # a small last part rides with another
    assert all(s < 64 and s >= repo_mib for s in sizes), (sizes, repo_mib)
    line = re.search(r"device time: start (\d+) s \+ (\d) transfer\(s\) .* = ([\d.]+) s of the 900 s budget "
                     r"\(spare ([\d.]+) s\)", proc.stdout)
    assert line, proc.stdout
    assert int(line[2]) == len(sizes) and float(line[3]) + float(line[4]) == 900
    assert "PROBLEM" not in proc.stdout


def test_a_plan_over_the_device_budget_is_refused():
    """A check that leaves the window no room (`--budget 700` beside a start and three transfers) is more
    device time than a session has: the plan says so and `--plan` exits 2."""
    proc, _, _ = plan_in_repo(None, "--budget", "700")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "check <= 700 s" in proc.stdout and "OVER" in proc.stdout
    assert "PROBLEM: the window needs" in proc.stdout and "over the 900 s budget" in proc.stdout
