"""A WebSocket session's life, the same for every WebSocket protocol (ours, ElevenLabs' two): the gate, the
deadline loop, bounded sends, the audio sender and the teardown. A protocol only parses its messages and
renders its events (:class:`WireSession`'s hooks).

- **Gate**, before any other work: an ``Origin`` the policy refuses gets HTTP 403 at the upgrade; then the
  key (the handshake's, or, where the protocol allows it, the first message's within ``auth_timeout``).
- **Deadlines**, in one loop: every timer of the session — idle, the open turn's text clock, the
  protocol's own (ElevenLabs' inactivity) — is a deadline of the receive wait; the nearest one fires.
- **Clocks**: a message the session refuses (an error answers it) moves no clock; a keep-alive (a message
  that asks for nothing, :meth:`WireSession.keepalive`) opens no turn and moves only the socket's clocks
  (the idle clock :attr:`WireSession.active_since` and the protocol's keep-alive clock
  :attr:`WireSession.quiet_since`, ElevenLabs' inactivity), never a turn's text clock; any other message,
  and the end of a turn, moves both too. So a keep-alive keeps a socket (which costs no slot: an idle
  conversation's slot can be parked), never a turn or a slot; refused messages alone keep nothing.
- **Sends** are bounded by ``stall_timeout``: a client that does not take a message in time loses its
  stream (slot freed, ``mossrt_stalled_streams_total`` counted) and its socket.
- **Teardown**, however the session ends: the sender stops, the stream's slot is freed, the socket count
  drops.
- **Shutdown**: once the drain is over (turns finished, or the drain timeout stopped them), every socket
  still open is ended by :func:`close_sessions` with the catalogue's ``draining`` error in its protocol's
  shape and its close code (ours 4503, ElevenLabs' 1008), before uvicorn's own shutdown would close it
  with 1012 and no reason.
- **The text buffer** counts characters (:class:`~app.session.policy.TextLedger`): what the open turn
  received and its model has not read yet, plus what the protocol holds outside the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import WebSocket, WebSocketDisconnect

from engine.serving.handles import StreamError

from ..errors import CLOSE_FORBIDDEN, ApiError, close_code, from_engine, json_error
from .conversation import Conversation
from .pump import Audio, Ended, Failed, Out, TurnAudio

log = logging.getLogger("mossrt.ws")
TEXT_POLL_S = 0.5          # how often an open turn's wait for text is looked at (the text clock's resolution)
CLOSE_BOUND_S = 5.0        # a client that reads nothing cannot take the close frame either


def open_sessions(app) -> set["WireSession"]:
    """The app's WebSocket sessions still open (every protocol's)."""
    sessions = getattr(app.state, "wire_sessions", None)
    if sessions is None:
        sessions = app.state.wire_sessions = set()
    return sessions


async def close_sessions(app, err: ApiError | None = None) -> int:
    """End every open session with ``err`` (default: ``draining``) in its protocol's shape and close code, each
    within :data:`CLOSE_BOUND_S`; returns how many were open. The shutdown calls it after the drain."""
    err = err or ApiError("draining", "the server is shutting down: reconnect to another instance")
    sessions = [s for s in open_sessions(app) if not s.closed]
    await asyncio.gather(*(asyncio.wait_for(s.end(err), CLOSE_BOUND_S) for s in sessions), return_exceptions=True)
    return len(sessions)


class ClientStalled(Exception):
    """The client did not take a message within the stall timeout."""


class SessionEnd(Exception):
    """End the session with this (fatal) error."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class FrameRefused(Exception):
    """A message that is not one JSON text message within the size limit (``code``: ``binary_not_expected``,
    ``message_too_large``, ``invalid_json``)."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


def json_frame(message: dict, max_bytes: int):
    """The JSON value of a received WebSocket message; FrameRefused otherwise."""
    if message.get("bytes") is not None:
        raise FrameRefused(ApiError("binary_not_expected", "send JSON text frames; binary frames are for the audio "
                                                           "the server sends"))
    text = message.get("text") or ""
    if len(text.encode()) > max_bytes:
        raise FrameRefused(ApiError("message_too_large", f"messages are limited to {max_bytes} bytes"))
    try:
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - json_error says which failures are bad JSON
        err = json_error(e)
        if err is None:
            raise
        raise FrameRefused(err) from None


class WireSession:
    """One WebSocket session. Subclasses set :attr:`protocol` and :attr:`path` and implement
    :meth:`open` (after the gate: readiness, configuration), :meth:`on_data` (one parsed message),
    :meth:`render_error`, :meth:`on_audio`/:meth:`on_failed`/:meth:`on_ended` (the sender's items) and, when
    they have one, :meth:`authenticate` (a key in the first message) and :meth:`protocol_deadline`."""

    protocol = "ws"                       # metrics' transport label and close codes
    path = ""

    def __init__(self, ws: WebSocket, service):
        self.ws, self.service = ws, service
        self.policy = service.policy
        self.metrics = ws.app.state.metrics
        self.conversation: Conversation | None = None
        self.turn: TurnAudio | None = None    # the open turn's audio (its encoder and meter)
        self._send_lock = asyncio.Lock()
        self._sender: asyncio.Task | None = None
        self._sender_handle = None            # the stream whose events the sender sends
        now = time.monotonic()
        self.active_since = now   # the idle clock: the last message that did something, or the last turn's end
        self.quiet_since = now    # the keep-alive clock: the same, keep-alives too
        self._verdict = "took"    # what the message being handled was: took | keepalive | refused
        self.closed = False

    # ------------------------------------------------------------------ the whole life
    async def serve(self) -> None:
        if not self.policy.origin_allowed(self.ws.headers):
            await self.ws.close(code=CLOSE_FORBIDDEN)       # before accept: the upgrade is refused with HTTP 403
            return
        authorized, subprotocol = self.policy.websocket_credentials(self.ws.headers, self.ws.query_params)
        await self.ws.accept(subprotocol=subprotocol)
        self.metrics.sessions.inc()
        sessions = open_sessions(self.ws.app)
        sessions.add(self)
        claimed = False
        try:
            if not authorized:
                await self.authenticate()
            claimed = self.service.claim_session()      # idle sessions hold no slot: their number is bounded
            if not claimed:
                raise SessionEnd(ApiError("too_many_sessions", f"{self.service.settings.ws_max_sessions} WebSocket "
                                                               "sessions are open on this server; retry later"))
            await self.open()
            await self._loop()
        except SessionEnd as e:
            await self.end(e.error)
        except WebSocketDisconnect:
            pass
        except ClientStalled:
            await self._stalled()
        except Exception as e:  # noqa: BLE001 - one session's bug never takes the server down
            log.exception("%s session failed", self.protocol)
            await self.end(ApiError("internal_error", f"internal error: {type(e).__name__}"))
        finally:
            sessions.discard(self)
            self.metrics.sessions.dec()
            if claimed:
                self.service.release_session()
            if self._sender is not None:
                self._sender.cancel()
            if self.conversation is not None:
                self.conversation.close()

    async def authenticate(self) -> None:
        """No key came with the handshake: the protocol's default refuses at once."""
        raise SessionEnd(ApiError("invalid_api_key", "missing or invalid API key"))

    async def open(self) -> None:
        """After the gate, before the first message is read (readiness, configuration, a greeting)."""

    # ------------------------------------------------------------------ the deadline loop
    async def _loop(self) -> None:
        while not self.closed:
            now = time.monotonic()
            deadline, what = self._next_deadline(now)
            try:
                message = await asyncio.wait_for(self.ws.receive(), None if deadline is None else
                                                 max(0.0, deadline - now))
            except asyncio.TimeoutError:
                await self._on_deadline(what, time.monotonic())
                continue
            if message["type"] == "websocket.disconnect":
                return
            received = time.monotonic()
            self._verdict = "took"
            await self.on_message(message)
            self.clocks_after(self._verdict, received)

    def clocks_after(self, verdict: str, received: float) -> None:
        """Move the socket's clocks for a message received at ``received``: a refused one moves none; a
        keep-alive and any other message move both (a keep-alive opened no turn, so no text clock moved)."""
        if verdict == "refused":
            return
        self.quiet_since = max(self.quiet_since, received)
        self.active_since = max(self.active_since, received)

    def keepalive(self) -> None:
        """The message being handled asks for nothing (an empty text delta): it opens no turn and moves only
        the socket's clocks."""
        if self._verdict == "took":
            self._verdict = "keepalive"

    async def refuse(self, err: ApiError, **context) -> None:
        """Answer the message being handled with a recoverable error: it moves no clock."""
        self._verdict = "refused"
        await self.error(err, **context)

    async def on_message(self, message: dict) -> None:
        try:
            data = json_frame(message, self.policy.max_message_bytes)
        except FrameRefused as e:
            await self.refuse(e.error)
            return
        await self.on_data(data)

    def _next_deadline(self, now: float) -> tuple[float | None, str]:
        candidates = []
        if self.conversation is not None and self.conversation.turn_open:
            candidates.append((now + TEXT_POLL_S, "poll"))           # the turn may start waiting for text
            due = self.conversation.text_deadline(now)
            if due is not None:
                candidates.append((due, "text"))
        if not self.busy():
            candidates.append((self.active_since + self.policy.idle_timeout, "idle"))
        own = self.protocol_deadline(now)
        if own is not None:
            candidates.append(own)
        return min(candidates) if candidates else (None, "")

    async def _on_deadline(self, what: str, now: float) -> None:
        if what == "text" and self.conversation is not None:
            due = self.conversation.text_deadline(now)
            if due is not None and due <= now:
                await self.on_text_timeout()
        elif what == "idle" and not self.busy() and now - self.active_since >= self.policy.idle_timeout:
            raise SessionEnd(ApiError("idle_timeout", f"no turn and no message that did something for "
                                      f"{self.policy.idle_timeout:g} s (refused messages do not count)"))
        elif what not in ("poll", "text", "idle"):
            await self.on_protocol_deadline(what, now)

    def busy(self) -> bool:
        """A turn is running: the session is not idle (its client listens)."""
        return self.conversation is not None and self.conversation.turn_open

    def protocol_deadline(self, now: float) -> tuple[float, str] | None:
        return None

    async def on_protocol_deadline(self, what: str, now: float) -> None:
        pass

    async def on_text_timeout(self) -> None:
        """The open turn waited ``text_timeout`` s for text with nothing to speak: its text is ended for it
        (it finishes what it has), so a client that never ends a turn cannot hold its turn, or its slot."""
        log.info("%s session: no text for %g s while the turn waited for it; its text was ended", self.protocol,
                 self.policy.text_timeout)
        self.conversation.end_text()

    # ------------------------------------------------------------------ text into the turn
    def unspoken_chars(self) -> int:
        """Characters of the open turn received and not yet read by its model (0 between turns)."""
        if self.turn is None or self.conversation is None or self.conversation.handle is None:
            return 0
        return self.turn.text.unspoken(self.conversation.handle.stream)

    def check_buffer(self, incoming: int, elsewhere: int = 0) -> None:
        """The socket's text buffer (``--ws-max-buffered-chars``, in characters): the open turn's unspoken
        text, ``elsewhere`` (the protocol's text waiting outside the stream) and ``incoming`` together."""
        self.policy.check_buffer(self.unspoken_chars() + elsewhere, incoming)

    def push_text(self, text: str) -> int:
        """Text into the open turn, counted toward the text buffer (checked with :meth:`check_buffer` first)."""
        if self.turn is not None:
            self.turn.text.took(len(text))
        return self.conversation.push_text(text)

    # ------------------------------------------------------------------ sending
    async def send_json(self, payload: dict) -> None:
        await self._send(self.ws.send_text(json.dumps(payload, separators=(",", ":"))))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.ws.send_bytes(data))

    async def _send(self, sending) -> None:
        """One message to the client; one it does not take within the stall timeout ends the session."""
        async with self._send_lock:
            try:
                await asyncio.wait_for(sending, self.policy.stall_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled from None

    async def error(self, err: ApiError, fatal: bool = False, **context) -> None:
        """The error in the protocol's shape; a fatal one closes the socket."""
        await self.send_json(self.render_error(err, fatal, **context))
        if fatal:
            await self._close(close_code(err, self.protocol), err.message[:120])

    async def end(self, err: ApiError) -> None:
        """End the session with a fatal error, quietly if the client is already gone."""
        try:
            await self.error(err, fatal=True)
        except (WebSocketDisconnect, RuntimeError, ClientStalled):
            pass

    async def _close(self, code: int, reason: str = "") -> None:
        self.closed = True
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), CLOSE_BOUND_S)
        except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
            pass

    async def _stalled(self) -> None:
        """The client stopped taking messages: its slot is freed now, then the socket is closed."""
        if self.closed:
            return
        self.metrics.stalled.labels(self.protocol).inc()
        log.warning("%s session ended: the client took no message for %g s", self.protocol, self.policy.stall_timeout)
        if self.conversation is not None:
            self.conversation.close()
        await self._close(close_code(ApiError("client_stalled", "client stalled"), self.protocol), "client stalled")

    # ------------------------------------------------------------------ the sender
    def start_sender(self) -> None:
        """Send the conversation's stream's events from now on (a fresh stream gets a sender of its own)."""
        if self._sender is not None and self._sender is not asyncio.current_task():
            self._sender.cancel()
        self._sender_handle = self.conversation.handle
        self._sender = asyncio.create_task(self._send_events(self.conversation.handle))

    def sender_follows_stream(self) -> bool:
        """Whether a sender sends the conversation's current stream's events (a fresh stream needs its own)."""
        return self._sender is not None and self._sender_handle is self.conversation.handle

    async def _send_events(self, handle) -> None:
        try:
            while self.conversation is not None and handle is self.conversation.handle:
                event = await handle.aget()
                if handle is not self.conversation.handle:
                    continue
                if self.turn is None:                # between turns: only an error can come (the engine stopped)
                    if isinstance(event, StreamError):
                        await self.on_failed(from_engine(event.error))
                    continue
                out = self.turn.on_event(event)
                if out is not None:
                    await self.on_out(out)
        except ClientStalled:
            await self._stalled()
        except SessionEnd as e:
            await self.end(e.error)
        except (WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
            pass

    async def on_out(self, out: Out) -> None:
        if isinstance(out, Audio):
            await self.on_audio(out)
            self.turn.sent()
        elif isinstance(out, Failed):
            await self.on_failed(out.error)
        elif isinstance(out, Ended):
            self.conversation.turn_ended()
            ended = time.monotonic()                 # idle counts from the turn's end
            self.active_since, self.quiet_since = max(self.active_since, ended), max(self.quiet_since, ended)
            turn, self.turn = self.turn, None
            await self.on_ended(out, turn)

    # ------------------------------------------------------------------ protocol hooks
    def render_error(self, err: ApiError, fatal: bool, **context) -> dict:
        raise NotImplementedError

    async def on_data(self, data) -> None:
        raise NotImplementedError

    async def on_audio(self, out: Audio) -> None:
        raise NotImplementedError

    async def on_failed(self, err: ApiError) -> None:
        await self.error(err, fatal=False)

    async def on_ended(self, out: Ended, turn: TurnAudio) -> None:
        raise NotImplementedError
