"""Parked contexts: the KV rows of idle streams that gave their slot to a waiter, kept in host memory.

A stream between turns needs nothing of its slot but the rows it filled (the codec starts each turn's
audio afresh, and its sampling state is host state of the stream): when a stream waits for a slot and none
is free, admission picks the stream idle longest, and the device loop copies its used rows into a compact
host array (:class:`ParkedContexts`) and frees the slot. Its next turn takes a slot through the same
admission and the rows are copied back, so it goes on exactly as if it had kept the slot.

The parked rows are bounded by ``budget_bytes``: past it the stream parked first (the one idle longest)
is **evicted**, its rows dropped; its next turn refuses with :class:`~engine.errors.ContextEvictedError`
(the service then starts it on a fresh context). A park whose rows would not be kept even once every
evictable context is gone (a budget of 0, a context larger than the budget) is refused before any copy
(:meth:`ParkedContexts.fits`, :meth:`ParkedContexts.refuse`): the stream is evicted at once. Every method
is called holding the scheduler's lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

H = TypeVar("H", bound=Hashable)

log = logging.getLogger("mossrt.parking")


@dataclass(frozen=True)
class ParkingStats:
    parked: int          # streams whose context is parked now
    bytes: int           # host memory of their rows
    budget_bytes: int
    parks: int           # totals since start
    resumes: int
    evictions: int


class ParkedContexts(Generic[H]):
    """Host copies of parked streams' KV rows, in the order they were parked, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"the parked context budget must be an integer >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[H, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.parks = self.resumes = self.evictions = 0

    def fits(self, nbytes: int, evictable: Callable[[H], bool]) -> bool:
        """Whether rows of ``nbytes`` would be kept by :meth:`put`: within the budget once every context
        ``evictable`` lets go is evicted (asked before the copy, so that a park whose rows would be dropped
        at once copies nothing)."""
        held = sum(rows.nbytes for owner, rows in self._rows.items() if not evictable(owner))
        return nbytes <= self.budget_bytes - held

    def refuse(self) -> None:
        """A park whose rows :meth:`fits` says would not be kept: counted as a park and an eviction (its
        slot was given away and its context dropped), without a copy."""
        self.parks += 1
        self.evictions += 1

    def put(self, owner: H, rows: np.ndarray, evictable: Callable[[H], bool]) -> list[H]:
        """Keep ``owner``'s rows; returns the owners evicted to stay within the budget (oldest first, only
        those ``evictable`` says may go: not one that is taking its slot back; ``owner`` itself when its
        rows alone exceed the budget)."""
        old = self._rows.pop(owner, None)
        if old is not None:
            # a stream is parked at most once between attaches (its resume takes its rows): a bug if seen;
            # the newer rows are its context, and the bytes stay exact
            log.error("a stream was parked while its earlier rows were still parked: replaced")
            self.bytes -= old.nbytes
        self._rows[owner] = rows
        self.bytes += rows.nbytes
        self.parks += 1
        evicted: list[H] = []
        for candidate in list(self._rows):
            if self.bytes <= self.budget_bytes:
                break
            if evictable(candidate):
                self.drop(candidate)
                self.evictions += 1
                evicted.append(candidate)
        return evicted

    def take(self, owner: H) -> np.ndarray | None:
        """The rows of a stream that resumes (None: it has none parked)."""
        rows = self._rows.pop(owner, None)
        if rows is not None:
            self.bytes -= rows.nbytes
            self.resumes += 1
        return rows

    def drop(self, owner: H) -> None:
        """Forget ``owner``'s rows (it closed, or is evicted)."""
        rows = self._rows.pop(owner, None)
        if rows is not None:
            self.bytes -= rows.nbytes

    def __contains__(self, owner: H) -> bool:
        return owner in self._rows

    def stats(self) -> ParkingStats:
        return ParkingStats(len(self._rows), self.bytes, self.budget_bytes, self.parks, self.resumes, self.evictions)
