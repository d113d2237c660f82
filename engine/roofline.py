"""The bandwidth roofline of a bundle's per-frame stages: the bytes of weights each stage reads per call
(from its graph's initializers), the bandwidth that achieved at the measured time, and its share of what
this machine's memory delivers (a read probe run in the same process, at the same thread count)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .graph_stats import bundle_weight_bytes

PROBE_BYTES = 1 << 30       # 1 GiB: far beyond any last-level cache
PROBE_REPEATS = 5
FRAME_SECONDS = 0.08        # one frame of audio: the real-time budget of a frame


def probe_threads(threads: int) -> int:
    """The probe's reader threads for an intra-op setting (0 = all cores, as onnxruntime takes it)."""
    return threads if threads > 0 else len(os.sched_getaffinity(0))


def memory_read_bandwidth(threads: int = 0, nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> dict:
    """Best of ``repeats`` timed reads of an ``nbytes`` float64 buffer, summed in ``threads`` slices in
    parallel (numpy releases the GIL in a reduction): bytes per second this machine reads from memory.
    Run in a child process, so its buffer never counts in the bench's own peak RSS."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_read_probe, (probe_threads(threads), nbytes, repeats))


def _read_probe(n: int, nbytes: int, repeats: int) -> dict:
    buf = np.ones(max(nbytes // 8, n), np.float64)          # written once: every page is resident
    slices = np.array_split(buf, n)
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            total = sum(pool.map(np.sum, slices))
            best = min(best, time.perf_counter() - t)
    if total != buf.size:                                   # the reads happened and were whole
        raise RuntimeError("memory probe: wrong sum")
    return {"bytes": int(buf.nbytes), "threads": n, "repeats": repeats, "seconds": best,
            "bytes_per_s": buf.nbytes / best}


def stage_bytes(bundle) -> dict[str, int]:
    """Weight bytes per call of the per-frame stages present in ``bundle``: the backbone step, the depth
    call and the codec decoder call (the same bytes whether it decodes one frame or six)."""
    per_graph = bundle_weight_bytes(bundle)
    names = {"backbone step": "backbone", "depth": "depth", "codec call": "codec_decoder"}
    return {stage: per_graph[g] for stage, g in names.items() if g in per_graph}


def roofline(stages: dict[str, tuple[int, float]], probe: dict) -> dict:
    """Per stage ``name -> (bytes per call, ms per call)``: bytes, ms, the bandwidth achieved (bytes / time)
    and its share of ``probe``'s bandwidth."""
    rows = {}
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


def format_roofline(r: dict) -> list[str]:
    p = r["probe"]
    lines = [f"  roofline: memory read probe {p['bytes_per_s'] / 1e9:.1f} GB/s ({p['bytes'] / 2**30:.1f} GiB, "
             f"{p['threads']} threads, best of {p['repeats']})",
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
