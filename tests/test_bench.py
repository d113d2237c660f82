"""The benchmark commands report consistent figures (benchmarks measure; tests only check they are sane)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import TEST_DEVICE


def mossrt(*args):
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", *map(str, args), "--device", TEST_DEVICE],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_bench_streams(full_bundle_dir, tmp_path):
    out = mossrt("bench", "streams", "--bundle", full_bundle_dir, "--streams", "1,2", "--frames", "4",
                 "--json", tmp_path / "s.json")
    r = json.loads((tmp_path / "s.json").read_text())
    one, two = r["runs"]
    assert (one["streams"], two["streams"]) == (1, 2) and one["speedup_vs_1"] == 1.0
    assert abs(two["speedup_vs_1"] - two["frames_per_s"] / one["frames_per_s"]) < 1e-9
    assert two["frames"] <= 2 * 4 and two["kv_bytes_in_use"] == 2 * two["kv_bytes_per_stream"]
    assert two["backbone_steps"] < two["frames"]               # two streams shared their step calls
    assert "frames/s" in out


def test_bench_compare(full_bundle_dir, tmp_path):
    out = mossrt("bench", "compare", "--bundle", full_bundle_dir, "--frames", "3", "--streams", "2", "--repeats", "1",
                 "--json", tmp_path / "c.json")
    r = json.loads((tmp_path / "c.json").read_text())
    for key in ("cold (no prefix cache)", "text only", "registered voice", "second turn"):
        assert r["time_to_first_audio_ms"][key] > 0
    assert r["prefix_cache"]["hits"] >= 2                       # text-only and voice streams started from cache
    assert set(r["frames_per_s"]) == {"1", "2"}
    assert "ratio = ours / upstream" in out and "time to first audio" in out
    # every time-to-first-audio line prints our figure, the baseline's, and their ratio = ours / baseline
    base = r["baseline"]["time_to_first_audio_ms"]
    assert base > 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("time to first audio"))
    printed = {}
    for line in lines[header + 1:]:
        m = re.fullmatch(r"    (\S.*?)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d{3})x", line)
        if not m:
            break
        printed[m.group(1)] = tuple(float(x) for x in m.group(2, 3, 4))
    assert set(printed) == set(r["time_to_first_audio_ms"]), (printed, out)
    for key, ours in r["time_to_first_audio_ms"].items():
        ms, baseline, ratio = printed[key]
        assert abs(ms - ours) <= 0.05 + 1e-9 and abs(baseline - base) <= 0.05 + 1e-9, (key, printed[key], ours, base)
        assert abs(ratio - ours / base) <= 5e-4 + 1e-12, (key, ratio, ours / base)
