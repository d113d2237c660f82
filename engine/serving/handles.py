"""What a caller holds of a scheduled stream: the :class:`StreamHandle`, the events it receives and the sinks
they arrive through.

Every handle method is thread-safe and returns without running a graph: it changes the stream's host state
and wakes the device loop. Events (frames with their audio, turn ends, errors) go into a sink: a thread-safe
queue, or an asyncio queue fed with ``call_soon_threadsafe`` so that an asyncio server never blocks on the
engine. A consumer that stops reading pauses its stream at ``max_buffered_frames`` instead of buffering
audio without bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, cast

import numpy as np
import numpy.typing as npt

from engine.errors import ContextEvictedError, InputError, StreamClosedError
from engine.model.sampling import SamplingParams
from engine.serving.stream import Frame, StreamState, TurnInputs, TurnStats

if TYPE_CHECKING:
    from engine.serving.admission import Admission


# ---------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class FrameEvent:
    frame: Frame


@dataclass(frozen=True)
class TurnEnd:
    turn: int
    stats: TurnStats


@dataclass(frozen=True)
class StreamError:
    error: Exception


Event = FrameEvent | TurnEnd | StreamError


class EventSink(Protocol):
    def put(self, event: Event) -> None:
        """Called on the scheduler's thread; must not block."""


class BlockingSink(EventSink, Protocol):
    """A sink a consumer thread reads (:class:`QueueSink`)."""

    def get(self, timeout: float | None = None) -> Event:
        """The next event, waiting up to ``timeout`` s (queue.Empty after it)."""


class AwaitableSink(EventSink, Protocol):
    """A sink an asyncio consumer reads (:class:`AsyncSink`)."""

    async def get(self) -> Event:
        """The next event, awaited."""


class QueueSink:
    """Events for a consumer thread: ``get(timeout)`` blocks."""

    def __init__(self) -> None:
        self._q: queue.Queue[Event] = queue.Queue()

    def put(self, event: Event) -> None:
        self._q.put(event)

    def get(self, timeout: float | None = None) -> Event:
        return self._q.get(timeout=timeout)


class AsyncSink:
    """Events for an asyncio consumer: ``await get()`` never blocks the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._q: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._q.put_nowait, event)

    async def get(self) -> Event:
        return await self._q.get()


# ---------------------------------------------------------------------------------------------- handles
class StreamHandle:
    """A stream in a scheduler (its ``admission``; ``wake`` wakes its device loop). Every method is thread-safe
    and returns without running a graph. Between turns the stream may be parked (its slot given to another
    stream, its rows kept on the host): its next turn gets them back, or, once they were evicted, refuses
    with ContextEvictedError.

    Fixed at open (``Scheduler.open_stream``): ``one_shot`` — one turn, whose end gives the slot back at once
    without a copy (never parked; a second turn is refused); ``may_park_others`` False — its turns take only
    a free slot, never one freed by parking another stream (see ``engine.serving.admission``)."""

    def __init__(self, admission: Admission[StreamHandle], wake: Callable[[], None], stream: StreamState,
                 sink: EventSink, max_buffered_frames: int, one_shot: bool = False,
                 may_park_others: bool = True) -> None:
        self._admission = admission
        self._wake = wake
        self.stream = stream
        self.sink = sink
        self.max_buffered_frames = max_buffered_frames
        self.one_shot = bool(one_shot)
        self.may_park_others = bool(may_park_others)
        self.attached = False       # holds a runner slot (the loop attached it; until the loop detaches it)
        self.closed = False
        self.reserved = False       # admission promised it a slot (changed by the admission only)
        self.revoked = False        # that promise was given back while the loop held it (admission, the loop)
        # idle and parked bookkeeping (engine.serving.admission.SlotHolder: changed holding the admission's lock,
        # through the calls below that say what happened)
        self.turns_begun = 0
        self.turns_ended = 0
        self.pinned = False
        self.idle_since: float | None = None
        self.evicted = False
        self.admitted_at = 0.0
        self._buffered = 0          # frames delivered and not yet consumed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ what admission records (holding its lock)
    def promise_slot(self) -> None:
        """Admission promised it a slot."""
        self.reserved = True

    def withdraw_promise(self) -> None:
        """Its promised slot is free again."""
        self.reserved = False

    def revoke_promise(self) -> None:
        """Its promise is given back while the loop holds it: the loop completes the giving back."""
        self.revoked = True

    def clear_revocation(self) -> None:
        """No revocation is pending any more (completed, or a turn wants the promise after all)."""
        self.revoked = False

    def mark_admitted(self, now: float) -> None:
        """It was admitted at ``now`` (a resume's start)."""
        self.admitted_at = now

    def mark_busy(self, turn: bool) -> None:
        """A turn begins (``turn``: counted) or context rows outside a turn are fed (it is pinned): not idle."""
        if turn:
            self.turns_begun += 1
        else:
            self.pinned = True
        self.idle_since = None

    def mark_idle(self, now: float) -> None:
        """Every turn it began has ended, at ``now``: a waiter may take its slot."""
        self.idle_since = now

    def uncount_turn(self) -> None:
        """A turn counted as begun did not open."""
        self.turns_begun -= 1

    def count_turn_end(self) -> None:
        """The device loop delivered the end of one of its turns."""
        self.turns_ended += 1

    def mark_evicted(self) -> None:
        """Its parked context is dropped (or never kept): its next turn starts on a fresh stream."""
        self.evicted = True

    # ------------------------------------------------------------------ turn control
    def begin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None,
                   max_frames: int | None = None, params: SamplingParams | None = None,
                   wait: float | None = None) -> None:
        """Open a turn (``StreamingSession.begin_turn`` semantics). A stream without a slot (its first turn,
        or parked) waits up to ``wait`` seconds (default: the scheduler's queue timeout) for one, else
        CapacityError; ContextEvictedError when its parked context was evicted (also while it waited). The
        turn's inputs are checked before it asks for a slot: a turn refused for them (InputError,
        ContextLimitError) takes none."""
        self._require_resumable()
        inputs = self.stream.check_turn(user_text, user_audio_codes, user_audio_wav, max_frames, params)
        self._admission.reserve(self, wait)
        self._open_turn(inputs)

    async def abegin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                          user_audio_wav: tuple[np.ndarray, int] | None = None,
                          max_frames: int | None = None, params: SamplingParams | None = None,
                          wait: float | None = None) -> None:
        """``begin_turn`` for asyncio callers: waiting for a slot awaits (it holds no thread), in the same
        first-come-first-served queue as the blocking callers; cancelling the wait leaves the queue."""
        self._require_resumable()
        inputs = self.stream.check_turn(user_text, user_audio_codes, user_audio_wav, max_frames, params)
        await self._admission.areserve(self, wait)
        self._open_turn(inputs)

    def _open_turn(self, inputs: TurnInputs) -> None:
        """Open the admitted turn; when that still fails (closed, or the stream changed since its inputs were
        checked) admission takes back what it promised for it."""
        try:
            self.stream.open_turn(inputs)
        except BaseException:
            self._admission.turn_failed(self)
            raise
        self._wake()

    def _require_resumable(self) -> None:
        self._require_open()
        if self.one_shot and self.turns_begun:
            raise InputError("a one-shot stream takes one turn: open a new stream for the next")
        if self.evicted:
            raise ContextEvictedError("this stream's parked context was evicted (the parked-context budget): "
                                      "its next turn starts on a fresh stream")

    def push_text(self, delta: str | bytes) -> int:
        """Assistant text, any split; returns the ids it committed."""
        self._require_open()
        n = self.stream.push_text(delta)
        if n:
            self._wake()
        return n

    def push_token_ids(self, ids: Iterable[int]) -> int:
        """Assistant token ids (fed exactly as given); returns how many."""
        self._require_open()
        n = self.stream.push_token_ids(ids)
        self._wake()
        return n

    def end_text(self) -> int:
        """No more text this turn; returns the ids the rest of the text committed."""
        self._require_open()
        n = self.stream.end_text()
        self._wake()
        return n

    def cancel(self) -> None:
        """Barge-in: the turn ends at the next step boundary (a frame in flight is discarded)."""
        self._require_open()
        self.stream.cancel()
        self._wake()

    def truncate_turn(self, audio_frames: int) -> int:
        """Keep of the ended turn only what a listener of ``audio_frames`` frames heard (``StreamState``)."""
        self._require_open()
        kept = self.stream.truncate_turn(audio_frames)
        self._wake()
        return kept

    def prime(self, rows: npt.ArrayLike) -> None:
        """Feed context rows between turns without generating (``StreamState.prime``)."""
        self._require_resumable()
        self._admission.reserve(self, None, turn=False)
        self.stream.prime(rows)
        self._wake()

    def prime_prefix(self, rows: npt.ArrayLike, wait: float | None = None) -> None:
        """Feed a stream's system block, or its text-only opening (system block + assistant header), cached
        by the scheduler's prefix cache as it goes."""
        self._require_resumable()
        self._admission.reserve(self, wait, turn=False)
        self.stream.prime(rows, prefix=True)
        self._wake()

    def close(self) -> None:
        """End the stream and free its slot at the next step boundary. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.stream.close()
        self._admission.release(self)

    # ------------------------------------------------------------------ consumer side
    def consumed(self, frames: int = 1) -> None:
        """The consumer took ``frames`` frames off the sink: a paused stream resumes below half the bound."""
        with self._lock:
            self._buffered = max(0, self._buffered - frames)
            resume = self.stream.paused and self._buffered <= self.max_buffered_frames // 2
            if resume:
                self.stream.mark_unpaused()
        if resume:
            self._wake()

    def get(self, timeout: float | None = None) -> Event:
        """The next event (QueueSink); raises queue.Empty after ``timeout``."""
        event = cast(BlockingSink, self.sink).get(timeout=timeout)     # the caller's sink reads so
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    async def aget(self) -> Event:
        """The next event (AsyncSink)."""
        event = await cast(AwaitableSink, self.sink).get()             # the caller's sink awaits so
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    @property
    def context_rows(self) -> int:
        """Rows of the stream's context fed so far."""
        return self.stream.fed_rows

    def delivered(self) -> None:
        """The loop put a frame into the sink (called on its thread): at the bound the stream pauses."""
        with self._lock:
            self._buffered += 1
            if self._buffered >= self.max_buffered_frames:
                self.stream.mark_paused()

    def _require_open(self) -> None:
        if self.closed:
            raise StreamClosedError("the stream is closed")
