"""The device side of generation: one tick advances every stream that has work, in batched graph calls.

A :class:`StepRunner` owns the backbone KV slot pool and the codec decoder rings for up to ``slots``
streams (a stream holds one slot while attached). Each :meth:`StepRunner.tick`:

1. asks every attached stream what it wants fed (``StreamState.want``);
2. runs prefills as batch-1 backbone calls on the stream's own slot, in chunks of ``prefill_chunk_rows``
   at fixed offsets of the prefill (so results never depend on load), at most about
   ``prefill_rows_per_tick`` rows per tick: running streams wait at most that long for a newcomer. A
   stream's system block is a chunk of its own, so its KV can come from the prefix cache instead (a
   device-to-device copy). A chunk's hidden states stay on the device; only the last row of a request
   is kept (copied on the device) for the depth call;
3. runs one batched backbone step for every stream that feeds one row, at the tick's batch bucket
   (``engine/model/buckets.py``: the smallest of 1, 2, 4, … slots covering the highest slot with work, bound once
   at fixed addresses); slots of the bucket with nothing to feed ride along with a dummy row written past
   their valid rows, or into a free slot (no stream's cache changes);
4. runs one batched depth call, at the same bucket, for every stream whose rows are complete (per-row
   sampling settings, draws and first-frame flags), reading the step's hidden states where the step left
   them (on the device); only the codes and per-row finiteness flags come back;
5. decodes audio in one batched codec call: a turn's first frame at once, later frames in chunks that
   grow along ``codec_schedule`` (fewer, larger calls), but never later than the stream's playback
   needs them; frames are handed back, in order, once their audio exists.

A failing call is retried stream by stream, so a stream whose state breaks a graph fails alone.
Not thread-safe: one thread drives a runner (the scheduler's loop, or a session's caller).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from engine.audio.codec import MAX_FRAMES_PER_CALL
from engine.errors import CapacityError, GraphError, InputError
from engine.kv.prefix import PrefixCache, prefix_key
from engine.model.buckets import (
    CAPTURE_WARM_RUNS,
    BucketBuffers,
    BufferStats,
    PrefillBuffers,
    bucket_for,
    bucket_sizes,
    history_windows,
)
from engine.model.tts import NON_FINITE_LOGITS
from engine.runtime.timing import CallTiming
from engine.serving.stream import Frame, StepRequest, StreamState, TurnStats

log = logging.getLogger("mossrt.runner")

DEFAULT_PREFILL_CHUNK_ROWS = 64
DEFAULT_PREFILL_ROWS_PER_TICK = 64
SERVICE_CODEC_SCHEDULE = (1, 1, 2, 4, 6)   # frames per codec call along a turn (the last repeats)


def frames_to_decode(available: int, ended: bool, target: int, ahead_s: float | None, tick_s: float,
                     codec_call_s: float, frame_s: float) -> int:
    """How many of a stream's ``available`` generated frames the codec decodes now (0: wait for more).

    A chunk of ``target`` frames (the schedule's size for this call) once there are that many; everything
    when the turn has ended. Earlier, with fewer frames, only to keep playback going: when the listener's
    remaining audio (``ahead_s``) would run out before the next tick and codec call could deliver. A listener
    already starved (``ahead_s <= 0``) of a stream that generates slower than real time gains nothing from
    small calls, which cost the codec's whole weight read each: such a stream keeps the schedule's chunk,
    the fastest way through its remaining audio.
    """
    if ended:
        return min(available, MAX_FRAMES_PER_CALL)
    if available >= target:
        return target
    if ahead_s is not None and ahead_s <= 2 * (tick_s + codec_call_s) and (ahead_s > 0 or tick_s < frame_s):
        return available
    return 0


@dataclass
class RunnerTiming:
    prefill: CallTiming = field(default_factory=CallTiming)
    step: CallTiming = field(default_factory=CallTiming)
    depth: CallTiming = field(default_factory=CallTiming)
    codec: CallTiming = field(default_factory=CallTiming)
    ticks: int = 0
    tick_s: float = 0.0
    prefix_rows_copied: int = 0
    idle_rows_stepped: int = 0         # step rows of streams between turns riding in the bucket (0 when slots
                                       # are kept in order: the cost item 4 of docs/architecture.md rules out)
    slot_trades: int = 0               # a generating stream moved below an idle one (rows and codec rings copied)


@dataclass
class _Entry:
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


@dataclass
class TickResult:
    frames: list[tuple[StreamState, Frame]] = field(default_factory=list)
    turn_ends: list[tuple[StreamState, int, TurnStats]] = field(default_factory=list)
    failed: list[tuple[StreamState, Exception]] = field(default_factory=list)
    worked: bool = False               # any graph ran


class StepRunner:
    def __init__(self, model, slots: int, max_context_rows: int,
                 prefill_chunk_rows: int = DEFAULT_PREFILL_CHUNK_ROWS,
                 prefill_rows_per_tick: int = DEFAULT_PREFILL_ROWS_PER_TICK,
                 codec_schedule: tuple[int, ...] = (1,), prefix_cache: PrefixCache | None = None,
                 capture: bool = False):
        for name, v in (("slots", slots), ("prefill_chunk_rows", prefill_chunk_rows),
                        ("prefill_rows_per_tick", prefill_rows_per_tick), ("max_context_rows", max_context_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}")
        self.model = model
        self.codec_schedule = tuple(model.codec.check_chunk_sizes(codec_schedule))
        # the only frame counts a codec call takes (fixed shapes per batch): the schedule's sizes and 1, so
        # any due count splits into them (see codec_call_frames)
        self.codec_call_sizes = tuple(sorted(set(self.codec_schedule) | {1}))
        self.slots = slots
        self.max_context_rows = max_context_rows
        self.prefill_chunk_rows = prefill_chunk_rows
        self.prefill_rows_per_tick = prefill_rows_per_tick
        self.prefix_cache = prefix_cache
        self.kv = model.kv_pool(slots, max_context_rows)
        self.decoder = model.codec.streaming_decoder(slots, model.layout.codebooks)
        self.timing = RunnerTiming(codec=self.decoder.timing)
        self._entries: list[_Entry] = []          # index = slot
        self._serial = 0
        self._frame_s = model.codec.frame_seconds
        self._tick_s = 0.0                          # running mean of a working tick's duration
        self._codec_call_s = 0.0                    # running mean of a codec call's duration
        self._rider_row = model.prompt.text_rows([model.layout.text_pad_id])[0]
        self.bucket_sizes = bucket_sizes(slots)
        self.buffer_stats = BufferStats()
        self._buckets: dict[int, BucketBuffers] = {}
        self.prefill_buffers = PrefillBuffers(model, slots, prefill_chunk_rows, self.buffer_stats)
        self.capture = capture                      # run the buckets' calls as captured CUDA graphs
        self.warmed = False                         # warm_up ran: codec calls take bucketed stream counts
        self._lost: list[StreamState] = []          # idle contexts a failed trade could not restore (take_lost)

    # ------------------------------------------------------------------ slots
    @property
    def attached(self) -> int:
        return len(self._entries)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self._entries)

    def bytes_per_stream(self) -> int:
        return self.kv.nbytes_per_slot + self.decoder.state_bytes_per_stream

    def attach(self, stream: StreamState, rows: np.ndarray | None = None) -> int:
        """Give ``stream`` a slot; CapacityError when every slot is taken. ``rows``: its context's KV rows
        (from :meth:`park_rows`), copied back into the slot."""
        if stream.limits.max_context_rows > self.max_context_rows:
            raise InputError(f"the stream allows {stream.limits.max_context_rows} context rows; this runner's "
                             f"slots hold {self.max_context_rows}")
        if any(e.stream is stream for e in self._entries):
            raise InputError("the stream is already attached")
        if not self.free_slots:
            raise CapacityError(f"all {self.slots} stream slots are in use")
        slot = len(self._entries)
        self.kv.lengths[slot] = 0
        self.decoder.reset(slot)          # before the entry exists: a failure here leaves the runner as it was
        if rows is not None:
            self.kv.write_rows(slot, rows)
        self._serial += 1
        self._entries.append(_Entry(stream, slot, self._serial))
        return slot

    def detach(self, stream: StreamState) -> None:
        """Free the stream's slot; the last slot's stream moves into it so active slots stay a prefix. All or
        nothing: the move's device copies (its KV rows, then its codec rings and position) run first, and the
        host bookkeeping (lengths, frame position, entries) is committed only once both succeeded, so a
        failing copy leaves every stream where it was and whole (the stream stays attached: retry later,
        and the retry moves the same rows)."""
        entry = self._entry(stream)
        if entry.request is not None:
            stream.release(entry.request)
            entry.request = None
        last = self._entries[-1]
        if last is not entry:
            self.kv.copy_slot(last.slot, entry.slot)
            self.decoder.copy_stream(last.slot, entry.slot)
            self.kv.lengths[entry.slot] = self.kv.lengths[last.slot]        # committed: nothing below fails
            self.decoder.commit_copy(last.slot, entry.slot)
            last.slot = entry.slot
            self._entries[entry.slot] = last
        self._entries.pop()
        self.kv.lengths[len(self._entries)] = 0

    def park_row_count(self, stream: StreamState) -> int:
        """Rows a park of the stream copies: its context's, not its slot's capacity (so its bytes,
        ``kv.host_bytes``, are known before the copy)."""
        return min(int(self.kv.lengths[self._entry(stream).slot]), stream.fed_rows)

    def park_rows(self, stream: StreamState) -> np.ndarray:
        """A host copy of the rows the stream's context uses, [layers, 2, kv_heads, rows, head_dim]; changes
        nothing (its slot is freed by :meth:`detach`). Between turns only: its codec stream starts afresh at
        its next turn anyway, and its sampling state is the stream's own."""
        return self.kv.park_rows(self._entry(stream).slot, self.park_row_count(stream))

    def take_lost(self) -> list[StreamState]:
        """Idle streams whose context a failed slot trade could not restore since the last call (their rows
        are gone: their next turn must start on a fresh stream)."""
        lost, self._lost = self._lost, []
        return lost

    def context_kv(self, stream: StreamState) -> np.ndarray:
        """A copy of the stream's KV rows [layers, 2, kv_heads, rows, head_dim] (tests, diagnostics)."""
        return self.kv.rows_of(self._entry(stream).slot)

    def _entry(self, stream: StreamState) -> _Entry:
        for e in self._entries:
            if e.stream is stream:
                return e
        raise InputError("the stream is not attached to this runner")

    # ------------------------------------------------------------------ warm-up
    def warm_up(self) -> list[int]:
        """Make every call shape the loop will run before any stream attaches, so no live tick stalls on a
        first use (bindings, onnxruntime's first-run allocations, a CUDA graph's warm-up runs and capture):
        each bucket's backbone step, its depth call at every bound history window (64 to 4,096 frames: a
        request's ``repetition_window`` picks one, and a first use during serving would stall every stream's
        tick on a capture) and, from then on, the codec's calls at each bucket's stream count and each of ``codec_call_sizes``. Every row is padding,
        as the loop runs free slots: step rows write their dummy row at a free slot's length (its lengths
        stay), depth codes are dropped, codec rows ride with 0 frames (rings and positions untouched).
        With capture each call runs ``CAPTURE_WARM_RUNS`` times. Must run on the thread that will run the
        ticks (onnxruntime keeps captured graphs per thread). Returns the buckets warmed."""
        if self._entries:
            raise InputError("warm up before any stream attaches")
        runs = CAPTURE_WARM_RUNS if self.capture and self.model.cuda_graphs else 1
        for bucket in self.bucket_sizes:
            bufs = self._bucket([bucket - 1])
            for _ in range(runs):
                bufs.stage_step({}, self.kv.lengths[:bucket], self._rider_row)
                self.model.run_step(bufs)
            for window in history_windows():
                for _ in range(runs):
                    self.model.run_bucket_depth(bufs, bufs.stage_depth([], self.model.history_pad, window))
        self.decoder.warm([(n, frames) for n in self.bucket_sizes for frames in self.codec_call_sizes])
        self.warmed = True
        return list(self.bucket_sizes)

    # ------------------------------------------------------------------ one tick
    def tick(self) -> TickResult:
        t0 = time.perf_counter()
        result = TickResult()
        for e in self._entries:
            if e.request is None and self.kv.lengths[e.slot] > e.stream.fed_rows:
                self.kv.lengths[e.slot] = e.stream.fed_rows     # the stream truncated its context
            if e.request is not None and e.stream.aborted(e.request):
                e.stream.release(e.request)
                e.request = None
            if e.request is None:
                e.request = e.stream.want()
                e.fed = 0
                if e.request is not None:
                    # where its rows go, read with the request (under the stream's lock): a truncate and a
                    # new turn between the check above and want() must not make it write at the old length
                    self.kv.lengths[e.slot] = e.request.start_row
        self._generating_first()
        prefills = sorted((e for e in self._entries if e.request is not None and len(e.request.rows) > 1),
                          key=lambda e: e.serial)
        decodes = [e for e in self._entries if e.request is not None and len(e.request.rows) == 1]
        done: list[tuple[_Entry, bool]] = []       # (entry, whether its hidden row is a prefill's)
        if prefills:
            done += self._prefill(prefills, result)
        if decodes or done:
            # one bucket for the tick's step and depth: they share its hidden buffer
            bufs = self._bucket([e.slot for e in decodes] + [e.slot for e, _ in done])
            if decodes:
                done += self._step(decodes, bufs, result)
            for e, _ in done:
                if not e.request.sample:            # context rows only (prime): no frame follows
                    e.stream.release(e.request)
                    e.request = None
            done = [(e, h) for e, h in done if e.request is not None]
            if done:
                for e, frame in self._depth(done, bufs, result):
                    e.pending.append(frame)
        self._hand_back(result)
        if result.worked:
            spent = time.perf_counter() - t0
            self.timing.ticks += 1
            self.timing.tick_s += spent
            self._tick_s = spent if not self._tick_s else 0.8 * self._tick_s + 0.2 * spent
        return result

    def _generating_first(self) -> None:
        """A stream with frames to make in a slot above an idle stream's (no turn in progress, its audio all
        handed back) trades slots with it, so the batch bucket covers the generating streams, not idle ones
        riding below them: as its turn starts, or mid-turn when the stream below it has just finished its own.
        At a tick's start, when no hidden row is kept for a later call. The idle stream's rows go through the
        host (its codec ring does not matter: its next turn's audio starts afresh), the generating one's rows
        move on the device, and mid-turn its codec ring and frame position move with them. A trade that fails
        leaves both streams consistent (:meth:`_trade`) and ends this tick's trades: the tick runs them where
        they are (a trade only saves rider rows)."""
        idle = [e for e in self._entries if self._riding_idle(e)]
        for e in sorted(self._entries, key=lambda e: -e.slot):
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
                return
            self.timing.slot_trades += 1

    def _trade(self, e: _Entry, low: _Entry, starting: bool) -> None:
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

    def _commit_trade(self, e: _Entry, low: _Entry, n_e: int) -> None:
        """The host half of a trade whose copies of ``e`` succeeded: ``e`` in ``low``'s old slot, ``low`` in ``e``'s
        (its length is set by whoever wrote its rows there)."""
        lo, hi = low.slot, e.slot
        self.kv.lengths[lo] = n_e
        self.kv.lengths[hi] = 0
        low.slot, e.slot = hi, lo
        self._entries[low.slot], self._entries[e.slot] = low, e

    def _write_back(self, e: _Entry, slot: int, rows: np.ndarray) -> None:
        """An idle stream's rows back into ``slot`` (its slot now) from the host copy, after a failed trade; if
        that fails too its context is dropped (length 0, :meth:`take_lost`) rather than left wrong."""
        try:
            self.kv.write_rows(slot, rows)
        except Exception as exc:  # noqa: BLE001 - reported as a lost context
            log.error("an idle stream's rows could not be written back after a failed slot trade: %s", exc)
            self.kv.lengths[slot] = 0
            self._lost.append(e.stream)

    @staticmethod
    def _riding_idle(e: _Entry) -> bool:
        s = e.stream
        return e.request is None and not e.pending and (not s.has_turn or s.turn_done) and not s.closed

    def has_work(self) -> bool:
        """Whether a tick now would run a graph or hand back frames."""
        return self.seconds_until_work() == 0

    # ------------------------------------------------------------------ prefill, step, depth
    def _chunk_end(self, e: _Entry) -> int:
        """End of the next prefill chunk: chunks start at multiples of prefill_chunk_rows from the start
        of the request, except that each end of a cacheable prefix (``prefix_cuts``) ends a chunk too."""
        n, c, start = len(e.request.rows), self.prefill_chunk_rows, e.fed
        cuts = [cut for cut in e.request.prefix_cuts if cut > start]
        if cuts:
            return min(cuts[0], (start // c + 1) * c)
        return min(n, start + c)

    def _from_prefix_cache(self, e: _Entry) -> None:
        """Start the slot with the longest cached prefix of the request (its system block's KV, or that
        and the assistant header's), when there is one."""
        req = e.request
        if self.prefix_cache is None or not req.prefix_cuts or e.fed or self.kv.lengths[e.slot]:
            return
        cached = self.prefix_cache.get(prefix_key(req.rows[: req.prefix_cuts[0]]))
        held = 0 if cached is None else self.kv.prefix_rows(cached)
        n = max((cut for cut in req.prefix_cuts if cut <= held), default=0)
        if n:
            self.kv.copy_rows(cached, e.slot, n)          # device to device
            e.stream.on_fed(req, req.rows[:n])
            e.fed = n
            self.timing.prefix_rows_copied += n

    def _to_prefix_cache(self, e: _Entry) -> None:
        """Keep the request's cacheable prefix once it is all computed, unless a cached one is as long."""
        req = e.request
        if self.prefix_cache is None or not req.prefix_cuts or e.fed != req.prefix_cuts[-1] \
                or self.kv.lengths[e.slot] != e.fed:
            return
        key = prefix_key(req.rows[: req.prefix_cuts[0]])
        held = self.prefix_cache.peek(key)
        if held is None or self.kv.prefix_rows(held) < e.fed:
            self.prefix_cache.put(key, self.kv.prefix_of(e.slot, e.fed))

    def _prefill(self, entries: list[_Entry], result: TickResult) -> list[tuple[_Entry, bool]]:
        """Chunks of the entries' prefills; the hidden states stay on the device (``prefill_buffers``), the
        last row of a request's last chunk kept for the depth call. Their finiteness is not checked here:
        a NaN hidden row (or NaN KV rows it attends to) gives NaN logits, which the depth call's ``finite``
        flag refuses at the turn's first frame."""
        done = []
        budget = self.prefill_rows_per_tick
        for e in entries:
            last = False                    # whether the request's last row was computed (and kept)
            if e.request is not None and not e.stream.aborted(e.request):
                self._from_prefix_cache(e)
            while budget > 0 and e.request is not None and e.fed < len(e.request.rows):
                if e.stream.aborted(e.request):
                    e.stream.release(e.request)
                    e.request = None
                    break
                end = self._chunk_end(e)
                rows = e.request.rows[e.fed:end]
                try:
                    self.model.run_backbone_into(rows[None], self.kv, e.slot, e.slot + 1, self.prefill_buffers.hidden,
                                                 self.timing.prefill)
                    if end == len(e.request.rows):
                        self.prefill_buffers.keep_last(e.slot, len(rows))
                except Exception as exc:  # noqa: BLE001 - any failure of this stream's call fails this stream only
                    self._fail(e, exc, result)
                    break
                result.worked = True
                self.kv.lengths[e.slot] += len(rows)
                e.stream.on_fed(e.request, rows)
                e.fed = end
                budget -= len(rows)
                self._to_prefix_cache(e)
                last = e.fed == len(e.request.rows)
            if e.request is not None and e.fed == len(e.request.rows):
                # False only for a prime whose rows all came from the prefix cache (no frame follows it): a
                # turn's rows always run past its cacheable prefix
                done.append((e, last))
        return done

    def _bucket(self, slots: list[int]) -> BucketBuffers:
        """The buffers of the smallest bucket covering ``slots`` (made, allocated and bound, on first use)."""
        bucket = bucket_for(max(slots) + 1, self.bucket_sizes)
        if bucket not in self._buckets:
            self._buckets[bucket] = self.model.step_buffers(bucket, self.kv, self.buffer_stats, self.capture)
        return self._buckets[bucket]

    def _step(self, entries: list[_Entry], bufs: BucketBuffers, result: TickResult) -> list[tuple[_Entry, bool]]:
        def run(group: list[_Entry]) -> list[None]:
            bufs.stage_step({e.slot: e.request.rows[0] for e in group}, self.kv.lengths[: bufs.bucket],
                            self._rider_row)
            self.timing.idle_rows_stepped += sum(1 for o in self._entries[: bufs.bucket] if self._riding_idle(o))
            self.model.run_step(bufs, self.timing.step)
            return [None] * len(group)                # the hidden states stay in bufs.hidden, on the device

        def commit(e: _Entry, _: None) -> tuple[_Entry, bool]:
            self.kv.lengths[e.slot] += 1
            e.stream.on_fed(e.request, e.request.rows)
            return e, False

        result.worked = True
        return self._isolated(run, commit, entries, result)

    def _depth(self, done: list[tuple[_Entry, bool]], bufs: BucketBuffers,
               result: TickResult) -> list[tuple[_Entry, Frame]]:
        """One frame for each stream of ``done``, from its hidden state: in ``bufs.hidden`` already (a step's
        row) or kept by its prefill (copied into its row of the buffer here, on the device)."""
        def run(group: list[tuple[_Entry, bool]]) -> list[tuple[np.ndarray, bool]]:
            self.prefill_buffers.to_bucket(bufs, [e.slot for e, from_prefill in group if from_prefill])
            window = bufs.stage_depth([(e.slot, e.request.history, e.request.params, e.request.uniform,
                                        e.request.first_frame) for e, _ in group], self.model.history_pad)
            codes, finite = self.model.run_bucket_depth(bufs, window, self.timing.depth)
            return [(codes[e.slot], bool(finite[e.slot])) for e, _ in group]

        def commit(item: tuple[_Entry, bool], out: tuple[np.ndarray, bool]) -> tuple[_Entry, Frame] | None:
            e, (codes, finite) = item[0], out
            if not finite:
                raise GraphError(NON_FINITE_LOGITS)
            req, e.request = e.request, None
            frame = e.stream.accept(req, codes)
            return None if frame is None else (e, frame)

        result.worked = True
        return self._isolated(run, commit, done, result, entry_of=lambda item: item[0])

    # ------------------------------------------------------------------ audio and hand-back
    def _due(self, e: _Entry, now: float) -> list[Frame]:
        """The pending frames whose audio is decoded now: the head of the pending list up to the turn's
        chunk size, all of it when the turn ended, or when waiting longer would starve the listener."""
        turn = e.pending[0].turn
        if e.codec_turn != turn:     # the previous turn is all handed back: start this one's codec stream
            self.decoder.reset(e.slot)   # each turn's audio is its own codec stream (as upstream)
            e.codec_turn, e.chunks, e.play_start, e.audio_s = turn, 0, None, 0.0
        same = [f for f in e.pending if f.turn == turn]
        audio = [f for f in same if f.needs_audio]
        if not audio:
            return []
        ended = len(same) < len(e.pending) or e.stream.turn_serial != turn or e.stream.turn_done or e.stream.closed
        ahead = None if e.play_start is None else e.play_start + e.audio_s - now
        target = self.codec_schedule[min(e.chunks, len(self.codec_schedule) - 1)]
        return audio[:frames_to_decode(len(audio), ended, target, ahead, self._tick_s, self._codec_call_s,
                                       self._frame_s)]

    def seconds_until_work(self) -> float | None:
        """When a tick would next have something to do: 0 now (a request to feed, frames to decode or hand
        back), the seconds until some listener's audio runs low enough for pending frames to be decoded
        early, or None when nothing changes until a stream does (new text, a resumed consumer, a close)."""
        if any(e.request is not None for e in self._entries):
            return 0.0
        now, soonest = time.monotonic(), None
        for e in self._entries:
            if not e.pending:
                continue
            if not e.pending[0].needs_audio or self._due(e, now):
                return 0.0
            if e.play_start is not None:
                wait = e.play_start + e.audio_s - now - 2 * (self._tick_s + self._codec_call_s)
                if wait > 0:
                    soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def _hand_back(self, result: TickResult) -> None:
        now = time.monotonic()
        due = [(e, fs) for e in self._entries if e.pending for fs in [self._due(e, now)] if fs]
        if due:
            self._decode(due, result)
        for e in self._entries:
            while e.pending and (e.pending[0].audio is not None or not e.pending[0].needs_audio):
                frame = e.pending.pop(0)
                result.frames.append((e.stream, frame))
            if not e.pending:
                for turn, stats in e.stream.take_finished():
                    result.turn_ends.append((e.stream, turn, stats))

    def codec_call_frames(self, wanted: int) -> int:
        """Frames of the next codec call when ``wanted`` are due: the largest allowed size not above it; the
        rest stays pending for the next tick (one call per tick, so a failed call is retried whole)."""
        return max(n for n in self.codec_call_sizes if n <= wanted)

    def _decode(self, due: list[tuple[_Entry, list[Frame]]], result: TickResult) -> None:
        size = self.codec_call_frames(max(len(fs) for _, fs in due))
        due = [(e, fs[:size]) for e, fs in due]

        def run(group: list[tuple[_Entry, list[Frame]]]) -> list[np.ndarray]:
            hi = max(e.slot for e, _ in group) + 1
            if self.warmed:             # the warmed shapes: rows past the highest due slot ride with 0 frames
                hi = bucket_for(hi, self.bucket_sizes)
            codes = np.zeros((hi, size, self.model.codec.num_quantizers), np.int64)
            count = np.zeros(hi, np.int64)
            for e, fs in group:
                for i, f in enumerate(fs):
                    codes[e.slot, i, : len(f.codes)] = f.codes
                count[e.slot] = len(fs)
            t0 = time.perf_counter()
            audio = self.decoder.decode_checked(codes, count)
            spent = time.perf_counter() - t0
            self._codec_call_s = spent if not self._codec_call_s else 0.8 * self._codec_call_s + 0.2 * spent
            return [audio[e.slot] for e, _ in group]

        def commit(item: tuple[_Entry, list[Frame]], audio: np.ndarray) -> None:
            e, fs = item
            spf = self.model.codec.samples_per_frame
            for i, f in enumerate(fs):
                f.audio = audio[i * spf:(i + 1) * spf]
            e.chunks += 1
            e.play_start = time.monotonic() if e.play_start is None else e.play_start
            e.audio_s += len(fs) * self._frame_s

        result.worked = True
        failed_before = len(result.failed)
        self._isolated(run, commit, due, result, entry_of=lambda item: item[0])
        for stream, _ in result.failed[failed_before:]:     # a stream whose audio failed: hand back what it has
            for e in self._entries:
                if e.stream is stream:
                    for f in e.pending:
                        if f.audio is None:
                            f.audio = np.zeros(0, np.float32)

    # ------------------------------------------------------------------ failure isolation
    def _isolated(self, run, commit, items: list, result: TickResult, entry_of=lambda item: item) -> list:
        """``run(items)``, the batched graph call, returns one output per item; if it raises, each item is
        run alone, failing only those that raise. Then ``commit(item, output)`` applies each output exactly
        once (a failing commit fails its item alone): a call that succeeded is never run again, so no row is
        computed twice and no request is read after it was consumed. Returns the commits' results (not
        None)."""
        try:
            outputs = list(zip(items, run(items)))
        except Exception as batch_error:  # noqa: BLE001
            if len(items) == 1:
                self._fail(entry_of(items[0]), batch_error, result)
                return []
            log.warning("batched call failed (%s); retrying %d streams one by one", batch_error, len(items))
            outputs = []
            for item in items:
                try:
                    outputs += zip([item], run([item]))
                except Exception as exc:  # noqa: BLE001
                    self._fail(entry_of(item), exc, result)
        out = []
        for item, output in outputs:
            try:
                done = commit(item, output)
            except Exception as exc:  # noqa: BLE001 - one stream's results, never the others'
                self._fail(entry_of(item), exc, result)
                continue
            if done is not None:
                out.append(done)
        return out

    def _fail(self, e: _Entry, exc: Exception, result: TickResult) -> None:
        log.error("stream in slot %d failed: %s", e.slot, exc)
        e.request = None
        e.stream.fail()
        result.failed.append((e.stream, exc))
