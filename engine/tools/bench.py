"""Benchmarks of bundle graphs (``mossrt bench``): medians over repeats, ratios rather than absolutes."""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from engine.audio.codec import Codec
from engine.errors import InputError
from engine.limits import Limits
from engine.model.tts import TTSModel
from engine.tools.roofline import ReadProbe, Report, format_roofline, frame_bytes, roofline, stage_bytes

if TYPE_CHECKING:          # the serving package is imported where a bench runs it, not with this module
    from engine.core.client import RemoteStream
    from engine.serving.scheduler import Scheduler, StreamHandle


def _probing(probe: ReadProbe | None, threads: int) -> AbstractContextManager[ReadProbe]:
    """``probe`` as it is (a caller pooling the samples of several benches), or a new one for this bench."""
    return contextlib.nullcontext(probe) if probe is not None else ReadProbe(threads)


def bench_codec(codec: Codec, frames: int = 24, repeats: int = 3, chunk_sizes: Sequence[int] = (1, 3, 6),
                n_quantizers: int = 16, seed: int = 0, probe: ReadProbe | None = None) -> Report:
    """ms per frame of streaming decode at each chunk size and of one-pass decode over the same frames,
    the streaming/one-pass ratio, host time outside ``session.run`` as a share, and KV bytes per stream;
    the memory read probe is sampled after the one-pass runs and after each chunk size's runs."""
    if frames < 1 or repeats < 1:
        raise InputError("bench codec needs frames >= 1 and repeats >= 1")
    with _probing(probe, codec.bundle.threads) as sampled:
        return _bench_codec(codec, frames, repeats, chunk_sizes, n_quantizers, seed, sampled)


def _bench_codec(codec: Codec, frames: int, repeats: int, chunk_sizes: Sequence[int], n_quantizers: int, seed: int,
                 probe: ReadProbe) -> Report:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codec.codebook_size, size=(frames, n_quantizers), dtype=np.int64)
    codec.decode(codes[:2], n_quantizers)  # warm-up: session creation, first-run allocations
    results: Report = {"frames": frames, "repeats": repeats, "n_quantizers": n_quantizers,
                     "device": codec.bundle.device, "streaming": {}}

    def one_pass() -> float:
        t = time.perf_counter()
        codec.decode(codes, n_quantizers, max_frames_per_call=frames)
        return time.perf_counter() - t

    one = [one_pass() for _ in range(repeats)]
    probe.sample()
    results["one_pass_ms_per_frame"] = 1000 * statistics.median(one) / frames
    for n in chunk_sizes:
        per_frame: list[float] = []
        host: list[float] = []
        for _ in range(repeats):
            dec = codec.streaming_decoder(1, n_quantizers)
            t = time.perf_counter()
            for f in range(0, frames, n):
                dec.decode(codes[f:f + n])
            per_frame.append((time.perf_counter() - t) / frames)
            host.append(dec.timing.host_share)
        probe.sample()
        ms = 1000 * statistics.median(per_frame)
        results["streaming"][n] = {"ms_per_frame": ms,
                                   "ratio_to_one_pass": ms / results["one_pass_ms_per_frame"],
                                   "host_share": statistics.median(host),
                                   "realtime_factor": ms / (1000 * codec.samples_per_frame / codec.sample_rate)}
    results["kv_bytes_per_stream"] = codec.streaming_decoder(1, n_quantizers).state_bytes_per_stream
    # encode: one second of noise per repeat, ms per frame
    wav = rng.standard_normal(codec.sample_rate).astype(np.float32) * 0.1
    enc: list[float] = []
    for _ in range(repeats):
        t = time.perf_counter()
        codec.encode(wav, codec.sample_rate)
        enc.append(time.perf_counter() - t)
    results["encode_ms_per_frame"] = 1000 * statistics.median(enc) / -(-wav.size // codec.samples_per_frame)
    call = stage_bytes(codec.bundle)["codec call"]
    results["roofline"] = roofline({f"codec, {n} frame(s)/call, per frame": (call // n, s["ms_per_frame"])
                                    for n, s in results["streaming"].items()},
                                   probe.result())
    return results


def format_codec_report(r: Report) -> str:
    """The printed report of :func:`bench_codec`."""
    lines = [f"codec decode bench: {r['frames']} frames, {r['n_quantizers']} quantizers, median of "
             f"{r['repeats']}, device {r['device']}",
             f"  one-pass decode          {r['one_pass_ms_per_frame']:9.2f} ms/frame"]
    for n, s in r["streaming"].items():
        lines.append(f"  streaming N={n:<3}          {s['ms_per_frame']:9.2f} ms/frame   "
                     f"x{s['ratio_to_one_pass']:.2f} of one-pass   host {100 * s['host_share']:.1f}%   "
                     f"RTF {s['realtime_factor']:.3f}")
    lines.append(f"  encode                   {r['encode_ms_per_frame']:9.2f} ms/frame")
    lines.append(f"  KV state per stream      {r['kv_bytes_per_stream']:,} bytes")
    return "\n".join(lines + format_roofline(r["roofline"]))


BENCH_TEXT = ("Welcome to the world of MOSS TTS Realtime. Experience how text transforms into smooth, "
              "human-like speech in real time.")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    import resource  # Unix only, like the service images

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def bench_synth(model: TTSModel, frames: int = 16, repeats: int = 3, seed: int = 0,
                probe: ReadProbe | None = None) -> Report:
    """Per-frame cost of each stage of synthesis (median over repeats, after a warm-up run): backbone
    prefill per prompt row, backbone step, depth and TTS frame interval (all after frame 0), codec
    (1 frame per call), the real-time factor, the host share (wall time outside ``session.run`` in the
    frame loop) and peak RSS. Runs a streaming session fed the text's ids, as a voice agent would. The
    memory read probe is sampled after each timed run."""
    if frames < 2 or repeats < 1:
        raise InputError("bench synth needs frames >= 2 and repeats >= 1")
    with _probing(probe, model.bundle.threads) as sampled:
        return _bench_synth(model, frames, repeats, seed, sampled)


def _bench_synth(model: TTSModel, frames: int, repeats: int, seed: int, probe: ReadProbe) -> Report:
    from engine.offline.session import StreamingSession

    ids = model.tokenizer.encode(BENCH_TEXT)
    n0 = model.layout.text_lead
    runs: list[dict[str, float]] = []
    for run in range(repeats + 1):
        if run > 1:
            probe.sample()                          # after each timed run but the last (sampled below)
        s = StreamingSession(model, seed=seed)
        t = s.runner.timing
        s.begin_turn(max_frames=frames)
        t0 = time.perf_counter()
        produced = s.push_token_ids(ids[:n0])                      # prefill -> frame 0
        t1 = time.perf_counter()
        prefill_rows = s.stats.prefill_rows
        first = {k: getattr(t, k).snapshot() for k in ("prefill", "step", "depth", "codec")}
        for token in ids[n0:]:
            produced += s.push_token_ids([token])
        produced += s.end_text() + s.drain()
        loop_s = time.perf_counter() - t1
        steps = len(produced) - 1
        d = {k: getattr(t, k).since(first[k]) for k in first}
        s.close()
        inside = sum(v.run_s for v in d.values())
        decoded = max(d["codec"].calls, 1)
        runs.append({
            "prefill_ms_per_row": 1000 * first["prefill"].total_s / prefill_rows,
            "prefill_rows": prefill_rows,
            "first_frame_ms": 1000 * (t1 - t0),
            "backbone_step_ms": 1000 * d["step"].total_s / steps,
            "depth_ms": 1000 * d["depth"].total_s / steps,
            "codec_ms": 1000 * d["codec"].total_s / decoded,
            "frame_ms": 1000 * (loop_s - d["codec"].total_s) / steps,
            "host_share": (loop_s - inside) / loop_s if loop_s else 0.0,
        })
    probe.sample()
    med: Report = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
    frame_s = model.codec.frame_seconds
    med["rtf"] = (med["frame_ms"] + med["codec_ms"]) / (1000 * frame_s)
    med.update(frames=frames, repeats=repeats, device=model.bundle.device, peak_rss_bytes=peak_rss_bytes(),
               tts_dtype=model.bundle.section("tts").dtype, codec_dtype=model.bundle.section("codec").dtype)
    per_call = stage_bytes(model.bundle)
    med["roofline"] = roofline({"backbone step": (per_call["backbone step"], med["backbone_step_ms"]),
                                "depth": (per_call["depth"], med["depth_ms"]),
                                "codec, 1 frame/call": (per_call["codec call"], med["codec_ms"])},
                               probe.result())
    med["roofline"].update(frame_bytes=frame_bytes(per_call, 6), codec_frames_per_call=6)
    return med


def format_synth_report(r: Report) -> str:
    """The printed report of :func:`bench_synth`."""
    return "\n".join([
        f"synth bench: {r['frames']} frames, median of {r['repeats']} (after a warm-up run), "
        f"device {r['device']}, tts {r['tts_dtype']}, codec {r['codec_dtype']}",
        f"  backbone prefill        {r['prefill_ms_per_row']:9.2f} ms/row  ({r['prefill_rows']} rows)",
        f"  first frame (prefill + depth) {r['first_frame_ms']:9.1f} ms",
        f"  backbone step           {r['backbone_step_ms']:9.2f} ms/frame",
        f"  depth loop (16 codes)   {r['depth_ms']:9.2f} ms/frame",
        f"  TTS frame interval      {r['frame_ms']:9.2f} ms/frame   host {100 * r['host_share']:.1f}%",
        f"  codec (1 frame/call)    {r['codec_ms']:9.2f} ms/frame",
        f"  real-time factor        {r['rtf']:9.3f}   (TTS frame + codec per 80 ms of audio)",
        f"  peak RSS                {r['peak_rss_bytes'] / 2**30:9.2f} GiB",
        *format_roofline(r["roofline"]),
    ])


STREAM_TEXTS = [
    "Welcome to the world of MOSS TTS Realtime, where text turns into speech as it arrives.",
    "The quick brown fox jumps over the lazy dog while the streaming model keeps on talking.",
    "Numbers like forty two and three point one four sound natural when spoken clearly.",
    "A voice agent answers questions about the weather, the trains and the news of the day.",
    "Every stream in a batch gets its own audio, exactly as if it had the machine to itself.",
    "Paris has museums, cafes and long walks along the river, all within a few hours.",
    "Reading the same weights once for many streams is where a batched server wins its speed.",
    "Short replies, long stories and everything in between are spoken frame by frame.",
]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def bench_streams(model: TTSModel, streams: Sequence[int] = (1, 2, 4, 8, 16), frames: int = 32,
                  seed: int = 0, engine_process: bool = False) -> Report:
    """N concurrent streams with different texts through one scheduler (its prefix cache warm, as in the
    service): aggregate frames/s, per-stream frame interval p50/p99, time to first frame under load, the
    ratio to one stream, KV bytes, and the device loop's cost: tick time p50/p99 and host time (a tick's
    wall time outside onnxruntime runs) per steady tick and per stream in it. ``engine_process``: the
    scheduler runs in an engine core process (as ``mossrt serve --engine-process on`` runs it), one started
    per stream count, and the intervals are the frames' arrivals in this process."""
    import threading

    from engine.core.client import EngineClient
    from engine.core.config import CoreConfig
    from engine.serving.handles import QueueSink
    from engine.serving.scheduler import FrameEvent, Scheduler, StreamError, TurnEnd

    if frames < 2 or any(n < 1 for n in streams):
        raise InputError("bench streams needs frames >= 2 and stream counts >= 1")
    texts = [model.tokenizer.encode(" ".join(STREAM_TEXTS[i:] + STREAM_TEXTS[:i]) * 3)
             for i in range(len(STREAM_TEXTS))]

    prefix_bytes = 4 * model.kv_bytes_per_slot(len(model.prompt.tts_prompt(None)))

    def run(n: int) -> Report:
        if engine_process:
            b = model.bundle
            # the core warms the system prompt's prefix KV as it starts (LocalEngine's warm-up synthesis)
            client = EngineClient.start(CoreConfig(bundle_dir=str(b.dir), device=b.device, threads=b.threads,
                                                   slots=n, prefix_cache_bytes=prefix_bytes,
                                                   cuda_graphs=model.cuda_graphs, warm_buckets=model.warm_buckets))
            if client.wait_settled(600) != "ready":
                raise InputError(f"the engine core did not start: {client.error or client.broken}")
            client.call("take_ticks")                           # only the run's ticks count
            def opener(i: int) -> StreamHandle | RemoteStream:
                return client.open_stream(None, model.default_sampling(), seed + i, QueueSink())
        else:
            # as the service runs: the system prompt's KV comes from the prefix cache (computed before timing)
            scheduler = Scheduler(model, slots=n, prefix_cache_bytes=prefix_bytes)
            scheduler.warm_prefix(None)
            scheduler.wait_warm()                   # its bucket warm-up (--warm-buckets on) is not measured
            scheduler.runner.timing.recent_ticks.clear()        # the loop is idle here: only the run's ticks count
            def opener(i: int) -> StreamHandle | RemoteStream:
                return scheduler.open_stream(params=model.default_sampling(), seed=seed + i)
        stats: list[tuple[float, list[float]] | None] = [None] * n      # per stream: its start, its frames' times

        def one(i: int) -> None:
            h = opener(i)
            t0 = time.perf_counter()
            h.begin_turn(max_frames=frames, wait=60)
            h.push_token_ids(texts[i % len(texts)])
            h.end_text()
            times: list[float] = []
            while True:
                event = h.get(timeout=600)
                if isinstance(event, FrameEvent):
                    times.append(time.perf_counter())
                elif isinstance(event, StreamError):
                    raise event.error
                elif isinstance(event, TurnEnd):
                    break
            h.close()
            stats[i] = (t0, times)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        t_start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_start
        finished = [s for s in stats if s is not None]
        assert len(finished) == n, "every stream's thread finished its turn (a failed one printed its traceback)"
        if engine_process:
            ticks = [tuple(t) for t in client.call("take_ticks")]
            snap = client.fresh_snapshot()
            assert snap.stats is not None, "a ready core has its stats"
            bytes_per_stream = snap.stats.bytes_per_stream
            steps = depths = None           # the core keeps its graph-call counters to itself
            client.stop()
        else:
            bytes_per_stream = scheduler.runner.bytes_per_stream()
            timing = scheduler.runner.timing
            steps, depths = timing.step.calls, timing.depth.calls
            scheduler.stop()
            ticks = list(timing.recent_ticks)
        # steady ticks: every stream fed a row (no stream still waiting, prefilling alone or finished)
        steady = [(wall, run, k) for wall, run, k in ticks if k == n] or ticks
        intervals = [b - a for _, ts in finished for a, b in zip(ts, ts[1:])]
        total = sum(len(ts) for _, ts in finished)
        return {"streams": n, "frames": total, "wall_s": wall, "frames_per_s": total / wall,
                "interval_ms_p50": 1000 * _percentile(intervals, 50),
                "interval_ms_p99": 1000 * _percentile(intervals, 99),
                "first_frame_ms_p50": 1000 * _percentile([ts[0] - t0 for t0, ts in finished if ts], 50),
                "first_frame_ms_max": 1000 * max(ts[0] - t0 for t0, ts in finished if ts),
                "ticks": len(ticks), "steady_ticks": len(steady),
                "tick_ms_p50": 1000 * _percentile([wall for wall, _, _ in ticks], 50),
                "tick_ms_p99": 1000 * _percentile([wall for wall, _, _ in ticks], 99),
                "host_ms_per_tick_p50": 1000 * _percentile([wall - run for wall, run, _ in steady], 50),
                "host_us_per_stream_p50": 1e6 * _percentile([(wall - run) / k for wall, run, k in steady if k], 50),
                "backbone_steps": steps, "depth_calls": depths,
                "kv_bytes_in_use": n * bytes_per_stream, "kv_bytes_per_stream": bytes_per_stream}

    run(1)   # warm-up: session creation, first-run allocations
    results = [run(n) for n in streams]
    base = results[0]["frames_per_s"] if results and results[0]["streams"] == 1 else None
    for r in results:
        r["speedup_vs_1"] = r["frames_per_s"] / base if base else None
    return {"device": model.bundle.device, "tts_dtype": model.bundle.section("tts").dtype, "frames_per_stream": frames,
            "engine": "core process" if engine_process else "in process",
            "kv_rows_per_slot": Limits().max_context_rows, "runs": results, "peak_rss_bytes": peak_rss_bytes()}


def format_streams_report(r: Report) -> str:
    """The printed report of :func:`bench_streams`."""
    lines = [f"streams bench: {r['frames_per_stream']} frames per stream, device {r['device']}, "
             f"tts {r['tts_dtype']}, KV slot {r['kv_rows_per_slot']} rows, engine {r.get('engine', 'in process')}",
             "  streams   frames/s   x one   interval p50/p99 ms   first frame p50/max ms   KV in use"
             "   tick p50/p99 ms   host/tick ms   host/stream us"]
    for x in r["runs"]:
        speed = f"x{x['speedup_vs_1']:.2f}" if x["speedup_vs_1"] else "  -"
        lines.append(f"  {x['streams']:>7} {x['frames_per_s']:10.1f} {speed:>7}   {x['interval_ms_p50']:8.1f} / "
                     f"{x['interval_ms_p99']:<8.1f}   {x['first_frame_ms_p50']:9.1f} / {x['first_frame_ms_max']:<9.1f}"
                     f"   {x['kv_bytes_in_use'] / 2**20:8.1f} MiB   {x['tick_ms_p50']:7.2f} / {x['tick_ms_p99']:<7.2f}"
                     f"   {x['host_ms_per_tick_p50']:12.3f}   {x['host_us_per_stream_p50']:14.1f}")
    lines.append("  host: a steady tick's wall time outside onnxruntime runs (every stream fed a row), median")
    lines.append(f"  peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    return "\n".join(lines)


def profile_summary(files: Sequence[str | Path], top: int = 15) -> str:
    """Top ops of onnxruntime profiles by time: per op type and per module (node names carry the module
    path, e.g. ``language_model.layers.3.self_attn/MatMulNBits_120``)."""
    import collections
    import json

    by_op: collections.Counter[str] = collections.Counter()
    by_module: collections.Counter[str] = collections.Counter()
    total = 0.0
    for path in files:
        for event in json.loads(Path(path).read_text()):
            if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
                continue
            dur = event["dur"] / 1000.0
            total += dur
            by_op[event["args"].get("op_name", "?")] += dur
            parts = []
            for part in event["name"][: -len("_kernel_time")].split("/"):
                if re.fullmatch(r"[A-Za-z0-9]+_\d+", part):     # the node itself (Op_N): the scope ends here
                    break
                parts.append(".".join(p for p in part.split(".") if not p.isdigit()))
            module = "/".join(parts) or "(graph)"
            by_module[module] += dur
    lines = [f"onnxruntime profile: {total:.1f} ms of kernel time in {len(files)} sessions"]
    for title, counter in (("op type", by_op), ("module", by_module)):
        lines.append(f"  top {title}s:")
        for name, ms in counter.most_common(top):
            lines.append(f"    {name:<48} {ms:10.1f} ms  {100 * ms / total if total else 0:5.1f}%")
    return "\n".join(lines)


# Upstream PyTorch fp32 on this machine kind (../shared/spec/baseline_cpu.md, medians): the fixed reference
# `bench compare` quotes its ratios against.
BASELINE_CPU = {
    "prefill_ms_per_row": 36.4, "backbone_step_ms": 350.0, "depth_ms": 809.0, "tts_frame_ms": 1165.0,
    "codec_ms_per_frame": {1: 396.0, 3: 293.0, 6: 169.0}, "time_to_first_audio_ms": 6700.0,
    "peak_rss_gib": 9.21 + 7.34,
}


def _ttfa(scheduler: Scheduler, model: TTSModel, ids: Sequence[int], voice: npt.NDArray[np.int64] | None = None,
          user_text: str = "", handle: StreamHandle | None = None) -> tuple[float, StreamHandle]:
    """Milliseconds from a turn's first text to its first audio through the scheduler (12 ids, as an LLM
    would have streamed them by then)."""
    from engine.serving.scheduler import FrameEvent, StreamError, TurnEnd

    h = handle or scheduler.open_stream(voice_codes=voice, params=model.default_sampling(), seed=0)
    t0 = time.perf_counter()
    h.begin_turn(user_text=user_text, max_frames=6, wait=600)
    h.push_token_ids(ids[: model.layout.text_lead])
    first = None
    while True:
        event = h.get(timeout=600)
        if isinstance(event, FrameEvent) and event.frame.audio is not None and first is None:
            first = time.perf_counter() - t0
            h.push_token_ids(ids[model.layout.text_lead: model.layout.text_lead + 8])
            h.end_text()
        elif isinstance(event, StreamError):
            raise event.error
        elif isinstance(event, TurnEnd):
            assert first is not None, "a turn of 6 frames has audio before its end"
            return 1000 * first, h


def bench_parking(model: TTSModel, ids: Sequence[int], context_rows: int = 1000, repeats: int = 3) -> Report:
    """What parking costs a conversation of ``context_rows`` rows: the time to first audio of its next turn
    kept in its slot, and of the same turn after another stream's turn parked it (one slot, so every turn of
    the other stream parks the conversation and every turn of the conversation parks the other), the turn
    that parks it, and the resume itself (admission to rows back in the slot)."""
    from engine.serving.scheduler import Scheduler

    need_rows: Callable[[StreamHandle], int] = lambda h: max(0, context_rows - h.context_rows - len(ids) - 8)
    kept: list[float] = []
    parking: list[float] = []
    resumed: list[float] = []
    resume_ms: list[float] = []
    row_bytes = model.kv_bytes_per_slot(1) // 2
    sch = Scheduler(model, slots=1, limits=Limits(max_context_rows=max(2 * context_rows, 512)),
                    parked_bytes=4 * row_bytes * (context_rows + 512))
    try:
        sch.wait_warm()
        h = sch.open_stream(params=model.default_sampling(), seed=0)
        sentence_rows = len(model.tokenizer.encode(BENCH_TEXT))
        per_turn = max(1, 3500 // (len(BENCH_TEXT) + 1))      # sentences in a user text within its limit
        while True:                                           # the conversation's earlier turns
            sentences = min(per_turn, need_rows(h) // sentence_rows)
            _ttfa(sch, model, ids, user_text=" ".join([BENCH_TEXT] * sentences), handle=h)
            if sentences < per_turn:
                break
        g: StreamHandle | None = None
        for _ in range(repeats):
            kept.append(_ttfa(sch, model, ids, user_text="And then?", handle=h)[0])
            ms, g = _ttfa(sch, model, ids, handle=g)           # no free slot: h is parked
            parking.append(ms)
            sch.take_resume_seconds()
            rows = h.context_rows
            resumed.append(_ttfa(sch, model, ids, user_text="And then?", handle=h)[0])   # g parked, h resumed
            resume_ms += [1000 * s for s in sch.take_resume_seconds()]
        stats = sch.stats().parking
        assert stats is not None and g is not None, "the scheduler parks (parked_bytes > 0) and repeats >= 1"
        g.close()
        h.close()
    finally:
        sch.stop()
    return {"context_rows": rows, "parked_bytes": rows * row_bytes, "parks": stats.parks,
            "resumes": stats.resumes,
            "resume_ms": statistics.median(resume_ms), "resume_samples": len(resume_ms),
            "time_to_first_audio_ms": {f"next turn at {rows} rows, kept in its slot": statistics.median(kept),
                                       f"next turn at {rows} rows, parked and resumed": statistics.median(resumed),
                                       f"a turn that parks a {rows}-row context": statistics.median(parking)}}


def bench_compare(model: TTSModel, frames: int = 8, streams: int = 8, voice_seconds: float = 10.0,
                  repeats: int = 3, context_rows: int = 1000) -> Report:
    """Per-stage ms, time to first audio (text only, registered voice, second turn, a turn of a conversation
    of ``context_rows`` rows kept in its slot and parked), frames/s at 1 and ``streams`` streams, memory;
    each with its ratio to the upstream PyTorch CPU baseline."""
    from engine.serving.scheduler import Scheduler

    with ReadProbe(model.bundle.threads) as probe:        # one series across both: the steady frame joins them
        synth = bench_synth(model, frames=frames, repeats=repeats, probe=probe)
        codec = bench_codec(model.codec, frames=12, repeats=repeats, chunk_sizes=(1, 3, 6), probe=probe)
    ids = model.tokenizer.encode(BENCH_TEXT)
    rng = np.random.default_rng(0)
    voice_wav = (rng.standard_normal(int(voice_seconds * model.codec.sample_rate)) * 0.1).astype(np.float32)
    voice = model.codec.encode(voice_wav, model.codec.sample_rate)[:, : model.layout.codebooks]
    prefix_bytes = 4 * model.kv_bytes_per_slot(len(model.prompt.tts_prompt(voice)))
    ttfa: dict[str, list[float]] = {"cold (no prefix cache)": [], "text only": [], "registered voice": [],
                                    "second turn": []}
    scheduler = Scheduler(model, slots=2, prefix_cache_bytes=prefix_bytes)
    plain = Scheduler(model, slots=1)
    try:
        for sch in (scheduler, plain):
            sch.wait_warm()                     # the bucket warm-up (--warm-buckets on) is not measured
        scheduler.warm_prefix(None)
        scheduler.warm_prefix(voice)
        _ttfa(scheduler, model, ids)[1].close()               # warm-up: first-run allocations
        for _ in range(repeats):
            ms, h = _ttfa(plain, model, ids)
            h.close()
            ttfa["cold (no prefix cache)"].append(ms)
            ms, h = _ttfa(scheduler, model, ids)
            ttfa["text only"].append(ms)
            ttfa["second turn"].append(_ttfa(scheduler, model, ids, user_text="And then?", handle=h)[0])
            h.close()
            ms, h = _ttfa(scheduler, model, ids, voice=voice)
            h.close()
            ttfa["registered voice"].append(ms)
        assert scheduler.prefix_cache is not None, "made with prefix_cache_bytes > 0"
        prefix_stats = scheduler.prefix_cache.stats
    finally:
        scheduler.stop()
        plain.stop()
    parked = bench_parking(model, ids, context_rows=context_rows, repeats=repeats)
    ttfa_ms = {k: statistics.median(v) for k, v in ttfa.items()} | parked.pop("time_to_first_audio_ms")
    runs = bench_streams(model, streams=(1, streams), frames=max(frames, 8))["runs"]
    frame_ms = synth["frame_ms"]
    steady = synth["backbone_step_ms"] + synth["depth_ms"] + codec["streaming"][6]["ms_per_frame"]
    per_call = stage_bytes(model.bundle)
    lines = roofline({"backbone step": (per_call["backbone step"], synth["backbone_step_ms"]),
                      "depth": (per_call["depth"], synth["depth_ms"]),
                      "codec, 1 frame/call": (per_call["codec call"], codec["streaming"][1]["ms_per_frame"]),
                      "codec, 6 frames/call, per frame": (per_call["codec call"] // 6,
                                                          codec["streaming"][6]["ms_per_frame"]),
                      "steady frame (step+depth+codec@6)": (frame_bytes(per_call, 6), steady)},
                     probe.result())
    lines.update(frame_bytes=frame_bytes(per_call, 6), codec_frames_per_call=6)
    return {
        "device": model.bundle.device, "tts_dtype": model.bundle.section("tts").dtype,
        "codec_dtype": model.bundle.section("codec").dtype,
        "stages_ms": {"prefill_per_row": synth["prefill_ms_per_row"], "backbone_step": synth["backbone_step_ms"],
                      "depth": synth["depth_ms"], "tts_frame": frame_ms,
                      **{f"codec_{n}_per_frame": s["ms_per_frame"] for n, s in codec["streaming"].items()},
                      "steady_frame_codec6": steady},
        "host_share": synth["host_share"],
        "time_to_first_audio_ms": ttfa_ms,
        "parking": parked,
        "frames_per_s": {r["streams"]: r["frames_per_s"] for r in runs},
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_bytes_per_row": model.kv_bytes_per_slot(1) // 2,
        "kv_bytes_per_stream": {"4096 rows": model.kv_bytes_per_slot(4096)
                                + model.codec.decoder_bytes_per_stream()},
        "prefix_kv_bytes": {"system prompt": len(model.prompt.tts_prompt(None))
                            * (model.kv_bytes_per_slot(1) // 2),
                            f"system prompt + {voice_seconds:g} s voice":
                                len(model.prompt.tts_prompt(voice)) * (model.kv_bytes_per_slot(1) // 2)},
        "prefix_cache": {"hits": prefix_stats.hits, "entries": prefix_stats.entries},
        "baseline": BASELINE_CPU,
        "roofline": lines,
    }


def format_compare_report(r: Report) -> str:
    """The printed report of :func:`bench_compare`, each figure beside the upstream baseline."""
    b = r["baseline"]

    def ratio(ours: float, base: float) -> str:
        return f"{ours / base:6.3f}x" if base else ""
    st = r["stages_ms"]
    rows = [("prefill per row", st["prefill_per_row"], b["prefill_ms_per_row"]),
            ("backbone step", st["backbone_step"], b["backbone_step_ms"]),
            ("depth (16 codes)", st["depth"], b["depth_ms"]),
            ("TTS frame", st["tts_frame"], b["tts_frame_ms"])]
    rows += [(f"codec, {n} frame(s)/call, per frame", st[f"codec_{n}_per_frame"], b["codec_ms_per_frame"][n])
             for n in (1, 3, 6)]
    lines = [f"bench compare: device {r['device']}, tts {r['tts_dtype']}, codec {r['codec_dtype']}; "
             "ratio = ours / upstream PyTorch fp32 on this machine kind (lower is better)",
             f"  {'stage':<36} {'ms':>10} {'baseline':>10} {'ratio':>8}"]
    lines += [f"  {name:<36} {ours:10.2f} {base:10.1f} {ratio(ours, base):>8}" for name, ours, base in rows]
    lines.append(f"  {'steady frame (step+depth+codec@6)':<36} {st['steady_frame_codec6']:10.2f}")
    lines.append(f"  host time outside onnxruntime runs: {100 * r['host_share']:.1f}% of the frame loop")
    lines.append(f"  {'time to first audio':<46} {'ms':>10} {'baseline':>10} {'ratio':>8}")
    for name, ms in r["time_to_first_audio_ms"].items():
        lines.append(f"    {name:<44} {ms:10.1f} {b['time_to_first_audio_ms']:10.1f} "
                     f"{ratio(ms, b['time_to_first_audio_ms']):>8}")
    p = r["parking"]
    lines.append(f"  parking a {p['context_rows']}-row context ({_size(p['parked_bytes'])} of KV): resume "
                 f"{p['resume_ms']:.1f} ms (admission to rows back in the slot, median of {p['resume_samples']})")
    fps = r["frames_per_s"]
    one, many = min(fps), max(fps)
    lines.append(f"  frames/s: 1 stream {fps[one]:.2f}, {many} streams {fps[many]:.2f} "
                 f"(x{fps[many] / fps[one]:.2f}); baseline 1 stream {1000 / b['tts_frame_ms']:.2f}")
    lines.append(f"  peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (baseline TTS + codec processes "
                 f"{b['peak_rss_gib']:.2f} GiB)")
    lines.append(f"  KV: {_size(r['kv_bytes_per_row'])} per context row; a stream of 4096 rows with its codec "
                 f"rings {_size(r['kv_bytes_per_stream']['4096 rows'])}")
    for name, n in r["prefix_kv_bytes"].items():
        lines.append(f"  cached prefix KV, {name}: {_size(n)}")
    return "\n".join(lines + format_roofline(r["roofline"]))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
