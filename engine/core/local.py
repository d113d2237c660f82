"""The engine of one bundle: its model, its scheduler, their loading and warm-up, readiness, the voices'
prefix KV, drain and stop. The engine core process runs one (:mod:`engine.core.process`); a caller that
wants the engine in its own process may too (``mossrt synth`` and ``bench`` use the scheduler directly).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from engine.errors import EngineBrokenError, EngineError, InputError, OverloadError
from engine.kv.parking import ParkingStats
from engine.kv.prefix import PrefixStats, prefix_key
from engine.model.sampling import SamplingParams
from engine.model.tts import TTSModel
from engine.runtime.bundle import Bundle
from engine.serving.handles import EventSink, QueueSink, StreamError, StreamHandle, TurnEnd
from engine.serving.scheduler import Scheduler, SchedulerStats

from .config import MAX_DEFAULT_SLOTS, CoreConfig

log = logging.getLogger("mossrt.engine")

WARM_TIMEOUT_S = 1800            # the bucket warm-up (every bucket's calls, CUDA-graph captures) at most
WARM_UP_TEXT = "Hello."


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as ``/ready`` and ``/metrics`` report it: ``state`` loading → warming → ready (or failed,
    with ``error``; draining once it drains), ``broken`` (why the running engine is unusable, else None),
    and the scheduler's and the prefix cache's counters once it runs."""

    state: str
    error: str | None = None
    broken: str | None = None
    stats: SchedulerStats | None = None
    prefix: PrefixStats | None = None
    sessions_open: int = 0


class LocalEngine:
    """One bundle's engine in this process. ``load`` (blocking) builds it; every other call is thread-safe."""

    def __init__(self, config: CoreConfig, bundle: Bundle | None = None) -> None:
        self.config = config
        self.bundle = bundle or Bundle(config.bundle_dir, device=config.device, threads=config.threads,
                                       defer_refusal=True, shared_pool=config.shared_pool)
        self.model: TTSModel | None = None
        self.scheduler: Scheduler | None = None
        self.state = "loading"
        self.error: str | None = None
        self.sessions_open = 0           # WebSocket sessions past their gate, over every API process
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> None:
        """Open the graphs, start the scheduler, warm its buckets and run one short synthesis; a failure is
        kept in ``state``/``error`` (the caller reports it), never raised."""
        try:
            t0 = time.monotonic()
            c = self.config
            model = TTSModel(self.bundle, cuda_graphs=c.cuda_graphs, warm_buckets=c.warm_buckets)
            slots = c.slots or self._default_slots(model)
            self.state = "warming"
            scheduler = Scheduler(model, slots=slots, limits=c.limits, queue_timeout=c.queue_timeout,
                                  prefix_cache_bytes=c.prefix_cache_bytes, parked_bytes=c.parked_bytes)
            self.model, self.scheduler = model, scheduler
            if not scheduler.wait_warm(timeout=WARM_TIMEOUT_S) or scheduler.broken:
                raise EngineError(scheduler.broken or f"the batch buckets did not warm in {WARM_TIMEOUT_S} s")
            self._warm_up(model, scheduler)      # also computes the default system prompt's prefix KV
            self.state = "ready"
            log.info("engine ready in %.1f s: %d stream slots of %d context rows (%.0f MiB each), device %s",
                     time.monotonic() - t0, slots, c.limits.max_context_rows,
                     scheduler.runner.bytes_per_stream() / 2**20, self.bundle.device)
        except Exception as e:  # noqa: BLE001 - reported by /ready and the log
            log.exception("loading the bundle failed")
            self.error = f"{type(e).__name__}: {e}"
            self.state = "failed"

    def _default_slots(self, model: TTSModel) -> int:
        c = self.config
        budget = (c.kv_budget_bytes or available_memory_bytes() // 2) - c.prefix_cache_bytes
        slots = Scheduler.slots_for_budget(model, max(budget, 0), c.limits.max_context_rows)
        if slots < 1:
            raise InputError(f"the KV budget ({budget / 2**20:.0f} MiB) holds no stream of "
                             f"{c.limits.max_context_rows} rows: lower --max-context-rows or raise the budget")
        return min(slots, MAX_DEFAULT_SLOTS)

    @staticmethod
    def _warm_up(model: TTSModel, scheduler: Scheduler) -> None:
        """One short synthesis: creates every session's kernels and buffers before the first request."""
        h = scheduler.open_stream(params=model.default_sampling(greedy=True), seed=0, sink=QueueSink(),
                                  one_shot=True)
        try:
            h.begin_turn(max_frames=2, wait=60)
            h.push_token_ids(model.tokenizer.encode(WARM_UP_TEXT))
            h.end_text()
            while True:
                event = h.get(timeout=600)
                if isinstance(event, TurnEnd):
                    break
                if isinstance(event, StreamError):
                    raise event.error
        finally:
            h.close()

    def drain(self, timeout: float) -> bool:
        """No new streams; running turns get ``timeout`` seconds to end. Returns whether they all did. Each API
        worker of one core calls it on SIGTERM: every call waits for the same turns."""
        was_running = self.state in ("ready", "draining")
        self.state = "draining"                                          # readiness off at once
        return self.scheduler.drain(timeout) if was_running and self.scheduler is not None else True

    def stop(self) -> None:
        """Stop now: the scheduler's loop ends and open streams get an error."""
        self.state = "draining"
        if self.scheduler is not None:
            self.scheduler.stop()

    @property
    def broken(self) -> str | None:
        return self.scheduler.broken if self.scheduler is not None else None

    def snapshot(self) -> EngineSnapshot:
        s = self.scheduler
        return EngineSnapshot(state=self.state, error=self.error, broken=self.broken,
                              stats=s.stats() if s is not None else None,
                              prefix=s.prefix_cache.stats if s is not None and s.prefix_cache is not None else None,
                              sessions_open=self.sessions_open)

    def take_resume_seconds(self) -> list[float]:
        return self.scheduler.take_resume_seconds() if self.scheduler is not None else []

    def take_ticks(self) -> list[tuple[float, float, int]]:
        """The device loop's recent working ticks (wall seconds, seconds inside onnxruntime runs, streams fed),
        oldest first, forgotten once taken (``mossrt bench streams`` through a core process reads them)."""
        if self.scheduler is None:
            return []
        recent = self.scheduler.runner.timing.recent_ticks
        ticks = list(recent)
        recent.clear()
        return ticks

    def parking_stats(self) -> ParkingStats | None:
        s = self.scheduler
        return s.stats().parking if s is not None else None

    # ------------------------------------------------------------------ streams
    def _running(self) -> Scheduler:
        if self.scheduler is None or self.state not in ("ready", "draining"):
            raise OverloadError(f"the engine is {self.state}")
        if self.scheduler.broken:
            raise EngineBrokenError(f"the engine is broken: {self.scheduler.broken}")
        return self.scheduler

    def open_stream(self, voice_codes: np.ndarray | None, params: SamplingParams, seed: int | None,
                    sink: EventSink, allow_special_tokens: bool = False, *, one_shot: bool = False,
                    may_park_others: bool = True) -> StreamHandle:
        """A scheduler stream (``Scheduler.open_stream``)."""
        return self._running().open_stream(voice_codes=voice_codes, params=params, seed=seed, sink=sink,
                                           allow_special_tokens=allow_special_tokens, one_shot=one_shot,
                                           may_park_others=may_park_others)

    def claim_session(self, limit: int) -> bool:
        """One more open WebSocket session, unless ``limit`` are open (then False)."""
        with self._lock:
            if self.sessions_open >= limit:
                return False
            self.sessions_open += 1
            return True

    def release_session(self) -> None:
        with self._lock:
            self.sessions_open = max(0, self.sessions_open - 1)

    # ------------------------------------------------------------------ voices' prefix KV
    def voice_prefix(self, codes: np.ndarray) -> np.ndarray | None:
        """Compute (or find) the prefix KV of a voice's text-only opening and return a host copy of it (to
        persist beside the voice), None without a prefix cache. Blocking."""
        scheduler = self._running()
        prefix = scheduler.warm_prefix(codes)
        return None if prefix is None else scheduler.prefix_to_host(prefix)

    def has_voice_prefix(self, codes: np.ndarray) -> bool:
        """Whether the prefix cache holds the voice's system block (True without a cache: nothing to load)."""
        scheduler, model = self._running(), self.model
        assert model is not None, "a running scheduler has its model"
        if scheduler.prefix_cache is None:
            return True
        return prefix_key(model.prompt.system_block(codes)) in scheduler.prefix_cache

    def load_voice_prefix(self, codes: np.ndarray, kv: np.ndarray) -> bool:
        """A voice's persisted prefix KV into the cache, if it is of this model's dtype and shape (one that
        is not is left: the first stream with the voice recomputes it)."""
        scheduler, model = self._running(), self.model
        assert model is not None, "a running scheduler has its model"
        system = model.prompt.system_block(codes)
        c = model.config
        # a persisted entry holds the system block's rows, and the assistant header's after it
        rows = (len(system), len(model.prompt.tts_prompt(codes)))
        if kv.dtype == model.kv_dtype and kv.ndim == 5 and kv.shape[3] in rows \
                and kv.shape[:3] + kv.shape[4:] == (c.layers, 2, c.kv_heads, c.head_dim):
            return scheduler.cache_prefix(system, kv)
        return False
