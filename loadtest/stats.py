"""Per-stream measurements (client side) and the per-level summary.

Definitions (all times on the client's monotonic clock):

* ``sent``: the request is sent (HTTP: just before the POST goes out, connection set-up included; WS: the
  first ``input.text`` delta is sent, after the session is open; ``connect_s`` is the WS handshake plus
  ``session.created``, reported apart).
* **TTFA** (time to first audio) = first audio bytes received - sent.
* **stream RTF** (delivery real-time factor) = (last audio byte - first audio byte) / audio seconds received.
  Below 1 the audio arrives faster than it plays; above 1 a listener who starts at the first byte must stall.
* **generation RTF** = (last audio byte - sent) / audio seconds received (what the server reports as
  ``realtime_factor``: TTFA included; for WS with paced text it includes waiting for the text).
* **inter-chunk gap**: time between two consecutive audio chunks of one stream (an HTTP chunk is whatever one
  socket read returned, a WS chunk is one binary message; mossrt writes one 80 ms frame per chunk).
  **delivery gap**: the same between *deliveries*, a delivery being chunks that arrive less than
  ``BURST_MERGE_S`` (2 ms) after the previous one: the server decodes frames in growing groups (1, 1, 2, 4, 6
  frames) and sends a group back to back, so within a group the chunk gaps are ~0 and the delivery gaps show
  the cadence a listener actually sees.
* **underrun**: a simulated player starts at the first chunk (+ ``prebuffer``) and plays in real time; a chunk
  that arrives after everything received before it has finished playing is an underrun, and the time the player
  sat silent is ``stall_s``. Playback resumes at once with the new chunk.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

SAMPLE_RATE = 24000
BYTES_PER_SECOND = 2 * SAMPLE_RATE          # s16le mono
BURST_MERGE_S = 0.002


class Playback:
    """A real-time player fed by the chunks as they arrive; counts the times it runs dry."""

    def __init__(self, prebuffer_s: float = 0.0):
        self.prebuffer_s = prebuffer_s
        self.start: float | None = None
        self.end: float | None = None       # wall time at which the audio received so far has been played
        self.underruns = 0
        self.stall_s = 0.0

    def chunk(self, t: float, seconds: float) -> None:
        if self.start is None or self.end is None:      # the first chunk (start and end are set together)
            self.start = t + self.prebuffer_s
            self.end = self.start + seconds
            return
        if t > self.end:                    # the player ran out before this chunk arrived
            self.underruns += 1
            self.stall_s += t - self.end
            self.end = t + seconds
        else:
            self.end += seconds


@dataclass
class StreamRecord:
    transport: str
    level: float
    index: int
    text_chars: int
    seed: int | None = None
    start_s: float = 0.0                    # when the request started, from the level's start
    status: str = "pending"                 # ok | rejected (429 / no_capacity) | error
    error_kind: str | None = None
    error_detail: str | None = None
    http_status: int | None = None
    retry_after_s: float | None = None
    connect_s: float | None = None          # WS: handshake + session.created
    ttfa_s: float | None = None
    ttfa_after_done_s: float | None = None  # WS: first audio - input.done sent (negative: audio before the text ended)
    text_send_s: float | None = None        # WS: first delta -> input.done
    total_s: float | None = None            # sent -> end of the response (last byte / response.done)
    audio_s: float = 0.0
    audio_bytes: int = 0
    chunks: int = 0
    stream_rtf: float | None = None
    gen_rtf: float | None = None
    gap_p50_s: float | None = None
    gap_max_s: float | None = None
    underruns: int = 0
    stall_s: float = 0.0
    finish_reason: str | None = None        # WS response.done
    server_timing: dict | None = None       # WS response.done timing
    deltas: int | None = None               # WS: text deltas sent
    call: int | None = None                 # voice-agent mode: the call this turn belongs to
    turn: int | None = None                 # voice-agent mode: 0 for a call's first turn
    deliveries: int = 0
    delivery_gap_max_s: float | None = None
    trace: list | None = None               # [[ms after sent, bytes], ...] of every chunk (--trace-streams)
    gaps: list[float] = field(default_factory=list, repr=False)
    delivery_gaps: list[float] = field(default_factory=list, repr=False)

    # ---------------------------------------------------------------- filled as the stream runs
    def begin_audio(self, prebuffer_s: float, trace: bool = False) -> None:
        self._player = Playback(prebuffer_s)
        self._first: float | None = None
        self._last: float | None = None
        self._last_delivery: float | None = None
        if trace:
            self.trace = []

    def on_audio(self, t: float, sent: float, nbytes: int) -> None:
        if nbytes <= 0:
            return
        seconds = nbytes / BYTES_PER_SECOND
        if self._first is None or self._last is None or self._last_delivery is None:   # the first audio: all three
            self._first = self._last_delivery = t
            self.ttfa_s = t - sent
            self.deliveries = 1
        else:
            self.gaps.append(t - self._last)
            if t - self._last >= BURST_MERGE_S:
                self.delivery_gaps.append(t - self._last_delivery)
                self._last_delivery = t
                self.deliveries += 1
        self._last = t
        if self.trace is not None:
            self.trace.append([round(1000 * (t - sent), 2), nbytes])
        self._player.chunk(t, seconds)
        self.audio_bytes += nbytes
        self.audio_s = self.audio_bytes / BYTES_PER_SECOND
        self.chunks += 1

    def played_by(self) -> float | None:
        """When the simulated player finishes what has arrived (the client's clock; None before any audio)."""
        player = getattr(self, "_player", None)
        return player.end if player is not None else None

    def finish_audio(self, sent: float) -> None:
        """Derived per-stream numbers once the stream has ended (however it ended)."""
        player = getattr(self, "_player", None)
        if player is not None:
            self.underruns, self.stall_s = player.underruns, round(player.stall_s, 4)
        first, last = getattr(self, "_first", None), getattr(self, "_last", None)
        if self.audio_s > 0 and first is not None and last is not None:     # set together, at the first audio
            self.stream_rtf = (last - first) / self.audio_s
            self.gen_rtf = (last - sent) / self.audio_s
        if self.gaps:
            self.gap_p50_s = float(np.median(self.gaps))
            self.gap_max_s = float(max(self.gaps))
        if self.delivery_gaps:
            self.delivery_gap_max_s = float(max(self.delivery_gaps))

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("gaps")
        d.pop("delivery_gaps")
        if d["trace"] is None:
            d.pop("trace")
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()}


def pct(values, qs=(50, 90, 99)) -> dict:
    """Percentiles (linear interpolation) plus n, mean and max; empty -> Nones."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    out: dict[str, float | None] = {"n": len(vals)}
    for q in qs:
        out[f"p{q}"] = float(np.percentile(vals, q)) if vals else None
    out["mean"] = float(np.mean(vals)) if vals else None
    out["max"] = float(np.max(vals)) if vals else None
    return out


def _scaled(d: dict, k: float, nd: int = 1) -> dict:
    return {key: (round(v * k, nd) if isinstance(v, float) and key != "n" else v) for key, v in d.items()}


def summarize(records: list[StreamRecord], wall_s: float, transport: str, mode: str, level: float) -> dict:
    """One level's numbers (ms for times, plain ratios for RTF)."""
    ok = [r for r in records if r.status == "ok"]
    with_audio = [r for r in records if r.audio_s > 0]
    errors: dict[str, int] = {}
    for r in records:
        if r.status == "error":
            errors[r.error_kind or "unknown"] = errors.get(r.error_kind or "unknown", 0) + 1
    gaps = [g for r in with_audio for g in r.gaps]
    audio_total = sum(r.audio_s for r in records)
    summary = {
        "transport": transport, "mode": mode, "level": level,
        "requests": len(records), "ok": len(ok),
        "rejected_429": sum(r.status == "rejected" for r in records),
        "errors": sum(r.status == "error" for r in records), "errors_by_kind": errors,
        "ttfa_ms": _scaled(pct([r.ttfa_s for r in ok]), 1000),
        "stream_rtf": _scaled(pct([r.stream_rtf for r in ok], (50, 90, 99)), 1, 3),
        "gen_rtf": _scaled(pct([r.gen_rtf for r in ok], (50, 90, 99)), 1, 3),
        "gap_ms": _scaled(pct(gaps, (50, 90, 99)), 1000),
        "delivery_gap_ms": _scaled(pct([g for r in with_audio for g in r.delivery_gaps], (50, 90, 99)), 1000),
        "underruns": sum(r.underruns for r in ok),
        "streams_with_underruns": sum(r.underruns > 0 for r in ok),
        "stall_s": round(sum(r.stall_s for r in ok), 3),
        "audio_s": round(audio_total, 3),
        "wall_s": round(wall_s, 3),
        "throughput_audio_s_per_s": round(audio_total / wall_s, 3) if wall_s > 0 else None,
        "completed_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
    }
    if transport in ("ws", "elevenlabs"):
        summary["connect_ms"] = _scaled(pct([r.connect_s for r in records if r.connect_s is not None]), 1000)
        summary["ttfa_after_done_ms"] = _scaled(pct([r.ttfa_after_done_s for r in ok]), 1000)
        summary["finish_reasons"] = _count(r.finish_reason for r in ok)
    return summary


INCOMPLETE_REASONS = ("context_limit", "cancelled", "no_text", "error")


def summarize_calls(calls: list, turns: list[StreamRecord], server: dict) -> dict:
    """Voice-agent mode's numbers: calls served (every turn spoken, to its time), turns, 429s, TTFA of first
    turns and of later (resumed) turns apart, the served calls' talk share (audio seconds / call time), and
    ``server``: the parks, resumes and evictions the server counted over the level (None where the server
    has no such series)."""
    ok = [r for r in turns if r.status == "ok"]
    errors = _count(c.error_kind for c in calls if c.status == "error")
    shares = [c.talk_share for c in calls if c.status == "ok" and c.talk_share is not None]
    return {
        "calls": len(calls), "served": sum(c.status == "ok" for c in calls),
        "rejected": sum(c.status == "rejected" for c in calls), "failed": sum(c.status == "error" for c in calls),
        "errors_by_kind": errors,
        "turns": len(turns), "turns_ok": len(ok), "turns_429": sum(r.status == "rejected" for r in turns),
        "turns_complete": sum(r.finish_reason not in INCOMPLETE_REASONS for r in ok),
        "ttfa_first_ms": _scaled(pct([r.ttfa_s for r in ok if r.turn == 0], (50, 95)), 1000),
        "ttfa_resumed_ms": _scaled(pct([r.ttfa_s for r in ok if r.turn], (50, 95)), 1000),
        "talk_share": round(float(np.mean(shares)), 3) if shares else None,
        "keepalives": sum(c.keepalives for c in calls),
        **server,
    }


def _count(items) -> dict:
    out: dict = {}
    for it in items:
        out[str(it)] = out.get(str(it), 0) + 1
    return out
