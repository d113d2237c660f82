"""``mossrt`` command line: composes ``export`` (bundle writing) and ``engine`` (running bundles)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


class CliError(Exception):
    """A usage problem found by the CLI itself (bad flag combination, unreadable file)."""


def _progress(msg: str) -> None:
    print(f"[mossrt] {msg}", file=sys.stderr, flush=True)


def _load_array(path, what: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises OSError, ValueError, EOFError... for unreadable files
        raise CliError(f"{what} {path}: not a readable .npy array ({e})") from None


# ---------------------------------------------------------------------------------------------- export
def cmd_export(args) -> None:
    from export.bundle import BundleWriter
    from export.checkpoint import resolve_checkpoint
    from export.codec_export import export_codec
    from export.tokenizer_export import export_tokenizer, find_tokenizer

    if not args.codec and not args.model:
        raise CliError("export needs --codec CKPT_DIR (and/or --model TTS_CKPT_DIR)")
    codec_dir = resolve_checkpoint(args.codec) if args.codec else None
    model_dir = resolve_checkpoint(args.model) if args.model else None
    tokenizer = find_tokenizer(resolve_checkpoint(args.tokenizer) if args.tokenizer else model_dir) if model_dir else None
    writer = BundleWriter(args.out)
    if codec_dir:
        codec_dtype = args.codec_dtype or (args.dtype if args.dtype in ("fp32", "fp16") else "fp32")
        export_codec(codec_dir, writer, codec_dtype, _progress, progress_bar=True)
    if model_dir:
        from export.tts_export import export_tts

        export_tts(model_dir, writer, args.dtype, _progress, progress_bar=True)
        export_tokenizer(tokenizer, writer)
    path = writer.finish()
    _progress(f"bundle written: {path.parent}")


# ---------------------------------------------------------------------------------------------- codec
def _load_codec(args):
    from engine.bundle import Bundle
    from engine.codec import Codec

    return Codec(Bundle(args.bundle, device=args.device, threads=args.threads))


def _parse_schedule(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--schedule must be comma-separated frame counts, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise CliError("--schedule sizes must be >= 1")
    return sizes


def cmd_codec_encode(args) -> None:
    from engine.codec import read_audio

    codec = _load_codec(args)
    wav, sr = read_audio(args.input)
    codes = codec.encode(wav, sr)
    np.save(args.output, codes)
    _progress(f"{codes.shape[0]} frames x {codes.shape[1]} quantizers -> {args.output}")


def cmd_codec_decode(args) -> None:
    from engine.codec import write_audio

    codec = _load_codec(args)
    codes = _load_array(args.input, "codes")
    nq = args.n_quantizers if args.n_quantizers is not None else codec.default_n_quantizers(codes)
    if args.chunk_frames is not None and args.schedule is not None:
        raise CliError("give either --chunk-frames or --schedule, not both")
    if args.chunk_frames is not None and args.chunk_frames < 1:
        raise CliError("--chunk-frames must be >= 1")
    schedule = _parse_schedule(args.schedule) if args.schedule else (
        [args.chunk_frames] if args.chunk_frames else None)
    wav = codec.decode(codes, nq, schedule=schedule)
    write_audio(args.output, wav, codec.sample_rate, pcm16=args.pcm16)
    _progress(f"{wav.size} samples ({wav.size / codec.sample_rate:.2f} s) -> {args.output}")


# ---------------------------------------------------------------------------------------------- synth
def _load_tts(args):
    from engine.bundle import Bundle
    from engine.tts import TTSModel

    bundle = Bundle(args.bundle, device=args.device, threads=args.threads)
    if "demo" in bundle.manifest:
        _progress(f"note: {args.bundle} is the demo bundle ({bundle.manifest['demo']['note']})")
    return TTSModel(bundle)


def _sampling(model, args):
    return model.default_sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  repetition_penalty=args.repetition_penalty,
                                  repetition_window=args.repetition_window, greedy=args.greedy or None)


def cmd_synth(args) -> None:
    from engine.codec import read_audio, write_audio
    from engine.generate import generate, resolve_voice, synthesize

    model = _load_tts(args)
    params = _sampling(model, args)
    if args.voice and args.voice_codes:
        raise CliError("give --voice or --voice-codes, not both")
    voice_codes = _load_array(args.voice_codes, "voice codes") if args.voice_codes else None
    voice = resolve_voice(model, read_audio(args.voice) if args.voice else None, voice_codes)
    gen = generate(model, text=args.text, voice_codes=voice, params=params, seed=args.seed,
                   max_frames=args.max_frames, max_text_chars=args.max_text_chars)
    wav = synthesize(model, gen)
    write_audio(args.out, wav, model.codec.sample_rate)
    if args.codes_out:
        np.save(args.codes_out, gen.codes)
    end = "EOS" if gen.stopped_on_eos else f"the {gen.raw_frames.shape[0]}-frame limit"
    _progress(f"{gen.codes.shape[0]} frames ({wav.size / model.codec.sample_rate:.2f} s), stopped at {end}, "
              f"seed {gen.seed} -> {args.out}")


def cmd_replay(args) -> None:
    """Drive a whole streaming session from a JSON script; write each turn's codes and audio."""
    from engine.codec import read_audio, write_audio
    from engine.session import StreamingSession

    script_path = Path(args.script)
    try:
        script = json.loads(script_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"{script_path}: not a readable JSON script ({e})") from None
    if not isinstance(script, dict) or not isinstance(script.get("turns"), list) or not script["turns"]:
        raise CliError(f"{script_path}: the script needs a non-empty \"turns\" list")
    base = script_path.parent
    model = _load_tts(args)
    params = _sampling(model, args)
    voice = None
    def path_field(obj: dict, key: str, where: str) -> Path | None:
        value = obj.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise CliError(f"{where}: {key} must be a path (string) or null")
        return base / value

    voice_codes, voice_wav = path_field(script, "voice_codes", "script"), path_field(script, "voice_wav", "script")
    if voice_codes and voice_wav:
        raise CliError("give voice_codes or voice_wav, not both")
    if voice_codes:
        voice = model.prompt.check_voice_codes(_load_array(voice_codes, "voice_codes"))
    elif voice_wav:
        voice = model.voice_codes_from_wav(*read_audio(voice_wav))
    session = StreamingSession(model, voice_codes=voice, params=params, seed=args.seed,
                               max_context_rows=args.max_context_rows)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, turn in enumerate(script["turns"]):
        if not isinstance(turn, dict):
            raise CliError(f"turn {i}: must be an object")
        if not isinstance(turn.get("user_text") or "", str):
            raise CliError(f"turn {i}: user_text must be a string")
        has_deltas, has_ids = "assistant_deltas" in turn, "assistant_token_ids" in turn
        if has_deltas == has_ids:
            raise CliError(f"turn {i}: give exactly one of assistant_deltas / assistant_token_ids")
        deltas, token_ids = turn.get("assistant_deltas"), turn.get("assistant_token_ids")
        if has_deltas and (not isinstance(deltas, list) or not all(isinstance(d, str) for d in deltas)):
            raise CliError(f"turn {i}: assistant_deltas must be a list of strings")
        if has_ids and not isinstance(token_ids, list):
            raise CliError(f"turn {i}: assistant_token_ids must be a list of integers")
        codes_path = path_field(turn, "user_audio_codes", f"turn {i}")
        wav_path = path_field(turn, "user_audio_wav", f"turn {i}")
        user_codes = _load_array(codes_path, "user_audio_codes") if codes_path else None
        user_wav = read_audio(wav_path) if wav_path else None
        session.begin_turn(user_text=turn.get("user_text") or "", user_audio_codes=user_codes,
                           user_audio_wav=user_wav, max_frames=args.max_frames)
        frames = []
        if has_deltas:
            for delta in deltas:
                frames += session.push_text(delta)
        else:
            frames += session.push_token_ids(token_ids)
        frames += session.end_text()
        frames += session.drain()
        audible = [f for f in frames if not f.eos]
        codes = np.stack([f.codes for f in audible]) if audible else np.zeros((0, model.ids.rvq), np.int64)
        wav = np.concatenate([f.audio for f in audible if f.audio is not None] or [np.zeros(0, np.float32)])
        np.save(out_dir / f"turn{i}_codes.npy", codes.astype(np.int64))
        write_audio(out_dir / f"turn{i}.wav", wav, model.codec.sample_rate)
        st = session.stats
        _progress(f"turn {i}: {st.text_ids} text ids, {codes.shape[0]} frames ({wav.size / model.codec.sample_rate:.2f} s), "
                  f"finished by {st.finish_reason}, context {session.context_rows} rows")
    session.close()


# ---------------------------------------------------------------------------------------------- bench
def _report(result: dict, text: str, json_path: str | None) -> None:
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


def cmd_bench_codec(args) -> None:
    from engine.bench import bench_codec, format_codec_report

    result = bench_codec(_load_codec(args), frames=args.frames, repeats=args.repeats)
    _report(result, format_codec_report(result), args.json)


def cmd_bench_synth(args) -> None:
    from engine.bench import bench_synth, format_synth_report

    result = bench_synth(_load_tts(args), frames=args.frames, repeats=args.repeats)
    _report(result, format_synth_report(result), args.json)


# ---------------------------------------------------------------------------------------------- checkpoints
def cmd_make_checkpoint(args) -> None:
    from export import random_checkpoint

    if args.seed < 0:
        raise CliError("--seed must be >= 0")
    out = Path(args.out)
    if args.kind == "codec":
        paths = [random_checkpoint.make_codec_checkpoint(out, seed=args.seed, preset=args.preset, progress=_progress)]
    elif args.kind == "tts":
        paths = [random_checkpoint.make_tts_checkpoint(out, seed=args.seed, preset=args.preset,
                                                       tokenizer_json=args.tokenizer, progress=_progress)]
    else:  # pair: <out>/tts and <out>/codec
        paths = [random_checkpoint.make_tts_checkpoint(out / "tts", seed=args.seed, preset=args.preset,
                                                       tokenizer_json=args.tokenizer, progress=_progress),
                 random_checkpoint.make_codec_checkpoint(out / "codec", seed=args.seed + 1, preset=args.preset,
                                                         progress=_progress)]
    for path in paths:
        _progress(f"random checkpoint ({args.preset} dimensions, NOT a trained model) -> {path}")


# ---------------------------------------------------------------------------------------------- demo
def default_demo_dir() -> Path:
    import os

    return Path(os.environ.get("MOSSRT_DEMO_DIR", Path.home() / ".cache" / "mossrt" / "demo-bundle"))


def ensure_demo_bundle(path: Path | None = None) -> Path:
    """The demo bundle, built on first use (seconds, no download)."""
    from export.demo import build_demo_bundle

    path = path or default_demo_dir()
    if not (path / "manifest.json").is_file():
        _progress(f"building the demo bundle (random weights, audio is noise) in {path}")
        build_demo_bundle(path, progress=_progress)
    return path


def cmd_demo(args) -> None:
    from engine.bundle import Bundle
    from engine.codec import write_audio
    from engine.generate import generate, synthesize
    from engine.tts import TTSModel

    bundle_dir = ensure_demo_bundle(Path(args.bundle) if args.bundle else None)
    model = TTSModel(Bundle(bundle_dir, device=args.device, threads=args.threads))
    gen = generate(model, text=args.text, seed=0, max_frames=args.max_frames)
    wav = synthesize(model, gen)
    write_audio(args.out, wav, model.codec.sample_rate)
    print(f"demo bundle {bundle_dir}: synthesized {gen.codes.shape[0]} frames ({wav.size / model.codec.sample_rate:.2f} s) "
          f"of {args.text!r} -> {args.out} (random weights: expect noise, not speech)")


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mossrt", description="MOSS-TTS-Realtime on onnxruntime")
    sub = p.add_subparsers(dest="command", required=True)

    def runtime_flags(sp):
        sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="onnxruntime provider (auto: CUDA when installed)")
        sp.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")

    def sampling_flags(sp):
        sp.add_argument("--greedy", action="store_true", help="argmax decoding (the repetition penalty still applies)")
        sp.add_argument("--temperature", type=float, help="default from the bundle (0.8); 0 = greedy")
        sp.add_argument("--top-k", type=int, help="default 30; 0 = off")
        sp.add_argument("--top-p", type=float, help="default 0.6; 1 = off")
        sp.add_argument("--repetition-penalty", type=float, help="default 1.1; 1 = off")
        sp.add_argument("--repetition-window", type=int, help="default 50 frames")
        sp.add_argument("--seed", type=int, help="makes sampling reproducible (default: random, printed)")

    e = sub.add_parser("export", help="upstream checkpoint(s) -> ONNX bundle")
    e.add_argument("--codec", help="MOSS-Audio-Tokenizer checkpoint directory (or hub id, with the hub extra)")
    e.add_argument("--model", help="MOSS-TTS-Realtime checkpoint directory (or hub id, with the hub extra)")
    e.add_argument("--tokenizer", help="directory holding tokenizer.json (default: the model directory)")
    e.add_argument("--out", required=True, help="bundle directory to write")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "int8", "int4"],
                   help="weight storage type of the TTS graphs (and of the codec when fp32/fp16)")
    e.add_argument("--codec-dtype", choices=["fp32", "fp16"],
                   help="codec weight storage (default: --dtype if fp32/fp16, else fp32)")
    e.set_defaults(func=cmd_export)

    c = sub.add_parser("codec", help="run the codec of a bundle")
    csub = c.add_subparsers(dest="codec_command", required=True)
    ce = csub.add_parser("encode", help="audio file -> codes .npy [frames, 32] int64")
    ce.add_argument("--bundle", required=True)
    ce.add_argument("input")
    ce.add_argument("output")
    runtime_flags(ce)
    ce.set_defaults(func=cmd_codec_encode)
    cd = csub.add_parser("decode", help="codes .npy [frames, K] -> 24 kHz WAV (32-bit float)")
    cd.add_argument("--bundle", required=True)
    cd.add_argument("input")
    cd.add_argument("output")
    cd.add_argument("--n-quantizers", type=int, default=None, help="levels to decode (default: K, at most 32)")
    cd.add_argument("--chunk-frames", type=int, default=None, help="stream N frames per decoder call")
    cd.add_argument("--schedule", default=None, help="stream with these chunk sizes, e.g. 1,2,7 (last repeats)")
    cd.add_argument("--pcm16", action="store_true", help="write 16-bit PCM instead of 32-bit float")
    runtime_flags(cd)
    cd.set_defaults(func=cmd_codec_decode)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, help_text, frames, func in (("codec", "codec streaming vs one-pass decode", 24, cmd_bench_codec),
                                          ("synth", "per-stage cost of synthesis", 16, cmd_bench_synth)):
        bp = bsub.add_parser(name, help=help_text)
        bp.add_argument("--bundle", required=True)
        bp.add_argument("--frames", type=int, default=frames)
        bp.add_argument("--repeats", type=int, default=3)
        bp.add_argument("--json", help="also write the results as JSON here")
        runtime_flags(bp)
        bp.set_defaults(func=func)

    d = sub.add_parser("demo", help="build the built-in demo bundle and synthesize with it")
    d.add_argument("--bundle", help="demo bundle directory (default ~/.cache/mossrt/demo-bundle)")
    d.add_argument("--text", default="Hello from mossrt, the streaming speech service.")
    d.add_argument("--max-frames", type=int, default=25)
    d.add_argument("--out", default="demo.wav")
    runtime_flags(d)
    d.set_defaults(func=cmd_demo)

    sy = sub.add_parser("synth", help="text (+ voice) -> speech, offline")
    sy.add_argument("--bundle", required=True)
    sy.add_argument("--text", required=True)
    sy.add_argument("--out", required=True, help="24 kHz WAV, 32-bit float")
    sy.add_argument("--voice", help="reference voice audio file (encoded with the bundle's codec)")
    sy.add_argument("--voice-codes", help="reference voice codes .npy [frames, K >= 16]")
    sampling_flags(sy)
    sy.add_argument("--max-frames", type=int, help="frame limit (default: 60 + 10 per text token, at most 3750)")
    sy.add_argument("--max-text-chars", type=int, default=4000)
    sy.add_argument("--codes-out", help="also write the codes .npy [frames, 16] int64")
    runtime_flags(sy)
    sy.set_defaults(func=cmd_synth)

    rp = sub.add_parser("replay", help="drive a streaming session from a JSON script")
    rp.add_argument("--bundle", required=True)
    rp.add_argument("script")
    rp.add_argument("--out-dir", required=True)
    sampling_flags(rp)
    rp.add_argument("--max-frames", type=int, help="frame limit per turn")
    rp.add_argument("--max-context-rows", type=int, default=8192, help="context limit of the session (rows)")
    runtime_flags(rp)
    rp.set_defaults(func=cmd_replay)

    m = sub.add_parser("make-checkpoint", help="random-weight checkpoint with real dimensions (benchmarks only)")
    m.add_argument("kind", choices=["codec", "tts", "pair"], help="pair writes OUT/tts and OUT/codec")
    m.add_argument("--tokenizer", help="tokenizer.json to copy beside a TTS checkpoint")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", default="real", choices=["real", "tiny"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_checkpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import EngineError
    from export.checkpoint import CheckpointError

    try:
        args.func(args)
    except (CliError, EngineError, CheckpointError, OSError) as e:
        print(f"mossrt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
