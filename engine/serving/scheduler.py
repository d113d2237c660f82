"""Many streams, one device loop: the scheduler batches every stream's next step into shared graph calls.

A :class:`Scheduler` owns a :class:`StepRunner` (the onnxruntime sessions' KV slot pool and codec rings)
and runs its ticks on one thread: it attaches the streams admission let in, detaches the closed ones, runs a
tick and hands each stream's events to its sink. Callers hold :class:`~engine.serving.handles.StreamHandle` objects
(``engine.serving.handles``: they feed text and control turns from any thread and never run a graph); who holds a
slot, who waits for one and whose idle context is parked to make room is
:class:`~engine.serving.admission.Admission`'s, and the loop moves a parked stream's rows out of its slot and back
(``engine.kv.parking``). Cancel and close take effect at the next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import CapacityError, EngineError, InputError, OverloadError, StreamClosedError
from engine.kv.parking import ParkingStats
from engine.kv.prefix import PrefixCache, prefix_key
from engine.limits import Limits
from engine.model.buckets import history_windows
from engine.model.sampling import SamplingParams
from engine.runtime.device import DeviceTensor
from engine.serving.admission import Admission
from engine.serving.handles import (
    AsyncSink,
    Event,
    EventSink,
    FrameEvent,
    QueueSink,
    StreamError,
    StreamHandle,
    TurnEnd,
)
from engine.serving.runner import (
    DEFAULT_PREFILL_CHUNK_ROWS,
    DEFAULT_PREFILL_ROWS_PER_TICK,
    SERVICE_CODEC_SCHEDULE,
    StepRunner,
)
from engine.serving.stream import StreamState, TurnStats

if TYPE_CHECKING:
    from engine.model.tts import TTSModel

log = logging.getLogger("mossrt.scheduler")

DEFAULT_QUEUE_TIMEOUT = 10.0
DEFAULT_MAX_BUFFERED_FRAMES = 250      # 20 s of audio waiting for its consumer
MAX_DETACH_ATTEMPTS = 3                # a slot that cannot be freed so often: the device is not trustworthy
RESUME_TIMES_KEPT = 4096               # resume durations waiting to be read (take_resume_seconds)


@dataclass(frozen=True)
class SchedulerStats:
    capacity: int          # KV slots
    active: int            # streams holding a slot
    queued: int            # streams waiting for a slot
    generating: int        # streams with a turn in progress
    bytes_per_stream: int  # KV slot + codec rings
    idle: int = 0          # streams holding a slot with no turn in progress
    parking: ParkingStats | None = None   # parked contexts: how many, their bytes, parks/resumes/evictions


class Scheduler:
    """The device loop over ``slots`` KV slots of ``model``: admission (:attr:`admission`), the runner, and
    one thread that attaches, ticks and detaches."""

    def __init__(self, model: TTSModel, slots: int, limits: Limits | None = None,
                 prefill_chunk_rows: int = DEFAULT_PREFILL_CHUNK_ROWS,
                 prefill_rows_per_tick: int = DEFAULT_PREFILL_ROWS_PER_TICK,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
                 max_buffered_frames: int = DEFAULT_MAX_BUFFERED_FRAMES,
                 codec_schedule: tuple[int, ...] = SERVICE_CODEC_SCHEDULE,
                 prefix_cache_bytes: int = 0, warm_buckets: bool | None = None, parked_bytes: int = 0) -> None:
        """``warm_buckets``: the loop thread first runs every batch bucket's calls once on padding rows
        (``StepRunner.warm_up``), before it serves any stream (None: the model's ``warm_buckets``).
        ``parked_bytes``: host memory for the KV rows of parked streams (0: a parked stream's context is
        evicted at once)."""
        self.model = model
        self.limits = limits or Limits()
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.runner = StepRunner(model, slots, self.limits.max_context_rows, prefill_chunk_rows=prefill_chunk_rows,
                                 prefill_rows_per_tick=prefill_rows_per_tick, codec_schedule=codec_schedule,
                                 prefix_cache=self.prefix_cache, capture=model.claim_capture())
        self.queue_timeout = queue_timeout
        self.max_buffered_frames = max_buffered_frames
        self._cond = threading.Condition()
        self._dirty = False
        self.admission: Admission[StreamHandle] = Admission(self.runner.slots, queue_timeout, self._cond,
                                                            self._mark_dirty, lambda: self.broken, parked_bytes)
        self._resume_seconds: deque[float] = deque(maxlen=RESUME_TIMES_KEPT)
        self._handles: list[StreamHandle] = []    # attached, in the loop thread's view
        self._stop = False
        self._detach_failures: dict[int, int] = {}   # id(handle) -> failed detaches (its slot is still taken)
        self.broken: str | None = None            # why the engine is unusable (no new streams), else None
        self._warm = model.warm_buckets if warm_buckets is None else warm_buckets
        self._warmed = threading.Event()           # set when the loop is ready to tick (after any warm-up)
        self.warm_seconds: float | None = None     # how long the warm-up took (None: none ran)
        self._thread = threading.Thread(target=self._loop, name="mossrt-scheduler", daemon=True)
        self._thread.start()

    @staticmethod
    def slots_for_budget(model: TTSModel, budget_bytes: int, max_context_rows: int) -> int:
        """How many streams a byte budget holds (KV slot of max_context_rows rows + codec rings each)."""
        per = model.kv_bytes_per_slot(max_context_rows) + model.codec.decoder_bytes_per_stream()
        return max(0, budget_bytes // per)

    # ------------------------------------------------------------------ public
    @property
    def capacity(self) -> int:
        return self.runner.slots

    def stats(self) -> SchedulerStats:
        with self._cond:
            generating = sum(1 for h in self._handles if h.stream.has_turn and not h.stream.turn_done)
            return SchedulerStats(capacity=self.runner.slots, active=self.admission.promised,
                                  queued=self.admission.queued,
                                  generating=generating, bytes_per_stream=self.runner.bytes_per_stream(),
                                  idle=self.admission.idle, parking=self.admission.parked.stats())

    def take_resume_seconds(self) -> list[float]:
        """How long each resume since the last call took, from its admission to its rows back in a slot
        (what parking added to that turn's first audio)."""
        with self._cond:
            out = list(self._resume_seconds)
            self._resume_seconds.clear()
        return out

    def open_stream(self, voice_codes: np.ndarray | None = None, params: SamplingParams | None = None,
                    seed: int | None = None, decode_audio: bool = True, allow_special_tokens: bool = False,
                    sink: EventSink | None = None, limits: Limits | None = None, *, one_shot: bool = False,
                    may_park_others: bool = True) -> StreamHandle:
        """A new stream (no slot yet: it takes one at its first turn). Validates its settings now.

        ``one_shot``: the stream takes one turn (an utterance): when it ends its slot is freed at once, without
        a copy of its context (nobody resumes it), so it is never parked; its events already delivered still
        reach the consumer, and a second ``begin_turn`` raises InputError. ``may_park_others`` False: its turns
        take only a free slot and never park an idle stream to make room (so it causes no park and no
        eviction); it waits in the same queue (see ``engine.serving.admission``)."""
        if not self.admission.accepting:
            raise OverloadError("the server is draining: no new streams")
        limits = limits or self.limits
        if limits.max_context_rows > self.limits.max_context_rows:
            raise InputError(f"max_context_rows {limits.max_context_rows} exceeds the scheduler's "
                             f"{self.limits.max_context_rows}")
        stream = StreamState(self.model, voice_codes=voice_codes, params=params, seed=seed, limits=limits,
                             decode_audio=decode_audio, allow_special_tokens=allow_special_tokens)
        return StreamHandle(self.admission, self.wake, stream, sink or QueueSink(), self.max_buffered_frames,
                            one_shot=one_shot, may_park_others=may_park_others)

    def warm_prefix(self, voice_codes: np.ndarray | None = None, timeout: float = 600) -> DeviceTensor | None:
        """Compute (or find) the KV of a text-only first turn's opening for ``voice_codes`` (its system block
        and the assistant header) in the prefix cache and return its entry (device memory, see
        :meth:`prefix_to_host`), so streams with that voice skip those rows. None without a cache or when it
        alone exceeds the cache's budget."""
        if self.prefix_cache is None:
            return None
        probe = StreamState(self.model, voice_codes=voice_codes, limits=self.limits)
        rows = self.model.prompt.tts_prompt(probe.voice_codes)
        key = prefix_key(rows[: probe.system_rows])
        held = self.prefix_cache.peek(key)
        if held is None or self.runner.kv.prefix_rows(held) < len(rows):
            h = StreamHandle(self.admission, self.wake, probe, QueueSink(), self.max_buffered_frames)
            try:
                h.prime_prefix(rows, wait=timeout)
                deadline = time.monotonic() + timeout
                while probe.in_flight or probe.fed_rows < len(rows):
                    if time.monotonic() > deadline:
                        raise CapacityError("computing the voice's prefix timed out")
                    time.sleep(0.005)
            finally:
                h.close()
        return self.prefix_cache.get(key)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until the loop is ready to tick (its warm-up, if any, done); returns whether it is."""
        return self._warmed.wait(timeout)

    def prefix_to_host(self, prefix: DeviceTensor) -> np.ndarray:
        """A host copy of a prefix cache entry, [layers, 2, kv_heads, rows, head_dim] (read once, to persist it)."""
        return self.runner.kv.download_prefix(prefix)

    def cache_prefix(self, system_rows: np.ndarray, kv: np.ndarray) -> bool:
        """Keep host KV rows ``kv`` [layers, 2, kv_heads, rows, head_dim] (a persisted prefix) as the prefix
        cache's entry for the system block ``system_rows``, uploaded once; False without a cache or when it
        alone exceeds the budget."""
        if self.prefix_cache is None or kv.nbytes > self.prefix_cache.budget_bytes:
            return False
        return self.prefix_cache.put(prefix_key(system_rows), self.runner.kv.upload_prefix(kv))

    def drain(self, timeout: float) -> bool:
        """Stop admitting streams and wait up to ``timeout`` s for every turn in progress to end.
        Returns whether they all did."""
        self.admission.accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.stats().generating:
                return True
            time.sleep(0.05)
        return not self.stats().generating

    def stop(self) -> None:
        """End the loop; streams still open get a StreamError and are closed."""
        self.admission.close()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ waking the loop
    def _mark_dirty(self) -> None:
        """(Holding ``_cond``.) The loop has work: handles to attach or detach, or a stream changed."""
        self._dirty = True
        self._cond.notify_all()

    def wake(self) -> None:
        """A stream changed (text, a turn, cancel): the loop looks at it at its next wake."""
        with self._cond:
            self._mark_dirty()

    # ------------------------------------------------------------------ the loop (its own thread)
    def _warm_up(self) -> None:
        """The runner's warm-up, on the loop's own thread (captured graphs belong to the thread that ran
        them); a failure breaks the engine (no new streams, /ready says why) instead of the loop."""
        t0 = time.perf_counter()
        try:
            buckets = self.runner.warm_up()
        except Exception as exc:  # noqa: BLE001 - reported, never a dead loop
            log.exception("warming the batch buckets failed")
            self._break(f"warming the batch buckets failed: {type(exc).__name__}: {exc}")
            return
        self.warm_seconds = time.perf_counter() - t0
        windows = history_windows()
        log.info("warmed batch buckets %s (backbone step, depth call at history windows %d-%d, codec calls of "
                 "%s frames)%s in %.2f s", ", ".join(map(str, buckets)), windows[0], windows[-1],
                 "/".join(map(str, self.runner.codec_call_sizes)),
                 ", captured" if self.runner.capture and self.model.cuda_graphs else "", self.warm_seconds)

    def _loop(self) -> None:
        if self._warm:
            self._warm_up()
        self._warmed.set()
        wait_s: float | None = None     # from the last tick: 0 tick again, None sleep until woken, else at most
        while True:
            with self._cond:
                deadline = None if wait_s is None else time.monotonic() + wait_s
                while not (self._dirty or self._stop):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
                self._dirty = False
                if self._stop:
                    break
                leaving, parking, joining = self.admission.changes()
            try:
                # slot moves and resets run outside the lock: no caller waits on a device copy. Detaches
                # and parks first: the slots they free are already promised.
                for h in leaving:
                    self._detach(h)
                for h in parking:
                    self._park(h)
                for h in joining:
                    self._attach(h)
                with self._cond:
                    handles = list(self._handles)
                wait_s = self._tick(handles)
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the loop: every stream would hang
                log.exception("scheduler loop failed")
                self._break(f"the scheduler loop failed: {type(exc).__name__}: {exc}")
                with self._cond:
                    stranded = list(self._handles)
                for h in stranded:                      # an error now rather than a stream that never ends
                    self._fail(h, EngineError(f"internal error: {exc}"))
                wait_s = None
        self._shutdown()

    def _detach(self, h: StreamHandle) -> None:
        """Free the slot of a handle that keeps nothing in it (closed, a one-shot whose turn ended, a parked
        one whose rows were copied out). When that fails (a device copy), the slot stays taken and the
        detach is retried at the next wake; after MAX_DETACH_ATTEMPTS the slot is given up and the engine is
        broken."""
        if not h.attached:
            return                                      # its attach failed: it never held a runner slot
        try:
            self.runner.detach(h.stream)
        except Exception as exc:  # noqa: BLE001 - one stream's slot, never the loop
            tries = self._detach_failures.get(id(h), 0) + 1
            self._detach_failures[id(h)] = tries
            log.error("freeing a stream slot failed (attempt %d of %d): %s", tries, MAX_DETACH_ATTEMPTS, exc)
            # still taken: admission must not promise it again
            self.admission.detach_failed(h, first=tries == 1, retry=tries < MAX_DETACH_ATTEMPTS)
            if tries >= MAX_DETACH_ATTEMPTS:
                self._break(f"a stream slot could not be freed ({type(exc).__name__}: {exc})")
            return
        with self._cond:
            self._handles.remove(h)
            h.attached = False
        if self._detach_failures.pop(id(h), 0):
            self.admission.detached_after_failures()

    def _park(self, h: StreamHandle) -> None:
        """Copy an idle handle's used KV rows to the host and free its slot (admission gave it away). Whether
        the copy is worth making is decided first, from the rows' size (``Admission.will_keep``): a handle
        closed since it was chosen, or whose rows the budget would not keep, only has its slot freed. When
        the copy fails its context is lost (evicted: its next turn starts afresh); the slot is freed as a
        closed handle's is (a failing detach retried), and rows copied out stay parked meanwhile."""
        if not h.attached:
            return
        nbytes = self.runner.kv.host_bytes(self.runner.park_row_count(h.stream))
        with self._cond:
            copy = self.admission.will_keep(h, nbytes)
        if copy:
            try:
                rows = self.runner.park_rows(h.stream)
            except Exception as exc:  # noqa: BLE001 - one stream's context, never the loop
                log.error("parking a stream failed: %s", exc)
                with self._cond:
                    h.mark_evicted()
            else:
                with self._cond:
                    self.admission.park_rows_evicting_oldest(h, rows)
        self._detach(h)

    def _attach(self, h: StreamHandle) -> None:
        """Give a handle its runner slot (with its parked rows, when it resumes); when that fails only its
        stream fails (its slot is free again). A handle whose promise was given back since the loop took it
        (``Admission.attaching``: a turn that failed after admission, a close) is not attached; one given
        back while the attach ran is parked or detached again (``Admission.attached``)."""
        with self._cond:
            if not self.admission.attaching(h):
                return
            if h.attached:                  # its detach (a park's) is still failing: its rows stay parked
                rows, refused = None, True
            else:
                rows, refused = self.admission.parked.take(h), False
        try:
            if refused:
                raise EngineError("its slot from before is not freed yet (a failing device copy)")
            self.runner.attach(h.stream, rows)
        except Exception as exc:  # noqa: BLE001 - one stream, never the loop
            log.error("starting a stream failed: %s", exc)
            if rows is not None:                                # its rows are gone: its next turn starts afresh
                h.mark_evicted()
            self.admission.attach_failed(h)
            self._fail(h, EngineError(f"the stream could not start: {exc}"))
            return
        with self._cond:
            self._handles.append(h)
            h.attached = True
            if rows is not None:
                self._resume_seconds.append(time.monotonic() - h.admitted_at)
            self.admission.attached(h, resumed=rows is not None)

    def _fail(self, h: StreamHandle, error: Exception) -> None:
        """The one way a stream fails: its turn ends with ERROR, and its consumer gets the error, then the
        turn's end (a consumer waiting for either always gets both)."""
        h.stream.fail()
        h.sink.put(StreamError(error))
        for turn, stats in h.stream.take_finished():
            self._turn_end(h, turn, stats)

    def _turn_end(self, h: StreamHandle, turn: int, stats: TurnStats) -> None:
        """A turn's end to its consumer, counted by admission first (the handle may be idle from now: a
        next turn its consumer begins on seeing the end is counted after it)."""
        self.admission.turn_ended(h)
        h.sink.put(TurnEnd(turn, stats))

    def _break(self, reason: str) -> None:
        """The engine is unusable: no new streams (EngineBrokenError, /ready says so); running ones go on
        as far as they can."""
        if self.broken is None:
            log.error("engine broken: %s", reason)
            self.broken = reason

    def _tick(self, handles: list[StreamHandle]) -> float | None:
        """One runner tick and its events to the handles; returns how long the loop may sleep (see
        ``StepRunner.seconds_until_work``): frames waiting for their codec chunk are no reason to spin."""
        try:
            result = self.runner.tick()
        except Exception as exc:  # noqa: BLE001 - a bug in the loop must not kill every stream silently
            log.exception("scheduler tick failed")
            for h in handles:
                self._fail(h, EngineError(f"internal error: {exc}"))
            result = None
        by_stream = {id(h.stream): h for h in handles}
        lost = self.runner.take_lost()
        if lost:
            with self._cond:
                for stream in lost:             # a failed slot trade could not restore an idle context
                    held = by_stream.get(id(stream))
                    if held is not None:
                        held.mark_evicted()
        if result is not None:
            for stream, error in result.failed:
                held = by_stream.get(id(stream))
                if held is not None:
                    held.sink.put(StreamError(error))
            for stream, frame in result.frames:
                held = by_stream.get(id(stream))
                if held is not None:
                    held.sink.put(FrameEvent(frame))
                    held.delivered()
            for stream, turn, stats in result.turn_ends:
                held = by_stream.get(id(stream))
                if held is not None:
                    self._turn_end(held, turn, stats)
        if result is None:
            return None
        return 0.0 if result.worked else self.runner.seconds_until_work()

    def _shutdown(self) -> None:
        with self._cond:
            _, _, joining = self.admission.changes()
        for h in list(self._handles) + joining:
            if not h.closed:
                self._fail(h, StreamClosedError("the scheduler stopped"))


__all__ = ["AsyncSink", "Event", "EventSink", "FrameEvent", "QueueSink", "Scheduler", "SchedulerStats", "StreamError",
           "StreamHandle", "TurnEnd"]
