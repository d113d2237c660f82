"""Voice-agent calls: one socket for a whole call, alternating a turn the agent speaks (its text at LLM pace)
and a listening gap (the caller talks) in which the client sends only keep-alives, until the call's time is up.

The gap starts once the turn's audio has played (a simulated player at real time from its first chunk), so
a call's talk share is about talk / (talk + gap) however fast the audio is generated. A call over our
WebSocket (``/v1/audio/speech/stream``) speaks each turn as ``input.text`` deltas and ``input.done`` and
sends ``{"type": "input.text", "text": ""}`` while it listens; over the ElevenLabs socket
(``multi-stream-input``) each turn is a context (``" "``, the deltas, a flush, ``close_context``) and the
listening carries ``{"text": ""}``. Every turn is one :class:`~loadtest.stats.StreamRecord` (its ``call`` and
``turn`` set), so a turn is measured as any stream is; the call's own outcome is a :class:`CallRecord`.
A turn that fails or is refused (429) ends its call. Like the single-stream clients, nothing here raises
for what the server or the network does; only cancellation propagates.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

from websockets.exceptions import ConnectionClosed

from .clients import (
    RequestOptions,
    _end_record,
    _open_session,
    _ws_failures,
    elevenlabs_context,
    fail_record,
    ws_open,
    ws_turn,
)
from .stats import StreamRecord

FRAME_S = 0.08                   # one frame of audio
SPEECH_CHARS_PER_S = 14.0        # a turn of --talk-s seconds gets about this many characters a second of text


@dataclass
class CallPlan:
    """What every call of a run does."""

    call_s: float = 60.0          # a call starts no new turn after this long
    talk_s: float = 2.0           # each turn's speech (our WebSocket: max_frames; text of about this length)
    gap_s: float = 4.0            # the listening gap after each turn
    keepalive_s: float = 1.0      # a keep-alive this often in a gap (0: none)
    turns: int | None = None      # a call ends after this many turns (or call_s, whichever comes first)

    @property
    def talk_frames(self) -> int:
        return max(1, round(self.talk_s / FRAME_S))


@dataclass
class CallRecord:
    transport: str
    level: float
    index: int
    start_s: float = 0.0          # from the level's start
    status: str = "pending"       # ok (every turn spoken, the call lasted its time) | rejected | error
    error_kind: str | None = None
    turns: int = 0                # turns started
    turns_ok: int = 0
    keepalives: int = 0
    audio_s: float = 0.0
    call_s: float | None = None   # connect -> the socket closed by the client

    @property
    def talk_share(self) -> float | None:
        return self.audio_s / self.call_s if self.call_s else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["talk_share"] = self.talk_share
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def turn_text(texts: list[str], start: int, talk_s: float) -> str:
    """About ``talk_s`` seconds of speech: texts from ``start`` on, joined, cut after the word that reaches
    ``SPEECH_CHARS_PER_S * talk_s`` characters."""
    want = max(1, round(SPEECH_CHARS_PER_S * talk_s))
    words: list[str] = []
    i = start
    while sum(len(w) + 1 for w in words) < want:
        words.extend(texts[i % len(texts)].split())
        i += 1
    out, n = [], 0
    for w in words:
        out.append(w)
        n += len(w) + 1
        if n >= want:
            break
    return " ".join(out)


async def _listen(ws, call: CallRecord, plan: CallPlan, keepalive: dict, played_by: float | None) -> None:
    """The turn's audio plays out (until ``played_by``), then the caller talks for ``gap_s`` seconds: only
    keep-alives, one every ``keepalive_s``."""
    end = max(time.perf_counter(), played_by or 0.0) + plan.gap_s
    while True:
        left = end - time.perf_counter()
        if left <= 0:
            return
        if plan.keepalive_s > 0:
            await ws.send(json.dumps(keepalive))
            call.keepalives += 1
        await asyncio.sleep(min(left, plan.keepalive_s) if plan.keepalive_s > 0 else left)


async def voice_call(transport: str, opts: RequestOptions, plan: CallPlan, call: CallRecord, texts: list[str],
                     new_turn: Callable[[int], StreamRecord]) -> None:
    """One call over ``transport`` (``ws`` or ``elevenlabs``); ``new_turn(i)`` makes (and keeps) turn i's record."""
    t0 = time.perf_counter()
    rec = new_turn(0)
    rec.begin_audio(opts.prebuffer_s, rec.index < opts.trace_streams)
    headers = opts.request_headers(rec)
    if transport == "elevenlabs" and opts.api_key:
        headers["xi-api-key"] = opts.api_key
    url = opts.elevenlabs_url(rec.seed) if transport == "elevenlabs" else opts.ws_url
    sent, ended = None, False
    try:
        with _ws_failures(rec):
            async with ws_open(url, headers, opts) as ws:
                rec.connect_s = time.perf_counter() - t0
                # our WebSocket: each turn capped at talk_s of audio, unless --max-frames says otherwise
                update = {"max_frames": plan.talk_frames, **opts.generation_params(rec.seed)}
                if transport == "ws" and not await _open_session(ws, rec, t0, update):
                    return
                keepalive = {"type": "input.text", "text": ""} if transport == "ws" else {"text": ""}
                turn = 0
                while True:
                    call.turns += 1
                    text = turn_text(texts, call.index * 7 + turn, plan.talk_s)
                    rec.text_chars = len(text)
                    if transport == "elevenlabs":                 # each turn a context, opened by " "
                        await ws.send(json.dumps({"text": " ", "context_id": f"t{turn}"}))
                    sent = time.perf_counter()
                    rec.start_s = round(call.start_s + sent - t0, 4)
                    if transport == "ws":
                        await ws_turn(ws, opts, rec, text, sent)
                    else:
                        await elevenlabs_context(ws, opts, rec, text, sent, f"t{turn}")
                    _end_record(rec, sent, t0)
                    ended = True
                    call.audio_s += rec.audio_s
                    if rec.status != "ok":
                        return
                    call.turns_ok += 1
                    if time.perf_counter() - t0 >= plan.call_s or (plan.turns is not None
                                                                   and call.turns >= plan.turns):
                        call.status = "ok"
                        return
                    try:
                        await _listen(ws, call, plan, keepalive, rec.played_by())
                    except ConnectionClosed as e:
                        rcvd = getattr(e, "rcvd", None)
                        call.status, call.error_kind = "error", f"closed_in_gap:{rcvd.code if rcvd else 'none'}"
                        return
                    turn += 1
                    rec = new_turn(turn)
                    rec.begin_audio(opts.prebuffer_s, False)
                    sent, ended = None, False
    finally:
        if rec.status == "pending":
            fail_record(rec, "incomplete")
        if not ended:
            _end_record(rec, sent, t0)
            call.audio_s += rec.audio_s
        call.call_s = time.perf_counter() - t0
        if call.status == "pending":
            call.status = "rejected" if rec.status == "rejected" else "error"
            call.error_kind = call.error_kind or rec.error_kind
