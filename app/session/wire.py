"""A client session's life over any socket transport (:class:`~app.session.channel.Channel`): the WebSocket
protocols (ours, ElevenLabs' two: :mod:`app.session.websocket`) and Wyoming (:mod:`app.wyoming.session`) run
the same deadline loop, bounded sends, clocks, stall handling, request counting and teardown; a protocol
only passes its gate, parses its messages and renders its events (:class:`WireSession`'s hooks).

- **Gate**, before any other work (:meth:`WireSession.enter`, :meth:`WireSession.gate`): on a WebSocket an
  ``Origin`` the policy refuses gets HTTP 403 at the upgrade, then the key (the handshake's, or, where the
  protocol allows it, the first message's within ``auth_timeout``); then the session bound of the transport.
- **Deadlines**, in one loop: every timer of the session — idle, the open turn's text clock, the
  protocol's own (ElevenLabs' inactivity) — is a deadline of the receive wait; the nearest one fires.
- **Clocks**, one rule for every transport: a message the session takes moves the idle clock
  (:attr:`WireSession.active_since`) and the keep-alive clock (:attr:`WireSession.quiet_since`, ElevenLabs'
  inactivity); a keep-alive (a message that asks for nothing, :meth:`WireSession.keepalive`) opens no turn
  and moves those two, never a turn's text clock; a refused message (:meth:`WireSession.refuse`) and one the
  session does not take (a protocol's ping, an event type it ignores: :meth:`WireSession.ignore`) move no
  clock; the end of a turn moves both. So a keep-alive keeps a socket (which costs no slot: an idle
  conversation's slot can be parked), never a turn or a slot; refused messages and pings keep nothing.
- **Sends** are bounded by ``stall_timeout``: a client that does not take a message in time loses its
  stream (slot freed, ``mossrt_stalled_streams_total`` counted) and its connection.
- **Teardown**, however the session ends: the sender stops, the stream's slot is freed, the session count
  drops (:meth:`WireSession.leave`).
- **Shutdown**: once the drain is over (turns finished, or the drain timeout stopped them), every WebSocket
  still open is ended by :func:`close_sessions` with the catalogue's ``draining`` error in its protocol's
  shape and its close code (ours 4503, ElevenLabs' 1008), before uvicorn's own shutdown would close it
  with 1012 and no reason.
- **The text buffer** counts characters (:class:`~app.session.policy.TextLedger`): what the open turn
  received and its model has not read yet, plus what the protocol holds outside the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Generic, TypeVar

from engine.serving.handles import StreamError, StreamHandle

from ..errors import ApiError, close_code, from_engine
from .channel import Channel, FrameRefused
from .conversation import Conversation
from .policy import SessionPolicy
from .pump import Audio, Ended, Failed, Out, TurnAudio

log = logging.getLogger("mossrt.ws")
TEXT_POLL_S = 0.5          # how often an open turn's wait for text is looked at (the text clock's resolution)
CLOSE_BOUND_S = 5.0        # a client that reads nothing cannot take the close frame either

In = TypeVar("In")         # what the channel receives (a parsed message)
Msg = TypeVar("Msg")       # what it sends


def open_sessions(app: Any) -> set[WireSession[Any, Any]]:
    """The app's WebSocket sessions still open (every protocol's)."""
    sessions: set[WireSession[Any, Any]] | None = getattr(app.state, "wire_sessions", None)
    if sessions is None:
        sessions = app.state.wire_sessions = set()
    return sessions


async def close_sessions(app: Any, err: ApiError | None = None) -> int:
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


class WireSession(Generic[In, Msg]):
    """One client session over ``channel``. Subclasses set :attr:`protocol` and :attr:`path` and implement
    :meth:`error_message` (an error in the protocol's shape), :meth:`on_data` (one received message) and, as
    they need them, the gate (:meth:`enter`, :meth:`gate`, :meth:`leave`), :meth:`open`, the sender's items
    (:meth:`on_audio`/:meth:`on_failed`/:meth:`on_ended`) and :meth:`protocol_deadline`."""

    protocol = "ws"                       # metrics' transport label and close codes
    path = ""                             # mossrt_requests_total's endpoint

    def __init__(self, channel: Channel[In, Msg], service: Any, metrics: Any):
        self.channel, self.service, self.metrics = channel, service, metrics
        self.policy: SessionPolicy = service.policy
        self.conversation: Conversation | None = None
        self.turn: TurnAudio | None = None    # the open turn's audio (its encoder and meter)
        self._send_lock = asyncio.Lock()
        self._sender: asyncio.Task[None] | None = None
        self._sender_handle: StreamHandle | None = None   # the stream whose events the sender sends
        now = time.monotonic()
        self.active_since = now   # the idle clock: the last message that did something, or the last turn's end
        self.quiet_since = now    # the keep-alive clock: the same, keep-alives too
        self._verdict = "took"    # what the message being handled was: took | keepalive | refused | ignored
        self.closed = False

    # ------------------------------------------------------------------ the whole life
    async def serve(self) -> None:
        """The session from its gate to its teardown."""
        if not await self.enter():
            return
        try:
            await self.gate()
            await self.open()
            await self._loop()
        except SessionEnd as e:
            await self.end(e.error)
        except self.channel.disconnected:
            pass
        except ClientStalled:
            await self._stalled()
        except Exception as e:  # noqa: BLE001 - one session's bug never takes the server down
            log.exception("%s session failed", self.protocol)
            await self.end(ApiError("internal_error", f"internal error: {type(e).__name__}"))
        finally:
            await self.leave()
            if self._sender is not None:
                self._sender.cancel()
            if self.conversation is not None:
                self.conversation.close()

    async def enter(self) -> bool:
        """The transport's door, before the session counts (False: refused there, nothing to tear down)."""
        return True

    async def gate(self) -> None:
        """The key and the session bound (:class:`SessionEnd` refuses)."""

    async def leave(self) -> None:
        """The transport's part of the teardown (what :meth:`enter` and :meth:`gate` took)."""

    async def open(self) -> None:
        """After the gate, before the first message is read (readiness, configuration, a greeting)."""

    # ------------------------------------------------------------------ the deadline loop
    async def _loop(self) -> None:
        while not self.closed:
            now = time.monotonic()
            deadline, what = self._next_deadline(now)
            try:
                message = await asyncio.wait_for(self.channel.receive(), None if deadline is None else
                                                 max(0.0, deadline - now))
            except asyncio.TimeoutError:
                await self._on_deadline(what, time.monotonic())
                continue
            except FrameRefused as e:
                await self.refuse(e.error)
                continue
            if message is None or self.closed:
                return
            received = time.monotonic()
            self._verdict = "took"
            await self.on_data(message)
            self.clocks_after(self._verdict, received)

    def clocks_after(self, verdict: str, received: float) -> None:
        """Move the session's clocks for a message received at ``received``: a refused or ignored one moves
        none; a keep-alive and any other message move both (a keep-alive opened no turn, so no text clock
        moved)."""
        if verdict in ("refused", "ignored"):
            return
        self.quiet_since = max(self.quiet_since, received)
        self.active_since = max(self.active_since, received)

    def turn_over(self) -> None:
        """A turn ended (its last audio went out): the idle and keep-alive clocks count from now."""
        ended = time.monotonic()
        self.active_since, self.quiet_since = max(self.active_since, ended), max(self.quiet_since, ended)

    def keepalive(self) -> None:
        """The message being handled asks for nothing (an empty text delta): it opens no turn and moves only
        the session's clocks."""
        if self._verdict == "took":
            self._verdict = "keepalive"

    def ignore(self) -> None:
        """The message being handled is not the session's to count (a protocol's ping, an event type it does
        not know): answered or not, it moves no clock."""
        if self._verdict in ("took", "keepalive"):
            self._verdict = "ignored"

    async def refuse(self, err: ApiError, **context: str | None) -> None:
        """Answer the message being handled with a recoverable error: it moves no clock."""
        self._verdict = "refused"
        await self.error(err, False, **context)

    def _next_deadline(self, now: float) -> tuple[float | None, str]:
        candidates: list[tuple[float, str]] = []
        turn_open = self.conversation is not None and self.conversation.turn_open
        if turn_open or self.busy():
            # the turn may start waiting for text, or end (then the idle clock runs): looked at while it runs
            candidates.append((now + TEXT_POLL_S, "poll"))
        if self.conversation is not None and turn_open:
            due = self.conversation.text_deadline(now)
            if due is not None:
                candidates.append((due, "text"))
        if not self.busy():
            candidates.append((self.active_since + self.policy.idle_timeout, "idle"))
        own = self.protocol_deadline(now)
        if own is not None:
            candidates.append(own)
        if not candidates:
            return None, ""
        return min(candidates)

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
        if self.conversation is not None:
            self.conversation.end_text()

    @property
    def started_conversation(self) -> Conversation:
        """The session's conversation, where the protocol's state says it has begun (a bug otherwise)."""
        assert self.conversation is not None, "the session's conversation has begun"
        return self.conversation

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
        return self.started_conversation.push_text(text)

    # ------------------------------------------------------------------ sending
    async def send(self, message: Msg) -> None:
        """One message to the client; one it does not take within the stall timeout ends the session."""
        async with self._send_lock:
            try:
                await asyncio.wait_for(self.channel.send(message), self.policy.stall_timeout)
            except asyncio.TimeoutError:
                raise ClientStalled from None

    async def error(self, err: ApiError, fatal: bool = False, **context: str | None) -> None:
        """The error in the protocol's shape; a fatal one closes the connection."""
        await self.send(self.error_message(err, fatal, **context))
        if fatal:
            await self._close(close_code(err, self.protocol), err.message[:120])

    async def end(self, err: ApiError) -> None:
        """End the session with a fatal error, quietly if the client is already gone."""
        gone: tuple[type[Exception], ...] = (*self.channel.disconnected, RuntimeError, ClientStalled)
        try:
            await self.error(err, fatal=True)
        except gone:
            pass

    async def _close(self, code: int, reason: str = "") -> None:
        self.closed = True
        gone: tuple[type[Exception], ...] = (asyncio.TimeoutError, *self.channel.disconnected, RuntimeError)
        try:
            await asyncio.wait_for(self.channel.close(code, reason), CLOSE_BOUND_S)
        except gone:
            pass

    def count_request(self, status: str) -> None:
        """One request of this session's endpoint (:attr:`path`) ended with ``status``."""
        self.metrics.requests.labels(self.path, status).inc()

    def free_streams(self) -> None:
        """Free the session's stream slots now (the client stopped taking what they produce)."""
        if self.conversation is not None:
            self.conversation.close()

    async def _stalled(self) -> None:
        """The client stopped taking messages: its slot is freed now, then the connection is closed."""
        if self.closed:
            return
        self.metrics.stalled.labels(self.protocol).inc()
        log.warning("%s session ended: the client took no message for %g s", self.protocol, self.policy.stall_timeout)
        self.free_streams()
        await self._close(close_code(ApiError("client_stalled", "client stalled"), self.protocol), "client stalled")

    # ------------------------------------------------------------------ the sender
    def start_sender(self) -> None:
        """Send the conversation's stream's events from now on (a fresh stream gets a sender of its own)."""
        if self._sender is not None and self._sender is not asyncio.current_task():
            self._sender.cancel()
        assert self.conversation is not None and self.conversation.handle is not None, "a turn began"
        self._sender_handle = self.conversation.handle
        self._sender = asyncio.create_task(self._send_events(self.conversation.handle))

    def sender_follows_stream(self) -> bool:
        """Whether a sender sends the conversation's current stream's events (a fresh stream needs its own)."""
        return (self._sender is not None and self.conversation is not None
                and self._sender_handle is self.conversation.handle)

    async def _send_events(self, handle: StreamHandle) -> None:
        gone: tuple[type[BaseException], ...] = (*self.channel.disconnected, RuntimeError, asyncio.CancelledError)
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
        except gone:
            pass

    async def on_out(self, out: Out) -> None:
        turn = self.turn
        assert turn is not None, "the sender sends a turn's items"
        if isinstance(out, Audio):
            await self.on_audio(out)
            turn.sent()
        elif isinstance(out, Failed):
            await self.on_failed(out.error)
        elif isinstance(out, Ended):
            self.started_conversation.turn_ended()
            self.turn_over()                         # idle counts from the turn's end
            self.turn = None
            await self.on_ended(out, turn)

    # ------------------------------------------------------------------ protocol hooks
    def error_message(self, err: ApiError, fatal: bool, **context: str | None) -> Msg:
        raise NotImplementedError

    async def on_data(self, data: In) -> None:
        raise NotImplementedError

    async def on_audio(self, out: Audio) -> None:
        raise NotImplementedError

    async def on_failed(self, err: ApiError) -> None:
        await self.error(err, fatal=False)

    async def on_ended(self, out: Ended, turn: TurnAudio) -> None:
        raise NotImplementedError
