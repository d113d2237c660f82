"""``python -m loadtest --url http://host:8000 [...]``: flags, the run, the table, report.json and the plots."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import secrets
import shlex
import sys
from pathlib import Path

from mossrt.argtypes import finite_float

from .calls import CallPlan
from .clients import RequestOptions
from .runner import RunConfig, Runner
from .stats import __doc__ as DEFINITIONS
from .texts import load_texts

EPILOG = """examples:
  python -m loadtest --url http://127.0.0.1:8000 --concurrency 1,4,16 --transport http,ws --out results/
  python -m loadtest --url https://tts.example.com --api-key $KEY --rate 0.5,1,2 --duration 60 --transport ws
  python -m loadtest --calls 12 --call-s 60 --talk-s 2 --gap-s 4 --transport ws,elevenlabs   # voice-agent calls
"""


# Argument types: every number is checked here (argparse exits 2 with the message), so a bad value never
# reaches the run (a zero --delta-max-chars would loop forever, an inf concurrency would crash).
_number = finite_float


def positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _integer(text: str, lo: int) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"must be {lo} or more, got {text}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    return _integer(text, 0)


def _floats(text: str) -> list[float]:
    vals = [positive_float(v.strip()) for v in text.split(",") if v.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}")
    return vals


def _ints(text: str) -> list[float]:
    vals = _floats(text)
    if any(v != int(v) for v in vals):
        raise argparse.ArgumentTypeError("concurrency levels are whole numbers")
    return [float(int(v)) for v in vals]


TRANSPORTS = ("http", "ws", "elevenlabs")


def _transports(text: str) -> list[str]:
    vals = ["http", "ws"] if text == "both" else [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in TRANSPORTS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"transports are http, ws, elevenlabs (comma-separated) or both, "
                                         f"not {text!r}")
    return list(dict.fromkeys(vals))


def _seed(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description="Load generator for mossrt serve: concurrent "
                                "streams over HTTP and WebSocket, measured from the client's side.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the service (default %(default)s)")
    t.add_argument("--api-key", default=os.environ.get("MOSSRT_API_KEY"),
                   help="Bearer key (default: $MOSSRT_API_KEY); sent on HTTP and on the WebSocket handshake")
    t.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="extra header on every request, repeatable")
    t.add_argument("--session-header", default="X-Session-Id",
                   help="header given a fresh value per stream, for header-hash affinity behind an ingress "
                        "(default %(default)s; '' sends none)")
    t.add_argument("--insecure", action="store_true", help="do not verify TLS certificates (HTTP only)")
    t.add_argument("--wait-ready", type=non_negative_float, default=30.0,
                   help="wait this long for /ready at start (s; default %(default)s)")

    load = p.add_argument_group("load")
    load.add_argument("--transport", type=_transports,
                      help="http, ws, elevenlabs (the ElevenLabs-compatible multi-stream-input WebSocket), "
                           "comma-separated, or both (http,ws); default http, with --calls ws")
    g = load.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=_ints, help="concurrent streams per level, e.g. 1,4,16 (default 1)")
    g.add_argument("--rate", type=_floats, help="arrival rates in requests/s per level, e.g. 0.5,1,2")
    g.add_argument("--calls", type=_ints, help="voice-agent mode: concurrent calls per level, e.g. 4,12 (each one "
                                               "socket alternating a turn and a listening gap; ws, elevenlabs)")
    load.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                      help="with --rate (default %(default)s)")
    load.add_argument("--requests", type=positive_int,
                      help="requests per level (default: max(8, 2 x concurrency); 20 at a rate) unless --duration "
                           "is given")
    load.add_argument("--duration", type=positive_float, help="seconds per level during which new requests start")
    load.add_argument("--warmup", type=non_negative_int, default=1,
                      help="unmeasured requests per transport first (default %(default)s)")
    load.add_argument("--pause", type=non_negative_float, default=1.0,
                      help="seconds between levels (default %(default)s)")
    load.add_argument("--no-backoff", action="store_true", help="after a 429 start the next request at once "
                                                                "(default: wait Retry-After, at most 10 s)")

    b = p.add_argument_group("bounds")
    b.add_argument("--request-timeout", type=positive_float, default=120.0,
                   help="per stream, seconds (default %(default)s)")
    b.add_argument("--connect-timeout", type=positive_float, default=10.0, help="seconds (default %(default)s)")
    b.add_argument("--deadline", type=positive_float, default=1800.0,
                   help="whole run, seconds (default %(default)s)")
    b.add_argument("--settle-timeout", type=non_negative_float, default=30.0,
                   help="before each level wait at most this for /ready to show no active stream "
                        "(default %(default)s)")

    r = p.add_argument_group("requests")
    r.add_argument("--texts", help="file with one text per line (default: a built-in varied list)")
    r.add_argument("--model", default="tts-1", help="model field of every request (default %(default)s)")
    r.add_argument("--voice", help="voice name or id (default: the server's default)")
    r.add_argument("--seed", type=_seed, default=1,
                   help="request i of a level uses seed+i ('none': unseeded; default %(default)s)")
    r.add_argument("--greedy", action="store_true", help="greedy decoding")
    r.add_argument("--max-frames", type=positive_int, help="cap each response at N frames of 80 ms")
    r.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each HTTP request body")
    r.add_argument("--llm-tokens-per-s", type=non_negative_float, default=30.0,
                   help="WS: text deltas per second, like an LLM writing (0: the whole text at once; "
                        "default %(default)s)")
    r.add_argument("--delta-max-chars", type=positive_int, default=8,
                   help="WS: longest delta; longer words are split (default %(default)s)")
    r.add_argument("--playback-prebuffer-ms", type=non_negative_float, default=0.0,
                   help="simulated player starts this long after the first chunk (default %(default)s)")

    c = p.add_argument_group("voice-agent calls (--calls)")
    c.add_argument("--call-s", type=positive_float, default=60.0,
                   help="a call starts no new turn after this long (s; default %(default)s)")
    c.add_argument("--talk-s", type=positive_float, default=2.0,
                   help="each turn's speech: text of about 14 characters a second of it; on our WebSocket "
                        "also max_frames, unless --max-frames is given (s; default %(default)s)")
    c.add_argument("--gap-s", type=non_negative_float, default=4.0,
                   help="the listening gap after each turn's audio has played (s; default %(default)s)")
    c.add_argument("--keepalive-s", type=non_negative_float, default=1.0,
                   help="a keep-alive this often during a gap (0: none; s; default %(default)s)")
    c.add_argument("--turns", type=positive_int, help="a call ends after this many turns (default: when --call-s "
                                                      "is up)")

    o = p.add_argument_group("output")
    o.add_argument("--out", help="directory for report.json, table.txt and the plots")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--trace-streams", type=non_negative_int, default=1,
                   help="keep every chunk's arrival time for the first N streams of each level "
                        "(default %(default)s)")
    o.add_argument("--server-pid", type=positive_int,
                   help="PID of a server on this machine: its CPU use per level goes in the report (host_cpu), "
                        "beside the machine's and the generator's")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    headers = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f"--header wants 'NAME: VALUE', got {h!r}")
        headers[name.strip()] = value.strip()
    opts = RequestOptions(base_url=args.url, api_key=args.api_key or None, headers=headers,
                          session_header=args.session_header or None, run_id="lt" + secrets.token_hex(3),
                          model=args.model, voice=args.voice or None, greedy=True if args.greedy else None,
                          max_frames=args.max_frames, extra_body=args.extra_body,
                          llm_tokens_per_s=args.llm_tokens_per_s, delta_max_chars=args.delta_max_chars,
                          prebuffer_s=args.playback_prebuffer_ms / 1000, connect_timeout=args.connect_timeout,
                          trace_streams=args.trace_streams)
    mode = "rate" if args.rate else "voice-agent" if args.calls else "concurrency"
    transports = args.transport or (["ws"] if args.calls else ["http"])
    if args.calls and "http" in transports:
        raise SystemExit("--calls runs over the WebSockets: --transport ws, elevenlabs or ws,elevenlabs")
    plan = CallPlan(call_s=args.call_s, talk_s=args.talk_s, gap_s=args.gap_s, keepalive_s=args.keepalive_s,
                    turns=args.turns)
    return RunConfig(opts=opts, transports=transports, mode=mode, plan=plan,
                     levels=args.rate or args.calls or args.concurrency or [1.0], requests=args.requests,
                     duration=args.duration,
                     arrival=args.arrival, request_timeout=args.request_timeout, deadline=args.deadline,
                     texts=load_texts(args.texts), seed=args.seed, warmup=args.warmup, pause=args.pause,
                     settle_timeout=args.settle_timeout, backoff_429=not args.no_backoff,
                     verify_tls=not args.insecure, wait_ready=args.wait_ready, server_pid=args.server_pid)


# report keys of the fields whose key differs from the field name (the unit is in the key)
_REPORT_KEYS = {"base_url": "url", "duration": "duration_s", "request_timeout": "request_timeout_s",
                "deadline": "deadline_s"}


def _public_config(cfg: RunConfig) -> dict:
    """Every field of the run's configuration (RequestOptions first), without secrets: whether an API key
    was set, header names only, the number of texts; the run id is left out."""
    fields = dataclasses.asdict(cfg)
    fields = {**fields.pop("opts"), **fields}
    del fields["run_id"]
    fields["api_key"] = "set" if fields["api_key"] else None
    fields["headers"] = sorted(fields["headers"])
    fields["texts"] = len(fields["texts"])
    fields["playback_prebuffer_ms"] = 1000 * fields.pop("prebuffer_s")
    fields["requests_per_level"] = {f"{lv:g}": cfg.requests_for(lv) for lv in cfg.levels}
    if cfg.mode != "rate":
        fields["arrival"] = None
    return {_REPORT_KEYS.get(k, k): v for k, v in fields.items()}


def _f(v, nd=0) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _cpu(h: dict) -> str:
    if "busy_cores" not in h:
        return "-"
    others = h.get("other_cores", h.get("other_and_server_cores"))
    return f"{h['busy_cores']:.2f}/{h['cpus']} ({_f(others, 2)})"


def _aligned(rows: list[tuple]) -> list[str]:
    """Right-aligned columns, a rule under the head row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_table(levels: list[dict]) -> str:
    head = ("transport", "level", "req", "ok", "429", "err", "TTFA p50", "p90", "p99 ms", "RTF p50", "p90",
            "genRTF p50", "gap p50", "p99 ms", "delivery gap p50", "p99 ms", "underruns (streams)", "stall s",
            "audio s/s", "cpu busy (others)")
    rows = [head]
    for s in sorted(levels, key=lambda s: (s["transport"], s["level"])):
        rows.append((s["transport"], f"{s['level']:g}", str(s["requests"]), str(s["ok"]), str(s["rejected_429"]),
                     str(s["errors"]), _f(s["ttfa_ms"]["p50"]), _f(s["ttfa_ms"]["p90"]), _f(s["ttfa_ms"]["p99"]),
                     _f(s["stream_rtf"]["p50"], 3), _f(s["stream_rtf"]["p90"], 3), _f(s["gen_rtf"]["p50"], 3),
                     _f(s["gap_ms"]["p50"]), _f(s["gap_ms"]["p99"]), _f(s["delivery_gap_ms"]["p50"]),
                     _f(s["delivery_gap_ms"]["p99"]),
                     f"{s['underruns']} ({s['streams_with_underruns']})", _f(s["stall_s"], 2),
                     _f(s["throughput_audio_s_per_s"], 2), _cpu(s.get("host_cpu") or {})))
    lines = _aligned(rows)
    errs = [f"{s['transport']} {s['level']:g}: {s['errors_by_kind']}" for s in levels if s["errors_by_kind"]]
    if errs:
        lines += ["", "errors by kind:"] + ["  " + e for e in errs]
    calls = [s for s in levels if "voice_agent" in s]
    if calls:
        lines += ["", format_calls_table(calls)]
    return "\n".join(lines)


def format_calls_table(levels: list[dict]) -> str:
    """Voice-agent mode: calls served, turns, 429s, first and resumed turns' TTFA, talk share, parks."""
    head = ("transport", "calls", "served", "429 calls", "failed", "turns", "ok", "complete", "429", "first TTFA p50",
            "p95 ms", "resumed TTFA p50", "p95 ms", "talk share", "parks", "resumes", "evictions")
    rows = [head]
    for s in sorted(levels, key=lambda s: (s["transport"], s["level"])):
        v = s["voice_agent"]
        rows.append((s["transport"], str(v["calls"]), str(v["served"]), str(v["rejected"]), str(v["failed"]),
                     str(v["turns"]), str(v["turns_ok"]), str(v["turns_complete"]), str(v["turns_429"]),
                     _f(v["ttfa_first_ms"]["p50"]), _f(v["ttfa_first_ms"]["p95"]), _f(v["ttfa_resumed_ms"]["p50"]),
                     _f(v["ttfa_resumed_ms"]["p95"]), _f(v["talk_share"], 2), _f(v["parks"]), _f(v["resumes"]),
                     _f(v["parked_evictions"])))
    lines = _aligned(rows)
    errs = [f"{s['transport']} {s['level']:g}: {s['voice_agent']['errors_by_kind']}" for s in levels
            if s["voice_agent"]["errors_by_kind"]]
    return "\n".join(lines + (["", "calls failed by kind:"] + ["  " + e for e in errs] if errs else []))


def redact(argv: list[str]) -> list[str]:
    """The command line without secrets: the --api-key value and credential-looking --header values."""
    secret = ("auth", "key", "token", "cookie")
    out, hide_next, prev = [], False, ""
    for a in argv:
        if hide_next:
            name = a.split(":", 1)[0].strip().lower() if prev == "--header" else ""
            out.append("***" if prev == "--api-key" or any(k in name for k in secret) else a)
            hide_next = False
            continue
        if a in ("--api-key", "--header"):
            prev, hide_next = a, True
        elif a.startswith("--api-key="):
            a = "--api-key=***"
        elif a.startswith("--header=") and any(k in a.split(":", 1)[0].lower() for k in secret):
            a = "--header=***"
        out.append(a)
    return out


def run(argv: list[str] | None = None, log=None) -> dict:
    """Parse ``argv``, run every level, write the outputs; returns the report (also for in-process use)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    log = log or ((lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True)))
    started = dt.datetime.now(dt.timezone.utc)
    result = asyncio.run(Runner(cfg, log=log).run())
    report = {
        "tool": "mossrt loadtest", "started_at": started.isoformat(timespec="seconds"),
        "command": "python -m loadtest " + shlex.join(redact(argv)), "argv": redact(argv),
        "config": _public_config(cfg),
        "client": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "server": {"url": cfg.opts.base_url, "ready_before": result.get("ready_before"),
                   "ready_after": result.get("ready_after"), "metrics_before": result.get("metrics_before"),
                   "metrics_after": result.get("metrics_after")},
        "aborted": result.get("aborted"), "deadline_hit": result.get("deadline_hit", False),
        "elapsed_s": result.get("elapsed_s"), "warmup": result.get("warmup"),
        "levels": result.get("levels", []), "streams": result.get("streams", []),
        "definitions": DEFINITIONS.strip(), "plots": [],
    }
    table = format_table(report["levels"])
    if report["deadline_hit"]:
        log(f"[loadtest] warning: the --deadline of {cfg.deadline:g} s cut the run short (streams in flight are "
            "recorded as 'deadline'; later levels did not run)")
    if report["aborted"]:
        log(f"[loadtest] aborted: {report['aborted']}")
        table = f"aborted: {report['aborted']}"
    elif not args.quiet:
        print(table, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if not args.no_plots and report["levels"]:
            try:
                report["plots"] = _plots(report, out)
            except ImportError:
                log("[loadtest] matplotlib is not installed: no plots (pip install matplotlib)")
        (out / "table.txt").write_text(table + "\n")
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"[loadtest] wrote {out / 'report.json'}" + (f" and {', '.join(report['plots'])}" if report["plots"]
                                                          else ""))
    return report


def _plots(report: dict, out: Path) -> list[str]:
    from .plots import make_plots

    return make_plots(report, out)


def main(argv: list[str] | None = None) -> int:
    report = run(argv)
    if report["aborted"]:
        return 2
    return 0
