"""The ``mossrt`` subcommands: each checks its inputs and outputs before any work, then composes
``export`` (bundle writing) and ``engine`` (running bundles)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


class CliError(Exception):
    """A usage problem found by the CLI itself (bad flag combination, unreadable file)."""


def progress(msg: str) -> None:
    print(f"[mossrt] {msg}", file=sys.stderr, flush=True)


def load_array(path, what: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises OSError, ValueError, EOFError... for unreadable files
        raise CliError(f"{what} {path}: not a readable .npy array ({str(e)[:200]})") from None
    if not isinstance(arr, np.ndarray):   # a .npz archive loads as NpzFile
        raise CliError(f"{what} {path}: expected one .npy array, got a {type(arr).__name__} (an .npz archive?)")
    return arr


def npy_output(path: str | Path, what: str) -> Path:
    """The path np.save will write (it appends .npy when missing), checked writable."""
    from engine.audio.files import check_writable_file

    p = Path(path)
    if p.suffix != ".npy":
        p = p.with_name(p.name + ".npy")
    return check_writable_file(p, what)


def limits_from(args):
    from engine.limits import Limits

    kw = {k: getattr(args, k) for k in ("max_text_chars", "max_voice_seconds", "max_context_rows")
          if getattr(args, k, None) is not None}
    return Limits(**kw)


# ---------------------------------------------------------------------------------------------- bundles
def cmd_export(args) -> None:
    from export.bundle import BundleWriter
    from export.checkpoint import Checkpoint, resolve_checkpoint
    from export.codec import parse_codec_config
    from export.codec_export import export_codec
    from export.graph import INT8_BLOCK
    from export.tokenizer_export import export_tokenizer, find_tokenizer
    from export.tts import parse_tts_config

    if not args.codec and not args.model:
        raise CliError("export needs --codec CKPT_DIR (and/or --model TTS_CKPT_DIR)")
    codec_dir = resolve_checkpoint(args.codec) if args.codec else None
    model_dir = resolve_checkpoint(args.model) if args.model else None
    # both configs first: swapped directories are named before anything else is looked for
    if codec_dir:
        parse_codec_config(Checkpoint(codec_dir).config)
    if model_dir:
        parse_tts_config(Checkpoint(model_dir).config)
    tokenizer = None
    if model_dir:
        tokenizer = find_tokenizer(resolve_checkpoint(args.tokenizer) if args.tokenizer else model_dir)
    codec_dtype = args.codec_dtype or (args.dtype if args.dtype in ("fp32", "fp16") else "fp32")
    int8_block = getattr(args, "int8_block", None)
    if int8_block is not None and not ((model_dir and args.dtype == "int8") or (codec_dir and codec_dtype == "int8")):
        raise CliError("--int8-block sets the blocks of int8 weights: it needs --dtype int8 (with --model) or "
                       "--codec-dtype int8 (with --codec)")
    int8_block = int8_block or INT8_BLOCK
    writer = BundleWriter(args.out)
    if codec_dir:
        export_codec(codec_dir, writer, codec_dtype, progress, progress_bar=True, int8_block=int8_block)
    if model_dir:
        from export.tts_export import export_tts

        export_tts(model_dir, writer, args.dtype, progress, progress_bar=True,
                   compute_dtype=getattr(args, "compute_dtype", "fp32"), int8_block=int8_block)
        assert tokenizer is not None, "found with the model's directory"
        export_tokenizer(tokenizer, writer)
    path = writer.finish()
    progress(f"bundle written: {path.parent}")


def cmd_verify(args) -> None:
    from engine.runtime.bundle import Bundle

    bundle = Bundle(args.bundle, device=None)
    names = bundle.verify()
    total = sum(e.bytes for e in bundle.info.files.values())
    print(f"{args.bundle}: {len(names)} files, {total / 2**20:.1f} MiB, every sha256 matches the manifest "
          f"(bundle {bundle.identity})")
    from engine.runtime.graph_stats import node_count_lines, node_counts

    print("graph nodes:")
    print("\n".join(node_count_lines(node_counts(bundle))))
    if args.provider:
        report_placement(bundle, args.provider)


def report_placement(bundle, provider: str) -> None:
    """``verify --provider``: every node without a kernel there (or a device→host copy); status 2 if any."""
    from engine.runtime.kernel_table import kernel_table

    table = kernel_table(provider)
    findings = bundle.unplaced(provider)
    source = f"{table.ep} kernels of {table.package} {table.version}"
    if not findings:
        print(f"{provider}: 0 nodes without a kernel: every node of the {len(bundle.info.graphs)} graphs can run "
              f"there ({source})")
        return
    print(f"{provider}: {len(findings)} node(s) cannot run as exported ({source}):")
    for f in findings:
        print(f"  {f.line()}")
    raise CliError(f"{len(findings)} node(s) cannot run on the {provider} provider as exported")


def load_model(args):
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle

    bundle = Bundle(args.bundle, device=args.device, threads=args.threads, profile_dir=profile_dir(args),
                    shared_pool=True)
    if bundle.is_demo:
        progress(f"note: {args.bundle} is the demo bundle ({bundle.info.demo.describe()})")
    return TTSModel(bundle, cuda_graphs=cuda_graphs_choice(args), warm_buckets=warm_buckets_choice(args))


def on_off(flag: str | None) -> bool | None:
    """An ``on|off`` flag or setting as the engine takes it (None: not given, the engine decides)."""
    return None if flag is None else flag == "on"


def cuda_graphs_choice(args) -> bool | None:
    """``--cuda-graphs on|off`` (None: not given, the device decides)."""
    return on_off(getattr(args, "cuda_graphs", None))


def warm_buckets_choice(args) -> bool | None:
    """``--warm-buckets on|off`` (None: not given, on when capturing)."""
    return on_off(getattr(args, "warm_buckets", None))


def load_codec(args):
    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle

    return Codec(Bundle(args.bundle, device=args.device, threads=args.threads, profile_dir=profile_dir(args),
                        shared_pool=True))


def profile_dir(args) -> Path | None:
    """``--profile DIR`` of the bench commands, created; None otherwise."""
    path = getattr(args, "profile", None)
    if not path:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--profile {path}: {e.strerror or e}") from None
    return Path(path)


# ---------------------------------------------------------------------------------------------- codec
def parse_schedule(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--schedule must be comma-separated frame counts, got {text!r}") from None
    return sizes


def cmd_codec_encode(args) -> None:
    from engine.audio.files import read_audio

    out = npy_output(args.output, "output")
    wav, sr = read_audio(args.input)
    codec = load_codec(args)
    codes = codec.encode(wav, sr)
    np.save(out, codes)
    progress(f"{codes.shape[0]} frames x {codes.shape[1]} quantizers -> {out}")


def cmd_codec_decode(args) -> None:
    from engine.audio.codec import Codec
    from engine.audio.files import audio_target, write_audio

    if args.chunk_frames is not None and args.schedule is not None:
        raise CliError("give either --chunk-frames or --schedule, not both")
    schedule = parse_schedule(args.schedule) if args.schedule else ([args.chunk_frames] if args.chunk_frames else None)
    if schedule:
        Codec.check_chunk_sizes(schedule)
    target = audio_target(args.output, pcm16=args.pcm16)
    codec = load_codec(args)
    codes = load_array(args.input, "codes")
    nq = args.n_quantizers if args.n_quantizers is not None else codec.default_n_quantizers(codes)
    wav = codec.decode(codes, nq, schedule=schedule)
    write_audio(target, wav, codec.sample_rate)
    progress(f"{wav.size} samples ({wav.size / codec.sample_rate:.2f} s) -> {target.path}")


# ---------------------------------------------------------------------------------------------- synthesis
def sampling(model, args):
    return model.default_sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  repetition_penalty=args.repetition_penalty,
                                  repetition_window=args.repetition_window, greedy=args.greedy or None)


def cmd_synth(args) -> None:
    from engine.audio.files import audio_target, write_audio
    from engine.audio.voices import read_reference_audio, resolve_voice
    from engine.offline.generate import generate, synthesize

    if args.voice and args.voice_codes:
        raise CliError("give --voice or --voice-codes, not both")
    limits = limits_from(args)
    limits.check_text_chars(args.text)
    if args.bundle is None:                       # as mossrt serve: the built-in demo bundle
        args.bundle = str(ensure_demo_bundle())
    target = audio_target(args.out)
    codes_out = npy_output(args.codes_out, "--codes-out") if args.codes_out else None
    voice_wav = read_reference_audio(args.voice, limits) if args.voice else None
    voice_codes = load_array(args.voice_codes, "voice codes") if args.voice_codes else None
    model = load_model(args)
    params = sampling(model, args)
    voice = resolve_voice(model, limits, wav=voice_wav, codes=voice_codes)
    gen = generate(model, text=args.text, voice_codes=voice, params=params, seed=args.seed,
                   max_frames=args.max_frames, limits=limits, allow_special_tokens=args.allow_special_tokens)
    wav = synthesize(model, gen)
    write_audio(target, wav, model.codec.sample_rate)
    if codes_out:
        np.save(codes_out, gen.codes)
    end = "EOS" if gen.stopped_on_eos else f"the {gen.raw_frames.shape[0]}-frame limit"
    progress(f"{gen.codes.shape[0]} frames ({wav.size / model.codec.sample_rate:.2f} s), stopped at {end}, "
             f"seed {gen.seed} -> {target.path}")
    if not gen.stopped_on_eos:
        progress("warning: the turn ended at its frame limit before the model finished speaking; "
                 "raise --max-frames or shorten the text")


def cmd_replay(args) -> None:
    """Drive a whole streaming session from a JSON script; write each turn's codes and audio."""
    from engine.audio.files import check_writable_file, write_audio
    from engine.audio.voices import read_reference_audio, resolve_voice
    from engine.offline.session import StreamingSession
    from engine.offline.turn import run_turn

    from .replay import load_script

    script_path = Path(args.script)
    try:
        script = load_script(script_path)
    except ValueError as e:
        raise CliError(str(e)) from None
    base = script_path.parent
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out-dir {out_dir}: {e.strerror or e}") from None
    check_writable_file(out_dir / "turn0.wav", "--out-dir")
    limits = limits_from(args)
    model = load_model(args)
    voice = resolve_voice(
        model, limits,
        wav=read_reference_audio(base / script.voice_wav, limits) if script.voice_wav else None,
        codes=load_array(base / script.voice_codes, "voice_codes") if script.voice_codes else None)
    session = StreamingSession(model, voice_codes=voice, params=sampling(model, args), seed=args.seed, limits=limits,
                               allow_special_tokens=args.allow_special_tokens)
    try:
        for i, turn in enumerate(script.turns):
            user_codes = load_array(base / turn.user_audio_codes, "user_audio_codes") if turn.user_audio_codes else None
            user_wav = (read_reference_audio(base / turn.user_audio_wav, limits, "user audio", user_audio=True)
                        if turn.user_audio_wav else None)
            result = run_turn(session, deltas=turn.assistant_deltas, token_ids=turn.assistant_token_ids,
                              user_text=turn.user_text, user_audio_codes=user_codes, user_audio_wav=user_wav,
                              max_frames=args.max_frames)
            codes, wav = result.codes(model.layout.codebooks), result.audio()
            np.save(out_dir / f"turn{i}_codes.npy", codes)
            write_audio(out_dir / f"turn{i}.wav", wav, model.codec.sample_rate)
            st = result.stats
            assert st is not None and st.finish_reason is not None, "a run turn has its stats and its end"
            seconds = wav.size / model.codec.sample_rate
            progress(f"turn {i}: {st.text_ids} text ids, {codes.shape[0]} frames ({seconds:.2f} s), "
                     f"finished by {st.finish_reason.value}, context {session.context_rows} rows")
    finally:
        session.close()


# ---------------------------------------------------------------------------------------------- bench
def report(result: dict, text: str, json_path: str | None, bundle=None) -> None:
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1, default=str))
    if bundle is not None and bundle.profile_dir is not None:
        from engine.tools.bench import profile_summary

        files = bundle.end_profiling()
        print(profile_summary(files))
        print(f"  profiles: {', '.join(str(f) for f in files)}")


def run_bench(args, load, run, fmt) -> None:
    """Check ``--json`` first, load the bundle (with ``--profile``), run, print (and the profile)."""
    from engine.audio.files import check_writable_file

    if args.json:
        check_writable_file(args.json, "--json")
    target = load(args)
    result = run(target)
    report(result, fmt(result), args.json, target.bundle)


def cmd_bench_codec(args) -> None:
    from engine.tools.bench import bench_codec, format_codec_report

    run_bench(args, load_codec, lambda codec: bench_codec(codec, frames=args.frames, repeats=args.repeats),
              format_codec_report)


def cmd_bench_synth(args) -> None:
    from engine.tools.bench import bench_synth, format_synth_report

    run_bench(args, load_model, lambda model: bench_synth(model, frames=args.frames, repeats=args.repeats),
              format_synth_report)


def cmd_bench_streams(args) -> None:
    from engine.tools.bench import bench_streams, format_streams_report

    try:
        counts = [int(x) for x in args.streams.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--streams must be comma-separated stream counts, got {args.streams!r}") from None
    if not counts or any(not 1 <= n <= 256 for n in counts):
        raise CliError("--streams counts must be integers in 1..256")
    run_bench(args, load_model, lambda model: bench_streams(model, streams=counts, frames=args.frames,
                                                            engine_process=args.engine_process == "on"),
              format_streams_report)


def cmd_bench_compare(args) -> None:
    from engine.tools.bench import bench_compare, format_compare_report

    run_bench(args, load_model, lambda model: bench_compare(model, frames=args.frames, streams=args.streams,
                                                            repeats=args.repeats, context_rows=args.context_rows),
              format_compare_report)


# ---------------------------------------------------------------------------------------------- checkpoints, demo
def cmd_doctor(args) -> int:
    """``mossrt doctor``: exit 0 when every check passed (or was skipped), 1 when one failed."""
    from mossrt.doctor import CHECKS, run_checks

    checks = [x.strip() for x in args.checks.split(",") if x.strip()]
    unknown = [x for x in checks if x not in CHECKS]
    if unknown or not checks:
        raise CliError(f"--checks: unknown check(s) {unknown or '(none given)'}; choose from {', '.join(CHECKS)}")
    device = args.device
    if device is None:
        import onnxruntime as ort

        device = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    if args.bundle and not (Path(args.bundle) / "manifest.json").is_file():
        raise CliError(f"--bundle {args.bundle}: not a bundle (no manifest.json)")
    if args.json:
        from engine.audio.files import check_writable_file

        check_writable_file(Path(args.json), "--json")

    def show(r) -> None:
        line = f"{r.name:<10} {r.status:<7} {r.seconds:6.1f} s"
        print(line + (f"  {r.reason}" if r.reason else ""), flush=True)

    print(f"mossrt doctor: device {device}, checks {', '.join(checks)}", flush=True)
    results = run_checks(device, checks, Path(args.bundle) if args.bundle else None, args.compute_dtype,
                         args.registry_out, args.threads, progress=progress, on_result=show)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "checks": [r.as_dict() for r in results]},
                                              indent=1) + "\n")
    failed = [r.name for r in results if r.status == "failed"]
    print(f"mossrt doctor: {len(results) - len(failed)} of {len(results)} checks passed or skipped"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_make_checkpoint(args) -> None:
    from export import random_checkpoint
    from export.demo import TOKENIZER_JSON
    from export.tokenizer_export import find_tokenizer

    out = Path(args.out)
    tokenizer = find_tokenizer(args.tokenizer) if args.tokenizer else TOKENIZER_JSON
    if args.kind == "codec":
        paths = [random_checkpoint.make_codec_checkpoint(out, seed=args.seed, preset=args.preset, progress=progress)]
    elif args.kind == "tts":
        paths = [random_checkpoint.make_tts_checkpoint(out, seed=args.seed, preset=args.preset,
                                                       tokenizer_json=tokenizer, progress=progress)]
    else:  # pair: <out>/tts and <out>/codec
        paths = [random_checkpoint.make_tts_checkpoint(out / "tts", seed=args.seed, preset=args.preset,
                                                       tokenizer_json=tokenizer, progress=progress),
                 random_checkpoint.make_codec_checkpoint(out / "codec", seed=args.seed + 1, preset=args.preset,
                                                         progress=progress)]
    for path in paths:
        progress(f"random checkpoint ({args.preset} dimensions, NOT a trained model) -> {path}")


def default_demo_dir() -> Path:
    return Path(os.environ.get("MOSSRT_DEMO_DIR") or Path.home() / ".cache" / "mossrt" / "demo-bundle")


def ensure_demo_bundle(path: Path | None = None) -> Path:
    """The demo bundle, built on first use (seconds, no download); rebuilt when its format is outdated."""
    from engine.errors import BundleError
    from engine.runtime.bundle import Bundle
    from export.demo import DEMO_VERSION, build_demo_bundle

    path = path or default_demo_dir()
    if (path / "manifest.json").is_file():
        try:
            demo = Bundle(path, device="cpu").info.demo
            if demo is None or demo.version == DEMO_VERSION:      # (a bundle not built here is never rewritten)
                return path
            progress(f"rebuilding the demo bundle in {path} (version {demo.version}, now {DEMO_VERSION})")
        except BundleError as e:
            progress(f"rebuilding the demo bundle in {path} ({e})")
    else:
        progress(f"building the demo bundle (random weights, audio is noise) in {path}")
    build_demo_bundle(path, progress=progress)
    return path


def cmd_demo(args) -> None:
    from engine.audio.files import audio_target, write_audio
    from engine.model.tts import TTSModel
    from engine.offline.generate import generate, synthesize
    from engine.runtime.bundle import Bundle

    target = audio_target(args.out)
    bundle_dir = ensure_demo_bundle(Path(args.bundle) if args.bundle else None)
    model = TTSModel(Bundle(bundle_dir, device=args.device, threads=args.threads))
    gen = generate(model, text=args.text, seed=0, max_frames=args.max_frames)
    wav = synthesize(model, gen)
    write_audio(target, wav, model.codec.sample_rate)
    seconds = wav.size / model.codec.sample_rate
    print(f"demo bundle {bundle_dir}: synthesized {gen.codes.shape[0]} frames ({seconds:.2f} s) "
          f"of {args.text!r} -> {target.path} (random weights: expect noise, not speech)")
