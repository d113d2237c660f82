"""Prometheus metrics of the service and the per-stream meter every transport feeds."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily

FRAME_SECONDS = 0.08
CONVERSATION_STATES = ("generating", "idle", "parked")
SET_AT_SCRAPE = {"multiprocess_mode": "livemostrecent"}     # the engine's values: the last scrape's, never summed


class Metrics:
    """One registry per app (tests build several apps in one process). Under ``mossrt serve --api-workers N``
    (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus-client is imported) every worker's values go to that
    folder and a scrape reads them all: counters and histograms summed over the workers, the WebSocket
    sessions summed over the live ones, the engine's gauges as last set (each scrape sets them from the core)."""

    def __init__(self):
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mossrt_requests_total", "Requests by endpoint and final status",
                                ["endpoint", "status"], registry=r)
        self.ttfa = Histogram("mossrt_time_to_first_audio_seconds", "Request accepted to first audio bytes sent",
                              ["transport"], registry=r,
                              buckets=(0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30))
        self.frames = Counter("mossrt_frames_generated_total", "Codec frames generated (80 ms each)", registry=r)
        self.audio_seconds = Counter("mossrt_audio_seconds_total", "Seconds of audio sent", registry=r)
        self.active = Gauge("mossrt_active_streams", "Streams holding a KV slot", registry=r, **SET_AT_SCRAPE)
        self.queued = Gauge("mossrt_queued_streams", "Streams waiting for a KV slot", registry=r, **SET_AT_SCRAPE)
        self.capacity = Gauge("mossrt_capacity_streams", "KV slots (concurrent streams the server admits)",
                              registry=r, **SET_AT_SCRAPE)
        self.generating = Gauge("mossrt_generating_streams", "Streams with a turn in progress", registry=r,
                                **SET_AT_SCRAPE)
        self.stalled = Counter("mossrt_stalled_streams_total", "Streams ended because the client took no audio "
                               "for the stall timeout", ["transport"], registry=r)
        self.sessions = Gauge("mossrt_websocket_sessions", "Open WebSocket sessions", registry=r,
                              multiprocess_mode="livesum")
        self.underruns = Counter("mossrt_stream_underruns_total",
                                 "Times a stream's audio fell behind real time after its first chunk", registry=r)
        self.gaps = Histogram("mossrt_inter_chunk_gap_seconds", "Time between consecutive audio chunks of a stream",
                              registry=r, buckets=(0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5))
        self.rtf = Histogram("mossrt_realtime_factor", "Generation seconds per second of audio, per turn",
                             registry=r, buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10, 30))
        self._prefix_stats = None
        # what this process reads from the engine at each scrape (and its build info): never summed
        self._scraped = [_EngineTotals(lambda: self._prefix_stats, PREFIX_COUNTERS)]
        r.register(self._scraped[0])
        self.conversations = Gauge("mossrt_conversations", "Streams by state: generating (a turn in progress, in a "
                                   "slot), idle (between turns, in a slot), parked (between turns, its context on "
                                   "the host, no slot)", ["state"], registry=r, **SET_AT_SCRAPE)
        for state in CONVERSATION_STATES:
            self.conversations.labels(state)
        self.parked_bytes = Gauge("mossrt_parked_context_bytes", "Host memory of parked conversations' KV rows",
                                  registry=r, **SET_AT_SCRAPE)
        self._parking = None
        self._scraped.append(_EngineTotals(lambda: self._parking, PARKING_COUNTERS, zero_before=True))
        r.register(self._scraped[-1])
        self.resume = Histogram("mossrt_resume_seconds", "What resuming a parked conversation added to its turn's "
                                "first audio: from its admission to its KV rows back in a slot", registry=r,
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.prefix_entries = Gauge("mossrt_prefix_cache_entries", "System blocks (prompt, voices) in the KV cache",
                                    registry=r, **SET_AT_SCRAPE)
        self.prefix_bytes = Gauge("mossrt_prefix_cache_bytes", "Memory of the cached system-block KV", registry=r,
                                  **SET_AT_SCRAPE)
        self.ready = Gauge("mossrt_ready", "1 when the bundle is loaded and warmed up and not draining", registry=r,
                           **SET_AT_SCRAPE)
        self.info = Info("mossrt_build", "Bundle and runtime", registry=r)
        self._scraped.append(self.info)

    def initialise(self, endpoints: tuple[str, ...], transports: tuple[str, ...]) -> None:
        """Create at 0 the series alerts and SLOs divide by: each speech endpoint's 200, 429 and 500, each
        transport's stalls. Prometheus takes no rate from a counter's first sample, so a 429 series that
        first appears at 5 would count as 0 refusals."""
        for endpoint in endpoints:
            for status in ("200", "429", "500"):
                self.requests.labels(endpoint, status)
        for transport in transports:
            self.stalled.labels(transport)

    def render(self, scheduler_stats=None, prefix_stats=None, resume_seconds: Sequence[float] = ()) -> bytes:
        if prefix_stats is not None:
            self._prefix_stats = prefix_stats
            self.prefix_entries.set(prefix_stats.entries)
            self.prefix_bytes.set(prefix_stats.bytes)
        if scheduler_stats is not None:
            self.active.set(scheduler_stats.active)
            self.queued.set(scheduler_stats.queued)
            self.capacity.set(scheduler_stats.capacity)
            self.generating.set(scheduler_stats.generating)
            parking = scheduler_stats.parking
            self._parking = parking
            for state, n in zip(CONVERSATION_STATES, (scheduler_stats.generating, scheduler_stats.idle,
                                                      parking.parked if parking else 0)):
                self.conversations.labels(state).set(n)
            self.parked_bytes.set(parking.bytes if parking else 0)
        for seconds in resume_seconds:
            self.resume.observe(seconds)
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        scrape = CollectorRegistry()
        multiprocess.MultiProcessCollector(scrape, self.multiprocess_dir)
        for collector in self._scraped:
            scrape.register(collector)
        return generate_latest(scrape)


class StreamMeter:
    """Timing of one turn's audio as the client receives it: time to first audio, inter-chunk gaps,
    underruns (audio sent so far fell behind the wall clock since the first chunk) and the real-time factor."""

    def __init__(self, metrics: Metrics, transport: str, started: float | None = None):
        self.metrics, self.transport = metrics, transport
        self.started = started if started is not None else time.monotonic()
        self.first_audio: float | None = None
        self.last_chunk: float | None = None
        self.audio_s = 0.0
        self.frames = 0
        self.underruns = 0
        self._behind = False
        self._timing: dict | None = None

    def frame(self) -> None:
        self.frames += 1
        self.metrics.frames.inc()

    def audio_sent(self, seconds: float) -> None:
        now = time.monotonic()
        if self.first_audio is None or self.last_chunk is None:     # the first audio (both are set by it)
            self.first_audio = now
            self.metrics.ttfa.labels(self.transport).observe(now - self.started)
        else:
            self.metrics.gaps.observe(now - self.last_chunk)
            behind = self.audio_s < now - self.first_audio   # the listener has played everything sent
            if behind and not self._behind:
                self.underruns += 1
                self.metrics.underruns.inc()
            self._behind = behind
        self.last_chunk = now
        self.audio_s += seconds
        self.metrics.audio_seconds.inc(seconds)

    @property
    def first_audio_ms(self) -> float | None:
        return None if self.first_audio is None else 1000 * (self.first_audio - self.started)

    def finish(self) -> dict:
        """Per-turn timing (observed once as the real-time factor; later calls return the same figures)."""
        if self._timing is None:
            total = time.monotonic() - self.started
            rtf = total / self.audio_s if self.audio_s else None
            if rtf is not None:
                self.metrics.rtf.observe(rtf)
            self._timing = {"first_audio_ms": None if self.first_audio_ms is None else round(self.first_audio_ms, 1),
                            "total_ms": round(1000 * total, 1),
                            "realtime_factor": None if rtf is None else round(rtf, 3), "underruns": self.underruns}
        return self._timing


class _EngineTotals:
    """Running totals the engine keeps, as counters read at each scrape (a prometheus-client Counter can only be
    incremented; the totals live in the engine). ``read()`` gives the engine's stats object, None before there
    is one: then no series, or each at 0 with ``zero_before`` (so that a rate exists from start-up)."""

    def __init__(self, read, counters: tuple[tuple[str, str, str], ...], zero_before: bool = False):
        self.read, self.counters, self.zero_before = read, counters, zero_before

    def describe(self):
        return []

    def collect(self):
        stats = self.read()
        if stats is None and not self.zero_before:
            return
        for name, doc, attr in self.counters:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], getattr(stats, attr) if stats is not None else 0)
            yield family


PREFIX_COUNTERS = (("mossrt_prefix_cache_hits", "Streams started from cached system-block KV", "hits"),
                   ("mossrt_prefix_cache_misses", "Lookups of system-block KV that was not cached", "misses"),
                   ("mossrt_prefix_cache_evictions", "Cached system blocks dropped to stay within the budget",
                    "evictions"))
PARKING_COUNTERS = (("mossrt_parks", "Idle conversations parked: their slot given to a waiting stream", "parks"),
                    ("mossrt_resumes", "Parked conversations that took a slot again, their rows copied back",
                     "resumes"),
                    ("mossrt_parked_evictions", "Parked contexts dropped to stay within the parked-context budget "
                     "(their next turn starts fresh)", "evictions"))
