"""Parked contexts: the KV rows of idle streams that gave their slot to a waiter, kept in host memory.

A stream between turns needs nothing of its slot but the rows it filled (the codec starts each turn's
audio afresh, and its sampling state is host state of the stream): when a stream waits for a slot and none
is free, admission picks the stream idle longest, and the device loop copies its used rows into a compact
host array (:class:`ParkedContexts`) and frees the slot. Its next turn takes a slot through the same
admission and the rows are copied back, so it goes on exactly as if it had kept the slot.

The parked rows are bounded by ``budget_bytes``: past it the stream parked first (the one idle longest)
is **evicted**, its rows dropped; its next turn refuses with :class:`~engine.errors.ContextEvictedError`
(the service then starts it on a fresh context). Every method is called holding the scheduler's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

import numpy as np

H = TypeVar("H", bound=Hashable)


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

    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"the parked context budget must be an integer >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[H, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.parks = self.resumes = self.evictions = 0

    def put(self, owner: H, rows: np.ndarray, evictable: Callable[[H], bool]) -> list[H]:
        """Keep ``owner``'s rows; returns the owners evicted to stay within the budget (oldest first, only
        those ``evictable`` says may go: not one that is taking its slot back; ``owner`` itself when its
        rows alone exceed the budget)."""
        self._rows[owner] = rows
        self.bytes += rows.nbytes
        self.parks += 1
        evicted = []
        for old in list(self._rows):
            if self.bytes <= self.budget_bytes:
                break
            if evictable(old):
                self.drop(old)
                self.evictions += 1
                evicted.append(old)
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
