"""The benchmark commands report consistent figures (benchmarks measure; tests only check they are sane)."""

from __future__ import annotations

import json
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
    assert r["baseline"]["time_to_first_audio_ms"] == 6700.0
    assert set(r["frames_per_s"]) == {"1", "2"}
    assert "ratio = ours / upstream" in out and "time to first audio" in out
