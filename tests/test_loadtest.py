"""The load generator (``loadtest/``) against a real ``mossrt serve``: report fields, plots, and 429s counted
(not crashed on) when the server has no room."""

from __future__ import annotations

import asyncio
import json

import pytest
from service_helpers import Server

from loadtest import run as loadtest_run
from loadtest.calls import turn_text
from loadtest.cli import _public_config, build_parser, config_from_args, redact
from loadtest.clients import RequestOptions, fail_record
from loadtest.runner import RunConfig, Runner
from loadtest.stats import Playback, StreamRecord
from loadtest.texts import BUILTIN_TEXTS, split_deltas

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
        stopped = roomy.stop(), tight.stop()          # both, before either assert
        assert stopped[0] == 0, roomy.log()[-3000:]
        assert stopped[1] == 0, tight.log()[-3000:]


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


@pytest.mark.parametrize("option, value", [
    ("--delta-max-chars", "0"), ("--delta-max-chars", "-3"), ("--concurrency", "inf"), ("--concurrency", "2,0"),
    ("--concurrency", "1.5"), ("--rate", "nan"), ("--rate", "1,-2"), ("--request-timeout", "-1"),
    ("--request-timeout", "0"), ("--connect-timeout", "inf"), ("--deadline", "nan"), ("--duration", "0"),
    ("--requests", "0"), ("--warmup", "-1"), ("--pause", "-1"), ("--settle-timeout", "inf"),
    ("--wait-ready", "-1"), ("--max-frames", "0"), ("--llm-tokens-per-s", "-1"),
    ("--llm-tokens-per-s", "nan"), ("--playback-prebuffer-ms", "-5"), ("--trace-streams", "-1"),
    ("--server-pid", "0"), ("--requests", "2.5"), ("--calls", "0"), ("--calls", "1.5"), ("--call-s", "0"),
    ("--talk-s", "-1"), ("--gap-s", "-1"), ("--keepalive-s", "nan"), ("--turns", "0"),
])
def test_cli_refuses_bad_numbers(option, value, capsys):
    """Every numeric option is checked when parsed (exit 2 with a message, no traceback, no endless loop)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([option, value])
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_cli_numbers_accepted():
    args = build_parser().parse_args(["--concurrency", "1,4.0,16", "--delta-max-chars", "1", "--warmup", "0",
                                      "--pause", "0", "--llm-tokens-per-s", "0", "--trace-streams", "0"])
    assert args.concurrency == [1.0, 4.0, 16.0] and args.delta_max_chars == 1 and args.warmup == 0
    assert build_parser().parse_args(["--rate", "0.5,2"]).rate == [0.5, 2.0]


def test_calls_run_over_the_websockets():
    """--calls is voice-agent mode, over our WebSocket unless --transport says otherwise, never over HTTP."""
    cfg = config_from_args(build_parser().parse_args(["--calls", "2,4", "--gap-s", "3", "--turns", "5"]))
    assert (cfg.mode, cfg.transports, cfg.levels) == ("voice-agent", ["ws"], [2.0, 4.0])
    assert (cfg.plan.gap_s, cfg.plan.turns, cfg.plan.talk_frames) == (3.0, 5, 25)          # 2 s of 80 ms frames
    with pytest.raises(SystemExit, match="--calls runs over the WebSockets"):
        config_from_args(build_parser().parse_args(["--calls", "2", "--transport", "http,ws"]))
    for talk_s in (0.1, 2, 20):              # about 14 characters a second of speech, whole words
        text = turn_text(BUILTIN_TEXTS, 3, talk_s)
        assert 14 * talk_s <= len(text) + 1 < 14 * talk_s + 20 and text == text.strip(), (talk_s, text)
        assert all(w in " ".join(BUILTIN_TEXTS).split() for w in text.split())


def test_split_deltas_refuses_max_chars_below_one():
    assert split_deltas("abc", 1) == ["a", "b", "c"]
    for bad in (0, -1):                                 # used to loop forever
        with pytest.raises(ValueError, match="max_chars"):
            split_deltas("Hello there", bad)


def test_public_config_keys_and_secrets():
    """report.json's config: the keys the committed results use, and no secret or run id."""
    args = build_parser().parse_args(["--api-key", "sk-secret-1", "--header", "Authorization: Bearer tok-2",
                                      "--rate", "0.5,2", "--arrival", "fixed", "--playback-prebuffer-ms", "250",
                                      "--request-timeout", "9", "--duration", "3"])
    cfg = config_from_args(args)
    pub = _public_config(cfg)
    assert {"url", "api_key", "headers", "session_header", "transports", "mode", "levels", "requests_per_level",
            "duration_s", "arrival", "request_timeout_s", "deadline_s", "model", "voice", "seed", "greedy",
            "max_frames", "extra_body", "llm_tokens_per_s", "delta_max_chars", "playback_prebuffer_ms", "texts",
            "warmup", "backoff_429", "server_pid"} <= set(pub)
    text = json.dumps(pub)
    assert "sk-secret-1" not in text and "tok-2" not in text and cfg.opts.run_id not in text
    assert "run_id" not in pub and "opts" not in pub and "base_url" not in pub
    assert pub["api_key"] == "set" and pub["headers"] == ["Authorization"] and pub["texts"] == len(BUILTIN_TEXTS)
    assert pub["url"] == "http://127.0.0.1:8000" and pub["mode"] == "rate" and pub["arrival"] == "fixed"
    assert pub["playback_prebuffer_ms"] == 250 and pub["request_timeout_s"] == 9 and pub["duration_s"] == 3
    assert pub["requests_per_level"] == {"0.5": None, "2": None} and pub["levels"] == [0.5, 2.0]
    assert _public_config(config_from_args(build_parser().parse_args([])))["arrival"] is None


def test_request_options_headers_and_params():
    opts = RequestOptions(base_url="http://x", api_key="k", headers={"X-A": "1"}, run_id="lt1", greedy=True,
                          voice="v")
    rec = StreamRecord(transport="ws", level=4.0, index=2, text_chars=3, seed=None)
    assert opts.request_headers() == {"X-A": "1", "Authorization": "Bearer k"}      # probes: no session header
    assert opts.request_headers(rec)["X-Session-Id"] == "lt1-ws-4-2"
    assert opts.generation_params(None) == {"greedy": True, "voice": "v"}
    assert opts.generation_params(0) == {"seed": 0, "greedy": True, "voice": "v"}


def test_fail_record_keeps_the_first_outcome():
    rec = StreamRecord(transport="http", level=1.0, index=0, text_chars=3, seed=None)
    fail_record(rec, "read_timeout", "x" * 400)
    assert (rec.status, rec.error_kind, len(rec.error_detail)) == ("error", "read_timeout", 300)
    fail_record(rec, "deadline")
    assert rec.error_kind == "read_timeout"
    rejected = StreamRecord(transport="ws", level=1.0, index=1, text_chars=3, seed=None, status="rejected")
    fail_record(rejected, "deadline")
    assert rejected.status == "rejected"


def test_rate_level_in_flight_cap(monkeypatch):
    """Rate mode with max_in_flight 2: never more than 2 streams at once, and every stream runs."""
    running, peak, seen = [0], [0], []

    async def one(self, transport, level, index, records, t0, offset):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.02)
        running[0] -= 1
        seen.append(index)

    monkeypatch.setattr(Runner, "one", one)
    cfg = RunConfig(opts=RequestOptions(base_url="http://x"), mode="rate", requests=9, arrival="fixed",
                    max_in_flight=2)
    asyncio.run(Runner(cfg, log=lambda *a: None)._rate("http", 1000.0, [], 0.0, 0))
    assert sorted(seen) == list(range(9)) and peak[0] == 2


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
        assert 0 <= r["stream_rtf"] <= r["gen_rtf"] and r["gen_rtf"] > 0, r     # one read: stream_rtf 0
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


def test_elevenlabs_transport(servers):
    """--transport elevenlabs drives the ElevenLabs-compatible multi-stream-input socket with the same
    paced text: every stream ends with its isFinal and audio, TTFA measured."""
    roomy, _ = servers
    report = loadtest_run(["--url", roomy.base, "--concurrency", "1", "--requests", "2", "--transport", "elevenlabs",
                           *COMMON])
    (s,) = report["levels"]
    assert s["transport"] == "elevenlabs" and s["ok"] == 2 and s["errors"] == 0, s
    assert s["ttfa_ms"]["p50"] > 0 and s["audio_s"] > 0 and s["connect_ms"]["n"] == 2
    assert all(r["status"] == "ok" and r["deltas"] >= 1 and r["chunks"] >= 1 for r in report["streams"])


def test_voice_agent_calls(servers):
    """--calls: two calls per transport, over our WebSocket and the ElevenLabs socket, each two turns of
    LLM-paced text with a listening gap of keep-alives between them: every call served, every turn spoken
    and complete, first and resumed turns' TTFA apart, the keep-alives sent, and the server's parks read
    from /metrics."""
    roomy, _ = servers
    report = loadtest_run(["--url", roomy.base, "--calls", "2", "--turns", "2", "--call-s", "600", "--talk-s", "1",
                           "--gap-s", "1.5", "--keepalive-s", "0.5", "--transport", "ws,elevenlabs", *COMMON])
    assert not report["aborted"] and not report["deadline_hit"]
    assert [s["transport"] for s in report["levels"]] == ["ws", "elevenlabs"]
    assert report["config"]["mode"] == "voice-agent" and report["config"]["plan"]["turns"] == 2
    for s in report["levels"]:
        v = s["voice_agent"]
        assert (v["calls"], v["served"], v["rejected"], v["failed"]) == (2, 2, 0, 0), v
        assert v["turns"] == v["turns_ok"] == v["turns_complete"] == 4 and v["turns_429"] == 0, v
        assert v["ttfa_first_ms"]["n"] == v["ttfa_resumed_ms"]["n"] == 2, v
        assert 0 < v["ttfa_first_ms"]["p50"] <= v["ttfa_first_ms"]["p95"], v
        assert 0 < v["ttfa_resumed_ms"]["p50"] <= v["ttfa_resumed_ms"]["p95"], v
        assert v["keepalives"] >= 2 * 3 and 0 < v["talk_share"] < 1, v        # 1.5 s gaps, one each 0.5 s
        # 4 slots for 2 calls: no waiter, nothing parked (None only from a server without the series)
        parking = "mossrt_parks_total" in report["server"]["metrics_after"]["samples"]
        assert (v["parks"], v["resumes"]) == ((0, 0) if parking else (None, None)), v
        calls = v["call_records"]
        assert sorted(c["index"] for c in calls) == [0, 1] and all(c["turns_ok"] == 2 for c in calls), calls
    turns = [r for r in report["streams"] if r["call"] is not None]
    assert len(turns) == 8 and all(r["status"] == "ok" and r["audio_s"] > 0 for r in turns), turns
    assert sorted((r["transport"], r["call"], r["turn"]) for r in turns) == sorted(
        (t, c, i) for t in ("ws", "elevenlabs") for c in (0, 1) for i in (0, 1))


@pytest.fixture
def two_slots(full_bundle_dir, tmp_path):
    """2 stream slots, and a queue timeout no waiting turn reaches on a loaded machine: no refusal by the clock."""
    server = Server(full_bundle_dir, tmp_path / "voices", tmp_path / "two.log", "--max-streams", "2",
                    "--queue-timeout", "120")
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_voice_agent_calls_outnumbering_the_slots(two_slots):
    """6 calls on 2 slots, over both sockets: a call's context holds its slot from its first turn until it
    hangs up, so a third call open at once speaks before another hangs up only by parking an idle one (the
    calls' starts are spread over one turn and gap, and each lasts at least a turn's playback and a gap, so all
    six overlap). Every call is served, nothing is refused, and the report counts the server's parks (without
    parking every call is still served, each waiting for another to hang up: parks is then 0)."""
    report = loadtest_run(["--url", two_slots.base, "--calls", "6", "--turns", "2", "--call-s", "600",
                           "--talk-s", "0.5", "--gap-s", "1", "--keepalive-s", "0.5", "--transport", "ws,elevenlabs",
                           *COMMON])
    assert not report["aborted"] and not report["deadline_hit"]
    assert [s["transport"] for s in report["levels"]] == ["ws", "elevenlabs"]
    for s in report["levels"]:
        v = s["voice_agent"]
        assert (v["calls"], v["served"], v["rejected"], v["failed"]) == (6, 6, 0, 0), v
        assert v["turns"] == v["turns_ok"] == v["turns_complete"] == 12 and v["turns_429"] == 0, v
        assert v["parks"] >= 1 and v["resumes"] <= v["parks"] and v["parked_evictions"] == 0, v
