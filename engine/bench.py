"""Benchmarks of bundle graphs (``mossrt bench``): medians over repeats, ratios rather than absolutes."""

from __future__ import annotations

import statistics
import time

import numpy as np

from .codec import Codec


def bench_codec(codec: Codec, frames: int = 24, repeats: int = 3, chunk_sizes=(1, 3, 6),
                n_quantizers: int = 16, seed: int = 0) -> dict:
    """ms per frame of streaming decode at each chunk size and of one-pass decode over the same frames,
    the streaming/one-pass ratio, host time outside ``session.run`` as a share, and KV bytes per stream."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codec.codebook_size, size=(frames, n_quantizers), dtype=np.int64)
    codec.decode(codes[:2], n_quantizers)  # warm-up: session creation, first-run allocations
    results: dict = {"frames": frames, "repeats": repeats, "n_quantizers": n_quantizers,
                     "device": codec.bundle.device, "streaming": {}}

    def one_pass() -> float:
        t = time.perf_counter()
        codec.decode(codes, n_quantizers, max_frames_per_call=frames)
        return time.perf_counter() - t

    one = [one_pass() for _ in range(repeats)]
    results["one_pass_ms_per_frame"] = 1000 * statistics.median(one) / frames
    for n in chunk_sizes:
        per_frame, host = [], []
        for _ in range(repeats):
            dec = codec.streaming_decoder(1, n_quantizers)
            t = time.perf_counter()
            for f in range(0, frames, n):
                dec.decode(codes[f:f + n])
            per_frame.append((time.perf_counter() - t) / frames)
            host.append(dec.timing.host_share)
        ms = 1000 * statistics.median(per_frame)
        results["streaming"][n] = {"ms_per_frame": ms,
                                   "ratio_to_one_pass": ms / results["one_pass_ms_per_frame"],
                                   "host_share": statistics.median(host),
                                   "realtime_factor": ms / (1000 * codec.samples_per_frame / codec.sample_rate)}
    results["kv_bytes_per_stream"] = codec.streaming_decoder(1, n_quantizers).state_bytes_per_stream
    # encode: one second of noise per repeat, ms per frame
    wav = rng.standard_normal(codec.sample_rate).astype(np.float32) * 0.1
    enc = []
    for _ in range(repeats):
        t = time.perf_counter()
        codec.encode(wav, codec.sample_rate)
        enc.append(time.perf_counter() - t)
    results["encode_ms_per_frame"] = 1000 * statistics.median(enc) / -(-wav.size // codec.samples_per_frame)
    return results


def format_codec_report(r: dict) -> str:
    lines = [f"codec decode bench: {r['frames']} frames, {r['n_quantizers']} quantizers, median of {r['repeats']}, "
             f"device {r['device']}",
             f"  one-pass decode          {r['one_pass_ms_per_frame']:9.2f} ms/frame"]
    for n, s in r["streaming"].items():
        lines.append(f"  streaming N={n:<3}          {s['ms_per_frame']:9.2f} ms/frame   x{s['ratio_to_one_pass']:.2f} "
                     f"of one-pass   host {100 * s['host_share']:.1f}%   RTF {s['realtime_factor']:.3f}")
    lines.append(f"  encode                   {r['encode_ms_per_frame']:9.2f} ms/frame")
    lines.append(f"  KV state per stream      {r['kv_bytes_per_stream']:,} bytes")
    return "\n".join(lines)
