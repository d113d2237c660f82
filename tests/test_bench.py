"""The benchmark commands report consistent figures (benchmarks measure; tests only check they are sane)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import TEST_DEVICE


def mossrt(*args):
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", *map(str, args), "--device", TEST_DEVICE],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def assert_roofline_consistent(roof: dict) -> None:
    """Every stage's bandwidth is its bytes over its time, and its share that over the probe's."""
    probe = roof["probe"]
    assert probe["bytes_per_s"] > 0 and probe["threads"] >= 1
    assert abs(probe["bytes_per_s"] - probe["bytes"] / probe["seconds"]) <= 1e-9 * probe["bytes_per_s"]
    seen = sorted(probe["samples_bytes_per_s"])             # the roofline is the median of the samples taken
    assert seen[len(seen) // 2] == probe["bytes_per_s"]
    for name, st in roof["stages"].items():
        assert st["bytes"] > 0 and st["ms"] > 0, name
        assert abs(st["bytes_per_s"] - st["bytes"] / (st["ms"] / 1000)) <= 1e-9 * st["bytes_per_s"], name
        assert abs(st["share"] - st["bytes_per_s"] / probe["bytes_per_s"]) <= 1e-12, name


def test_weight_bytes_per_call_counts_each_read():
    """A weight read by two nodes counts twice, a Cast-widened one in its widened size per reader, a Gather
    table and rotary caches (rows by position) not at all."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from engine.runtime.graph_stats import weight_bytes_per_call

    inits = [numpy_helper.from_array(np.ones((4, 8), np.float32), "w"),
             numpy_helper.from_array(np.ones((10, 4), np.float32), "table"),
             numpy_helper.from_array(np.ones((4, 4), np.float16), "h16"),
             numpy_helper.from_array(np.ones((64, 2), np.float32), "cos"),
             numpy_helper.from_array(np.ones((64, 2), np.float32), "sin")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Cast", ["h16"], ["h"], to=TensorProto.FLOAT),
             helper.make_node("RotaryEmbedding", ["e", "pos", "cos", "sin"], ["r"], domain="com.microsoft"),
             helper.make_node("MatMul", ["r", "h"], ["a"]), helper.make_node("MatMul", ["a", "h"], ["b"]),
             helper.make_node("MatMul", ["b", "h"], ["c"]),
             helper.make_node("MatMul", ["c", "w"], ["d"]), helper.make_node("MatMul", ["c", "w"], ["f"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("d", "f")], inits)
    assert weight_bytes_per_call(helper.make_model(graph)) == 2 * 4 * 8 * 4 + 3 * 4 * 4 * 4


def test_probe_samples_combine_to_their_median():
    """The roofline's probe is the median sample (upper median for an even count), whatever the order taken."""
    from engine.tools.roofline import combine_probes

    samples = [{"bytes": 8, "seconds": s, "bytes_per_s": 8 / s, "threads": 2, "repeats": 5} for s in (1, 4, 2, 8)]
    p = combine_probes(samples)
    assert p["seconds"] == 2
    assert p["bytes_per_s"] == 4.0 and p["samples_bytes_per_s"] == [8.0, 2.0, 4.0, 1.0]
    assert combine_probes(samples[:3])["bytes_per_s"] == 4.0


def test_read_probe_reads_each_share_whole(monkeypatch):
    """The probe reads its whole buffer, split over its threads: each share's maximum is the mark written at
    its end, and a pass that stopped short of a share's end is refused rather than timed."""
    import engine.tools.roofline as roofline

    p = roofline._read_probe(3, 3 * 4096, 2)
    assert p["bytes"] == 3 * 4096 and p["threads"] == 3 and p["repeats"] == 2
    assert abs(p["bytes_per_s"] - p["bytes"] / p["seconds"]) <= 1e-9 * p["bytes_per_s"]
    real_max = np.max
    monkeypatch.setattr(roofline.np, "max", lambda a: real_max(a[:-1]))   # a read that misses the last element
    with pytest.raises(RuntimeError, match="wrong maximum"):
        roofline._read_probe(2, 2 * 4096, 1)


def test_bench_codec_roofline(codec_bundle_dir, tmp_path):
    import onnx

    from engine.runtime.graph_stats import weight_bytes_per_call

    out = mossrt("bench", "codec", "--bundle", codec_bundle_dir, "--frames", "6", "--repeats", "1",
                 "--json", tmp_path / "c.json")
    roof = json.loads((tmp_path / "c.json").read_text())["roofline"]
    assert_roofline_consistent(roof)
    assert len(roof["probe"]["samples_bytes_per_s"]) == 4      # after the one-pass runs and each chunk size's
    call = weight_bytes_per_call(onnx.load(str(codec_bundle_dir / "codec_decoder.onnx"), load_external_data=False))
    assert {name: st["bytes"] for name, st in roof["stages"].items()} == {
        f"codec, {n} frame(s)/call, per frame": call // n for n in (1, 3, 6)}
    assert "memory read probe" in out and "roofline" in out


def test_bench_streams(full_bundle_dir, tmp_path):
    out = mossrt("bench", "streams", "--bundle", full_bundle_dir, "--streams", "1,2", "--frames", "4",
                 "--json", tmp_path / "s.json")
    r = json.loads((tmp_path / "s.json").read_text())
    one, two = r["runs"]
    assert (one["streams"], two["streams"]) == (1, 2) and one["speedup_vs_1"] == 1.0
    assert abs(two["speedup_vs_1"] - two["frames_per_s"] / one["frames_per_s"]) < 1e-9
    assert two["frames"] <= 2 * 4 and two["kv_bytes_in_use"] == 2 * two["kv_bytes_per_stream"]
    assert two["backbone_steps"] < two["frames"]               # two streams shared their step calls
    for run in (one, two):                                      # the loop's own cost, from its ticks
        assert run["ticks"] >= run["steady_ticks"] >= 1 and run["tick_ms_p50"] <= run["tick_ms_p99"]
        assert 0 <= run["host_ms_per_tick_p50"] <= run["tick_ms_p99"]
        # steady ticks fed every stream: the per-stream host time is the per-tick one shared out
        assert abs(run["host_us_per_stream_p50"] * run["streams"] / 1000 - run["host_ms_per_tick_p50"]) < 1e-9
    assert "frames/s" in out and "host/stream us" in out


def test_bench_compare(full_bundle_dir, tmp_path):
    out = mossrt("bench", "compare", "--bundle", full_bundle_dir, "--frames", "3", "--streams", "2", "--repeats", "1",
                 "--json", tmp_path / "c.json")
    r = json.loads((tmp_path / "c.json").read_text())
    for key in ("cold (no prefix cache)", "text only", "registered voice", "second turn"):
        assert r["time_to_first_audio_ms"][key] > 0
    assert r["prefix_cache"]["hits"] >= 2                       # text-only and voice streams started from cache
    park = r["parking"]                     # --repeats 1: the conversation parked once by the other's turn
    assert park["context_rows"] >= 900 and park["resumes"] >= 1 and park["parks"] >= 2 and park["resume_ms"] > 0
    rows = park["context_rows"]
    for key in (f"next turn at {rows} rows, kept in its slot", f"next turn at {rows} rows, parked and resumed",
                f"a turn that parks a {rows}-row context"):
        assert r["time_to_first_audio_ms"][key] > 0
    assert f"parking a {rows}-row context" in out
    assert set(r["frames_per_s"]) == {"1", "2"}
    assert "ratio = ours / upstream" in out and "time to first audio" in out
    roof = r["roofline"]
    assert_roofline_consistent(roof)
    assert len(roof["probe"]["samples_bytes_per_s"]) == 1 + 4  # synth's one timed run, codec's four sample points
    stages = roof["stages"]
    assert set(stages) == {"backbone step", "depth", "codec, 1 frame/call", "codec, 6 frames/call, per frame",
                           "steady frame (step+depth+codec@6)"}
    assert roof["frame_bytes"] == stages["steady frame (step+depth+codec@6)"]["bytes"] == (
        stages["backbone step"]["bytes"] + stages["depth"]["bytes"] + stages["codec, 1 frame/call"]["bytes"] // 6)
    assert "one real-time stream needs" in out
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


def test_bench_synth_roofline(full_bundle_dir, tmp_path):
    """Per stage: the bytes each call reads, its bandwidth and share; one probe sample after each timed run."""
    out = mossrt("bench", "synth", "--bundle", full_bundle_dir, "--frames", "3", "--repeats", "2",
                 "--json", tmp_path / "s.json")
    r = json.loads((tmp_path / "s.json").read_text())
    roof = r["roofline"]
    assert_roofline_consistent(roof)
    assert len(roof["probe"]["samples_bytes_per_s"]) == 2
    assert set(roof["stages"]) == {"backbone step", "depth", "codec, 1 frame/call"}
    assert roof["stages"]["backbone step"]["ms"] == r["backbone_step_ms"]
    assert "median of 2 probes between the runs" in out and "one real-time stream needs" in out


def test_bench_streams_through_the_engine_core_process(full_bundle_dir, tmp_path):
    """``--engine-process on``: the streams run in a core process (one per stream count), their frames timed
    as they arrive here, the loop's ticks read from the core."""
    out = mossrt("bench", "streams", "--bundle", full_bundle_dir, "--streams", "2", "--frames", "4",
                 "--engine-process", "on", "--json", tmp_path / "s.json")
    r = json.loads((tmp_path / "s.json").read_text())
    (two,) = r["runs"]
    assert r["engine"] == "core process" and "engine core process" in out
    assert two["streams"] == 2 and 2 <= two["frames"] <= 2 * 4 and two["kv_bytes_per_stream"] > 0
    assert two["ticks"] >= two["steady_ticks"] >= 1 and 0 <= two["host_ms_per_tick_p50"] <= two["tick_ms_p99"]
