"""One Wyoming connection, held to every bound of a client session (:class:`~app.session.policy.SessionPolicy`).

- ``describe`` → ``info``; ``ping`` → ``pong``.
- ``synthesize`` (one text) is one utterance, checked once like an HTTP request (``aprepare_utterance``: the
  text limit, the stream's context and frame limit), then ``audio-start``, ``audio-chunk``s (s16le, 24 kHz,
  mono) as frames are generated, ``audio-stop``.
- ``synthesize-start`` opens a :class:`~app.session.conversation.Conversation`'s turn (the queue timeout),
  each ``synthesize-chunk`` is pushed into it as it arrives (the text buffer bound, in characters: a
  :class:`~app.session.policy.TextLedger`, as on the WebSocket), ``synthesize-stop`` ends its text; the audio
  goes out meanwhile, then ``audio-stop`` and ``synthesize-stopped``. The ``synthesize`` a streaming client
  sends for backward compatibility (the whole text again) is not spoken twice; it is the text when no chunk
  brought any to speak (a client may stream nothing but it).
- The session core (:class:`~app.session.wire.WireSession`, over :class:`~app.wyoming.channel.EventChannel`)
  runs the connection as it runs a WebSocket: the deadlines of the receive wait (the open turn's text clock:
  no text it can speak for ``text_timeout``, and its text is ended and it speaks what it has; the idle
  timeout), the clocks' one rule (an event the session takes and a synthesis's end move the idle clock; a
  ``ping``, an event type it ignores and a refused event move none), the bounded writes and the teardown.
- A connection is a session of ``--wyoming-max-sessions``, counted apart from the WebSocket ones.
- Trust (docs/wyoming.md): the protocol has no keys. With keys set, a peer here is held to what a keyless
  client may have: the built-in voices only (unless ``--wyoming-voices all``), and its syntheses take free
  slots only, never parking (so never evicting) another stream's context — a share of 0 of the parked
  contexts keyed conversations hold.
- Every write is bounded by ``stall_timeout`` (the core's): a client that does not read loses its stream
  (counted) and its connection.
- A refusal or failure is an ``error`` event (``text``, ``code`` of the catalogue), then the connection closes,
  as Wyoming's own servers do (Home Assistant reports the synthesis failed). The protocol has no
  authentication: the listener is opt-in (``--wyoming-uri``).

One synthesis runs at a time; each has its own stream, whose slot is freed when its audio ended.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
from starlette.concurrency import run_in_threadpool
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from engine.errors import EngineError
from engine.serving.handles import AsyncSink, StreamHandle
from engine.serving.stream import FinishReason

from ..audio_formats import StreamEncoder
from ..errors import ApiError, from_engine
from ..metrics import StreamMeter
from ..service import DEFAULT_VOICE, OPENAI_VOICES
from ..session.conversation import Conversation
from ..session.policy import speakable
from ..session.pump import Audio, Ended, Failed, TurnAudio, pump
from ..session.sampling import SamplingFields
from ..session.utterance import aprepare_utterance
from ..session.wire import ClientStalled, SessionEnd, WireSession
from .channel import EventChannel
from .info import describe

log = logging.getLogger("mossrt.wyoming")
PROTOCOL = "wyoming"          # the transport label of the meter and of mossrt_stalled_streams_total
ENDPOINT = "wyoming"          # mossrt_requests_total's endpoint: one per synthesis


class SessionCount:
    """The open connections of one listener, bounded by ``--wyoming-max-sessions`` apart from the WebSocket
    sessions: keyless peers cannot take the sessions keyed clients need. Used on the event loop only."""

    def __init__(self, bound: int):
        self.bound, self.open = bound, 0

    def claim(self) -> bool:
        """One more open connection, unless ``bound`` are open (then False)."""
        if self.open >= self.bound:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class Synthesis:
    """The running synthesis: its stream, its audio, and (streaming) its conversation."""

    def __init__(self, handle: StreamHandle, turn: TurnAudio, conversation: Conversation | None = None):
        self.handle, self.turn, self.conversation = handle, turn, conversation
        self.spoke_chunks = False            # streaming: a chunk brought text to speak
        self.took_whole_text = False         # streaming: no chunk did, and the synthesize copy was taken instead
        self.stop_received = False           # streaming: synthesize-stop arrived
        self.audio_ended = False             # audio-stop was sent
        self.task: asyncio.Task[None] | None = None

    @property
    def streaming(self) -> bool:
        return self.conversation is not None

    def close(self) -> None:
        if self.conversation is not None:
            self.conversation.close()
        self.handle.close()
        self.turn.close()


def _parsed(kind, event: Event):
    """The package's parse of ``event`` (``Synthesize``, ...); ``invalid_message`` when its data is not of the
    protocol's shape (a missing ``text``, a ``voice`` that is not an object)."""
    try:
        parsed = kind.from_event(event)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise ApiError("invalid_message", f"{event.type}: its data is not of the protocol's shape") from None
    voice = getattr(parsed, "voice", None)
    if voice is not None and voice.name is not None and not isinstance(voice.name, str):
        raise ApiError("invalid_message", f"{event.type}: voice.name is a string")
    if not isinstance(getattr(parsed, "text", ""), str):
        raise ApiError("invalid_message", f"{event.type}: text is a string")
    return parsed


class WyomingSession(WireSession[Event, Event]):
    """One Wyoming connection: the session core's loop, clocks and bounds (:class:`~app.session.wire.WireSession`)
    over its events (:class:`~app.wyoming.channel.EventChannel`)."""

    protocol = PROTOCOL
    path = ENDPOINT

    def __init__(self, channel: EventChannel, service, metrics, version: str, sessions: SessionCount):
        super().__init__(channel, service, metrics)
        self.version = version
        self.sessions = sessions
        self.uploaded_voices = service.settings.wyoming_uploaded_voices()
        # with keys set, a keyless synthesis never parks a keyed conversation's context (so never evicts one)
        self.may_park_others = not self.policy.keys_required
        self.synthesis: Synthesis | None = None
        self.syntheses = 0
        self._claimed = False

    # ------------------------------------------------------------------ the gate and the teardown
    async def gate(self) -> None:
        self._claimed = self.sessions.claim()        # --wyoming-max-sessions, apart from the WebSocket ones
        if not self._claimed:
            raise SessionEnd(ApiError("too_many_sessions", f"{self.sessions.bound} Wyoming connections are "
                                                           "open on this server; retry later"))

    async def leave(self) -> None:
        if self._claimed:
            self.sessions.release()
        s = self.synthesis
        if s is not None:
            if s.task is not None and s.task is not asyncio.current_task():
                s.task.cancel()
            s.close()
        if not self.closed:
            await self._close(0)

    def busy(self) -> bool:
        """A synthesis's audio is still going out: the connection is not idle (its client listens)."""
        return self.synthesis is not None and not self.synthesis.audio_ended

    def free_streams(self) -> None:
        if self.synthesis is not None:
            self.synthesis.close()

    def error_message(self, err: ApiError, fatal: bool, **context: str | None) -> Event:
        return Error(text=err.message, code=err.code).event()

    async def refuse(self, err: ApiError, **context: str | None) -> None:
        """Every refusal ends the connection, as Wyoming's own servers do."""
        raise SessionEnd(err)

    async def end(self, err: ApiError) -> None:
        """The error event, then the connection closes (quietly if the client is already gone)."""
        if self.closed:
            return
        log.info("wyoming: %s (%s); closing the connection", err.message, err.code)
        await super().end(err)

    # ------------------------------------------------------------------ events
    async def on_data(self, event: Event) -> None:
        try:
            if Describe.is_type(event.type):
                info = await run_in_threadpool(describe, self.service, self.version, self.uploaded_voices)
                await self.send(info.event())
            elif Ping.is_type(event.type):
                await self.send(Pong(text=_parsed(Ping, event).text).event())
                self.ignore()                # the protocol's ping: it keeps nothing (nor do a WebSocket's)
            elif Synthesize.is_type(event.type):
                msg = _parsed(Synthesize, event)
                if self.synthesis is not None and self.synthesis.streaming:
                    self._whole_text(self.synthesis, msg.text)              # a streaming client's copy
                else:
                    await self._synthesize(msg)
            elif SynthesizeStart.is_type(event.type):
                await self._start(_parsed(SynthesizeStart, event))
            elif SynthesizeChunk.is_type(event.type):
                self._chunk(_parsed(SynthesizeChunk, event).text)
            elif SynthesizeStop.is_type(event.type):
                await self._stop()
            else:
                log.debug("wyoming: ignored a %r event", event.type)
                self.ignore()                # an event the protocol has and we do not take: it keeps nothing
        except (ApiError, EngineError) as e:
            err = from_engine(e)
            self.count_request(str(err.status))
            await self.refuse(err)

    async def _voice(self, voice) -> np.ndarray | None:
        """A request's voice as prompt codes. Without ``--wyoming-voices all`` (with keys set, by default) only the
        built-in names are taken: an uploaded voice's name is unknown here, whether or not it exists."""
        key = voice.name if voice is not None else None
        if not self.uploaded_voices and key is not None and key.lower() not in (DEFAULT_VOICE, *OPENAI_VOICES):
            raise ApiError("voice_not_found", f"unknown voice {key!r}: this Wyoming listener speaks 'default' and "
                                              "OpenAI's names (--wyoming-voices)", "voice")
        return await run_in_threadpool(self.service.resolve_voice, key)

    def _begin(self) -> None:
        """A new synthesis may start: none runs, the connection's turn limit is not reached, the service is
        ready."""
        if self.synthesis is not None:
            raise ApiError("turn_in_progress", "a synthesis is running on this connection: wait for its audio-stop")
        if self.syntheses >= self.policy.max_turns:
            raise ApiError("max_turns", f"this connection reached its {self.policy.max_turns} syntheses")
        self.service.require_ready()
        self.syntheses += 1

    def _turn_audio(self) -> TurnAudio:
        rate = self.service.model.codec.sample_rate
        return TurnAudio(StreamMeter(self.metrics, PROTOCOL), make_encoder=lambda: StreamEncoder("pcm", rate))

    async def _synthesize(self, msg: Synthesize) -> None:
        arrived = time.monotonic()
        self._begin()
        voice = await self._voice(msg.voice)
        utterance = await aprepare_utterance(self.service, msg.text, voice, SamplingFields(), param="text")
        turn = self._turn_audio()
        try:
            handle = await utterance.start(self.service, AsyncSink(), arrived=arrived,
                                           may_park_others=self.may_park_others)
        except BaseException:
            turn.close()
            raise
        self._run(Synthesis(handle, turn))

    async def _start(self, msg: SynthesizeStart) -> None:
        self._begin()
        voice = await self._voice(msg.voice)
        conversation = Conversation(self.service, self.policy, voice, None, may_park_others=self.may_park_others)
        turn = self._turn_audio()
        try:
            await conversation.begin_turn(self.service.sampling(SamplingFields()))
        except BaseException:
            conversation.close()
            turn.close()
            raise
        assert conversation.handle is not None, "its turn began on its stream"
        self._run(Synthesis(conversation.handle, turn, conversation))

    def _chunk(self, text: str) -> None:
        s = self.synthesis
        if s is None or not s.streaming or s.stop_received:
            raise ApiError("no_turn", "synthesize-chunk goes between synthesize-start and synthesize-stop")
        if s.took_whole_text:
            return                           # part of the whole text, already taken from the synthesize copy
        self._push(s, text)
        s.spoke_chunks = s.spoke_chunks or speakable(text)

    def _whole_text(self, s: Synthesis, text: str) -> None:
        """The ``synthesize`` of a streaming client (between its chunks and ``synthesize-stop``): the whole text
        again, for servers that do not stream. A copy when a chunk brought text to speak; else the text itself
        (a client may send no chunk at all), taken at once so that it is spoken without waiting for the stop."""
        if s.stop_received or s.spoke_chunks or s.took_whole_text or not speakable(text):
            return
        self._push(s, text)
        s.took_whole_text = True

    def _push(self, s: Synthesis, text: str) -> None:
        """Text into the open turn, held to the text buffer in characters (``--ws-max-buffered-chars``, the
        WebSocket's :class:`~app.session.policy.TextLedger` measure: not the token ids the text commits to).
        Whitespace within the turn is text (it separates words), counted like any."""
        assert s.conversation is not None and s.conversation is self.conversation, "a streaming synthesis"
        Conversation.check_text(text)
        s.conversation.check_takes_text()
        self.check_buffer(len(text))
        self.push_text(text)

    async def _stop(self) -> None:
        s = self.synthesis
        if s is None or s.conversation is None or s.stop_received:
            raise ApiError("no_turn", "synthesize-stop without a synthesize-start")
        s.stop_received = True
        s.conversation.end_text()
        if s.audio_ended:                    # its text was ended for it earlier and its audio is out
            await self._finished(s)

    # ------------------------------------------------------------------ the audio
    def _run(self, s: Synthesis) -> None:
        """The synthesis runs; a streaming one's conversation is the session's (its text clock, its text
        buffer)."""
        self.synthesis = s
        if s.conversation is not None:
            self.conversation, self.turn = s.conversation, s.turn
        s.task = asyncio.create_task(self._speak(s))

    async def _speak(self, s: Synthesis) -> None:
        """The synthesis's audio as it is generated; then it is closed (its slot freed)."""
        rate = self.service.model.codec.sample_rate
        fmt = {"rate": rate, "width": 2, "channels": 1}
        started = False
        status = "client_disconnected"
        try:
            async for out in pump(s.handle, s.turn):
                if isinstance(out, Audio):
                    if not started:
                        await self.send(AudioStart(**fmt).event())
                        started = True
                    if out.data:
                        await self.send(AudioChunk(audio=out.data, **fmt).event())
                elif isinstance(out, Failed):
                    status = str(out.error.status)
                    await self.end(out.error)
                    return
                elif isinstance(out, Ended):
                    if not started:
                        await self.send(AudioStart(**fmt).event())
                    if out.tail:
                        await self.send(AudioChunk(audio=out.tail, **fmt).event())
                    await self.send(AudioStop().event())
                    status = "500" if out.stats.finish_reason is FinishReason.ERROR else "200"
            s.audio_ended = True
            if s.conversation is not None:
                s.conversation.turn_ended()
            self.turn_over()                                 # idle counts from the synthesis's end
            s.close()                                        # the slot is free before the client's next event
            if not s.streaming or s.stop_received:
                await self._finished(s)
        except ClientStalled:
            status = "client_stalled"
            await self._stalled()
        except (ConnectionError, asyncio.CancelledError):
            pass                                             # the client left, or the connection was closed
        except Exception as e:  # noqa: BLE001 - one synthesis's bug never takes the server down
            log.exception("wyoming synthesis failed")
            status = "500"
            await self.end(ApiError("internal_error", f"internal error: {type(e).__name__}"))
        finally:
            s.close()
            self.count_request(status)

    async def _finished(self, s: Synthesis) -> None:
        """The synthesis is over: a streaming one says so; the connection may start the next one."""
        if s.streaming:
            await self.send(SynthesizeStopped().event())
        if self.synthesis is s:
            self.synthesis = None
            if self.conversation is s.conversation:
                self.conversation, self.turn = None, None
