"""The runner's slot table: which stream holds which KV slot and codec ring, and the moves between slots.

Active slots stay a prefix (``0..attached-1``): a detach moves the last slot's stream into the freed slot,
and a generating stream above an idle one trades slots with it (:meth:`SlotTable.generating_first`), so
the batch bucket covers the streams with work. Every move is all or nothing: device copies first, the
host bookkeeping committed only once they succeeded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from engine.audio.codec_stream import StreamingDecoder
from engine.errors import CapacityError, InputError
from engine.kv.pool import BackboneKVPool
from engine.serving.stream import Frame, StepRequest, StreamState

log = logging.getLogger("mossrt.runner")


@dataclass
class SlotEntry:
    """One attached stream: its slot, the request being fed, and its frames waiting for their audio."""

    stream: StreamState
    slot: int
    serial: int                        # attach order: prefills are served first come, first served
    request: StepRequest | None = None
    fed: int = 0                       # rows of the request already fed (chunked prefill)
    codec_turn: int = -1               # the turn whose audio the codec ring holds
    pending: list[Frame] = field(default_factory=list)   # accepted frames waiting for their audio
    chunks: int = 0                    # codec calls of the current turn
    play_start: float | None = None    # when the turn's first audio was handed back
    audio_s: float = 0.0               # audio handed back in the turn

    @property
    def riding_idle(self) -> bool:
        """Between turns with nothing to feed or hand back: its slot only rides along in a bucket."""
        s = self.stream
        return self.request is None and not self.pending and (not s.has_turn or s.turn_done) and not s.closed

    def drop_request(self) -> None:
        """Give the request up (its turn ended meanwhile, or it needs no frame): the stream may ask again."""
        if self.request is not None:
            self.stream.release(self.request)
        self.request = None


class SlotTable:
    """Up to ``slots`` streams in the slots of ``kv`` (their KV rows) and ``decoder`` (their codec rings)."""

    def __init__(self, kv: BackboneKVPool, decoder: StreamingDecoder, slots: int, max_context_rows: int):
        self.kv = kv
        self.decoder = decoder
        self.slots = slots
        self.max_context_rows = max_context_rows
        self.entries: list[SlotEntry] = []          # index = slot
        self._serial = 0
        self._lost: list[StreamState] = []          # idle contexts a failed trade could not restore (take_lost)

    # ------------------------------------------------------------------ attach and detach
    @property
    def attached(self) -> int:
        return len(self.entries)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.entries)

    def attach(self, stream: StreamState, rows: np.ndarray | None = None) -> int:
        """Give ``stream`` a slot; CapacityError when every slot is taken. ``rows``: its context's KV rows
        (from :meth:`park_rows`), copied back into the slot."""
        if stream.limits.max_context_rows > self.max_context_rows:
            raise InputError(f"the stream allows {stream.limits.max_context_rows} context rows; this runner's "
                             f"slots hold {self.max_context_rows}")
        if any(e.stream is stream for e in self.entries):
            raise InputError("the stream is already attached")
        if not self.free_slots:
            raise CapacityError(f"all {self.slots} stream slots are in use")
        slot = len(self.entries)
        self.kv.lengths[slot] = 0
        self.decoder.reset(slot)          # before the entry exists: a failure here leaves the runner as it was
        if rows is not None:
            self.kv.write_rows(slot, rows)
        self._serial += 1
        self.entries.append(SlotEntry(stream, slot, self._serial))
        return slot

    def detach(self, stream: StreamState) -> None:
        """Free the stream's slot; the last slot's stream moves into it so active slots stay a prefix. All or
        nothing: the move's device copies (its KV rows, then its codec rings and position) run first, and the
        host bookkeeping (lengths, frame position, entries) is committed only once both succeeded, so a
        failing copy leaves every stream where it was and whole (the stream stays attached: retry later,
        and the retry moves the same rows)."""
        entry = self.entry(stream)
        entry.drop_request()
        last = self.entries[-1]
        if last is not entry:
            self.kv.copy_slot(last.slot, entry.slot)
            self.decoder.copy_stream(last.slot, entry.slot)
            self.kv.lengths[entry.slot] = self.kv.lengths[last.slot]        # committed: nothing below fails
            self.decoder.commit_copy(last.slot, entry.slot)
            last.slot = entry.slot
            self.entries[entry.slot] = last
        self.entries.pop()
        self.kv.lengths[len(self.entries)] = 0

    def park_row_count(self, stream: StreamState) -> int:
        """Rows a park of the stream copies: its context's, not its slot's capacity (so its bytes,
        ``kv.host_bytes``, are known before the copy)."""
        return min(int(self.kv.lengths[self.entry(stream).slot]), stream.fed_rows)

    def park_rows(self, stream: StreamState) -> np.ndarray:
        """A host copy of the rows the stream's context uses, [layers, 2, kv_heads, rows, head_dim]; changes
        nothing (its slot is freed by :meth:`detach`). Between turns only: its codec stream starts afresh at
        its next turn anyway, and its sampling state is the stream's own."""
        return self.kv.park_rows(self.entry(stream).slot, self.park_row_count(stream))

    def take_lost(self) -> list[StreamState]:
        """Idle streams whose context a failed slot trade could not restore since the last call (their rows
        are gone: their next turn must start on a fresh stream)."""
        lost, self._lost = self._lost, []
        return lost

    def context_kv(self, stream: StreamState) -> np.ndarray:
        """A copy of the stream's KV rows [layers, 2, kv_heads, rows, head_dim] (tests, diagnostics)."""
        return self.kv.rows_of(self.entry(stream).slot)

    def entry(self, stream: StreamState) -> SlotEntry:
        """The entry of an attached stream (InputError when it is not attached)."""
        for e in self.entries:
            if e.stream is stream:
                return e
        raise InputError("the stream is not attached to this runner")

    # ------------------------------------------------------------------ a tick's requests
    def collect_requests(self) -> int:
        """At a tick's start: each stream's KV length follows a truncated context, a request whose turn ended
        meanwhile is given up, and a stream without one is asked what it wants fed now. Returns how many
        streams have a request."""
        asking = 0
        for e in self.entries:
            if e.request is None and self.kv.lengths[e.slot] > e.stream.fed_rows:
                self.kv.lengths[e.slot] = e.stream.fed_rows     # the stream truncated its context
            if e.request is not None and e.stream.aborted(e.request):
                e.drop_request()
            if e.request is None:
                e.request = e.stream.want()
                e.fed = 0
                if e.request is not None:
                    # where its rows go, read with the request (under the stream's lock): a truncate and a
                    # new turn between the check above and want() must not make it write at the old length
                    self.kv.lengths[e.slot] = e.request.start_row
            asking += e.request is not None
        return asking

    # ------------------------------------------------------------------ trades
    def generating_first(self) -> int:
        """A stream with frames to make in a slot above an idle stream's (no turn in progress, its audio all
        handed back) trades slots with it, so the batch bucket covers the generating streams, not idle ones
        riding below them: as its turn starts, or mid-turn when the stream below it has just finished its own.
        At a tick's start, when no hidden row is kept for a later call. The idle stream's rows go through the
        host (its codec ring does not matter: its next turn's audio starts afresh), the generating one's rows
        move on the device, and mid-turn its codec ring and frame position move with them. A trade that fails
        leaves both streams consistent (:meth:`_trade`) and ends this tick's trades: the tick runs them where
        they are (a trade only saves rider rows). Returns the trades made."""
        trades = 0
        idle = [e for e in self.entries if e.riding_idle]
        for e in sorted(self.entries, key=lambda e: -e.slot):
            req = e.request
            if not idle or req is None or not req.sample:
                continue
            low = idle[0]
            if low.slot >= e.slot:
                break
            idle.pop(0)
            try:
                self._trade(e, low, starting=req.first_frame and not e.fed and not e.pending)
            except Exception as exc:  # noqa: BLE001 - an optimisation's device copy, never the tick
                log.error("a slot trade failed (slots %d and %d): %s", low.slot, e.slot, exc)
                return trades
            trades += 1
        return trades

    def _trade(self, e: SlotEntry, low: SlotEntry, starting: bool) -> None:
        """Generating ``e`` into idle ``low``'s slot and ``low`` into ``e``'s, all or nothing. The device copies
        come first, in an order a failure can undo: ``e``'s codec ring over ``low``'s (which does not matter:
        ``low``'s next turn starts its audio afresh), ``low``'s rows to the host (changes nothing), ``e``'s rows
        over ``low``'s, ``low``'s rows into ``e``'s slot; the host bookkeeping (lengths, frame position,
        entries) is committed only after the copies that it records. A failure once ``low``'s slot was
        overwritten writes its rows back from the host copy; one in the last copy finishes the trade for
        ``e`` (its rows are whole in ``low``'s slot) and writes ``low``'s rows again. A context that cannot be
        written back is dropped (:meth:`take_lost`), never left wrong. Raises the failure."""
        lo, hi = low.slot, e.slot
        n_low, n_e = int(self.kv.lengths[lo]), int(self.kv.lengths[hi])
        if not starting:
            self.decoder.copy_stream(hi, lo)
            self.decoder.commit_copy(hi, lo)           # the mirror follows the device: slot lo's ring is e's now
        rows = self.kv.park_rows(lo, n_low)
        try:
            self.kv.copy_slot(hi, lo, n_e)             # e's rows in both slots now
        except Exception:
            self._write_back(low, lo, rows)
            raise
        try:
            self.kv.write_rows(hi, rows, set_length=False)
        except Exception:
            self._commit_trade(e, low, n_e)
            self._write_back(low, low.slot, rows)
            raise
        self._commit_trade(e, low, n_e)
        self.kv.lengths[low.slot] = n_low

    def _commit_trade(self, e: SlotEntry, low: SlotEntry, n_e: int) -> None:
        """The host half of a trade whose copies of ``e`` succeeded: ``e`` in ``low``'s old slot, ``low`` in ``e``'s
        (its length is set by whoever wrote its rows there)."""
        lo, hi = low.slot, e.slot
        self.kv.lengths[lo] = n_e
        self.kv.lengths[hi] = 0
        low.slot, e.slot = hi, lo
        self.entries[low.slot], self.entries[e.slot] = low, e

    def _write_back(self, e: SlotEntry, slot: int, rows: np.ndarray) -> None:
        """An idle stream's rows back into ``slot`` (its slot now) from the host copy, after a failed trade; if
        that fails too its context is dropped (length 0, :meth:`take_lost`) rather than left wrong."""
        try:
            self.kv.write_rows(slot, rows)
        except Exception as exc:  # noqa: BLE001 - reported as a lost context
            log.error("an idle stream's rows could not be written back after a failed slot trade: %s", exc)
            self.kv.lengths[slot] = 0
            self._lost.append(e.stream)
