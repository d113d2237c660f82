"""The load generator (``loadtest/``) against a real ``mossrt serve``: report fields, plots, and 429s counted
(not crashed on) when the server has no room."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from service_helpers import Server

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                       # loadtest/ is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from loadtest import run as loadtest_run             # noqa: E402
from loadtest.cli import redact                      # noqa: E402
from loadtest.stats import Playback                  # noqa: E402
from loadtest.texts import BUILTIN_TEXTS, split_deltas  # noqa: E402

# short responses keep the test quick: 20 frames = 1.6 s of audio per stream
COMMON = ["--max-frames", "20", "--warmup", "0", "--pause", "0", "--quiet", "--request-timeout", "30",
          "--deadline", "60", "--llm-tokens-per-s", "200"]


@pytest.fixture(scope="module")
def servers(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loadtest")
    roomy = Server(full_bundle_dir, tmp / "v1", tmp / "roomy.log", "--max-streams", "4")
    tight = Server(full_bundle_dir, tmp / "v2", tmp / "tight.log", "--max-streams", "1", "--queue-timeout", "0")
    try:
        yield roomy.wait_ready(), tight.wait_ready()
    finally:
        assert roomy.stop() == 0, roomy.log()[-3000:]
        assert tight.stop() == 0, tight.log()[-3000:]


def test_split_deltas_and_playback():
    for text in BUILTIN_TEXTS:
        deltas = split_deltas(text)
        assert "".join(deltas) == text and all(0 < len(d) <= 8 for d in deltas)
    p = Playback()
    for t in (0.0, 0.05, 0.10):          # 80 ms chunks arriving faster than real time: no underrun
        p.chunk(t, 0.08)
    p.chunk(0.40, 0.08)                  # 0.24 s of audio ran out at 0.24: stalled 0.16 s
    assert p.underruns == 1 and abs(p.stall_s - 0.16) < 1e-9
    assert redact(["--api-key", "sk-secret-1", "--header", "Authorization: Bearer x", "--header", "X-A: 1"]) == \
        ["--api-key", "***", "--header", "***", "--header", "X-A: 1"]


def test_report_and_plots(servers, tmp_path):
    pytest.importorskip("matplotlib")
    roomy, _ = servers
    out = tmp_path / "out"
    report = loadtest_run(["--url", roomy.base, "--concurrency", "2", "--requests", "2", "--transport", "http,ws",
                           "--out", str(out), *COMMON])
    assert not report["aborted"] and not report["deadline_hit"]
    assert [(s["transport"], s["level"]) for s in report["levels"]] == [("http", 2.0), ("ws", 2.0)]
    for s in report["levels"]:
        assert s["requests"] == 2 and s["ok"] == 2, s
        assert s["errors"] == 0 and s["rejected_429"] == 0 and not s["errors_by_kind"]
        assert s["ttfa_ms"]["p50"] > 0 and s["ttfa_ms"]["p99"] >= s["ttfa_ms"]["p50"]
        # a tiny-model response can arrive in one read (first == last chunk), so delivery RTF may be 0
        assert 0 <= s["stream_rtf"]["p50"] <= s["gen_rtf"]["p50"] and s["gen_rtf"]["p50"] > 0, s
        assert s["audio_s"] > 0 and s["throughput_audio_s_per_s"] > 0
        assert s["server"]["metrics_delta"]      # the server counted the level's requests
    streams = report["streams"]
    assert len(streams) == 4 and all(r["status"] == "ok" for r in streams)
    for r in streams:                                   # at most --max-frames 20 frames (the model may stop first)
        assert r["ttfa_s"] > 0 and 0 < r["audio_s"] <= 1.6 + 1e-6 and 1 <= r["chunks"] <= 20, r
        assert r["stream_rtf"] > 0 and r["gen_rtf"] >= r["stream_rtf"], r
    assert all(r["finish_reason"] and r["deltas"] >= 1 for r in streams if r["transport"] == "ws")
    assert report["server"]["ready_before"]["status"] == "ready"
    assert report["server"]["metrics_after"]["samples"]
    assert report["command"].startswith("python -m loadtest --url")
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["levels"] == report["levels"]
    assert sorted(report["plots"]) == ["rtf_vs_concurrency.png", "throughput_errors.png",
                                       "ttfa_distribution.png", "ttfa_vs_concurrency.png"]
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overload_counts_429s(servers):
    """More concurrent streams than --max-streams 1 --queue-timeout 0 admits: 429s counted, nothing crashes."""
    _, tight = servers
    report = loadtest_run(["--url", tight.base, "--concurrency", "3", "--requests", "6", "--transport", "http,ws",
                           "--no-backoff", *COMMON])
    assert not report["aborted"] and not report["deadline_hit"]
    for s in report["levels"]:
        assert s["requests"] == 6 and s["errors"] == 0, s["errors_by_kind"]
        assert s["rejected_429"] >= 1 and s["ok"] >= 1 and s["ok"] + s["rejected_429"] == 6
    kinds = {r["error_kind"] for r in report["streams"] if r["status"] == "rejected"}
    assert kinds <= {"http_429:no_capacity", "ws_429:no_capacity"} and kinds
    http_rejected = [r for r in report["streams"] if r["transport"] == "http" and r["status"] == "rejected"]
    assert all(r["http_status"] == 429 and r["retry_after_s"] == 1 for r in http_rejected)
