"""Backbone KV of system blocks, computed once and copied into each new stream's slot.

Every stream's first turn starts with the same system prompt, and every stream with a given voice with
the same voice-clone rows (hundreds of them); a text-only first turn continues with the same assistant
header. The runner prefills the system block and that header as chunks of their own (fixed boundaries),
so the KV those chunks write does not depend on what follows: copying it from here gives bitwise the rows
a full prefill writes. Entries are keyed by the system block's content (the voice's codes are in the
rows) and hold its KV, followed by the header's once a text-only turn has computed it (a turn with user
context copies only the system block's rows); an LRU bounded in bytes.

Entries are device memory (``DeviceTensor``s of the bundle's compute dtype on its device, laid out as
``BackboneKVPool`` prefixes): an entry is filled from the slot that computed it and copied into a new
stream's slot by device-to-device copies, so nothing of it crosses the host bus per stream; the budget
counts device bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.runtime.device import DeviceTensor


def prefix_key(rows: np.ndarray) -> str:
    """Content key of a block of grid rows ``[n, 17]``."""
    arr = np.ascontiguousarray(rows, dtype=np.int64)
    return hashlib.sha256(arr.tobytes() + str(arr.shape).encode()).hexdigest()[:32]


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0           # entries dropped to stay within the budget (replacements are not)
    entries: int = 0
    bytes: int = 0


class PrefixCache:
    """LRU of prefixes (``BackboneKVPool`` layout: ``[layers * 2, kv_heads, n, head_dim]`` on the device) by
    content key, bounded in device bytes; thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be an integer >= 0 bytes, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, DeviceTensor] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    def get(self, key: str) -> DeviceTensor | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return kv

    def peek(self, key: str) -> DeviceTensor | None:
        """The entry, without counting a hit or a miss or refreshing its place."""
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, kv: DeviceTensor) -> bool:
        """Keep ``kv`` under ``key``, replacing an entry there (a longer prefix of the same block), and evict
        the least recently used beyond the budget; False if it alone exceeds the budget."""
        if kv.nbytes > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.stats.bytes -= old.nbytes
            self._entries[key] = kv
            self.stats.bytes += kv.nbytes
            while self.stats.bytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.stats.bytes -= old.nbytes
                self.stats.evictions += 1
            self.stats.entries = len(self._entries)
            return True
