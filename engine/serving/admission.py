"""Admission: which streams hold the scheduler's KV slots, who waits for one, and whose idle context is parked.

A stream takes a slot when a turn begins and keeps it between turns while no one else needs it. When every
slot is promised, a caller waits up to its queue timeout — blocking (:meth:`Admission.reserve`) or awaiting
on an event loop, holding no thread (:meth:`Admission.areserve`) — in one first-come-first-served queue;
the head of the queue first takes the slot of the stream that has been idle (no turn in progress) the
longest: that stream is **parked** (the device loop copies its used KV rows to the host,
:class:`~engine.kv.parking.ParkedContexts`, and frees the slot), and its next turn takes a slot the same way and
gets its rows back. With no idle stream to park the caller gets :class:`CapacityError` (the service's 429)
at its deadline. The slots promised are counted here and only here (:meth:`Admission._promise`,
:meth:`Admission._free`); the device loop takes the handles to detach, park and attach from :meth:`changes`.

Two properties of a handle, fixed when it is opened, shape this:

- ``one_shot`` (an HTTP, LocalAI or Wyoming ``synthesize`` utterance): it takes one turn, and when that turn
  ends its slot is given back at once, without a copy (:meth:`Admission.turn_ended`: the loop detaches it as
  a closed one); it is never idle, so never parked. Its events already delivered still reach its consumer.
- ``may_park_others`` False (a keyless Wyoming synthesis): it takes only a free slot, never parks an idle
  stream to make room, so it can cause neither a park nor an eviction. It waits in the same queue. A free
  slot goes to the head of the queue, whoever it is; when no slot is free, the first waiter that *may* park
  parks the idlest stream, passing any non-parking waiters ahead of it — those could not have used that
  slot, and they keep their place for the next free one (so neither kind holds the other up).

A turn's inputs are checked before it asks for a slot (``StreamHandle.begin_turn``); one that still fails
after admission gives its promise back (:meth:`Admission.turn_failed`) wherever the loop is with it: before
the loop took it, at once; taken but not attached yet, the loop skips the attach (a parked stream's rows
stay parked); attached meanwhile, the loop detaches it again, or parks it again when it had rows.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Generic, Protocol, TypeVar

import numpy as np

from engine.errors import (
    CapacityError,
    ContextEvictedError,
    EngineBrokenError,
    InputError,
    OverloadError,
    StreamClosedError,
)
from engine.kv.parking import ParkedContexts
from engine.serving.stream import StreamState


class SlotHolder(Protocol):
    """What admission reads of a stream handle (``engine.serving.handles.StreamHandle``), and the calls by which
    it records what happened to it (made holding admission's lock)."""

    def __hash__(self) -> int: ...          # parked contexts are kept by their holder
    @property
    def closed(self) -> bool: ...
    @property
    def one_shot(self) -> bool:
        """Takes one turn; its slot is given back, never parked, when it ends."""
    @property
    def may_park_others(self) -> bool:
        """False: takes only a free slot (never parks another stream)."""
    @property
    def reserved(self) -> bool:
        """Promised a slot (changed by the admission only)."""
    @property
    def revoked(self) -> bool:
        """Its promise was given back while the loop held it (the loop completes it)."""
    @property
    def attached(self) -> bool:
        """The loop attached it (changed by the loop, holding the lock)."""
    @property
    def turns_begun(self) -> int:
        """Turns begun (or beginning), counted here."""
    @property
    def turns_ended(self) -> int:
        """Their ends, as the device loop delivered them."""
    @property
    def pinned(self) -> bool:
        """Fed context rows outside a turn (prime): never parked."""
    @property
    def idle_since(self) -> float | None:
        """When its last turn ended, while no other is open (None: busy)."""
    @property
    def evicted(self) -> bool:
        """Its parked context was dropped."""
    @property
    def admitted_at(self) -> float:
        """When it was last admitted (the resume's start)."""
    @property
    def stream(self) -> StreamState:
        """Its stream (marked parked and unparked here)."""

    def promise_slot(self) -> None:
        """Admission promised it a slot."""
    def withdraw_promise(self) -> None:
        """Its promised slot is free again."""
    def revoke_promise(self) -> None:
        """Its promise is given back while the loop holds it: the loop completes the giving back."""
    def clear_revocation(self) -> None:
        """No revocation is pending any more (completed, or a turn wants the promise after all)."""
    def mark_admitted(self, now: float) -> None:
        """It was admitted at ``now`` (a resume's start)."""
    def mark_busy(self, turn: bool) -> None:
        """A turn begins (``turn``: counted) or context rows outside a turn are fed (it is pinned): not idle."""
    def mark_idle(self, now: float) -> None:
        """Every turn it began has ended, at ``now``: a waiter may take its slot."""
    def uncount_turn(self) -> None:
        """A turn counted as begun did not open."""
    def count_turn_end(self) -> None:
        """The device loop delivered the end of one of its turns."""
    def mark_evicted(self) -> None:
        """Its parked context is dropped (or never kept): its next turn starts on a fresh stream."""


H = TypeVar("H", bound=SlotHolder)


class _Ticket:
    """A place in the admission queue (a blocking caller's); ``may_park``: its handle may park another."""

    def __init__(self, may_park: bool):
        self.may_park = may_park


class _AsyncTicket(_Ticket):
    """A place in the admission queue held by a coroutine: woken from any thread."""

    def __init__(self, may_park: bool, loop: asyncio.AbstractEventLoop):
        super().__init__(may_park)
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:          # its loop closed: the waiter is gone
            pass


class Admission(Generic[H]):
    """Slots promised to handles, the queue of waiters, the parked contexts, and the handles the loop must
    detach, park or attach. ``cond`` is the device loop's condition (one lock for all); ``wake_loop`` marks
    the loop's work dirty (called holding it)."""

    def __init__(self, slots: int, queue_timeout: float, cond: threading.Condition, wake_loop: Callable[[], None],
                 broken: Callable[[], str | None], parked_bytes: int = 0):
        self.slots = slots
        self.queue_timeout = queue_timeout
        self._cond = cond
        self._wake_loop = wake_loop
        self._broken = broken
        self.promised = 0                     # slots promised to handles (attached or about to be)
        self.parked: ParkedContexts[H] = ParkedContexts(parked_bytes)
        self._holding: list[H] = []           # the handles promised a slot
        self._waiting: list[_Ticket] = []     # tickets of callers waiting for a slot, in order
        self._to_attach: list[H] = []
        self._to_park: list[H] = []
        self._to_detach: list[H] = []
        self.accepting = True
        self.stopping = False

    # ------------------------------------------------------------------ the count (holding the lock)
    def _promise(self, handle: H | None) -> None:
        """One more slot promised (``handle`` None: one a closed handle could not give back)."""
        self.promised += 1
        if handle is not None:
            handle.promise_slot()
            self._holding.append(handle)

    def _free(self, handle: H | None) -> None:
        """A promised slot is free again (``handle`` None: one whose handle already gave it up)."""
        self.promised -= 1
        if handle is not None:
            handle.withdraw_promise()
            self._holding.remove(handle)
        self._notify()

    # ------------------------------------------------------------------ callers (any thread)
    def reserve(self, handle: H, wait: float | None, turn: bool = True) -> bool:
        """Promise ``handle`` a slot for a turn (``turn`` False: context rows outside a turn, which pins it),
        waiting up to ``wait`` s (default the queue timeout); False if it already has one."""
        with self._cond:
            ticket = _Ticket(handle.may_park_others)
            deadline = self._join_queue(handle, ticket, wait, turn)
            if deadline is None:
                return False
            try:
                while not self._try_take_slot(handle, ticket):
                    left = deadline - time.monotonic()
                    if left <= 0 or self.stopping:
                        raise self._no_capacity()
                    self._cond.wait(timeout=left)
            finally:
                self._waiting.remove(ticket)
                self._notify()                       # the next in line may be admitted now
            self._admit(handle, turn)
            return True

    async def areserve(self, handle: H, wait: float | None, turn: bool = True) -> bool:
        """:meth:`reserve` on an event loop: the ticket waits on an asyncio event, set by every change that may
        admit it, so no thread is held however long the queue (the timeout is the time to the refusal)."""
        ticket = _AsyncTicket(handle.may_park_others, asyncio.get_running_loop())
        with self._cond:
            deadline = self._join_queue(handle, ticket, wait, turn)
        if deadline is None:
            return False
        try:
            while True:
                with self._cond:
                    if self._try_take_slot(handle, ticket):
                        self._admit(handle, turn)
                        return True
                    if self.stopping:
                        raise self._no_capacity()
                    ticket.event.clear()             # set again by the next _notify
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._no_capacity()
                try:
                    await asyncio.wait_for(ticket.event.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._cond:
                self._waiting.remove(ticket)
                self._notify()

    def turn_failed(self, handle: H) -> None:
        """A turn that :meth:`reserve` let begin did not open: it is not counted, and a promise that no open
        turn needs any more is given back wherever the loop is with it — still queued for the loop: at once
        (a parked stream's rows stay parked); taken by the loop and not attached yet: ``revoked``, and the
        loop completes the giving back (:meth:`attaching`, :meth:`attached`); attached with no turn ever
        ended (nothing in its slot to keep): detached. A stream attached with a context stays as any stream
        between turns: idle in its slot, which a waiter may take by parking it."""
        with self._cond:
            handle.uncount_turn()
            if handle.reserved and not handle.pinned and handle.turns_begun == handle.turns_ended:
                if handle in self._to_attach:
                    self._to_attach.remove(handle)
                    self._free(handle)
                elif not handle.attached:
                    handle.revoke_promise()
                elif not handle.turns_ended:
                    self._give_back(handle)
            self._maybe_idle(handle)

    def turn_ended(self, handle: H) -> None:
        """The device loop delivered the end of one of ``handle``'s turns (before its consumer can see it). A
        one-shot handle's slot is given back now, without a copy: nobody resumes it."""
        with self._cond:
            handle.count_turn_end()
            if handle.one_shot:
                self._give_back(handle)
            else:
                self._maybe_idle(handle)

    def release(self, handle: H) -> None:
        """A closed handle's slot is free for admission now: the loop detaches it before it attaches anyone
        else, so a client that opens its next stream right after closing one is never refused for its own.
        A parked one's rows are dropped."""
        with self._cond:
            self.parked.drop(handle)
            self._give_back(handle)
            if self._waiting:
                self._notify()                 # a waiter that is this handle refuses now

    # ------------------------------------------------------------------ the device loop
    def changes(self) -> tuple[list[H], list[H], list[H]]:
        """(handles to detach, to park, to attach) since the last call (holding the lock)."""
        leaving, self._to_detach = self._to_detach, []
        parking, self._to_park = self._to_park, []
        joining, self._to_attach = self._to_attach, []
        return leaving, parking, joining

    def will_keep(self, handle: H, nbytes: int) -> bool:
        """(Holding the lock.) Whether the loop copies the rows (``nbytes`` of them) of a handle chosen to be
        parked, decided before the copy: not for a handle closed since it was chosen (its slot is just
        freed) or whose context is already gone, nor for rows the budget would not keep even once every
        evictable parked context went (a budget of 0, a context larger than the budget): that handle is
        evicted at once, without a copy, and the contexts parked before it stay."""
        if handle.closed or handle.evicted:
            return False
        if self.parked.fits(nbytes, self._evictable):
            return True
        handle.mark_evicted()
        self.parked.refuse()
        return False

    def park_rows_evicting_oldest(self, handle: H, rows: np.ndarray) -> None:
        """The loop copied a parked handle's rows out (holding the lock): kept within the budget, evicting
        the oldest parked contexts past it (never one that is taking its slot back). A waiter whose context
        is evicted is woken: it refuses at once (ContextEvictedError) instead of waiting for a slot."""
        if handle.closed:
            return
        evicted = self.parked.put(handle, rows, self._evictable)
        for old in evicted:
            old.mark_evicted()
        if evicted and self._waiting:
            self._notify()

    @staticmethod
    def _evictable(handle: H) -> bool:
        return not handle.reserved           # not one that is taking its slot back

    def attaching(self, handle: H) -> bool:
        """(Holding the lock.) Whether the loop attaches a handle it took from :meth:`changes`, now, before it
        touches the device: not when its promise was given back meanwhile — a turn that failed after the
        loop took it (revoked: the promise is freed now, and a parked stream's rows stay parked), a close
        (its detach is queued), or a park that chose it again."""
        if handle.revoked:
            handle.clear_revocation()
            if handle.reserved:
                self._free(handle)
            return False
        return handle.reserved

    def attached(self, handle: H, resumed: bool) -> None:
        """(Holding the lock.) The loop attached ``handle`` (``resumed``: with its parked rows). A promise revoked
        while the attach ran is given back now: a stream with a context is parked again (its rows copied
        back out: nothing lost), one without one is detached."""
        if not handle.revoked:
            if handle.reserved:
                handle.stream.mark_unparked()
            return
        handle.clear_revocation()
        if not handle.reserved:
            return                            # closed, or chosen for parking, meanwhile: already given back
        if resumed:
            handle.stream.mark_parked()
            self._free(handle)
            self._to_park.append(handle)
        else:
            self._free(handle)
            self._to_detach.append(handle)
        self._wake_loop()

    def attach_failed(self, handle: H) -> None:
        """The loop could not give ``handle`` its slot: the promise is taken back."""
        with self._cond:
            if handle.reserved:
                self._free(handle)

    def detach_failed(self, handle: H, first: bool, retry: bool) -> None:
        """Freeing a closed handle's slot failed: the slot is still taken (promised again on the first
        failure: admission must not give it away), and the detach is retried when ``retry``."""
        with self._cond:
            if retry:
                self._to_detach.append(handle)
            if first:
                self._promise(None)

    def detached_after_failures(self) -> None:
        """A slot whose detach had failed is free at last."""
        with self._cond:
            self._free(None)

    def close(self) -> None:
        """No more admissions; waiters are refused."""
        self.accepting = False
        with self._cond:
            self.stopping = True
            self._notify()

    # ------------------------------------------------------------------ inside (holding the lock)
    def _give_back(self, handle: H) -> None:
        """A handle's promise is given back with nothing to keep (closed, or a one-shot whose turn ended): the
        loop detaches it (before it attaches anyone), or never attaches it when it has not yet."""
        if not handle.reserved:
            return
        if handle in self._to_attach:
            self._to_attach.remove(handle)
        else:
            self._to_detach.append(handle)
        handle.clear_revocation()
        self._free(handle)
        self._wake_loop()

    def _join_queue(self, handle: H, ticket: _Ticket, wait: float | None, turn: bool) -> float | None:
        """``ticket`` joins the queue, first come first served: its deadline, or None when ``handle`` already
        holds a slot (then busy from now: it is not parked). A one-shot handle takes one turn only."""
        if handle.one_shot and handle.turns_begun:
            raise InputError("a one-shot stream takes one turn: open a new stream for the next")
        if handle.reserved:
            handle.clear_revocation()          # a turn wants the promise again: the loop attaches it after all
            handle.mark_busy(turn)
            return None
        if not self.accepting:
            raise OverloadError("the server is draining: no new streams")
        broken = self._broken()
        if broken:
            raise EngineBrokenError(f"the engine is broken: {broken}")
        self._waiting.append(ticket)
        return time.monotonic() + (self.queue_timeout if wait is None else wait)

    def _try_take_slot(self, handle: H, ticket: _Ticket) -> bool:
        """Whether ``ticket`` takes a slot now, parking a stream to free one when it must: a free slot goes to
        the first in line; with none free, the first in line that may park others (non-parking waiters ahead
        of it could not use that slot) takes the slot of the stream idle longest, parking it. Raises for a
        handle that cannot resume any more (closed, or its parked context evicted while it waited): no promise
        is made for it."""
        if self.stopping:
            return False
        if handle.closed:
            raise StreamClosedError("the stream is closed")
        if handle.evicted:
            raise ContextEvictedError("this stream's parked context was evicted while it waited for a slot "
                                      "(the parked-context budget): its next turn starts on a fresh stream")
        if self.promised < self.slots:
            return self._waiting[0] is ticket
        if not ticket.may_park:
            return False
        first = next(t for t in self._waiting if t.may_park)
        return first is ticket and self._park_idlest()

    def _park_idlest(self) -> bool:
        # attached only: a promise the loop has not attached yet is one a failed turn is giving back
        idle = [(h, h.idle_since) for h in self._holding if h.idle_since is not None and h.attached and not h.closed
                and not h.one_shot and h not in self._to_attach]
        if not idle:
            return False
        handle = min(idle, key=lambda held: held[1])[0]
        handle.stream.mark_parked()          # it asks the runner for nothing until it is attached again
        self._free(handle)
        self._to_park.append(handle)
        self._wake_loop()
        return True

    def _admit(self, handle: H, turn: bool) -> None:
        self._promise(handle)
        handle.mark_busy(turn)
        handle.mark_admitted(time.monotonic())
        self._to_attach.append(handle)
        self._wake_loop()
        self._notify()

    def _maybe_idle(self, handle: H) -> None:
        """``handle`` is idle once every turn it began has ended: a waiter may take its slot now."""
        if not handle.pinned and handle.turns_begun and handle.turns_begun == handle.turns_ended:
            handle.mark_idle(time.monotonic())
            if handle.reserved and self._waiting:
                self._notify()

    def _no_capacity(self) -> CapacityError:
        return CapacityError(f"all {self.slots} stream slots are busy; retry later")

    def _notify(self) -> None:
        """Wake every waiter, blocking and asyncio."""
        self._cond.notify_all()
        for ticket in self._waiting:
            if isinstance(ticket, _AsyncTicket):
                ticket.wake()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> int:
        """Handles holding a slot with no turn in progress (holding the lock)."""
        return sum(1 for h in self._holding if h.idle_since is not None)
