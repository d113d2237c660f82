"""A conversation: one scheduler stream that lives across a client's turns, and every bound a turn is held to.

It owns the :class:`~engine.serving.handles.StreamHandle` (opened at the first turn, with the voice and seed fixed
then), admission (the queue timeout: at every turn, since between turns the stream may be parked — its
slot given to a waiting stream, its KV rows kept on the host — and a parked stream takes a slot again at
its next turn; one whose parked rows were evicted continues on a fresh stream,
:attr:`Conversation.context_lost`), the turn lifecycle (begin, push text or ids, end the text, cancel,
truncate), the turn limit and the text clock (the text buffer bound is the transport's, in characters:
:meth:`~app.session.policy.SessionPolicy.check_buffer`): an open turn that waits for text with
nothing left to speak is due to have its text ended at :meth:`Conversation.text_deadline`. Only text that
lets the turn go on moves that clock (text the tokenizer commits, or any text while the turn still has
something to speak): an empty delta, or one that commits nothing while the turn waits, does not.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from engine.errors import ContextEvictedError, EngineError, InputError
from engine.model.sampling import SamplingParams
from engine.model.tokenizer import check_unicode
from engine.serving.handles import AsyncSink, EventSink, StreamHandle

from ..errors import ApiError, from_engine
from .policy import SessionPolicy


class StreamOpener(Protocol):
    """What a conversation needs of the service (``app.service.TTSService``): a scheduler stream."""

    def open_stream(self, voice_codes: np.ndarray | None, params: SamplingParams, seed: int | None,
                    sink: EventSink, *, may_park_others: bool = True) -> StreamHandle: ...


class Conversation:
    def __init__(self, service: StreamOpener, policy: SessionPolicy, voice_codes: np.ndarray | None,
                 seed: int | None, may_park_others: bool = True) -> None:
        """``may_park_others`` False: the stream's turns take only a free slot, never park another stream's
        context to make room (``Scheduler.open_stream``)."""
        self.service, self.policy = service, policy
        self.voice_codes, self.seed = voice_codes, seed
        self.may_park_others = may_park_others
        self.handle: StreamHandle | None = None
        self.turns = 0
        self.turn_open = False                 # from begin_turn until the turn's end arrived
        self.context_lost = False              # the last turn began on a fresh stream: the parked one was evicted
        self._waiting_since: float | None = None

    # ------------------------------------------------------------------ the stream
    def _stream(self, params: SamplingParams) -> StreamHandle:
        if self.handle is None:
            self.handle = self.service.open_stream(self.voice_codes, params, self.seed, AsyncSink(),
                                                   may_park_others=self.may_park_others)
        return self.handle

    def _begun(self) -> StreamHandle:
        """The stream of a conversation whose first turn began (a transport calls nothing else before)."""
        if self.handle is None:
            raise RuntimeError("no turn was begun on this conversation")
        return self.handle

    @property
    def context_rows(self) -> int:
        """Rows of the stream's context (0 before its first turn)."""
        return self.handle.context_rows if self.handle is not None else 0

    def close_stream_for_fresh_context(self) -> None:
        """The next turn starts on a new stream (its context empty); this one's slot is freed."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def close(self) -> None:
        """Close the stream (its slot is freed); the handle stays for reading."""
        if self.handle is not None:
            self.handle.close()

    # ------------------------------------------------------------------ turns
    async def begin_turn(self, params: SamplingParams, user_text: str = "", user_audio: np.ndarray | None = None,
                         max_frames: int | None = None) -> None:
        """Open a turn, waiting for a stream slot (the queue timeout) unless the stream still holds one (a
        parked stream takes one again). Raises the catalogue's error: ``max_turns``, ``no_capacity``,
        ``input_too_long``, ``draining``..."""
        if self.turns >= self.policy.max_turns:
            raise ApiError("max_turns", f"this session reached its {self.policy.max_turns} turns")
        self.context_lost = False
        try:
            try:
                await self._stream(params).abegin_turn(user_text, user_audio, None, max_frames, params)
            except ContextEvictedError:
                # its parked context was dropped (the parked-context budget): as when a context is full, the
                # turn goes on a fresh stream; the transport tells its client (context_lost)
                self.close_stream_for_fresh_context()
                self.context_lost = True
                await self._stream(params).abegin_turn(user_text, user_audio, None, max_frames, params)
        except EngineError as e:
            raise from_engine(e) from None
        self.turns += 1
        self.turn_open = True
        self._waiting_since = time.monotonic()

    def turn_ended(self) -> None:
        """The turn's end arrived (its last audio was sent)."""
        self.turn_open = False
        self._waiting_since = None

    @staticmethod
    def check_text(text: str, param: str = "text") -> str:
        """Text the stream may take: valid Unicode (a lone surrogate is refused before it opens or counts
        toward anything)."""
        try:
            return check_unicode(text)
        except InputError as e:
            raise ApiError("invalid_value", str(e), param) from None

    def check_takes_text(self) -> None:
        """Refuse text for a turn whose response already ended (its end is on its way to the client)."""
        s = self.handle.stream if self.handle is not None else None
        if s is not None and s.has_turn and s.turn_done:
            reason = s.stats.finish_reason.value if s.stats.finish_reason else "ended"
            raise ApiError("response_ended", f"the response already ended ({reason}); this text was not spoken: "
                                             "wait for the end of the response, then send the next turn's text")

    def push_text(self, text: str) -> int:
        """Text into the open turn (checked with :meth:`check_text` first, and held to the text buffer by the
        transport: :meth:`SessionPolicy.check_buffer` over its :class:`~app.session.policy.TextLedger`)."""
        return self._progress(self._begun().push_text(text))

    def push_ids(self, ids: Iterable[int]) -> int:
        """Token ids into the open turn."""
        return self._progress(self._begun().push_token_ids(ids))

    def _progress(self, committed: int) -> int:
        if committed or not self._begun().stream.waiting_for_text:
            self._waiting_since = None           # re-armed when the turn is next seen waiting
        return committed

    def end_text(self) -> None:
        """End the open turn's text (a no-op when the stream closed or its text ended meanwhile)."""
        try:
            self._begun().end_text()
        except EngineError:
            pass                                 # the stream closed or its text ended meanwhile

    def cancel(self) -> None:
        """Barge-in: end the open turn now."""
        if self.handle is not None and not self.handle.closed:
            self.handle.cancel()

    def truncate_turn(self, frames: int) -> int:
        """Keep of the ended turn what a listener of ``frames`` frames heard; returns the context rows kept."""
        return self._begun().truncate_turn(frames)

    # ------------------------------------------------------------------ the text clock
    def text_deadline(self, now: float) -> float | None:
        """When the open turn's text is to be ended for it (None: it is not waiting for text)."""
        s = self.handle.stream if self.handle is not None else None
        if not self.turn_open or s is None or not s.waiting_for_text:
            self._waiting_since = None
            return None
        if self._waiting_since is None:
            self._waiting_since = now
        return self._waiting_since + self.policy.text_timeout
