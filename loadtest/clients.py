"""One measured stream per call: ``POST /v1/audio/speech`` (pcm), one turn on ``WS /v1/audio/speech/stream``,
or one context on the ElevenLabs-compatible ``multi-stream-input`` WebSocket (pcm_24000).

Each function fills a :class:`StreamRecord` and never raises for what the server or the network does (errors
are recorded by kind); only cancellation (the caller's timeout or deadline) propagates.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .stats import StreamRecord
from .texts import split_deltas

SPEECH_PATH = "/v1/audio/speech"
WS_PATH = "/v1/audio/speech/stream"
ELEVENLABS_PATH = "/v1/text-to-speech/{voice}/multi-stream-input"
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass
class RequestOptions:
    """What every request of a run carries."""

    base_url: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    session_header: str | None = "X-Session-Id"      # a fresh value per stream (spreads streams over pods)
    run_id: str = "lt"
    model: str = "tts-1"
    voice: str | None = None
    greedy: bool | None = None
    max_frames: int | None = None
    extra_body: dict = field(default_factory=dict)
    llm_tokens_per_s: float = 30.0                  # 0: the whole text in one delta
    delta_max_chars: int = 8
    prebuffer_s: float = 0.0
    connect_timeout: float = 10.0
    trace_streams: int = 1                          # chunk arrival traces for streams with index below this

    def request_headers(self, rec: StreamRecord | None = None) -> dict[str, str]:
        """The extra headers and the key; with a stream's record also its session header (probes get none)."""
        h = dict(self.headers)
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if self.session_header and rec is not None:
            h[self.session_header] = f"{self.run_id}-{rec.transport}-{rec.level:g}-{rec.index}"
        return h

    def generation_params(self, seed: int | None) -> dict:
        """seed, greedy, max_frames and voice where set: in the HTTP body and the WS session.update alike."""
        return {k: v for k, v in (("seed", seed), ("greedy", self.greedy), ("max_frames", self.max_frames),
                                  ("voice", self.voice)) if v is not None}

    @property
    def ws_base(self) -> str:
        base = self.base_url.rstrip("/")
        if base.startswith("https://"):
            return "wss://" + base[len("https://"):]
        if base.startswith("http://"):
            return "ws://" + base[len("http://"):]
        return base

    @property
    def ws_url(self) -> str:
        return self.ws_base + WS_PATH

    def elevenlabs_url(self, seed: int | None) -> str:
        query = {"model_id": self.model, "output_format": "pcm_24000", **({"seed": seed} if seed is not None else {})}
        return (self.ws_base + ELEVENLABS_PATH.format(voice=urllib.parse.quote(self.voice or "default", safe=""))
                + "?" + urllib.parse.urlencode(query))


def _error_code(raw: bytes) -> str:
    """``error.code`` (else ``error.type``) of an OpenAI-shaped error body; ``-`` when there is none."""
    try:
        err = json.loads(raw.decode("utf-8", "replace")).get("error") or {}
        return str(err.get("code") or err.get("type") or "-")
    except (ValueError, AttributeError):
        return "-"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def fail_record(rec: StreamRecord, kind: str, detail: str | None = None) -> None:
    """Mark a stream failed with ``kind`` (and a short detail), unless it already failed or was rejected."""
    if rec.status in ("pending", "ok"):
        rec.status, rec.error_kind = "error", kind
        rec.error_detail = (detail or "")[:300] or None


# ---------------------------------------------------------------------------------------------- HTTP
async def http_stream(client: httpx.AsyncClient, opts: RequestOptions, rec: StreamRecord, text: str) -> None:
    body = {"model": opts.model, "input": text, "response_format": "pcm", "stream_format": "audio",
            **opts.generation_params(rec.seed), **opts.extra_body}
    rec.begin_audio(opts.prebuffer_s, rec.index < opts.trace_streams)
    sent = time.perf_counter()
    try:
        async with client.stream("POST", opts.base_url.rstrip("/") + SPEECH_PATH, json=body,
                                 headers=opts.request_headers(rec)) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                code = _error_code(raw)
                rec.total_s = time.perf_counter() - sent
                if resp.status_code == 429:
                    rec.status, rec.error_kind = "rejected", f"http_429:{code}"
                    rec.retry_after_s = _retry_after(resp.headers.get("retry-after"))
                else:
                    fail_record(rec, f"http_{resp.status_code}:{code}", raw[:300].decode("utf-8", "replace"))
                return
            async for chunk in resp.aiter_raw():
                rec.on_audio(time.perf_counter(), sent, len(chunk))
        rec.total_s = time.perf_counter() - sent
        if rec.audio_bytes == 0:
            fail_record(rec, "no_audio", "200 with an empty body")
        elif rec.audio_bytes % 2:
            fail_record(rec, "odd_byte_count", f"{rec.audio_bytes} bytes is not whole s16le samples")
        else:
            rec.status = "ok"
    except httpx.ConnectTimeout as e:
        fail_record(rec, "connect_timeout", repr(e))
    except httpx.TimeoutException as e:
        fail_record(rec, "read_timeout", repr(e))
    except httpx.ConnectError as e:
        fail_record(rec, "connect_error", repr(e))
    except httpx.RemoteProtocolError as e:             # e.g. the chunked body was cut off
        fail_record(rec, "stream_cut", repr(e))
    except httpx.HTTPError as e:
        fail_record(rec, f"http_error:{type(e).__name__}", repr(e))
    except OSError as e:
        fail_record(rec, f"os_error:{type(e).__name__}", repr(e))
    finally:
        rec.finish_audio(sent)


# ---------------------------------------------------------------------------------------------- WebSocket
def ws_open(url: str, headers: dict[str, str], opts: RequestOptions) -> ws_connect:
    """The WebSocket connection every stream of the generator opens (``async with``): its request headers, the
    connect timeout of ``opts``, no cap on a message's size and no compression."""
    return ws_connect(url, additional_headers=headers, open_timeout=opts.connect_timeout, close_timeout=2,
                      max_size=None, compression=None)


async def ws_stream(opts: RequestOptions, rec: StreamRecord, text: str) -> None:
    """One session, one turn: session.update, the text as paced deltas, input.done, audio until response.done."""
    t0 = time.perf_counter()
    sent = None
    rec.begin_audio(opts.prebuffer_s, rec.index < opts.trace_streams)
    try:
        with _ws_failures(rec):
            async with ws_open(opts.ws_url, opts.request_headers(rec), opts) as ws:
                if not await _open_session(ws, rec, t0, opts.generation_params(rec.seed)):
                    return
                sent = time.perf_counter()
                await ws_turn(ws, opts, rec, text, sent)
    finally:
        _end_record(rec, sent, t0)


async def ws_turn(ws, opts: RequestOptions, rec: StreamRecord, text: str, sent: float) -> None:
    """One turn on an open session: the text as paced deltas from ``sent`` on, input.done, its audio until
    response.done."""
    deltas = split_deltas(text, opts.delta_max_chars) if opts.llm_tokens_per_s > 0 else [text]
    done_at: list[float] = []
    sender = asyncio.create_task(_send_text(ws, deltas, opts.llm_tokens_per_s, sent, done_at, rec))
    try:
        await _receive_turn(ws, rec, sent, sender)
    finally:
        await _finish_sending(sender, rec, sent, done_at)


async def _open_session(ws, rec: StreamRecord, t0: float, update: dict) -> bool:
    """``session.created`` (``connect_s`` measured to it), then ``session.update`` with ``update`` if any;
    False (recorded) when the server answers anything else."""
    first = await _recv_json(ws)
    if first.get("type") != "session.created":
        _ws_error(rec, first)
        return False
    rec.connect_s = time.perf_counter() - t0
    if update:
        await ws.send(json.dumps({"type": "session.update", **update}))
        reply = await _recv_json(ws)
        if reply.get("type") != "session.updated":
            _ws_error(rec, reply)
            return False
    return True


# ---------------------------------------------------------------------------------------------- ElevenLabs
async def elevenlabs_stream(opts: RequestOptions, rec: StreamRecord, text: str) -> None:
    """One context on a fresh multi-stream-input socket: the opening " ", the text as paced deltas, a flush
    and close_context (as pipecat ends an utterance), audio until its isFinal. Greedy decoding is the
    server's MOSSRT_ELEVENLABS_GREEDY (the protocol has no such field); max_frames does not apply."""
    t0 = time.perf_counter()
    sent = None
    rec.begin_audio(opts.prebuffer_s, rec.index < opts.trace_streams)
    headers = opts.request_headers(rec)
    if opts.api_key:
        headers["xi-api-key"] = opts.api_key
    try:
        with _ws_failures(rec):
            async with ws_open(opts.elevenlabs_url(rec.seed), headers, opts) as ws:
                rec.connect_s = time.perf_counter() - t0
                await ws.send(json.dumps({"text": " ", "context_id": "c"}))
                sent = time.perf_counter()
                await elevenlabs_context(ws, opts, rec, text, sent, "c")
    finally:
        _end_record(rec, sent, t0)


async def elevenlabs_context(ws, opts: RequestOptions, rec: StreamRecord, text: str, sent: float, cid: str) -> None:
    """One utterance on an opened context: the text as paced deltas from ``sent`` on, a flush and
    close_context, its audio until its isFinal."""
    deltas = split_deltas(text, opts.delta_max_chars) if opts.llm_tokens_per_s > 0 else [text]
    done_at: list[float] = []
    messages = [{"text": d, "context_id": cid} for d in deltas]
    end = [{"context_id": cid, "flush": True}, {"context_id": cid, "close_context": True}]
    sender = asyncio.create_task(_send_paced(ws, messages, end, opts.llm_tokens_per_s, sent, done_at, rec))
    try:
        await _receive_context(ws, rec, sent)
    finally:
        await _finish_sending(sender, rec, sent, done_at)


async def _receive_context(ws, rec: StreamRecord, sent: float) -> None:
    """An ElevenLabs context's audio until its ``isFinal`` (or an error, recorded: no_capacity is a 429)."""
    while True:
        data = json.loads(await ws.recv())
        now = time.perf_counter()
        if data.get("error"):
            kind = "ws_429" if data["error"] in ("no_capacity", "rate_limited") else "ws_error"
            if kind == "ws_429" and rec.status in ("pending", "ok"):
                rec.status, rec.error_kind = "rejected", f"ws_429:{data['error']}"
                rec.retry_after_s = DEFAULT_RETRY_AFTER_S
            else:
                fail_record(rec, f"{kind}:{data['error']}", data.get("message"))
            rec.total_s = now - sent
            return
        if data.get("audio"):
            rec.on_audio(now, sent, len(base64.b64decode(data["audio"])))
        if data.get("isFinal") is True:
            rec.total_s = now - sent
            if rec.status == "pending":
                if rec.audio_bytes:
                    rec.status = "ok"
                else:
                    fail_record(rec, "no_audio")
            return


def _end_record(rec: StreamRecord, sent: float | None, t0: float) -> None:
    if rec.total_s is None and sent is not None and rec.status != "pending":
        rec.total_s = time.perf_counter() - sent
    rec.finish_audio(sent if sent is not None else t0)


async def _finish_sending(sender: asyncio.Task, rec: StreamRecord, sent: float, done_at: list) -> None:
    """Stop the text sender if it still runs; record when the text was all sent, and TTFA after that."""
    if not sender.done():
        sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    if done_at:
        rec.text_send_s = done_at[0] - sent
        if rec.ttfa_s is not None:
            rec.ttfa_after_done_s = sent + rec.ttfa_s - done_at[0]


@contextlib.contextmanager
def _ws_failures(rec: StreamRecord):
    """What the network or the server does to a WebSocket stream, recorded by kind (a 429 handshake is a
    rejection)."""
    try:
        yield
    except ConnectionClosed as e:
        rcvd = getattr(e, "rcvd", None)
        fail_record(rec, f"ws_closed:{rcvd.code if rcvd is not None else 'none'}", str(e))
    except asyncio.TimeoutError as e:                   # open_timeout
        fail_record(rec, "connect_timeout", repr(e))
    except InvalidHandshake as e:
        status = e.response.status_code if isinstance(e, InvalidStatus) else None
        if status == 429:
            rec.status, rec.error_kind = "rejected", "ws_handshake_429"
        else:
            fail_record(rec, f"ws_handshake_{status or 'failed'}", str(e))
    except OSError as e:
        fail_record(rec, "connect_error", repr(e))


async def _recv_json(ws) -> dict:
    while True:
        msg = await ws.recv()
        if isinstance(msg, str):
            try:
                data = json.loads(msg)
            except ValueError:
                return {"type": "invalid_json", "raw": msg[:200]}
            return data if isinstance(data, dict) else {"type": "invalid_json", "raw": msg[:200]}


async def _send_text(ws, deltas: list[str], tps: float, sent: float, done_at: list, rec: StreamRecord) -> None:
    """Deltas on a fixed schedule (delta i at sent + i / tps, no drift), then input.done."""
    await _send_paced(ws, [{"type": "input.text", "text": d} for d in deltas], [{"type": "input.done"}], tps, sent,
                      done_at, rec)


async def _send_paced(ws, messages: list[dict], end: list[dict], tps: float, sent: float, done_at: list,
                      rec: StreamRecord) -> None:
    """Text messages on a fixed schedule (message i at sent + i / tps, no drift), then the end messages."""
    for i, message in enumerate(messages):
        if i and tps > 0:
            delay = sent + i / tps - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await ws.send(json.dumps(message))
        rec.deltas = i + 1
    for message in end:
        await ws.send(json.dumps(message))
    done_at.append(time.perf_counter())


def _ws_error(rec: StreamRecord, msg: dict) -> bool:
    """Record an ``error`` message (or an unexpected one); True when the stream is over."""
    if msg.get("type") != "error":
        fail_record(rec, f"ws_unexpected:{msg.get('type')}", json.dumps(msg)[:300])
        return True
    err = msg.get("error") or {}
    code = err.get("code") or "-"
    if err.get("type") == "rate_limit_error" or code == "no_capacity":
        if rec.status in ("pending", "ok"):
            rec.status, rec.error_kind = "rejected", f"ws_429:{code}"
            rec.retry_after_s = DEFAULT_RETRY_AFTER_S
        return True
    fail_record(rec, f"ws_error:{code}", err.get("message"))
    return bool(msg.get("fatal"))


async def _receive_turn(ws, rec: StreamRecord, sent: float, sender: asyncio.Task) -> None:
    while True:
        failed = sender.exception() if sender.done() else None
        if failed is not None and not isinstance(failed, ConnectionClosed):
            raise failed
        msg = await ws.recv()
        now = time.perf_counter()
        if isinstance(msg, (bytes, bytearray, memoryview)):
            rec.on_audio(now, sent, len(msg))
            continue
        try:
            data = json.loads(msg)
        except ValueError:
            fail_record(rec, "ws_invalid_json", msg[:300])
            continue
        kind = data.get("type")
        if kind == "response.done":
            rec.total_s = now - sent
            rec.finish_reason = data.get("finish_reason")
            rec.server_timing = data.get("timing")
            if rec.status == "pending":
                if rec.audio_bytes == 0:
                    fail_record(rec, "no_audio", json.dumps(data)[:300])
                elif rec.finish_reason == "error":
                    fail_record(rec, "finish_error", json.dumps(data)[:300])
                else:
                    rec.status = "ok"
            return
        if kind == "error":
            if _ws_error(rec, data):
                rec.total_s = now - sent        # not after the close handshake, which a busy server may delay
                return
