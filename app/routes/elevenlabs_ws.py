"""ElevenLabs-compatible WebSockets: ``/v1/text-to-speech/{voice_id}/multi-stream-input`` and ``/stream-input``.

A thin adapter onto one scheduler stream per socket, exactly like our own WebSocket: the contexts of a
socket are consecutive assistant turns of one conversation (the KV context carries over), run one at a
time in the order their text arrived. A ``flush`` without text ends the context's current turn (everything
received is spoken; livekit sends one, pipecat sends a bare flush); a flush with text is only a hint (text is
spoken as it arrives). ``close_context`` after such an end lets the turn finish and then sends ``isFinal``;
``close_context`` with text not yet ended, or a second one, is a barge-in: the turn is cancelled at the
next step and the context truncated to the audio that was sent. When the conversation's context is nearly
full the next turn starts a fresh stream. See the README ("ElevenLabs-compatible API").
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from engine.errors import ContextLimitError, EngineError, InputError
from engine.scheduler import AsyncSink, FrameEvent, StreamError, StreamHandle, TurnEnd
from engine.stream import FinishReason

from ..audio_formats import StreamEncoder
from ..auth import _known, websocket_key
from ..elevenlabs.alignment import FRAME_MS, Aligner
from ..elevenlabs.formats import OutputFormat, parse_output_format
from ..elevenlabs.protocol import DEFAULT_INACTIVITY_TIMEOUT, ClientMessage, ConnectionParams
from ..errors import ApiError, from_engine
from ..metrics import FRAME_SECONDS, StreamMeter
from ..service import SamplingFields, TTSService
from .ws import FrameRefused, end_session, json_frame

log = logging.getLogger("mossrt.elevenlabs")
router = APIRouter()
MULTI_PATH = "/v1/text-to-speech/{voice_id}/multi-stream-input"
SINGLE_PATH = "/v1/text-to-speech/{voice_id}/stream-input"
CLOSE_POLICY = 1008         # ElevenLabs closes bad sessions (auth, settings, timeout) with a policy violation
CLOSE_INTERNAL = 1011
FRESH_CONTEXT_BELOW = 0.25  # start the next turn on a fresh stream when less than this share of rows is left
SINGLE_CONTEXT = ""


class Fatal(Exception):
    def __init__(self, code: str, message: str, close: int = CLOSE_POLICY):
        super().__init__(message)
        self.code, self.message, self.close = code, message, close


@dataclass
class Context:
    id: str
    pending: list[str] = field(default_factory=list)   # text waiting for the context's (next) turn
    flush_pending: bool = False  # a flush came for the pending text: its turn ends its text at once
    turn_ended: bool = False     # the open turn's text has ended: it finishes by itself
    close_requested: bool = False
    cancelled: bool = False
    queued: bool = False
    aligner: Aligner = field(default_factory=Aligner)
    encoder: StreamEncoder | None = None
    frames_sent: int = 0         # frames of the current turn whose audio was sent
    meter: StreamMeter | None = None


@router.websocket(MULTI_PATH)
async def multi_stream_input(ws: WebSocket, voice_id: str):
    await _serve(ws, voice_id, multi=True)


@router.websocket(SINGLE_PATH)
async def stream_input(ws: WebSocket, voice_id: str):
    await _serve(ws, voice_id, multi=False)


async def _serve(ws: WebSocket, voice_id: str, multi: bool) -> None:
    service: TTSService = ws.app.state.service
    keys = service.settings.api_keys
    authorized, subprotocol = websocket_key(ws, keys)
    authorized = authorized or _known(keys, ws.headers.get("xi-api-key"))
    await ws.accept(subprotocol=subprotocol)
    session = ElevenLabsSession(ws, service, voice_id, multi, authorized)
    await session.run()


class ElevenLabsSession:
    def __init__(self, ws: WebSocket, service: TTSService, voice_id: str, multi: bool, authorized: bool):
        self.ws, self.service, self.voice_id, self.multi = ws, service, voice_id, multi
        self.metrics = ws.app.state.metrics
        self.settings = service.settings
        self.path = MULTI_PATH if multi else SINGLE_PATH
        self.authorized = authorized
        self.format: OutputFormat | None = None
        self.voice = None
        self.seed: int | None = None
        self.sync_alignment = True
        self.timeout = float(DEFAULT_INACTIVITY_TIMEOUT)
        self.handle: StreamHandle | None = None
        self.contexts: dict[str, Context] = {}
        self.closed_ids: set[str] = set()
        self.queue: deque[Context] = deque()     # contexts with text waiting for the stream
        self.active: Context | None = None       # the context whose turn is open on the stream
        self.turns = 0
        self._starting = False
        self._send_lock = asyncio.Lock()
        self._sender: asyncio.Task | None = None
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ sending
    async def send(self, payload: dict) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(payload, separators=(",", ":")))

    async def error(self, code: str, message: str, context_id: str | None = None) -> None:
        """ElevenLabs' error shape: livekit fails the named context with ``error``; pipecat ignores it."""
        payload = {"error": code, "message": message}
        if self.multi and context_id is not None:
            payload["contextId"] = context_id
        await self.send(payload)

    def _tag(self, payload: dict, ctx: Context) -> dict:
        if self.multi:
            payload["contextId"] = ctx.id
        return payload

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        self.metrics.sessions.inc()
        try:
            await self._configure()
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), timeout=self.timeout)
                except asyncio.TimeoutError:
                    if self.active is not None or self.queue:
                        continue                     # audio is still being generated: not idle
                    raise Fatal("input_timeout_exceeded", f"no text received for {self.timeout:g} s") from None
                if message["type"] == "websocket.disconnect" or self._closed:
                    return
                await self.on_message(message)
                if self._closing and (self.multi or self.active is None):
                    await self._close()
                    return
        except Fatal as e:
            await self._fail(e)
        except WebSocketDisconnect:
            pass
        except Exception as e:  # noqa: BLE001 - one session's bug never takes the server down
            log.exception("elevenlabs session failed")
            try:
                await self.error("internal_error", f"internal error: {type(e).__name__}")
                await self.ws.close(code=CLOSE_INTERNAL)
            except (WebSocketDisconnect, RuntimeError):
                pass
        finally:
            end_session(self.metrics, self._sender, self.handle)

    async def _fail(self, e: Fatal) -> None:
        try:
            await self.error(e.code, e.message)
            await self.ws.close(code=e.close, reason=e.message[:120])
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def _configure(self) -> None:
        """Query parameters, readiness and the voice: refused before any text."""
        try:
            params = ConnectionParams.from_query(self.ws.query_params)
        except ValidationError as e:
            err = e.errors()[0]
            raise Fatal("invalid_request", f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        try:
            self.format = parse_output_format(params.output_format)
            self.service.require_ready()
            self.voice = await run_in_threadpool(self.service.resolve_voice, self.voice_id, param="voice_id")
        except ApiError as e:
            raise Fatal(e.code or "invalid_request", e.message,
                        CLOSE_INTERNAL if e.status >= 500 else CLOSE_POLICY) from None
        self.seed = params.seed if params.seed is not None else self.settings.elevenlabs_seed
        self.timeout = float(params.inactivity_timeout or DEFAULT_INACTIVITY_TIMEOUT)

    async def on_message(self, message: dict) -> None:
        try:
            data = json_frame(message, self.settings.ws_max_message_bytes)
        except FrameRefused as e:
            await self.error("invalid_message" if e.code == "binary" else e.code, e.message)
            return
        context_id = data.get("context_id") if isinstance(data, dict) and isinstance(data.get("context_id"), str) \
            else None
        if not isinstance(data, dict):
            await self.error("invalid_message", "every message is a JSON object")
            return
        try:
            msg = ClientMessage.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            await self.error("invalid_message", f"{'.'.join(map(str, err['loc']))}: {err['msg']}", context_id)
            return
        if not self.authorized:
            if not _known(self.settings.api_keys, msg.xi_api_key or msg.authorization):
                raise Fatal("invalid_api_key", "missing or invalid API key: send the xi-api-key header or "
                            "xi_api_key in the first message")
            self.authorized = True
        try:
            await self.handle_message(msg)
        except (ApiError, EngineError) as e:
            err = from_engine(e)
            if err.status >= 500 and err.status != 503:
                raise
            self.metrics.requests.labels(self.path, str(err.status)).inc()
            await self.error(err.code or "invalid_request", err.message, msg.context_id)

    async def handle_message(self, msg: ClientMessage) -> None:
        if msg.close_socket:
            self._closing = True
            if self.active is not None:
                self.handle.cancel()
            return
        cid = (msg.context_id or "default") if self.multi else SINGLE_CONTEXT
        ctx = self.contexts.get(cid)
        if msg.close_context:
            if ctx is not None:
                await self._close_context(ctx)
            return
        if msg.text is None and not msg.flush:
            return
        if ctx is None and cid in self.closed_ids:
            if not (msg.text or msg.flush):
                return          # a keep-alive naming a context that has ended
            raise ApiError(400, f"context {cid!r} was closed: open a new context_id for more text",
                           param="context_id", code="context_closed")
        if ctx is None:
            if msg.text is not None and msg.text.strip() == "" and not msg.flush and msg.context_id is None \
                    and self.multi:
                return          # a keep-alive without a context
            ctx = self.contexts[cid] = Context(cid)
            if msg.text == " ":
                return          # the context-opening " " (it carries the ignored voice settings)
        if (ctx.close_requested or ctx.cancelled) and not (msg.text or msg.flush):
            return              # a keep-alive for a context that is finishing
        if ctx.close_requested or ctx.cancelled:
            raise ApiError(400, f"context {cid!r} was closed: open a new context_id for more text",
                           param="context_id", code="context_closed")
        text = msg.text or ""
        if text:
            self._check_buffer(ctx, len(text))
            ctx.aligner.add(text)
            if self.active is ctx and not ctx.turn_ended:
                self.handle.push_text(text)
            else:
                ctx.pending.append(text)        # its turn opens later (after a flush: its next turn)
                self._enqueue(ctx)
        if msg.flush and not text:
            self._flush(ctx)                     # a flush with text is a hint: text is spoken as it comes
        elif msg.text == "" and not self.multi:
            self._flush(ctx)                     # stream-input: {"text": ""} ends the input
            await self._close_context(ctx)
            return
        await self._start_next()

    def _check_buffer(self, ctx: Context, incoming: int) -> None:
        waiting = sum(len(t) for t in ctx.pending)
        if self.active is ctx and self.handle is not None:
            waiting += self.handle.stream.pending_text_chars + self.handle.stream.pending_text_ids
        if waiting + incoming > self.settings.ws_max_buffered_chars:
            raise ApiError(400, f"text buffer full: at most {self.settings.ws_max_buffered_chars} characters may wait "
                           "to be spoken", code="text_buffer_full")

    def _enqueue(self, ctx: Context) -> None:
        if not ctx.queued and self.active is not ctx:
            ctx.queued = True
            self.queue.append(ctx)

    def _flush(self, ctx: Context) -> None:
        """Everything received for the context is spoken without waiting for more text."""
        if ctx.pending:
            ctx.flush_pending = True
        elif self.active is ctx and not ctx.turn_ended:
            ctx.turn_ended = True
            self.handle.end_text()

    def _unflushed(self, ctx: Context) -> bool:
        return (self.active is ctx and not ctx.turn_ended) or (bool(ctx.pending) and not ctx.flush_pending)

    async def _close_context(self, ctx: Context) -> None:
        if ctx.cancelled:
            return
        if not ctx.close_requested and not self._unflushed(ctx):
            ctx.close_requested = True            # end of the utterance: finish, then isFinal
            if self.active is not ctx and not ctx.queued:
                await self._finish_context(ctx)
            return
        # barge-in: stop at the next step; the rest of this context is dropped
        ctx.cancelled = True
        ctx.close_requested = True
        ctx.pending.clear()
        if self.active is ctx:
            self.handle.cancel()
        else:
            if ctx.queued:
                self.queue.remove(ctx)
                ctx.queued = False
            await self._finish_context(ctx)

    async def _finish_context(self, ctx: Context) -> None:
        self.contexts.pop(ctx.id, None)
        self.closed_ids.add(ctx.id)
        await self.send(self._tag({"isFinal": True}, ctx))
        if not self.multi:
            self._closing = True

    # ------------------------------------------------------------------ turns
    async def _start_next(self) -> None:
        """Open the next queued context's turn once the stream is free. A turn that cannot open (no
        capacity) fails its context only: an error naming it, then its isFinal."""
        while self.active is None and not self._starting and self.queue:
            ctx = self.queue.popleft()
            ctx.queued = False
            self._starting = True
            try:
                await self._begin_turn(ctx)
            except (ApiError, EngineError) as e:
                err = from_engine(e)
                self.metrics.requests.labels(self.path, str(err.status)).inc()
                await self.error(err.code or "turn_refused", err.message, ctx.id)
                ctx.pending.clear()
                await self._finish_context(ctx)
                continue
            finally:
                self._starting = False
            text, ctx.pending = "".join(ctx.pending), []
            self.handle.push_text(text)
            if ctx.flush_pending:
                ctx.flush_pending, ctx.turn_ended = False, True
                self.handle.end_text()

    async def _begin_turn(self, ctx: Context) -> None:
        if self.turns >= self.settings.ws_max_turns:
            raise Fatal("max_turns", f"this socket reached its {self.settings.ws_max_turns} turns")
        params = self.service.sampling(SamplingFields(greedy=self.settings.elevenlabs_greedy or None))
        limits = self.service.limits
        if self.handle is not None and self.handle.context_rows > (1 - FRESH_CONTEXT_BELOW) * limits.max_context_rows:
            self._fresh_stream()
        started = time.monotonic()
        for attempt in range(2):
            if self.handle is None:
                self.handle = self.service.open_stream(self.voice, params, self.seed, AsyncSink())
                self._sender = asyncio.create_task(self._send_events(self.handle))
            try:
                await self.handle.abegin_turn("", None, None, None, params)      # awaits a slot, holds no thread
                break
            except ContextLimitError:
                if attempt:
                    raise
                self._fresh_stream()             # the conversation is full: continue on a fresh context
        self.turns += 1
        self.active = ctx
        ctx.turn_ended = False
        ctx.aligner.new_turn()
        ctx.encoder, ctx.frames_sent = None, 0
        ctx.meter = StreamMeter(self.metrics, "elevenlabs", started)

    def _fresh_stream(self) -> None:
        log.info("conversation context full (%d rows): the next turn starts a fresh one", self.handle.context_rows)
        if self._sender is not None and self._sender is not asyncio.current_task():
            self._sender.cancel()    # (called from the sender itself, it returns after this event)
        self.handle.close()
        self.handle, self._sender = None, None

    async def _send_events(self, handle: StreamHandle) -> None:
        try:
            while handle is self.handle:
                event = await handle.aget()
                ctx = self.active
                if ctx is None or handle is not self.handle:
                    continue
                if isinstance(event, FrameEvent):
                    await self._on_frame(ctx, event)
                elif isinstance(event, StreamError):
                    err = from_engine(event.error)
                    await self.error(err.code or "engine_error", err.message, ctx.id)
                elif isinstance(event, TurnEnd):
                    await self._on_turn_end(ctx, event)
        except Fatal as e:
            await self._fail(e)
        except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
            pass

    async def _on_frame(self, ctx: Context, event: FrameEvent) -> None:
        ctx.meter.frame()
        frame = event.frame
        if frame.audio is None:
            return
        if ctx.encoder is None:
            ctx.encoder = self.format.encoder(self.service.model.codec.sample_rate)
        audio = ctx.encoder.write(frame.audio)
        ctx.frames_sent += 1
        payload = {"audio": base64.b64encode(audio).decode(), "isFinal": None}
        self._align(payload, ctx.aligner.frame(frame.text_chars, FRAME_MS))
        await self.send(self._tag(payload, ctx))
        ctx.meter.audio_sent(FRAME_SECONDS)

    def _align(self, payload: dict, span: dict | None) -> None:
        payload["alignment"] = span
        payload["normalizedAlignment"] = span

    async def _on_turn_end(self, ctx: Context, event: TurnEnd) -> None:
        reason = event.stats.finish_reason
        ctx.meter.finish()
        status = "200" if reason is not FinishReason.ERROR else "500"
        self.metrics.requests.labels(self.path, status).inc()
        tail = ctx.encoder.close() if ctx.encoder is not None else b""
        span = None if ctx.cancelled else ctx.aligner.rest()
        if tail or span:
            payload = {"audio": base64.b64encode(tail).decode(), "isFinal": None}
            self._align(payload, span)
            await self.send(self._tag(payload, ctx))
        if reason is FinishReason.CANCELLED:
            try:   # keep in the conversation only what was sent
                self.handle.truncate_turn(ctx.frames_sent)
            except InputError as e:
                log.warning("could not truncate the cancelled turn: %s", e)
        self.active = None
        ctx.encoder = None
        if ctx.pending and not ctx.cancelled:
            self._enqueue(ctx)                   # text that came after its flush: the context's next turn
        elif ctx.close_requested:
            await self._finish_context(ctx)
        await self._start_next()
        if self._closing and not self.multi:
            await self._close()

    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.ws.close(1000)
