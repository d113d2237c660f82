"""Levels of load, one after another: a fixed number of concurrent streams, an arrival rate, or a number of
voice-agent calls (:mod:`loadtest.calls`), per transport.

Everything is bounded: requests per level (or a duration), a per-request timeout, and one overall deadline
after which whatever is in flight is cancelled (and recorded as ``deadline``) and the run reports what it has.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass, field

import httpx

from . import promtext
from .calls import CallPlan, CallRecord, voice_call
from .clients import DEFAULT_RETRY_AFTER_S, RequestOptions, elevenlabs_stream, fail_record, http_stream, ws_stream
from .hostcpu import CpuMeter
from .stats import StreamRecord, summarize, summarize_calls

# what the server counts of parked conversations (docs/operations.md), read over each voice-agent level
PARKING_SERIES = {"parks": "mossrt_parks_total", "resumes": "mossrt_resumes_total",
                  "parked_evictions": "mossrt_parked_evictions_total"}


@dataclass
class RunConfig:
    opts: RequestOptions
    transports: list[str] = field(default_factory=lambda: ["http"])
    mode: str = "concurrency"                 # concurrency | rate | voice-agent (levels: calls)
    levels: list[float] = field(default_factory=lambda: [1])
    plan: CallPlan = field(default_factory=CallPlan)   # voice-agent mode: what each call does
    requests: int | None = None               # per level; None: see requests_for()
    duration: float | None = None             # per level: stop starting new requests after this
    arrival: str = "poisson"                  # rate mode: poisson | fixed
    request_timeout: float = 120.0
    deadline: float = 1800.0                  # whole run
    texts: list[str] = field(default_factory=list)
    seed: int | None = 1                      # request i of a level gets seed + i (None: server's choice)
    warmup: int = 1                           # unmeasured requests per transport before its first level
    pause: float = 1.0                        # seconds between levels (after the server is idle again)
    settle_timeout: float = 30.0              # wait at most this for /ready to show no active streams
    backoff_429: bool = True                  # a worker waits Retry-After after a 429 before its next request
    max_in_flight: int = 1000                 # rate mode: cap on outstanding requests
    verify_tls: bool = True
    sample_interval: float = 0.5              # /ready polling during a level (server-side active/queued)
    wait_ready: float = 30.0                  # at start, wait this long for /ready to answer 200
    server_pid: int | None = None             # local server: its CPU use per level (hostcpu)

    def requests_for(self, level: float) -> int | None:
        if self.requests is not None:
            return self.requests
        if self.duration is not None or self.mode == "voice-agent":
            return None
        return max(8, 2 * int(level)) if self.mode == "concurrency" else 20


class Runner:
    def __init__(self, cfg: RunConfig, log=print):
        self.cfg, self.log = cfg, log
        self.t_start = time.perf_counter()
        self.deadline_at = self.t_start + cfg.deadline
        self.deadline_hit = False
        self.client: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        """The run's HTTP client: :meth:`run` opens it before any request."""
        if self.client is None:
            raise RuntimeError("the runner's HTTP client is opened by run()")
        return self.client

    # ------------------------------------------------------------------ server probes (never fatal)
    async def ready(self) -> dict:
        try:
            r = await self.http.get(self.cfg.opts.base_url.rstrip("/") + "/ready",
                                    headers=self.cfg.opts.request_headers(), timeout=5)
            try:
                body = r.json()
            except ValueError:
                body = {"raw": r.text[:500]}
            return {"http_status": r.status_code, **(body if isinstance(body, dict) else {"body": body})}
        except (httpx.HTTPError, OSError) as e:
            return {"http_status": None, "error": repr(e)}

    async def metrics(self) -> dict:
        try:
            r = await self.http.get(self.cfg.opts.base_url.rstrip("/") + "/metrics",
                                    headers=self.cfg.opts.request_headers(), timeout=10)
            if r.status_code != 200:
                return {"http_status": r.status_code, "samples": {}}
            return {"http_status": 200, "samples": promtext.parse(r.text)}
        except (httpx.HTTPError, OSError) as e:
            return {"http_status": None, "error": repr(e), "samples": {}}

    async def wait_ready(self, timeout: float) -> dict:
        end = time.perf_counter() + timeout
        while True:
            info = await self.ready()
            if info.get("http_status") == 200 or time.perf_counter() >= end:
                return info
            await asyncio.sleep(0.5)

    async def settle(self) -> None:
        """Until /ready shows no active or queued stream (bounded): the next level starts on an idle server."""
        end = min(time.perf_counter() + self.cfg.settle_timeout, self.deadline_at)
        while time.perf_counter() < end:
            streams = (await self.ready()).get("streams") or {}
            if not streams or (streams.get("active", 0) == 0 and streams.get("queued", 0) == 0):
                return
            await asyncio.sleep(0.2)

    async def _sample_server(self, samples: list) -> None:
        t0 = time.perf_counter()
        while True:
            streams = (await self.ready()).get("streams")
            if streams:
                samples.append({"t_s": round(time.perf_counter() - t0, 2), **streams})
            await asyncio.sleep(self.cfg.sample_interval)

    # ------------------------------------------------------------------ one stream
    async def one(self, transport: str, level: float, index: int, records: list, level_t0: float,
                  text_offset: int) -> StreamRecord:
        cfg = self.cfg
        text = cfg.texts[(text_offset + index) % len(cfg.texts)]
        started = time.perf_counter()
        rec = StreamRecord(transport=transport, level=level, index=index, text_chars=len(text),
                           seed=None if cfg.seed is None else cfg.seed + index,
                           start_s=round(started - level_t0, 4))
        records.append(rec)
        try:
            coro = (http_stream(self.http, cfg.opts, rec, text) if transport == "http"
                    else elevenlabs_stream(cfg.opts, rec, text) if transport == "elevenlabs"
                    else ws_stream(cfg.opts, rec, text))
            await asyncio.wait_for(coro, cfg.request_timeout)
        except asyncio.TimeoutError:
            fail_record(rec, "request_timeout", f"no end after {cfg.request_timeout:g} s")
        except asyncio.CancelledError:
            fail_record(rec, "deadline")
            rec.total_s = rec.total_s if rec.total_s is not None else time.perf_counter() - started
            raise
        except Exception as e:  # noqa: BLE001 - a client bug is one failed stream, not a crashed run
            fail_record(rec, f"client:{type(e).__name__}", repr(e))
        if rec.status == "pending":
            fail_record(rec, "incomplete")
        if rec.total_s is None:                         # timed out or failed before any answer
            rec.total_s = time.perf_counter() - started
        return rec

    # ------------------------------------------------------------------ voice-agent calls
    async def one_call(self, transport: str, level: float, index: int, records: list, calls: list,
                       level_t0: float, text_offset: int) -> None:
        cfg = self.cfg
        call = CallRecord(transport=transport, level=level, index=index,
                          start_s=round(time.perf_counter() - level_t0, 4))
        calls.append(call)

        def new_turn(turn: int) -> StreamRecord:
            rec = StreamRecord(transport=transport, level=level, index=len(records), text_chars=0,
                               seed=None if cfg.seed is None else cfg.seed + index, call=index, turn=turn)
            records.append(rec)
            return rec

        texts = cfg.texts[text_offset % len(cfg.texts):] + cfg.texts[:text_offset % len(cfg.texts)]
        try:
            await asyncio.wait_for(voice_call(transport, cfg.opts, cfg.plan, call, texts, new_turn),
                                   cfg.plan.call_s + cfg.request_timeout)
        except asyncio.TimeoutError:
            call.status, call.error_kind = "error", "call_timeout"
        except asyncio.CancelledError:
            call.status, call.error_kind = "error", "deadline"
            raise
        except Exception as e:  # noqa: BLE001 - a client bug is one failed call, not a crashed run
            call.status, call.error_kind = "error", f"client:{type(e).__name__}"
        for rec in records:
            if rec.call == index and rec.status == "pending":
                fail_record(rec, call.error_kind or "incomplete")

    async def _voice_agent(self, transport: str, level: float, records: list, t0: float, offset: int,
                           calls: list) -> None:
        """``level`` calls, their starts spread over one turn and gap, so that about talk / (talk + gap) of
        them speak at any time."""
        n, plan = int(level), self.cfg.plan

        async def staggered(k: int) -> None:
            await asyncio.sleep(k * (plan.talk_s + plan.gap_s) / n)
            await self.one_call(transport, level, k, records, calls, t0, offset)

        await asyncio.gather(*(staggered(k) for k in range(n)))

    # ------------------------------------------------------------------ levels
    async def _concurrency(self, transport: str, level: float, records: list, t0: float, offset: int) -> None:
        n, total = int(level), self.cfg.requests_for(level)
        stop_at = t0 + self.cfg.duration if self.cfg.duration is not None else math.inf
        issued = 0

        async def worker():
            nonlocal issued
            while (total is None or issued < total) and time.perf_counter() < stop_at:
                i = issued
                issued += 1
                rec = await self.one(transport, level, i, records, t0, offset)
                if rec.status == "rejected" and self.cfg.backoff_429:
                    wait = min(rec.retry_after_s or DEFAULT_RETRY_AFTER_S, 10.0)
                    await asyncio.sleep(max(0.0, min(wait, stop_at - time.perf_counter())))

        await asyncio.gather(*(worker() for _ in range(n)))

    async def _rate(self, transport: str, level: float, records: list, t0: float, offset: int) -> None:
        total = self.cfg.requests_for(level)
        stop_at = t0 + self.cfg.duration if self.cfg.duration is not None else math.inf
        rng = random.Random(f"{self.cfg.seed}-{transport}-{level}")
        tasks: set[asyncio.Task] = set()
        i, t_next = 0, t0
        while (total is None or i < total) and t_next < stop_at:
            delay = t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            while len(tasks) >= self.cfg.max_in_flight:      # done tasks leave the set by their callback
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(self.one(transport, level, i, records, t0, offset))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            t_next += rng.expovariate(level) if self.cfg.arrival == "poisson" else 1.0 / level
        try:
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def level(self, transport: str, level: float, text_offset: int) -> tuple[list[StreamRecord], dict]:
        records: list[StreamRecord] = []
        calls: list[CallRecord] = []
        samples: list[dict] = []
        load_before = _loadavg()
        before = await self.metrics()
        cpu = CpuMeter(self.cfg.server_pid)
        t0 = time.perf_counter()
        sampler = asyncio.create_task(self._sample_server(samples))
        if self.cfg.mode == "voice-agent":
            body = self._voice_agent(transport, level, records, t0, text_offset, calls)
        else:
            body = (self._concurrency if self.cfg.mode == "concurrency" else self._rate)(
                transport, level, records, t0, text_offset)
        try:
            await asyncio.wait_for(body, max(0.0, self.deadline_at - time.perf_counter()))
        except asyncio.TimeoutError:
            self.deadline_hit = True
        finally:
            wall = time.perf_counter() - t0             # level start -> its last stream ended (or was cut)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        host_cpu = cpu.finish()
        after = await self.metrics()
        summary = summarize(records, wall, transport, self.cfg.mode, level)
        d = promtext.delta(before.get("samples", {}), after.get("samples", {}))
        summary["server"] = {
            "metrics_delta": d, "means": promtext.histogram_means(d),
            "max_active": max((s.get("active", 0) for s in samples), default=None),
            "max_queued": max((s.get("queued", 0) for s in samples), default=None),
            "capacity": samples[-1].get("capacity") if samples else None,
            "samples": samples,
        }
        summary["client_loadavg_1m"] = {"before": load_before, "after": _loadavg()}
        summary["host_cpu"] = host_cpu
        if self.cfg.mode == "voice-agent":
            parking = {key: _series_delta(before, after, name) for key, name in PARKING_SERIES.items()}
            summary["voice_agent"] = summarize_calls(calls, records, parking)
            summary["voice_agent"]["call_records"] = [c.to_json() for c in calls]
        return records, summary

    async def warmup(self, transport: str) -> list[str]:
        out = []
        for i in range(self.cfg.warmup):
            if time.perf_counter() >= self.deadline_at:
                break
            rec = await self.one(transport, 0, i, [], time.perf_counter(), 7919)
            out.append(rec.status if rec.status != "error" else f"error:{rec.error_kind}")
        return out

    async def run(self) -> dict:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.opts.connect_timeout)
        result: dict = {"levels": [], "streams": [], "warmup": {}}
        async with _CookielessClient(limits=limits, timeout=timeout, verify=cfg.verify_tls) as client:
            self.client = client
            result["ready_before"] = await self.wait_ready(cfg.wait_ready)
            if result["ready_before"].get("http_status") is None:
                result["aborted"] = f"server unreachable: {result['ready_before'].get('error')}"
                return result
            if result["ready_before"].get("http_status") != 200:
                self.log(f"[loadtest] warning: /ready answers {result['ready_before'].get('http_status')}; "
                         "running anyway")
            result["metrics_before"] = await self.metrics()
            for transport in cfg.transports:
                if time.perf_counter() < self.deadline_at:
                    result["warmup"][transport] = await self.warmup(transport)
            # level-major: both transports run a level back to back, so they see the same conditions
            for li, level in enumerate(cfg.levels):
                for transport in cfg.transports:
                    if self.deadline_hit or time.perf_counter() >= self.deadline_at:
                        self.deadline_hit = True
                        break
                    await self.settle()
                    if cfg.pause > 0:
                        await asyncio.sleep(min(cfg.pause, max(0.0, self.deadline_at - time.perf_counter())))
                    self.log(f"[loadtest] {transport} {cfg.mode}={level:g}: "
                             + (f"{level:g} calls of {cfg.plan.call_s:g} s ..." if cfg.mode == "voice-agent" else
                                f"{cfg.requests_for(level) or 'duration-bounded'} requests ..."))
                    records, summary = await self.level(transport, level, text_offset=li * 7)
                    result["levels"].append(summary)
                    result["streams"].extend(r.to_json() for r in records)
                    self.log(f"[loadtest]   ok {summary['ok']}, 429 {summary['rejected_429']}, errors "
                             f"{summary['errors']} {summary['errors_by_kind'] or ''}in {summary['wall_s']:.1f} s")
            await self.settle()
            result["ready_after"] = await self.ready()
            result["metrics_after"] = await self.metrics()
        result["deadline_hit"] = self.deadline_hit
        result["elapsed_s"] = round(time.perf_counter() - self.t_start, 3)
        return result


def _series_delta(before: dict, after: dict, name: str) -> float | None:
    """How much the counter ``name`` grew between two /metrics snapshots; None when the server has no such
    series (an older server, or /metrics unreachable)."""
    b, a = before.get("samples", {}), after.get("samples", {})
    return None if name not in a else round(a[name] - b.get(name, 0.0), 6)


def _loadavg() -> float | None:
    """1-minute load average of the machine the generator runs on (the server's too when it is local)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


class _NoCookies(httpx.Cookies):
    def extract_cookies(self, response) -> None:
        return None


class _CookielessClient(httpx.AsyncClient):
    """Keeps no cookies: a sticky-session cookie from an ingress would otherwise pin every later request of the
    run to one pod (each stream should be placed like a fresh client)."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NoCookies()

    @cookies.setter
    def cookies(self, value) -> None:
        pass
