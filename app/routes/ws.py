"""``WS /v1/audio/speech/stream``: text in as it is written, audio out as it is generated, many turns.

JSON text frames with a ``type`` both ways; audio as binary frames. One connection is one stream: its
multi-turn context (the KV cache) lives as long as the connection. See the README for the protocol.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import secrets
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from engine.errors import EngineError, InputError
from engine.scheduler import AsyncSink, FrameEvent, StreamError, StreamHandle, TurnEnd
from engine.tokenizer import check_unicode
from engine.voices import resolve_voice

from ..audio_formats import MAX_OUT_RATE, MIN_OUT_RATE, StreamEncoder
from ..auth import websocket_key, websocket_origin_allowed
from ..errors import ApiError, from_engine
from ..metrics import FRAME_SECONDS, StreamMeter
from ..schemas import SamplingExtras, VoiceRef, WholeInt
from ..service import SamplingFields, TTSService
from ..uploads import decode_upload

log = logging.getLogger("mossrt.ws")
router = APIRouter()
PATH = "/v1/audio/speech/stream"

CLOSE_UNAUTHORIZED = 4001
CLOSE_FORBIDDEN_ORIGIN = 4003  # refused before accept: the client sees HTTP 403
CLOSE_POLICY = 4008       # idle timeout, too many turns
CLOSE_UNAVAILABLE = 4503  # loading, draining
CLOSE_INTERNAL = 4500
TEXT_POLL_S = 0.5         # how often an open turn's wait for text is checked (the text timeout's resolution)


class SessionUpdate(SamplingExtras):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None
    voice: StrictStr | VoiceRef | None = None
    response_format: str | None = Field(None, pattern="^(pcm|wav|ulaw|alaw)$")
    sample_rate: WholeInt | None = Field(None, ge=MIN_OUT_RATE, le=MAX_OUT_RATE)   # resampled (soxr)


class UserInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None
    text: StrictStr | None = None
    audio: StrictStr | None = None        # base64 of an audio file (WAV, FLAC, ...)


class TextInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None
    text: StrictStr


class TokensInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None
    ids: list[StrictInt] = Field(max_length=100_000)


class Truncate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None
    audio_end_ms: StrictInt = Field(ge=0)


class Bare(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    event_id: StrictStr | None = None


class FrameRefused(Exception):
    """A WebSocket frame that is not one JSON text message within the size limit: ``code`` is ``binary``,
    ``message_too_large`` or ``invalid_json``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def json_frame(message: dict, max_bytes: int):
    """The JSON value of a received text frame (both WebSocket protocols); FrameRefused otherwise."""
    if message.get("bytes") is not None:
        raise FrameRefused("binary", "send JSON text frames")
    text = message.get("text") or ""
    if len(text.encode()) > max_bytes:
        raise FrameRefused("message_too_large", f"messages are limited to {max_bytes} bytes")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:     # also a 5,000-digit integer, nesting past the parser's depth
        raise FrameRefused("invalid_json", f"not valid JSON: {str(e)[:200]}") from None


def end_session(metrics, sender: asyncio.Task | None, handle: StreamHandle | None) -> None:
    """A WebSocket session's teardown, whatever ended it (both WebSocket protocols): uncount it, stop its
    audio sender, free its stream's slot."""
    metrics.sessions.dec()
    if sender is not None:
        sender.cancel()
    if handle is not None:
        handle.close()


class ClientStalled(Exception):
    """The client did not take a frame of audio within the stall timeout."""


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, fatal: bool = False, close: int = CLOSE_POLICY):
        super().__init__(message)
        self.code, self.message, self.fatal, self.close = code, message, fatal, close


@router.websocket(PATH)
async def speech_stream(ws: WebSocket):
    service: TTSService = ws.app.state.service
    if not websocket_origin_allowed(ws, service.settings.cors_origins):
        await ws.close(code=CLOSE_FORBIDDEN_ORIGIN)       # before accept: the upgrade is refused with HTTP 403
        return
    authorized, subprotocol = websocket_key(ws, service.settings.api_keys)
    await ws.accept(subprotocol=subprotocol)
    session = WsSession(ws, service, ws.app.state.metrics)
    if not authorized:
        await session.fail(ProtocolError("invalid_api_key", "missing or invalid API key", True, CLOSE_UNAUTHORIZED))
        return
    try:
        service.require_ready()
    except ApiError as e:
        await session.fail(ProtocolError(e.code or "unavailable", e.message, True, CLOSE_UNAVAILABLE))
        return
    await session.run()


class WsSession:
    def __init__(self, ws: WebSocket, service: TTSService, metrics):
        self.ws, self.service, self.metrics = ws, service, metrics
        self.settings = service.settings
        self.session_id = "sess_" + secrets.token_hex(8)
        self.format = "pcm"
        self.sample_rate: int | None = None     # output rate; None: the model's
        self.voice_spec = None
        self.sampling = SamplingFields()
        self.max_frames: int | None = None
        self.handle: StreamHandle | None = None
        self.user_text = ""
        self.user_audio = None
        self.turns = 0
        self.response_id: str | None = None
        self.meter: StreamMeter | None = None
        self.turn_refused = False         # a turn failed to open: its remaining text is refused
        self.turn_closed = asyncio.Event()  # cleared while a turn is open (response.created, not yet .done)
        self.turn_closed.set()
        self.last_response: str | None = None
        self._send_lock = asyncio.Lock()
        self._sender: asyncio.Task | None = None
        self._closing = False
        self._waiting_since: float | None = None   # when the open turn was last seen waiting for text
        self._quiet_since = time.monotonic()      # the last message, or the end of the last turn if later

    # ------------------------------------------------------------------ sending
    async def send_json(self, payload: dict) -> None:
        await self._send(self.ws.send_text(json.dumps(payload, separators=(",", ":"))))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.ws.send_bytes(data))

    async def _send(self, sending) -> None:
        """One message to the client; one it does not take within the stall timeout ends the session."""
        async with self._send_lock:
            try:
                await asyncio.wait_for(sending, self.settings.stall_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled from None

    async def error(self, code: str, message: str, fatal: bool = False, event_id: str | None = None,
                    type_: str = "invalid_request_error") -> None:
        payload = {"type": "error", "error": {"type": type_, "code": code, "message": message}, "fatal": fatal}
        if event_id:
            payload["event_id"] = event_id
        await self.send_json(payload)

    @property
    def turn_open(self) -> bool:
        return not self.turn_closed.is_set()

    async def fail(self, e: ProtocolError) -> None:
        try:
            await self.error(e.code, e.message, fatal=True)
            await self.ws.close(code=e.close, reason=e.message[:120])
        except (WebSocketDisconnect, RuntimeError, ClientStalled):
            pass

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        self.metrics.sessions.inc()
        try:
            await self.send_json({
                "type": "session.created", "session_id": self.session_id, "sample_rate": self.service.model.codec.sample_rate,
                "format": self.format,
                "limits": {"max_message_bytes": self.settings.ws_max_message_bytes,
                           "max_buffered_chars": self.settings.ws_max_buffered_chars,
                           "max_turns": self.settings.ws_max_turns, "idle_timeout_s": self.settings.ws_idle_timeout,
                           "text_timeout_s": self.settings.ws_text_timeout,
                           "max_context_rows": self.service.limits.max_context_rows,
                           "max_voice_seconds": self.service.limits.max_voice_seconds}})
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), timeout=self._receive_timeout())
                except asyncio.TimeoutError:
                    if self.turn_open:
                        await self._check_text_timeout()
                        continue                       # the client is listening to a turn: not idle
                    if time.monotonic() - self._quiet_since < self.settings.ws_idle_timeout:
                        continue
                    raise ProtocolError("idle_timeout", f"no message for {self.settings.ws_idle_timeout:g} s",
                                        True, CLOSE_POLICY) from None
                self._quiet_since = time.monotonic()
                if message["type"] == "websocket.disconnect":
                    return
                await self.handle_message(message)
        except ProtocolError as e:
            await self.fail(e)
        except WebSocketDisconnect:
            pass
        except ClientStalled:
            await self._end_stalled()
        except Exception as e:  # noqa: BLE001 - one session's bug never takes the server down
            log.exception("websocket session failed")
            await self.fail(ProtocolError("internal_error", f"internal error: {type(e).__name__}", True,
                                          CLOSE_INTERNAL))
        finally:
            end_session(self.metrics, self._sender, self.handle)

    async def handle_message(self, message: dict) -> None:
        try:
            data = json_frame(message, self.settings.ws_max_message_bytes)
        except FrameRefused as e:
            if e.code == "binary":
                await self.error("binary_not_expected", "send JSON text frames; binary frames are for audio the "
                                                        "server sends")
            else:
                await self.error(e.code, e.message)
            return
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            await self.error("invalid_message", "every message is a JSON object with a string \"type\"")
            return
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        handler = {"session.update": self.on_session_update, "input.user": self.on_user, "input.text": self.on_text,
                   "input.tokens": self.on_tokens, "input.done": self.on_done, "response.cancel": self.on_cancel,
                   "response.truncate": self.on_truncate}.get(data["type"])
        if handler is None:
            await self.error("unknown_type", f"unknown message type {data['type']!r}", event_id=event_id)
            return
        try:
            await handler(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            await self.error("invalid_value", f"{data['type']}: {where}: {err['msg']}", event_id=event_id)
        except (ApiError, EngineError) as e:
            err = from_engine(e)
            if err.code != "turn_refused":    # echoes of a refusal already counted (the 429) are not requests
                self.metrics.requests.labels(PATH, str(err.status)).inc()
            if err.status == 503:
                raise ProtocolError(err.code or "unavailable", err.message, True, CLOSE_UNAVAILABLE) from None
            await self.error(err.code or "invalid_value", err.message, event_id=event_id,
                             type_="rate_limit_error" if err.status == 429 else err.type)

    # ------------------------------------------------------------------ client messages
    async def on_session_update(self, data: dict) -> None:
        msg = SessionUpdate.model_validate(data)
        if self.turn_open:
            raise ApiError(400, "session.update goes between turns", code="turn_in_progress")
        fields = msg.model_fields_set
        if "voice" in fields:
            voice = msg.voice.model_dump() if isinstance(msg.voice, VoiceRef) else msg.voice
            if self.handle is not None and voice != self.voice_spec:
                raise ApiError(400, "the voice is part of the session's context: it can only change before the first "
                               "turn (open a new session for another voice)", param="voice", code="voice_locked")
            await run_in_threadpool(self.service.resolve_voice, voice)   # unknown voices fail now; reads its codes
            self.voice_spec = voice
        if msg.response_format is not None:
            self.format = msg.response_format
        if msg.sample_rate is not None:
            self.sample_rate = msg.sample_rate
        if "seed" in fields and self.handle is not None and msg.seed != self.sampling.seed:
            raise ApiError(400, "the seed can only change before the first turn", param="seed", code="seed_locked")
        merged = {k: getattr(msg, k) if k in fields else getattr(self.sampling, k)
                  for k in SamplingFields.__dataclass_fields__}
        candidate = SamplingFields(**merged)
        self.service.sampling(candidate)                 # validate the combination now
        self.sampling = candidate
        if "max_frames" in fields:
            self.max_frames = msg.max_frames
        await self.send_json({"type": "session.updated", "session": {
            "format": self.format, "sample_rate": self.sample_rate or self.service.model.codec.sample_rate,
            "voice": self.voice_spec, "max_frames": self.max_frames,
            **{k: v for k, v in self.sampling.__dict__.items()}}})

    async def on_user(self, data: dict) -> None:
        msg = UserInput.model_validate(data)
        if self.turn_open:
            raise ApiError(400, "input.user goes before a turn's first text", code="turn_in_progress")
        if msg.text is not None:
            if len(msg.text) > self.service.limits.max_text_chars:
                raise ApiError(400, f"user text is {len(msg.text)} characters; the limit is "
                               f"{self.service.limits.max_text_chars}", param="text", code="input_too_long")
            self.user_text = msg.text
        if msg.audio is not None:
            try:
                raw = base64.b64decode(msg.audio, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "audio must be base64 of an audio file", param="audio", code="invalid_audio") from None
            try:
                wav, rate = await run_in_threadpool(decode_upload, raw, self.service.limits, "user audio", True)
                self.user_audio = await run_in_threadpool(
                    lambda: resolve_voice(self.service.model, self.service.limits, wav=(wav, rate), what="user audio",
                                          user_audio=True))
            except InputError as e:                      # the code HTTP uploads answer for the same audio
                raise ApiError(400, str(e), param="audio", code="invalid_audio") from None
        await self.send_json({"type": "input.user.accepted", "text_chars": len(self.user_text),
                              "audio_frames": 0 if self.user_audio is None else len(self.user_audio)})

    def _refuse_text_of_refused_turn(self) -> None:
        """After a turn could not open (no capacity, context full), its remaining text is refused at once
        until the client ends that turn with input.done; then the next text opens a new attempt."""
        if self.turn_refused:
            raise ApiError(400, "this turn could not open (see the previous error); its text is dropped until "
                           "input.done", code="turn_refused")

    async def on_text(self, data: dict) -> None:
        msg = TextInput.model_validate(data)
        try:
            check_unicode(msg.text)                      # refused before it can open (and count) a turn
        except InputError as e:
            raise ApiError(400, str(e), param="text", code="invalid_value") from None
        self._refuse_text_of_refused_turn()
        await self._open_turn()
        self._check_buffer(len(msg.text))
        self.handle.push_text(msg.text)
        self._text_accepted()

    async def on_tokens(self, data: dict) -> None:
        msg = TokensInput.model_validate(data)
        self.service.model.check_text_ids(msg.ids)        # refuse bad ids before a turn opens
        self._refuse_text_of_refused_turn()
        await self._open_turn()
        self._check_buffer(len(msg.ids))
        self.handle.push_token_ids(msg.ids)
        self._text_accepted()

    async def on_done(self, data: dict) -> None:
        Bare.model_validate(data)
        if self.turn_refused:
            self.turn_refused = False
            await self.send_json({"type": "response.refused", "reason": "the turn could not open"})
            return
        if not self.turn_open or self.handle is None or not self.handle.stream.has_turn:
            raise ApiError(400, "no turn is open: send input.text or input.tokens first", code="no_turn")
        self.handle.end_text()

    async def on_cancel(self, data: dict) -> None:
        Bare.model_validate(data)
        if not self.turn_open or self.handle is None:
            raise ApiError(400, "no response is in progress", code="no_response")
        self.handle.cancel()

    async def on_truncate(self, data: dict) -> None:
        msg = Truncate.model_validate(data)
        if self.handle is None or self.last_response is None:
            raise ApiError(400, "no response to truncate", code="no_response")
        if self.turn_open:
            raise ApiError(400, "truncate after the response ended (send response.cancel first)", code="turn_in_progress")
        asked = math.ceil(msg.audio_end_ms / (1000 * FRAME_SECONDS))
        played = self.handle.stream.turn_audio_frames
        frames = min(asked, played)       # past the end of the audio: clamped to what was played
        kept = self.handle.truncate_turn(frames)
        reply = {"type": "response.truncated", "response_id": self.last_response,
                 "audio_end_ms": msg.audio_end_ms if asked <= played else round(played * 1000 * FRAME_SECONDS),
                 "audio_frames": frames, "context_rows": kept}
        if asked > played:
            reply["clamped"] = True
        await self.send_json(reply)

    # ------------------------------------------------------------------ the text timeout
    def _receive_timeout(self) -> float:
        """How long to wait for the next message: the idle timeout, or while a turn still takes text, the
        polling interval of its text timeout."""
        if self.turn_open and self.handle is not None and self.handle.stream.has_turn:
            return min(TEXT_POLL_S, self.settings.ws_text_timeout)
        return max(0.0, self._quiet_since + self.settings.ws_idle_timeout - time.monotonic())

    def _text_accepted(self) -> None:
        """Text went into the open turn: its wait for text starts again (now, if it has too little to go on)."""
        self._waiting_since = time.monotonic() if self.handle.stream.waiting_for_text else None

    async def _check_text_timeout(self) -> None:
        """A turn that has waited ``ws_text_timeout`` s for text with nothing left to speak gets its text
        ended for it (as by ``input.done``, after an ``error`` saying so): it finishes what it has, so a client
        that never sends ``input.done`` cannot hold its turn, or its slot, forever."""
        stream = self.handle.stream if self.handle is not None else None
        if stream is None or not stream.waiting_for_text:
            self._waiting_since = None
            return
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._waiting_since < self.settings.ws_text_timeout:
            return
        self._waiting_since = None
        await self.error("text_timeout", f"no text for {self.settings.ws_text_timeout:g} s while the turn waited for "
                         "it: its text was ended (as by input.done); the turn finishes what it has")
        try:
            self.handle.end_text()
        except EngineError:
            pass                                        # the stream closed or the text ended meanwhile

    # ------------------------------------------------------------------ turns
    async def _open_turn(self) -> None:
        if self.turn_open:
            return
        await self.turn_closed.wait()
        if self.turns >= self.settings.ws_max_turns:
            raise ProtocolError("max_turns", f"this session reached its {self.settings.ws_max_turns} turns", True)
        params = self.service.sampling(self.sampling)
        if self.handle is None:
            voice = await run_in_threadpool(self.service.resolve_voice, self.voice_spec)   # reads its codes
            self.handle = self.service.open_stream(voice, params, self.sampling.seed, AsyncSink())
            self._sender = asyncio.create_task(self._send_events())
        started = time.monotonic()
        try:
            await self.handle.abegin_turn(self.user_text, self.user_audio, None, self.max_frames, params)
        except Exception:
            self.turn_refused = True      # the rest of this turn's text is refused at once, not retried
            raise
        self.user_text, self.user_audio = "", None
        self.turns += 1
        self.response_id = "resp_" + secrets.token_hex(8)
        self.meter = StreamMeter(self.metrics, "ws", started)
        self._waiting_since = time.monotonic()        # the turn's wait for text starts when it opens
        self.turn_closed.clear()
        await self.send_json({"type": "response.created", "response_id": self.response_id, "turn": self.turns})

    def _check_buffer(self, incoming: int) -> None:
        s = self.handle.stream
        if s.turn_done:
            reason = s.stats.finish_reason.value if s.stats.finish_reason else "ended"
            raise ApiError(400, f"the response already ended ({reason}); this text was not spoken: wait for "
                           "response.done, then send the next turn's text", code="response_ended")
        if s.pending_text_chars + s.pending_text_ids + incoming > self.settings.ws_max_buffered_chars:
            raise ApiError(400, f"text buffer full: at most {self.settings.ws_max_buffered_chars} characters may wait "
                           "to be spoken; send more once audio has caught up", code="text_buffer_full")

    async def _send_events(self) -> None:
        encoder = None      # the turn's: pcm, or wav with its streaming header before the turn's first samples
        try:
            while True:
                event = await self.handle.aget()
                if isinstance(event, FrameEvent):
                    self.meter.frame()
                    if event.frame.audio is not None:
                        if encoder is None:
                            encoder = StreamEncoder(self.format, self.service.model.codec.sample_rate,
                                                    out_rate=self.sample_rate)
                        await self.send_bytes(encoder.write(event.frame.audio))
                        self.meter.audio_sent(FRAME_SECONDS)
                elif isinstance(event, StreamError):
                    err = from_engine(event.error)
                    await self.error(err.code or "engine_error", err.message, type_=err.type)
                elif isinstance(event, TurnEnd):
                    tail = encoder.close() if encoder is not None else b""   # the resampler's last samples
                    if tail:
                        await self.send_bytes(tail)
                    encoder = None
                    timing = self.meter.finish()
                    status = "200" if event.stats.finish_reason.value != "error" else "500"
                    self.metrics.requests.labels(PATH, status).inc()
                    await self.send_json({
                        "type": "response.done", "response_id": self.response_id,
                        "finish_reason": event.stats.finish_reason.value,
                        "usage": {"text_tokens": event.stats.text_ids, "frames": event.stats.frames,
                                  "audio_seconds": round(self.meter.audio_s, 3)},
                        "timing": {**timing, "stalls": event.stats.stalls}})
                    self.last_response = self.response_id
                    self._quiet_since = time.monotonic()      # the idle timeout counts from the turn's end
                    self.turn_closed.set()
        except ClientStalled:
            await self._end_stalled()
        except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
            pass

    async def _end_stalled(self) -> None:
        """The client stopped taking audio: its slot is freed now, then the socket is closed (bounded: a
        client that reads nothing cannot take the close frame either; the server aborts after its close
        timeout)."""
        self.metrics.stalled.labels("ws").inc()
        log.warning("websocket session %s ended: the client took no audio for %g s", self.session_id,
                    self.settings.stall_timeout)
        if self.handle is not None:
            self.handle.close()
        self.turn_closed.set()
        try:
            await asyncio.wait_for(self.ws.close(code=CLOSE_POLICY, reason="client stalled"), 5)
        except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
            pass
