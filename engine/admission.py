"""Admission: which streams hold the scheduler's KV slots, and who waits for one.

A stream takes a slot at its first turn and keeps it until closed. When every slot is promised, a caller
waits up to its queue timeout — blocking (:meth:`Admission.reserve`) or awaiting on an event loop, holding no
thread (:meth:`Admission.areserve`) — in one first-come-first-served queue, then gets :class:`CapacityError`
(the service's 429). The slots promised are counted here and only here (:meth:`Admission._promise`,
:meth:`Admission._free`); the device loop takes the handles to attach and detach from :meth:`changes`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Callable

from .errors import CapacityError, EngineBrokenError, OverloadError

if TYPE_CHECKING:
    from .handles import StreamHandle


class _AsyncTicket:
    """A place in the admission queue held by a coroutine: woken from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:          # its loop closed: the waiter is gone
            pass


class Admission:
    """Slots promised to handles, the queue of waiters, and the handles the loop must attach or detach.
    ``cond`` is the device loop's condition (one lock for both); ``wake_loop`` marks the loop's work dirty
    (called holding it)."""

    def __init__(self, slots: int, queue_timeout: float, cond: threading.Condition, wake_loop: Callable[[], None],
                 broken: Callable[[], str | None]):
        self.slots = slots
        self.queue_timeout = queue_timeout
        self._cond = cond
        self._wake_loop = wake_loop
        self._broken = broken
        self.promised = 0                     # slots promised to handles (attached or about to be)
        self._waiting: list[object] = []      # tickets of callers waiting for a slot, in order
        self._to_attach: list[StreamHandle] = []
        self._to_detach: list[StreamHandle] = []
        self.accepting = True
        self.stopping = False

    # ------------------------------------------------------------------ the count (holding the lock)
    def _promise(self, handle: "StreamHandle | None") -> None:
        """One more slot promised (``handle`` None: one a closed handle could not give back)."""
        self.promised += 1
        if handle is not None:
            handle.reserved = True

    def _free(self, handle: "StreamHandle | None") -> None:
        """A promised slot is free again (``handle`` None: one whose handle already gave it up)."""
        self.promised -= 1
        if handle is not None:
            handle.reserved = False
        self._notify()

    # ------------------------------------------------------------------ callers (any thread)
    def reserve(self, handle: "StreamHandle", wait: float | None) -> bool:
        """Promise ``handle`` a slot (once), waiting up to ``wait`` s (default the queue timeout); False if it
        already has one."""
        with self._cond:
            ticket = object()
            deadline = self._join_queue(handle, ticket, wait)
            if deadline is None:
                return False
            try:
                while not self._admissible(ticket):
                    left = deadline - time.monotonic()
                    if left <= 0 or self.stopping:
                        raise self._no_capacity()
                    self._cond.wait(timeout=left)
            finally:
                self._waiting.remove(ticket)
                self._notify()                       # the next in line may be admitted now
            self._admit(handle)
            return True

    async def areserve(self, handle: "StreamHandle", wait: float | None) -> bool:
        """:meth:`reserve` on an event loop: the ticket waits on an asyncio event, set by every change that may
        admit it, so no thread is held however long the queue (the timeout is the time to the refusal)."""
        ticket = _AsyncTicket(asyncio.get_running_loop())
        with self._cond:
            deadline = self._join_queue(handle, ticket, wait)
        if deadline is None:
            return False
        try:
            while True:
                with self._cond:
                    if self._admissible(ticket):
                        self._admit(handle)
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

    def unreserve(self, handle: "StreamHandle") -> None:
        """A first turn that failed to open gives its promise back (before the loop attached it)."""
        with self._cond:
            if handle in self._to_attach:
                self._to_attach.remove(handle)
                self._free(handle)

    def release(self, handle: "StreamHandle") -> None:
        """A closed handle's slot is free for admission now: the loop detaches it before it attaches anyone
        else, so a client that opens its next stream right after closing one is never refused for its own."""
        with self._cond:
            if not handle.reserved:
                return
            if handle in self._to_attach:
                self._to_attach.remove(handle)
            else:
                self._to_detach.append(handle)
            self._free(handle)
            self._wake_loop()

    # ------------------------------------------------------------------ the device loop
    def changes(self) -> tuple[list["StreamHandle"], list["StreamHandle"]]:
        """(handles to detach, handles to attach) since the last call (holding the lock)."""
        leaving, self._to_detach = self._to_detach, []
        joining, self._to_attach = self._to_attach, []
        return leaving, joining

    def attach_failed(self, handle: "StreamHandle") -> None:
        """The loop could not give ``handle`` its slot: the promise is taken back."""
        with self._cond:
            if handle.reserved:
                self._free(handle)

    def detach_failed(self, handle: "StreamHandle", first: bool, retry: bool) -> None:
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
    def _join_queue(self, handle: "StreamHandle", ticket: object, wait: float | None) -> float | None:
        """``ticket`` joins the queue, first come first served: its deadline, or None when ``handle`` already
        holds a slot."""
        if handle.reserved:
            return None
        if not self.accepting:
            raise OverloadError("the server is draining: no new streams")
        broken = self._broken()
        if broken:
            raise EngineBrokenError(f"the engine is broken: {broken}")
        self._waiting.append(ticket)
        return time.monotonic() + (self.queue_timeout if wait is None else wait)

    def _admissible(self, ticket: object) -> bool:
        return self.promised < self.slots and self._waiting[0] is ticket

    def _admit(self, handle: "StreamHandle") -> None:
        self._promise(handle)
        self._to_attach.append(handle)
        self._wake_loop()
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
