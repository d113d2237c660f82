"""ElevenLabs-compatible WebSockets: ``/v1/text-to-speech/{voice_id}/multi-stream-input`` and ``/stream-input``.

An adapter on the session core (:mod:`app.session`): the contexts of a socket are consecutive assistant turns
of one conversation (the KV context carries over), run one at a time in the order their text arrived. A
``flush`` without text ends the context's current turn (everything received is spoken; livekit sends one,
pipecat sends a bare flush); a flush with text is only a hint (text is spoken as it arrives).
``close_context`` after such an end lets the turn finish and then sends ``isFinal``; ``close_context`` with
text not yet ended, or a second one, is a barge-in: the turn is cancelled at the next step and the context
truncated to the audio that was sent. When the conversation's context is nearly full the next turn starts a
fresh stream. Every bound — Origin, the key before any other work, stalls, the text clock, inactivity, the
text buffer (per socket), the number of contexts — is the core's. See docs/api-elevenlabs.md.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from engine.errors import InputError
from engine.serving.stream import FinishReason

from ..alignment.characters import FRAME_MS, Aligner
from ..elevenlabs.formats import OutputFormat, parse_output_format
from ..elevenlabs.protocol import DEFAULT_INACTIVITY_TIMEOUT, ClientMessage, ConnectionParams
from ..errors import ApiError
from ..metrics import StreamMeter
from ..session.conversation import Conversation
from ..session.policy import speakable
from ..session.pump import Audio, Ended, TurnAudio
from ..session.sampling import SamplingFields
from ..session.websocket import WebSocketSession
from ..session.wire import SessionEnd

log = logging.getLogger("mossrt.elevenlabs")
router = APIRouter()
MULTI_PATH = "/v1/text-to-speech/{voice_id}/multi-stream-input"
SINGLE_PATH = "/v1/text-to-speech/{voice_id}/stream-input"
FRESH_CONTEXT_BELOW = 0.25  # start the next turn on a fresh stream when less than this share of rows is left
SINGLE_CONTEXT = ""
CLOSED_IDS_KEPT = 256       # contexts a socket remembers as closed (text naming one is refused)


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
    frames_sent: int = 0         # frames of the current turn whose audio was sent

    @property
    def pending_chars(self) -> int:
        return sum(len(t) for t in self.pending)


@router.websocket(MULTI_PATH)
async def multi_stream_input(ws: WebSocket, voice_id: str):
    await ElevenLabsSession(ws, ws.app.state.service, voice_id, multi=True).serve()


@router.websocket(SINGLE_PATH)
async def stream_input(ws: WebSocket, voice_id: str):
    await ElevenLabsSession(ws, ws.app.state.service, voice_id, multi=False).serve()


class ElevenLabsSession(WebSocketSession):
    protocol = "elevenlabs"

    def __init__(self, ws: WebSocket, service, voice_id: str, multi: bool):
        super().__init__(ws, service)
        self.voice_id, self.multi = voice_id, multi
        self.path = MULTI_PATH if multi else SINGLE_PATH
        self.format: OutputFormat | None = None
        self.inactivity = float(DEFAULT_INACTIVITY_TIMEOUT)
        self.contexts: dict[str, Context] = {}
        self.closed_ids: OrderedDict[str, None] = OrderedDict()
        self.queue: deque[Context] = deque()     # contexts with text waiting for the stream
        self.active: Context | None = None       # the context whose turn is open on the stream
        self._first: dict | None = None          # the message that authenticated, still to be handled
        self._starting: Context | None = None    # the context whose turn is being opened (it may wait for a slot)
        self._start_wait: asyncio.Task | None = None   # that wait: a barge-in on the context cancels it
        self._closing = False

    # ------------------------------------------------------------------ the gate and the configuration
    async def authenticate(self) -> None:
        """The key may come in the first message (``xi_api_key``, or ``authorization`` with or without
        ``Bearer``), within ``auth_timeout`` seconds; anything else ends the socket. Nothing else happens
        before: no voice lookup, no format check, no timeout the client chose."""
        refused = ApiError("invalid_api_key", "missing or invalid API key: send the xi-api-key header or xi_api_key "
                                              "in the first message")
        try:
            message = await asyncio.wait_for(self.ws.receive(), self.policy.auth_timeout)
        except asyncio.TimeoutError:
            raise SessionEnd(ApiError("auth_timeout", f"no API key within {self.policy.auth_timeout:g} s")) from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect()
        try:
            data = json.loads(message.get("text") or "")
        except Exception:  # noqa: BLE001 - any first message that is not JSON is refused alike
            raise SessionEnd(refused) from None
        key = data.get("xi_api_key") or data.get("authorization") if isinstance(data, dict) else None
        if not isinstance(key, str) or not self.policy.key_valid(key):
            raise SessionEnd(refused)
        self._first = data
        self.active_since = self.quiet_since = time.monotonic()     # the timers count from the key

    async def open(self) -> None:
        """Query parameters, readiness and the voice: refused before any text."""
        try:
            params = ConnectionParams.from_query(self.ws.query_params)
        except ValidationError as e:
            err = e.errors()[0]
            raise SessionEnd(ApiError("invalid_request", f"{'.'.join(map(str, err['loc']))}: {err['msg']}")) from None
        try:
            self.format = parse_output_format(params.output_format)
            self.service.require_ready()
            voice = await run_in_threadpool(self.service.resolve_voice, self.voice_id, "voice_id")
        except ApiError as e:
            raise SessionEnd(e) from None
        seed = params.seed if params.seed is not None else self.service.settings.elevenlabs_seed
        self.alignment = params.alignment
        self.conversation = Conversation(self.service, self.policy, voice, seed)
        # the client's inactivity_timeout, at most the server's idle timeout (a socket holds its context)
        self.inactivity = min(float(params.inactivity_timeout or DEFAULT_INACTIVITY_TIMEOUT), self.policy.idle_timeout)
        if self._first is not None:
            first, self._first = self._first, None
            await self.on_data(first)

    def render_error(self, err: ApiError, fatal: bool, **context: str | None) -> dict:
        return err.elevenlabs_message(context.get("context_id") if self.multi else None)

    # ------------------------------------------------------------------ timers
    def busy(self) -> bool:
        # audio is being generated or waits for a slot: not idle
        return self.active is not None or self._starting is not None or bool(self.queue)

    def _next_deadline(self, now: float):
        deadline, what = super()._next_deadline(now)
        if not self.busy():                   # ElevenLabs' inactivity: no message for inactivity_timeout seconds
            due = self.quiet_since + self.inactivity     # (keep-alives count, as for the idle timeout)
            if deadline is None or due < deadline:
                return due, "inactivity"
        return deadline, what

    async def on_protocol_deadline(self, what: str, now: float) -> None:
        if what == "inactivity" and not self.busy() and now - self.quiet_since >= self.inactivity:
            raise SessionEnd(ApiError("input_timeout_exceeded", f"no text received for {self.inactivity:g} s"))

    async def on_text_timeout(self) -> None:
        # no error message: ElevenLabs' clients fail a context on any error; the turn ends as by a flush
        ctx = self.active
        if ctx is not None and not ctx.turn_ended:
            ctx.turn_ended = True
        await super().on_text_timeout()

    # ------------------------------------------------------------------ client messages
    async def on_data(self, data) -> None:
        context_id = data.get("context_id") if isinstance(data, dict) and isinstance(data.get("context_id"), str) \
            else None
        if not isinstance(data, dict):
            await self.refuse(ApiError("invalid_message", "every message is a JSON object"))
            return
        try:
            msg = ClientMessage.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            await self.refuse(ApiError("invalid_message", f"{'.'.join(map(str, err['loc']))}: {err['msg']}"),
                              context_id=context_id)
            return
        try:
            await self.handle_message(msg)
        except ApiError as e:
            if e.status >= 500 and e.status != 503:
                raise
            self.count_request(str(e.status))
            await self.refuse(e, context_id=msg.context_id)
        if self._closing and (self.multi or self.active is None):
            await self._close(1000)

    async def handle_message(self, msg: ClientMessage) -> None:
        if msg.close_socket:
            self._closing = True
            if self.active is not None:
                self.started_conversation.cancel()
            return
        cid = (msg.context_id or "default") if self.multi else SINGLE_CONTEXT
        ctx = self.contexts.get(cid)
        if msg.close_context:
            if ctx is not None:
                await self._close_context(ctx)
            return
        if msg.text is None and not msg.flush:
            self.keepalive()    # asks for nothing
            return
        text = msg.text or ""
        if text:
            Conversation.check_text(text)       # refused before it opens a context or reaches the alignment
        if ctx is None and cid in self.closed_ids:
            if not (msg.text or msg.flush):
                self.keepalive()    # a keep-alive naming a context that has ended
                return
            raise ApiError("context_closed", f"context {cid!r} was closed: open a new context_id for more text",
                           "context_id")
        if ctx is None:
            if self.multi and msg.text is not None and not msg.flush and (
                    msg.text == "" or (not speakable(msg.text) and msg.context_id is None)):
                self.keepalive()    # a keep-alive without a context, or naming one not opened: opens none
                return
            if len(self.contexts) >= self.policy.max_contexts:
                raise ApiError("too_many_contexts", f"at most {self.policy.max_contexts} contexts may be open on one "
                               "socket: close one first", "context_id")
            ctx = self.contexts[cid] = Context(cid, aligner=Aligner(self.alignment))
            if msg.text == " ":
                return          # the context-opening " " (it carries the ignored voice settings)
        if (ctx.close_requested or ctx.cancelled) and not (msg.text or msg.flush):
            self.keepalive()    # a keep-alive for a context that is finishing
            return
        if ctx.close_requested or ctx.cancelled:
            raise ApiError("context_closed", f"context {cid!r} was closed: open a new context_id for more text",
                           "context_id")
        if self._is_keepalive(ctx, msg):
            self.keepalive()    # "" (or text with nothing to speak): opens no turn, is not spoken
            return
        if text:
            self._check_room(ctx, len(text))
            speaking = self.active is ctx and not ctx.turn_ended
            ctx.aligner.add(text, current=speaking)
            if speaking:
                self.push_text(text)
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

    def _is_keepalive(self, ctx: Context, msg: ClientMessage) -> bool:
        """Text that asks for nothing: ``""``, or text with nothing to speak (whitespace, a zero-width space:
        :func:`~app.session.policy.speakable`) for a context with nothing to speak (no turn open, no text
        waiting), as ElevenLabs' clients send ``" "`` every few seconds to keep a socket. stream-input's
        ``{"text": ""}`` is its end of input, a flush a command: neither is a keep-alive."""
        if msg.flush or msg.text is None or speakable(msg.text) or (msg.text == "" and not self.multi):
            return False
        return msg.text == "" or not (self._unflushed(ctx) or ctx.pending)

    def _check_room(self, ctx: Context, incoming: int) -> None:
        """The socket's text buffer, in characters: every context's waiting text and what its stream has not
        read yet."""
        self.check_buffer(incoming, sum(c.pending_chars for c in self.contexts.values()))

    def _enqueue(self, ctx: Context) -> None:
        # a context whose turn is opening takes its text when it opens (queued again it would open an empty turn)
        if not ctx.queued and self.active is not ctx and self._starting is not ctx:
            ctx.queued = True
            self.queue.append(ctx)

    def _flush(self, ctx: Context) -> None:
        """Everything received for the context is spoken without waiting for more text."""
        if ctx.pending:
            ctx.flush_pending = True
        elif self.active is ctx and not ctx.turn_ended:
            ctx.turn_ended = True
            self.started_conversation.end_text()

    def _unflushed(self, ctx: Context) -> bool:
        return (self.active is ctx and not ctx.turn_ended) or (bool(ctx.pending) and not ctx.flush_pending)

    async def _close_context(self, ctx: Context) -> None:
        if ctx.cancelled:
            return
        if not ctx.close_requested and not self._unflushed(ctx):
            ctx.close_requested = True            # end of the utterance: finish, then isFinal
            if self.active is not ctx and not ctx.queued and self._starting is not ctx:
                await self._finish_context(ctx)
            return
        # barge-in: stop at the next step; the rest of this context is dropped
        ctx.cancelled = True
        ctx.close_requested = True
        ctx.pending.clear()
        if self.active is ctx:
            self.started_conversation.cancel()
        elif self._starting is ctx:
            # its turn waits for a slot: the wait is cancelled (it leaves the queue); _start_next sends its isFinal
            if self._start_wait is not None:
                self._start_wait.cancel()
        else:
            if ctx.queued:
                self.queue.remove(ctx)
                ctx.queued = False
            await self._finish_context(ctx)

    async def _finish_context(self, ctx: Context) -> None:
        self.contexts.pop(ctx.id, None)
        self.closed_ids[ctx.id] = None
        while len(self.closed_ids) > CLOSED_IDS_KEPT:
            self.closed_ids.popitem(last=False)
        await self.send_json(self._tag({"isFinal": True}, ctx))
        if not self.multi:
            self._closing = True

    def _tag(self, payload: dict, ctx: Context) -> dict:
        if self.multi:
            payload["contextId"] = ctx.id
        return payload

    # ------------------------------------------------------------------ turns
    async def _start_next(self) -> None:
        """Open the next queued context's turn once the stream is free. A turn that cannot open (no
        capacity) fails its context only: an error naming it, then its isFinal. A context closed by a
        barge-in while its turn waits for a slot (this may run from the sender, while the receive loop goes
        on) never becomes active: its wait is cancelled, its one isFinal sent here; had the slot come at the
        same moment, the opened turn is cancelled at once and ends as any cancelled turn (one isFinal)."""
        while self.active is None and self._starting is None and self.queue:
            ctx = self.queue.popleft()
            ctx.queued = False
            self._starting = ctx
            try:
                opened = await self._begin_turn(ctx)
            except ApiError as e:
                if e.code == "max_turns":
                    raise SessionEnd(e) from None
                self.count_request(str(e.status))
                if not ctx.cancelled:
                    await self.error(e, context_id=ctx.id)
                ctx.pending.clear()
                await self._finish_context(ctx)
                continue
            finally:
                self._starting = None
            if not opened:
                await self._finish_context(ctx)          # closed while it waited: no turn was opened
                continue
            if ctx.cancelled:
                self.started_conversation.cancel()        # closed as its slot came: on_ended sends its isFinal
                return
            text, ctx.pending = "".join(ctx.pending), []
            self.push_text(text)
            if ctx.flush_pending:
                ctx.flush_pending, ctx.turn_ended = False, True
                self.started_conversation.end_text()

    async def _begin_turn(self, ctx: Context) -> bool:
        """Open the context's turn on the conversation's stream (False: its wait for a slot was cancelled)."""
        conv = self.started_conversation
        params = self.service.sampling(SamplingFields(greedy=self.service.settings.elevenlabs_greedy or None))
        if conv.context_rows > (1 - FRESH_CONTEXT_BELOW) * self.service.limits.max_context_rows:
            log.info("conversation context full (%d rows): the next turn starts a fresh one", conv.context_rows)
            conv.close_stream_for_fresh_context()
        meter = StreamMeter(self.metrics, self.protocol)
        if not await self._await_turn(params):
            return False
        if not self.sender_follows_stream():
            self.start_sender()                          # a fresh stream (first turn, full context) gets its sender
        self.active = ctx
        ctx.turn_ended = False
        ctx.aligner.new_turn()
        ctx.frames_sent = 0
        rate, fmt = self.service.model.codec.sample_rate, self.format
        assert fmt is not None, "open() parsed the output format"
        self.turn = TurnAudio(meter, make_encoder=lambda: fmt.encoder(rate))
        return True

    async def _await_turn(self, params) -> bool:
        """The conversation's turn begun, its wait for a slot in a task of its own that a barge-in on the
        starting context cancels (:meth:`_close_context`): the wait leaves the admission queue, no slot is
        taken. False when it was cancelled so; the catalogue's error when the turn cannot open."""
        task = asyncio.ensure_future(self._admit(params))
        self._start_wait = task
        try:
            await asyncio.wait({task})
        finally:
            self._start_wait = None
            if not task.done():
                task.cancel()                            # the session ends meanwhile (its sender is cancelled)
        if task.cancelled():
            return False
        task.result()
        return True

    async def _admit(self, params) -> None:
        conv = self.started_conversation
        try:
            await conv.begin_turn(params)                # awaits a slot, holds no thread
        except ApiError as e:
            if e.code != "input_too_long" or conv.handle is None:
                raise
            conv.close_stream_for_fresh_context()        # the conversation is full: continue on a fresh context
            await conv.begin_turn(params)

    # ------------------------------------------------------------------ the turn's events
    async def on_audio(self, out: Audio) -> None:
        ctx = self.active
        assert ctx is not None, "audio comes for the active context's turn"
        ctx.frames_sent += 1
        span = ctx.aligner.frame(out.frame.text_chars, out.frame.audio, FRAME_MS)
        alignment = span.message() if span is not None else None
        await self.send_json(self._tag({"audio": base64.b64encode(out.data).decode(), "isFinal": None,
                                        "alignment": alignment, "normalizedAlignment": alignment}, ctx))

    async def on_failed(self, err: ApiError) -> None:
        await self.error(err, context_id=self.active.id if self.active is not None else None)

    async def on_ended(self, out: Ended, turn: TurnAudio) -> None:
        ctx = self.active
        reason = out.stats.finish_reason
        self.count_request("200" if reason is not FinishReason.ERROR else "500")
        assert ctx is not None, "a turn's end comes for the active context"
        span = None if ctx.cancelled or reason is FinishReason.CANCELLED else ctx.aligner.rest()
        alignment = span.message() if span is not None else None
        if out.tail or alignment:
            await self.send_json(self._tag({"audio": base64.b64encode(out.tail).decode(), "isFinal": None,
                                            "alignment": alignment, "normalizedAlignment": alignment}, ctx))
        if reason is FinishReason.CANCELLED:
            try:   # keep in the conversation only what was sent
                self.started_conversation.truncate_turn(ctx.frames_sent)
            except InputError as e:
                log.warning("could not truncate the cancelled turn: %s", e)
        self.active = None
        if ctx.pending and not ctx.cancelled:
            self._enqueue(ctx)                   # text that came after its flush: the context's next turn
        elif ctx.close_requested:
            await self._finish_context(ctx)
        await self._start_next()
        if self._closing and not self.multi:
            await self._close(1000)

