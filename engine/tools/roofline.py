"""The bandwidth roofline of a bundle's per-frame stages: the bytes of weights each stage reads per call
(from its graph's initializers), the bandwidth that achieved at the measured time, and its share of what
this machine's memory delivers (read probes at the same thread count, taken between the timed runs)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.pool import Pool
from typing import Any

import numpy as np

from engine.runtime.bundle import Bundle
from engine.runtime.graph_stats import bundle_weight_bytes

PROBE_BYTES = 1 << 30       # 1 GiB: far beyond any last-level cache
PROBE_REPEATS = 5
FRAME_SECONDS = 0.08        # one frame of audio: the real-time budget of a frame

# a probe sample, a roofline, a bench's results: JSON-shaped reports (printed, or written with --json)
Report = dict[str, Any]


def probe_threads(threads: int) -> int:
    """The probe's reader threads for an intra-op setting (0 = all cores, as onnxruntime takes it)."""
    return threads if threads > 0 else len(os.sched_getaffinity(0))


class ReadProbe:
    """The memory read probe, sampled between a bench's runs: on a shared machine the bandwidth moves by tens
    of percent within minutes, so one probe taken before or after the timed runs says little about the
    bandwidth they had. ``sample()`` runs one probe (:func:`_read_probe`) in a child process kept for the
    bench (so its buffer never shows in the bench's peak RSS, and numpy is imported once); ``result()``
    gives the median sample, with every sample's bandwidth beside it."""

    def __init__(self, threads: int = 0, nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> None:
        self.threads, self.nbytes, self.repeats = probe_threads(threads), nbytes, repeats
        self.samples: list[Report] = []
        self._pool: Pool | None = None        # the probe's child process, while entered

    def __enter__(self) -> "ReadProbe":
        self._pool = multiprocessing.get_context("spawn").Pool(1)
        return self

    def __exit__(self, *exc: object) -> None:
        pool = self._entered()
        pool.terminate()
        pool.join()

    def sample(self) -> Report:
        """Run one probe in the child process and keep its result."""
        s: Report = self._entered().apply(_read_probe, (self.threads, self.nbytes, self.repeats))
        self.samples.append(s)
        return s

    def result(self) -> Report:
        """The samples so far as one probe result (:func:`combine_probes`)."""
        return combine_probes(self.samples)

    def _entered(self) -> Pool:
        if self._pool is None:
            raise RuntimeError("a ReadProbe samples inside its 'with' block only")
        return self._pool


def combine_probes(samples: list[Report]) -> Report:
    """One probe result from several samples: the median sample's figures (upper median for an even count),
    and ``samples_bytes_per_s``, every sample's bandwidth in the order taken."""
    if not samples:
        raise ValueError("no memory probe samples")
    mid = sorted(samples, key=lambda s: s["bytes_per_s"])[len(samples) // 2]
    return dict(mid, samples_bytes_per_s=[s["bytes_per_s"] for s in samples])


def _read_probe(n: int, nbytes: int, repeats: int) -> Report:
    """The best of ``repeats`` passes of ``n`` threads each taking the maximum of its share of an
    ``nbytes`` int32 buffer. A maximum, not a sum: numpy's float sum is pairwise and on some machines
    arithmetic-bound, slower than the memory and than onnxruntime's own weight reads, so a probe by sums put
    the stages above 100 % of the machine (measured in docs/performance.md, *The bandwidth roofline*).
    numpy's integer maximum is a SIMD compare per vector, far below any memory's rate on every core we know
    of."""
    buf = np.ones(max(nbytes // 4, n), np.int32)            # written once: every page is resident
    slices = np.array_split(buf, n)
    for i, part in enumerate(slices):
        part[-1] = 2 + i                                    # each share's last element: read through its end
    best = float("inf")
    peaks: list[np.int32] = []
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            peaks = list(pool.map(np.max, slices))
            best = min(best, time.perf_counter() - t)
    if peaks != [2 + i for i in range(n)]:                  # the reads happened and were whole
        raise RuntimeError("memory probe: wrong maximum")
    return {"bytes": int(buf.nbytes), "threads": n, "repeats": repeats, "seconds": best,
            "bytes_per_s": buf.nbytes / best}


def stage_bytes(bundle: Bundle) -> dict[str, int]:
    """Weight bytes per call of the per-frame stages present in ``bundle``: the backbone step, the depth
    call and the codec decoder call (the same bytes whether it decodes one frame or six)."""
    per_graph = bundle_weight_bytes(bundle)
    names = {"backbone step": "backbone", "depth": "depth", "codec call": "codec_decoder"}
    return {stage: per_graph[g] for stage, g in names.items() if g in per_graph}


def roofline(stages: dict[str, tuple[int, float]], probe: Report) -> Report:
    """Per stage ``name -> (bytes per call, ms per call)``: bytes, ms, the bandwidth achieved (bytes / time)
    and its share of ``probe``'s bandwidth."""
    rows: dict[str, Report] = {}
    for name, (nbytes, ms) in stages.items():
        nbytes = int(nbytes)
        bps = nbytes / (ms / 1000) if ms > 0 else float("nan")
        rows[name] = {"bytes": nbytes, "ms": ms, "bytes_per_s": bps, "share": bps / probe["bytes_per_s"]}
    return {"probe": probe, "stages": rows}


def frame_bytes(per_call: dict[str, int], codec_frames_per_call: int) -> int:
    """Weight bytes one steady frame reads: a backbone step, a depth call, and the codec call's bytes shared
    by the frames it decodes."""
    return (per_call.get("backbone step", 0) + per_call.get("depth", 0)
            + per_call.get("codec call", 0) // codec_frames_per_call)


def format_roofline(r: Report) -> list[str]:
    """The report's lines for a :func:`roofline` (with its probe and, when given, the steady frame's bytes)."""
    p = r["probe"]
    seen = p.get("samples_bytes_per_s", [p["bytes_per_s"]])
    spread = (f"median of {len(seen)} probes between the runs, {min(seen) / 1e9:.1f}-{max(seen) / 1e9:.1f}; "
              if len(seen) > 1 else "")
    lines = [f"  roofline: memory read probe {p['bytes_per_s'] / 1e9:.1f} GB/s ({spread}{p['bytes'] / 2**30:.1f} "
             f"GiB, {p['threads']} threads, each best of {p['repeats']})",
             f"    {'stage':<40} {'weights read':>13} {'ms':>9} {'GB/s':>7} {'roofline':>9}"]
    for name, s in r["stages"].items():
        lines.append(f"    {name:<40} {s['bytes'] / 1e6:10.1f} MB {s['ms']:9.2f} {s['bytes_per_s'] / 1e9:7.2f} "
                     f"{100 * s['share']:8.1f}%")
    if "frame_bytes" in r:
        need = r["frame_bytes"] / FRAME_SECONDS
        lines.append(f"    weights per steady frame {r['frame_bytes'] / 1e6:.1f} MB (codec at "
                     f"{r['codec_frames_per_call']} frames/call): one real-time stream needs {need / 1e9:.1f} GB/s, "
                     f"{100 * need / p['bytes_per_s']:.0f}% of the probe")
    return lines
