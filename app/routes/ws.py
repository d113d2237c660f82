"""``WS /v1/audio/speech/stream``: text in as it is written, audio out as it is generated, many turns.

JSON text frames with a ``type`` both ways; audio as binary frames. One connection is one conversation: its
multi-turn context (the KV cache) lives as long as the connection, in a slot or parked between turns. This
module parses the messages and renders the events; the session's life and every bound are
:mod:`app.session`'s. See docs/api-websocket.md.
"""

from __future__ import annotations

import base64
import binascii
import math
import secrets

import numpy as np
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from engine.audio.voices import resolve_voice
from engine.errors import EngineError, InputError

from ..audio_formats import MAX_OUT_RATE, MIN_OUT_RATE, StreamEncoder
from ..errors import ApiError, from_engine
from ..metrics import FRAME_SECONDS, StreamMeter
from ..schemas import SamplingExtras, VoiceRef, WholeInt
from ..session.conversation import Conversation
from ..session.policy import speakable
from ..session.pump import Audio, Ended, TurnAudio
from ..session.sampling import SamplingFields
from ..session.websocket import WebSocketSession
from ..session.wire import SessionEnd
from ..uploads import decode_upload

router = APIRouter()
PATH = "/v1/audio/speech/stream"


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


@router.websocket(PATH)
async def speech_stream(ws: WebSocket):
    await OurSession(ws, ws.app.state.service).serve()


class OurSession(WebSocketSession):
    protocol = "ws"
    path = PATH

    def __init__(self, ws: WebSocket, service):
        super().__init__(ws, service)
        self.session_id = "sess_" + secrets.token_hex(8)
        self.format = "pcm"
        self.sample_rate: int | None = None     # output rate; None: the model's
        self.voice_spec: str | dict | None = None
        self.sampling = SamplingFields()
        self.max_frames: int | None = None
        self.user_text = ""
        self.user_audio: np.ndarray | None = None
        self.response_id: str | None = None
        self.last_response: str | None = None
        self.turn_refused = False         # a turn failed to open: its remaining text is refused

    # ------------------------------------------------------------------ the session
    async def open(self) -> None:
        try:
            self.service.require_ready()
        except ApiError as e:
            raise SessionEnd(e) from None
        p = self.policy
        await self.send_json({
            "type": "session.created", "session_id": self.session_id,
            "sample_rate": self.service.model.codec.sample_rate, "format": self.format,
            "limits": {"max_message_bytes": p.max_message_bytes, "max_buffered_chars": p.max_buffered_chars,
                       "max_turns": p.max_turns, "idle_timeout_s": p.idle_timeout, "text_timeout_s": p.text_timeout,
                       "max_context_rows": self.service.limits.max_context_rows,
                       "max_voice_seconds": self.service.limits.max_voice_seconds}})

    def render_error(self, err: ApiError, fatal: bool, **context: str | None) -> dict:
        return err.ws_message(fatal, context.get("event_id"))

    @property
    def turn_open(self) -> bool:
        return self.conversation is not None and self.conversation.turn_open

    async def on_data(self, data) -> None:
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            await self.refuse(ApiError("invalid_message", "every message is a JSON object with a string \"type\""))
            return
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        handler = {"session.update": self.on_session_update, "input.user": self.on_user, "input.text": self.on_text,
                   "input.tokens": self.on_tokens, "input.done": self.on_done, "response.cancel": self.on_cancel,
                   "response.truncate": self.on_truncate}.get(data["type"])
        if handler is None:
            await self.refuse(ApiError("unknown_type", f"unknown message type {data['type']!r}"), event_id=event_id)
            return
        try:
            await handler(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            await self.refuse(ApiError("invalid_value", f"{data['type']}: {where}: {first['msg']}"), event_id=event_id)
        except (ApiError, EngineError) as e:
            err = from_engine(e)
            if err.code != "turn_refused":    # echoes of a refusal already counted (the 429) are not requests
                self.count_request(str(err.status))
            if err.status == 503 or err.code == "max_turns":
                raise SessionEnd(err) from None
            await self.refuse(err, event_id=event_id)

    # ------------------------------------------------------------------ client messages
    async def on_session_update(self, data: dict) -> None:
        msg = SessionUpdate.model_validate(data)
        if self.turn_open:
            raise ApiError("turn_in_progress", "session.update goes between turns")
        fields = msg.model_fields_set
        started = self.conversation is not None
        if "voice" in fields:
            voice = msg.voice.model_dump() if isinstance(msg.voice, VoiceRef) else msg.voice
            if started and voice != self.voice_spec:
                raise ApiError("voice_locked", "the voice is part of the session's context: it can only change "
                               "before the first turn (open a new session for another voice)", "voice")
            await run_in_threadpool(self.service.resolve_voice, voice)   # unknown voices fail now; reads its codes
            self.voice_spec = voice
        if msg.response_format is not None:
            self.format = msg.response_format
        if msg.sample_rate is not None:
            self.sample_rate = msg.sample_rate
        if "seed" in fields and started and msg.seed != self.sampling.seed:
            raise ApiError("seed_locked", "the seed can only change before the first turn", "seed")
        merged = {k: getattr(msg, k) if k in fields else getattr(self.sampling, k)
                  for k in SamplingFields.__dataclass_fields__}
        candidate = SamplingFields(**merged)
        self.service.sampling(candidate)                 # validate the combination now
        self.sampling = candidate
        if "max_frames" in fields:
            self.max_frames = msg.max_frames
        await self.send_json({"type": "session.updated", "session": {
            "format": self.format, "sample_rate": self.sample_rate or self.service.model.codec.sample_rate,
            "voice": self.voice_spec, "max_frames": self.max_frames, **dict(self.sampling.__dict__)}})

    async def on_user(self, data: dict) -> None:
        msg = UserInput.model_validate(data)
        if self.turn_open:
            raise ApiError("turn_in_progress", "input.user goes before a turn's first text")
        if msg.text is not None:
            if len(msg.text) > self.service.limits.max_text_chars:
                raise ApiError("input_too_long", f"user text is {len(msg.text)} characters; the limit is "
                               f"{self.service.limits.max_text_chars}", "text")
            self.user_text = msg.text
        if msg.audio is not None:
            try:
                raw = base64.b64decode(msg.audio, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError("invalid_audio", "audio must be base64 of an audio file", "audio") from None
            limits, model = self.service.limits, self.service.model
            try:
                wav, rate = await run_in_threadpool(decode_upload, raw, limits, "user audio", True)
                self.user_audio = await run_in_threadpool(
                    lambda: resolve_voice(model, limits, wav=(wav, rate), what="user audio", user_audio=True))
            except InputError as e:                      # the code HTTP uploads answer for the same audio
                raise ApiError("invalid_audio", str(e), "audio") from None
        await self.send_json({"type": "input.user.accepted", "text_chars": len(self.user_text),
                              "audio_frames": 0 if self.user_audio is None else len(self.user_audio)})

    def _refuse_text_of_refused_turn(self) -> None:
        """After a turn could not open (no capacity, context full), its remaining text is refused at once
        until the client ends that turn with input.done; then the next text opens a new attempt."""
        if self.turn_refused:
            raise ApiError("turn_refused", "this turn could not open (see the previous error); its text is dropped "
                           "until input.done")

    async def on_text(self, data: dict) -> None:
        msg = TextInput.model_validate(data)
        if msg.text == "" or (not self.turn_open and not speakable(msg.text)):
            # no text, or nothing to speak (whitespace, a zero-width space) with no turn open: opens no turn,
            # moves only the idle clock; within a turn whitespace is text (it separates words)
            self.keepalive()
            return
        Conversation.check_text(msg.text)                # refused before it can open (and count) a turn
        self._refuse_text_of_refused_turn()
        await self._open_turn()
        self.started_conversation.check_takes_text()
        self.check_buffer(len(msg.text))                 # characters, not the tokens they commit to
        self.push_text(msg.text)

    async def on_tokens(self, data: dict) -> None:
        msg = TokensInput.model_validate(data)
        if not msg.ids:
            self.keepalive()                              # no ids: as an empty input.text
            return
        self.service.model.check_text_ids(msg.ids)        # refuse bad ids before a turn opens
        self._refuse_text_of_refused_turn()
        await self._open_turn()
        self.started_conversation.check_takes_text()
        self.check_buffer(len(msg.ids))                  # a token id counts as one character
        self.started_conversation.push_ids(msg.ids)

    async def on_done(self, data: dict) -> None:
        Bare.model_validate(data)
        if self.turn_refused:
            self.turn_refused = False
            await self.send_json({"type": "response.refused", "reason": "the turn could not open"})
            return
        handle = self.conversation.handle if self.turn_open and self.conversation is not None else None
        if handle is None or not handle.stream.has_turn:
            raise ApiError("no_turn", "no turn is open: send input.text or input.tokens first")
        self.started_conversation.end_text()

    async def on_cancel(self, data: dict) -> None:
        Bare.model_validate(data)
        if not self.turn_open:
            raise ApiError("no_response", "no response is in progress")
        self.started_conversation.cancel()

    async def on_truncate(self, data: dict) -> None:
        msg = Truncate.model_validate(data)
        if self.conversation is None or self.last_response is None:
            raise ApiError("no_response", "no response to truncate")
        if self.turn_open:
            raise ApiError("turn_in_progress", "truncate after the response ended (send response.cancel first)")
        asked = math.ceil(msg.audio_end_ms / (1000 * FRAME_SECONDS))
        handle = self.conversation.handle
        assert handle is not None, "a response was sent on it"
        played = handle.stream.turn_audio_frames
        frames = min(asked, played)       # past the end of the audio: clamped to what was played
        kept = self.conversation.truncate_turn(frames)
        reply = {"type": "response.truncated", "response_id": self.last_response,
                 "audio_end_ms": msg.audio_end_ms if asked <= played else round(played * 1000 * FRAME_SECONDS),
                 "audio_frames": frames, "context_rows": kept}
        if asked > played:
            reply["clamped"] = True
        await self.send_json(reply)

    # ------------------------------------------------------------------ turns
    async def _open_turn(self) -> None:
        if self.turn_open:
            return
        params = self.service.sampling(self.sampling)
        if self.conversation is None:
            voice = await run_in_threadpool(self.service.resolve_voice, self.voice_spec)   # reads its codes
            self.conversation = Conversation(self.service, self.policy, voice, self.sampling.seed)
        meter = StreamMeter(self.metrics, self.protocol)
        before = self.conversation.handle
        try:
            await self.conversation.begin_turn(params, self.user_text, self.user_audio, self.max_frames)
        except ApiError as e:
            if e.code != "max_turns":
                self.turn_refused = True      # the rest of this turn's text is refused at once, not retried
            raise
        if self.conversation.handle is not before or self._sender is None:
            self.start_sender()               # a fresh stream (first turn, or an evicted context) gets its sender
        if self.conversation.context_lost:
            await self.error(ApiError("context_evicted", "this session's parked context was dropped to make room "
                                      "(the server's parked-context budget): this turn starts on a fresh context, "
                                      "without the earlier turns"))
        self.user_text, self.user_audio = "", None
        self.response_id = "resp_" + secrets.token_hex(8)
        rate, out_rate, fmt = self.service.model.codec.sample_rate, self.sample_rate, self.format
        self.turn = TurnAudio(meter, make_encoder=lambda: StreamEncoder(fmt, rate, out_rate=out_rate))
        await self.send_json({"type": "response.created", "response_id": self.response_id,
                              "turn": self.conversation.turns})

    async def on_text_timeout(self) -> None:
        await self.error(ApiError("text_timeout", f"no text for {self.policy.text_timeout:g} s while the turn waited "
                                  "for it: its text was ended (as by input.done); the turn finishes what it has"))
        await super().on_text_timeout()

    # ------------------------------------------------------------------ the turn's events
    async def on_audio(self, out: Audio) -> None:
        await self.send_bytes(out.data)

    async def on_ended(self, out: Ended, turn: TurnAudio) -> None:
        if out.tail:                                     # the resampler's last samples
            await self.send_bytes(out.tail)
        timing = turn.meter.finish()
        reason = out.stats.finish_reason
        assert reason is not None, "a turn's end says why it ended"
        status = "200" if reason.value != "error" else "500"
        self.count_request(status)
        await self.send_json({
            "type": "response.done", "response_id": self.response_id,
            "finish_reason": reason.value,
            "usage": {"text_tokens": out.stats.text_ids, "frames": out.stats.frames,
                      "audio_seconds": round(turn.meter.audio_s, 3)},
            "timing": {**timing, "stalls": out.stats.stalls}})
        self.last_response = self.response_id
