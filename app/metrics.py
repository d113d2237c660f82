"""Prometheus metrics of the service and the per-stream meter every transport feeds."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily

FRAME_SECONDS = 0.08


class Metrics:
    """One registry per app (tests build several apps in one process)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mossrt_requests_total", "Requests by endpoint and final status",
                                ["endpoint", "status"], registry=r)
        self.ttfa = Histogram("mossrt_time_to_first_audio_seconds", "Request accepted to first audio bytes sent",
                              ["transport"], registry=r,
                              buckets=(0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30))
        self.frames = Counter("mossrt_frames_generated_total", "Codec frames generated (80 ms each)", registry=r)
        self.audio_seconds = Counter("mossrt_audio_seconds_total", "Seconds of audio sent", registry=r)
        self.active = Gauge("mossrt_active_streams", "Streams holding a KV slot", registry=r)
        self.queued = Gauge("mossrt_queued_streams", "Streams waiting for a KV slot", registry=r)
        self.capacity = Gauge("mossrt_capacity_streams", "KV slots (concurrent streams the server admits)",
                              registry=r)
        self.generating = Gauge("mossrt_generating_streams", "Streams with a turn in progress", registry=r)
        self.stalled = Counter("mossrt_stalled_streams_total", "Streams ended because the client took no audio "
                               "for the stall timeout", ["transport"], registry=r)
        self.sessions = Gauge("mossrt_websocket_sessions", "Open WebSocket sessions", registry=r)
        self.underruns = Counter("mossrt_stream_underruns_total",
                                 "Times a stream's audio fell behind real time after its first chunk", registry=r)
        self.gaps = Histogram("mossrt_inter_chunk_gap_seconds", "Time between consecutive audio chunks of a stream",
                              registry=r, buckets=(0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5))
        self.rtf = Histogram("mossrt_realtime_factor", "Generation seconds per second of audio, per turn",
                             registry=r, buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10, 30))
        self._prefix_stats = None
        r.register(_PrefixCounters(self))
        self.prefix_entries = Gauge("mossrt_prefix_cache_entries", "System blocks (prompt, voices) in the KV cache",
                                    registry=r)
        self.prefix_bytes = Gauge("mossrt_prefix_cache_bytes", "Memory of the cached system-block KV", registry=r)
        self.ready = Gauge("mossrt_ready", "1 when the bundle is loaded and warmed up and not draining", registry=r)
        self.info = Info("mossrt_build", "Bundle and runtime", registry=r)

    def initialise(self, endpoints: tuple[str, ...], transports: tuple[str, ...]) -> None:
        """Create at 0 the series alerts and SLOs divide by: each speech endpoint's 200, 429 and 500, each
        transport's stalls. Prometheus takes no rate from a counter's first sample, so a 429 series that
        first appears at 5 would count as 0 refusals."""
        for endpoint in endpoints:
            for status in ("200", "429", "500"):
                self.requests.labels(endpoint, status)
        for transport in transports:
            self.stalled.labels(transport)

    def render(self, scheduler_stats=None, prefix_stats=None) -> bytes:
        if prefix_stats is not None:
            self._prefix_stats = prefix_stats
            self.prefix_entries.set(prefix_stats.entries)
            self.prefix_bytes.set(prefix_stats.bytes)
        if scheduler_stats is not None:
            self.active.set(scheduler_stats.active)
            self.queued.set(scheduler_stats.queued)
            self.capacity.set(scheduler_stats.capacity)
            self.generating.set(scheduler_stats.generating)
        return generate_latest(self.registry)


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
        if self.first_audio is None:
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


class _PrefixCounters:
    """The prefix cache's lookups and evictions as counters, read from the engine's running totals at each
    scrape (a prometheus-client Counter can only be incremented; the totals live in the engine)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        stats = self.metrics._prefix_stats
        if stats is None:
            return
        for name, doc, value in (("hits", "Streams started from cached system-block KV", stats.hits),
                                 ("misses", "Lookups of system-block KV that was not cached", stats.misses),
                                 ("evictions", "Cached system blocks dropped to stay within the budget",
                                  stats.evictions)):
            family = CounterMetricFamily(f"mossrt_prefix_cache_{name}", doc)
            family.add_metric([], value)
            yield family
