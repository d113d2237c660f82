"""Many streams, one device loop: the scheduler batches every stream's next step into shared graph calls.

A :class:`Scheduler` owns a :class:`StepRunner` (the onnxruntime sessions' KV slot pool and codec
rings) and runs its ticks on one thread. Callers hold :class:`StreamHandle` objects: they feed text and
control turns from any thread (the calls validate and return at once; they never run a graph), and
receive events — frames with their audio, turn ends, errors — through a sink: a thread-safe queue, or
an asyncio queue fed with ``call_soon_threadsafe`` so an asyncio server never blocks on the engine.

Admission: a stream takes a KV slot at its first turn and keeps it until closed. When every slot is
taken, ``begin_turn`` waits up to ``queue_timeout`` seconds for one, then raises :class:`CapacityError`
(the service answers 429); ``abegin_turn`` is the same wait for asyncio callers, holding no thread, in the
same first-come-first-served queue. Cancel and close take effect at the next step boundary. A consumer that
stops reading holds its stream (generation pauses) instead of buffering audio without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .buckets import history_windows
from .device import DeviceTensor
from .errors import CapacityError, EngineBrokenError, EngineError, InputError, OverloadError, StreamClosedError
from .limits import Limits
from .prefix import PrefixCache, prefix_key
from .runner import DEFAULT_PREFILL_CHUNK_ROWS, DEFAULT_PREFILL_ROWS_PER_TICK, SERVICE_CODEC_SCHEDULE, StepRunner
from .sampling import SamplingParams
from .stream import Frame, StreamState, TurnStats

log = logging.getLogger("mossrt.scheduler")

DEFAULT_QUEUE_TIMEOUT = 10.0
DEFAULT_MAX_BUFFERED_FRAMES = 250      # 20 s of audio waiting for its consumer
MAX_DETACH_ATTEMPTS = 3                # a slot that cannot be freed so often: the device is not trustworthy


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


class QueueSink:
    """Events for a consumer thread: ``get(timeout)`` blocks."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()

    def put(self, event: Event) -> None:
        self._q.put(event)

    def get(self, timeout: float | None = None) -> Event:
        return self._q.get(timeout=timeout)


class AsyncSink:
    """Events for an asyncio consumer: ``await get()`` never blocks the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._q: asyncio.Queue = asyncio.Queue()

    def put(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._q.put_nowait, event)

    async def get(self) -> Event:
        return await self._q.get()


# ---------------------------------------------------------------------------------------------- handles
class StreamHandle:
    """A stream in a scheduler. Every method is thread-safe and returns without running a graph."""

    def __init__(self, scheduler: "Scheduler", stream: StreamState, sink: EventSink, max_buffered_frames: int):
        self._scheduler = scheduler
        self.stream = stream
        self.sink = sink
        self.max_buffered_frames = max_buffered_frames
        self.attached = False       # holds a KV slot (from its first turn until closed)
        self.closed = False
        self._reserved = False
        self._buffered = 0          # frames delivered and not yet consumed
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ turn control
    def begin_turn(self, user_text: str = "", user_audio_codes=None, user_audio_wav=None,
                   max_frames: int | None = None, params: SamplingParams | None = None,
                   wait: float | None = None) -> None:
        """Open a turn (``StreamingSession.begin_turn`` semantics). The first turn waits up to ``wait``
        seconds (default: the scheduler's queue timeout) for a free slot, else CapacityError."""
        self._require_open()
        self._open_turn(self._scheduler._reserve(self, wait), user_text, user_audio_codes, user_audio_wav,
                        max_frames, params)

    async def abegin_turn(self, user_text: str = "", user_audio_codes=None, user_audio_wav=None,
                          max_frames: int | None = None, params: SamplingParams | None = None,
                          wait: float | None = None) -> None:
        """``begin_turn`` for asyncio callers: waiting for a slot awaits (it holds no thread), in the same
        first-come-first-served queue as the blocking callers; cancelling the wait leaves the queue."""
        self._require_open()
        self._open_turn(await self._scheduler._areserve(self, wait), user_text, user_audio_codes, user_audio_wav,
                        max_frames, params)

    def _open_turn(self, newly: bool, user_text, user_audio_codes, user_audio_wav, max_frames, params) -> None:
        try:
            self.stream.begin_turn(user_text, user_audio_codes, user_audio_wav, max_frames, params)
        except BaseException:
            if newly:
                self._scheduler._unreserve(self)
            raise
        self._scheduler._wake()

    def push_text(self, delta: str | bytes) -> int:
        """Assistant text, any split; returns the ids it committed."""
        self._require_open()
        n = self.stream.push_text(delta)
        if n:
            self._scheduler._wake()
        return n

    def push_token_ids(self, ids) -> int:
        self._require_open()
        n = self.stream.push_token_ids(ids)
        self._scheduler._wake()
        return n

    def end_text(self) -> int:
        self._require_open()
        n = self.stream.end_text()
        self._scheduler._wake()
        return n

    def cancel(self) -> None:
        """Barge-in: the turn ends at the next step boundary (a frame in flight is discarded)."""
        self._require_open()
        self.stream.cancel()
        self._scheduler._wake()

    def truncate_turn(self, audio_frames: int) -> int:
        self._require_open()
        kept = self.stream.truncate_turn(audio_frames)
        self._scheduler._wake()
        return kept

    def prime(self, rows) -> None:
        """Feed context rows between turns without generating (``StreamState.prime``)."""
        self._require_open()
        self._scheduler._reserve(self, None)
        self.stream.prime(rows)
        self._scheduler._wake()

    def prime_prefix(self, rows, wait: float | None = None) -> None:
        """Feed a stream's system block, or its text-only opening (system block + assistant header), cached
        by the scheduler's prefix cache as it goes."""
        self._require_open()
        self._scheduler._reserve(self, wait)
        self.stream.prime(rows, prefix=True)
        self._scheduler._wake()

    def close(self) -> None:
        """End the stream and free its slot at the next step boundary. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.stream.close()
        self._scheduler._release(self)

    # ------------------------------------------------------------------ consumer side
    def consumed(self, frames: int = 1) -> None:
        """The consumer took ``frames`` frames off the sink: a paused stream resumes below half the bound."""
        with self._lock:
            self._buffered = max(0, self._buffered - frames)
            resume = self.stream.paused and self._buffered <= self.max_buffered_frames // 2
        if resume:
            self.stream.paused = False
            self._scheduler._wake()

    def get(self, timeout: float | None = None) -> Event:
        """The next event (QueueSink); raises queue.Empty after ``timeout``."""
        event = self.sink.get(timeout=timeout)
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    async def aget(self) -> Event:
        """The next event (AsyncSink)."""
        event = await self.sink.get()
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    @property
    def context_rows(self) -> int:
        return self.stream.fed_rows

    def _delivered(self) -> None:
        with self._lock:
            self._buffered += 1
            if self._buffered >= self.max_buffered_frames:
                self.stream.paused = True

    def _require_open(self) -> None:
        if self.closed:
            raise StreamClosedError("the stream is closed")


# ---------------------------------------------------------------------------------------------- scheduler
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


@dataclass(frozen=True)
class SchedulerStats:
    capacity: int          # KV slots
    active: int            # streams holding a slot
    queued: int            # streams waiting for a slot
    generating: int        # streams with a turn in progress
    bytes_per_stream: int  # KV slot + codec rings


class Scheduler:
    def __init__(self, model, slots: int, limits: Limits | None = None,
                 prefill_chunk_rows: int = DEFAULT_PREFILL_CHUNK_ROWS,
                 prefill_rows_per_tick: int = DEFAULT_PREFILL_ROWS_PER_TICK,
                 queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
                 max_buffered_frames: int = DEFAULT_MAX_BUFFERED_FRAMES,
                 codec_schedule: tuple[int, ...] = SERVICE_CODEC_SCHEDULE,
                 prefix_cache_bytes: int = 0, warm_buckets: bool | None = None):
        """``warm_buckets``: the loop thread first runs every batch bucket's calls once on padding rows
        (``StepRunner.warm_up``), before it serves any stream (None: the model's ``warm_buckets``)."""
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
        self._reserved = 0                        # slots promised to handles (attached or about to be)
        self._waiting: list[object] = []          # tickets of begin_turn calls waiting for a slot, in order
        self._handles: list[StreamHandle] = []    # attached, in the loop thread's view
        self._to_attach: list[StreamHandle] = []
        self._to_detach: list[StreamHandle] = []
        self._accepting = True
        self._stop = False
        self._detach_failures: dict[int, int] = {}   # id(handle) -> failed detaches (its slot is still taken)
        self.broken: str | None = None            # why the engine is unusable (no new streams), else None
        self._warm = model.warm_buckets if warm_buckets is None else warm_buckets
        self._warmed = threading.Event()           # set when the loop is ready to tick (after any warm-up)
        self.warm_seconds: float | None = None     # how long the warm-up took (None: none ran)
        self._thread = threading.Thread(target=self._loop, name="mossrt-scheduler", daemon=True)
        self._thread.start()

    @staticmethod
    def slots_for_budget(model, budget_bytes: int, max_context_rows: int) -> int:
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
            return SchedulerStats(capacity=self.runner.slots, active=self._reserved, queued=len(self._waiting),
                                  generating=generating, bytes_per_stream=self.runner.bytes_per_stream())

    def open_stream(self, voice_codes=None, params: SamplingParams | None = None, seed: int | None = None,
                    decode_audio: bool = True, allow_special_tokens: bool = False,
                    sink: EventSink | None = None, limits: Limits | None = None) -> StreamHandle:
        """A new stream (no slot yet: it takes one at its first turn). Validates its settings now."""
        if not self._accepting:
            raise OverloadError("the server is draining: no new streams")
        limits = limits or self.limits
        if limits.max_context_rows > self.limits.max_context_rows:
            raise InputError(f"max_context_rows {limits.max_context_rows} exceeds the scheduler's "
                             f"{self.limits.max_context_rows}")
        stream = StreamState(self.model, voice_codes=voice_codes, params=params, seed=seed, limits=limits,
                             decode_audio=decode_audio, allow_special_tokens=allow_special_tokens)
        return StreamHandle(self, stream, sink or QueueSink(), self.max_buffered_frames)

    def warm_prefix(self, voice_codes=None, timeout: float = 600) -> DeviceTensor | None:
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
            h = StreamHandle(self, probe, QueueSink(), self.max_buffered_frames)
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
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.stats().generating:
                return True
            time.sleep(0.05)
        return not self.stats().generating

    def stop(self) -> None:
        """End the loop; streams still open get a StreamError and are closed."""
        self._accepting = False
        with self._cond:
            self._stop = True
            self._notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ admission (caller threads)
    def _reserve(self, handle: StreamHandle, wait: float | None) -> bool:
        """Promise ``handle`` a slot (once); False if it already has one."""
        with self._cond:
            ticket = object()
            deadline = self._join_queue(handle, ticket, wait)
            if deadline is None:
                return False
            try:
                while not self._admissible(ticket):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop:
                        raise self._no_capacity()
                    self._cond.wait(timeout=left)
            finally:
                self._waiting.remove(ticket)
                self._notify()                       # the next in line may be admitted now
            self._admit(handle)
            return True

    async def _areserve(self, handle: StreamHandle, wait: float | None) -> bool:
        """``_reserve`` on an event loop: the ticket waits on an asyncio event, set by every change that may
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
                    if self._stop:
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

    def _join_queue(self, handle: StreamHandle, ticket: object, wait: float | None) -> float | None:
        """(Holding ``_cond``.) ``ticket`` joins the queue, first come first served: its deadline, or None
        when ``handle`` already holds a slot."""
        if handle._reserved:
            return None
        if not self._accepting:
            raise OverloadError("the server is draining: no new streams")
        if self.broken:
            raise EngineBrokenError(f"the engine is broken: {self.broken}")
        self._waiting.append(ticket)
        return time.monotonic() + (self.queue_timeout if wait is None else wait)

    def _admissible(self, ticket: object) -> bool:
        return self._reserved < self.runner.slots and self._waiting[0] is ticket

    def _admit(self, handle: StreamHandle) -> None:
        self._reserved += 1
        handle._reserved = True
        self._to_attach.append(handle)
        self._dirty = True
        self._notify()

    def _no_capacity(self) -> CapacityError:
        return CapacityError(f"all {self.runner.slots} stream slots are busy; retry later")

    def _notify(self) -> None:
        """Wake every waiter, blocking and asyncio (call holding ``_cond``)."""
        self._cond.notify_all()
        for ticket in self._waiting:
            if isinstance(ticket, _AsyncTicket):
                ticket.wake()

    def _unreserve(self, handle: StreamHandle) -> None:
        with self._cond:
            if handle in self._to_attach:
                self._to_attach.remove(handle)
                self._reserved -= 1
                handle._reserved = False
                self._notify()

    def _release(self, handle: StreamHandle) -> None:
        """Free the handle's slot for admission now: the loop detaches it before it attaches anyone else,
        so a client that opens its next stream right after closing one is never refused for its own."""
        with self._cond:
            if not handle._reserved:
                return
            if handle in self._to_attach:
                self._to_attach.remove(handle)
            else:
                self._to_detach.append(handle)
            self._reserved -= 1
            handle._reserved = False
            self._dirty = True
            self._notify()

    def _wake(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify_all()

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
                leaving, self._to_detach = self._to_detach, []
                joining, self._to_attach = self._to_attach, []
            try:
                # slot moves and resets run outside the lock: no caller waits on a device copy. Detaches
                # first: the slots they free are already promised.
                for h in leaving:
                    self._detach(h)
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
                    self._fail_handle(h, EngineError(f"internal error: {exc}"))
                wait_s = None
        self._shutdown()

    def _detach(self, h: StreamHandle) -> None:
        """Free a closed handle's slot. When that fails (a device copy), the slot stays taken by the closed
        stream and the detach is retried at the next wake; after MAX_DETACH_ATTEMPTS the slot is given up
        and the engine is broken."""
        if not h.attached:
            return                                      # its attach failed: it never held a runner slot
        try:
            self.runner.detach(h.stream)
        except Exception as exc:  # noqa: BLE001 - one stream's slot, never the loop
            tries = self._detach_failures.get(id(h), 0) + 1
            self._detach_failures[id(h)] = tries
            log.error("freeing a stream slot failed (attempt %d of %d): %s", tries, MAX_DETACH_ATTEMPTS, exc)
            with self._cond:
                if tries < MAX_DETACH_ATTEMPTS:
                    self._to_detach.append(h)
                if tries == 1:
                    self._reserved += 1                 # still taken: admission must not promise it
            if tries >= MAX_DETACH_ATTEMPTS:
                self._break(f"a stream slot could not be freed ({type(exc).__name__}: {exc})")
            return
        with self._cond:
            self._handles.remove(h)
            h.attached = False
            if self._detach_failures.pop(id(h), 0):
                self._reserved -= 1
                self._notify()                          # asyncio waiters too

    def _attach(self, h: StreamHandle) -> None:
        """Give a handle its runner slot; when that fails only its stream fails (its slot is free again)."""
        try:
            self.runner.attach(h.stream)
        except Exception as exc:  # noqa: BLE001 - one stream, never the loop
            log.error("starting a stream failed: %s", exc)
            with self._cond:
                if h._reserved:
                    self._reserved -= 1
                    h._reserved = False
                    self._notify()
            self._fail_handle(h, EngineError(f"the stream could not start: {exc}"))
            return
        with self._cond:
            self._handles.append(h)
            h.attached = True

    def _fail_handle(self, h: StreamHandle, error: Exception) -> None:
        """The handle's turn ends with ERROR: the error, then the turn's end, to its consumer."""
        h.stream.fail()
        h.sink.put(StreamError(error))
        for turn, stats in h.stream.take_finished():
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
                h.stream.fail()
                h.sink.put(StreamError(EngineError(f"internal error: {exc}")))
            result = None
        by_stream = {id(h.stream): h for h in handles}
        if result is not None:
            for stream, exc in result.failed:
                h = by_stream.get(id(stream))
                if h is not None:
                    h.sink.put(StreamError(exc))
            for stream, frame in result.frames:
                h = by_stream.get(id(stream))
                if h is not None:
                    h.sink.put(FrameEvent(frame))
                    h._delivered()
            for stream, turn, stats in result.turn_ends:
                h = by_stream.get(id(stream))
                if h is not None:
                    h.sink.put(TurnEnd(turn, stats))
        if result is None:
            return None
        return 0.0 if result.worked else self.runner.seconds_until_work()

    def _shutdown(self) -> None:
        for h in list(self._handles) + list(self._to_attach):
            if not h.closed:
                h.stream.fail()
                h.sink.put(StreamError(StreamClosedError("the scheduler stopped")))
                for turn, stats in h.stream.take_finished():
                    h.sink.put(TurnEnd(turn, stats))
