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


# ---------------------------------------------------------------------------------------------- export
def cmd_export(args) -> None:
    from export.bundle import BundleWriter
    from export.codec_export import export_codec

    if not args.codec and not args.model:
        raise CliError("export needs --codec CKPT_DIR (and/or --model TTS_CKPT_DIR)")
    writer = BundleWriter(args.out)
    if args.codec:
        codec_dtype = args.dtype if args.dtype in ("fp32", "fp16") else "fp32"
        export_codec(args.codec, writer, codec_dtype, _progress)
    if args.model:
        from export.tts_export import export_tts

        export_tts(args.model, writer, args.dtype, _progress, tokenizer_dir=args.tokenizer)
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
    try:
        codes = np.load(args.input, allow_pickle=False)
    except Exception as e:
        raise CliError(f"{args.input}: not a readable .npy array ({e})") from None
    nq = args.n_quantizers if args.n_quantizers is not None else codec.default_n_quantizers(codes)
    if args.chunk_frames is not None and args.schedule is not None:
        raise CliError("give either --chunk-frames or --schedule, not both")
    if args.chunk_frames is None and args.schedule is None:
        wav = codec.decode(codes, nq, max_frames_per_call=max(1, codes.shape[0] if codes.ndim else 1))
    else:
        checked = codec.check_codes(codes, codec.check_n_quantizers(nq))[0]
        if args.chunk_frames is not None:
            if args.chunk_frames < 1:
                raise CliError("--chunk-frames must be >= 1")
            sizes = [args.chunk_frames]
        else:
            sizes = _parse_schedule(args.schedule)
        dec = codec.streaming_decoder(1, nq)
        pieces, f, i = [], 0, 0
        while f < checked.shape[0]:
            n = sizes[min(i, len(sizes) - 1)] if args.schedule else sizes[0]
            pieces.append(dec.decode(checked[f:f + n]))
            f, i = f + n, i + 1
        wav = np.concatenate(pieces)
    write_audio(args.output, wav, codec.sample_rate, pcm16=args.pcm16)
    _progress(f"{wav.size} samples ({wav.size / codec.sample_rate:.2f} s) -> {args.output}")


# ---------------------------------------------------------------------------------------------- bench
def cmd_bench_codec(args) -> None:
    from engine.bench import bench_codec, format_codec_report

    codec = _load_codec(args)
    result = bench_codec(codec, frames=args.frames, repeats=args.repeats)
    print(format_codec_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------- checkpoints
def cmd_make_checkpoint(args) -> None:
    from export import random_checkpoint

    if args.kind == "codec":
        path = random_checkpoint.make_codec_checkpoint(args.out, seed=args.seed, preset=args.preset,
                                                       progress=_progress)
    else:
        raise CliError(f"unknown checkpoint kind {args.kind!r}")
    _progress(f"random {args.kind} checkpoint ({args.preset} dimensions, NOT a trained model) -> {path}")


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
    from engine.codec import Codec, write_audio

    bundle_dir = ensure_demo_bundle(Path(args.bundle) if args.bundle else None)
    codec = Codec(Bundle(bundle_dir, device=args.device, threads=args.threads))
    t = np.arange(2 * codec.sample_rate) / codec.sample_rate
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    codes = codec.encode(tone, codec.sample_rate)
    dec = codec.streaming_decoder(1, 16)
    wav = np.concatenate([dec.decode(codes[f:f + 3, :16]) for f in range(0, codes.shape[0], 3)])
    write_audio(args.out, wav, codec.sample_rate)
    print(f"demo bundle {bundle_dir}: encoded a 2 s tone to {codes.shape[0]} frames x {codes.shape[1]} codes, "
          f"streamed it back through the decoder 3 frames per call -> {args.out} "
          f"(random weights: expect noise)")


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mossrt", description="MOSS-TTS-Realtime on onnxruntime")
    sub = p.add_subparsers(dest="command", required=True)

    def runtime_flags(sp):
        sp.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="onnxruntime provider (auto: CUDA when installed)")
        sp.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")

    e = sub.add_parser("export", help="upstream checkpoint(s) -> ONNX bundle")
    e.add_argument("--codec", help="MOSS-Audio-Tokenizer checkpoint directory")
    e.add_argument("--model", help="MOSS-TTS-Realtime checkpoint directory")
    e.add_argument("--tokenizer", help="directory holding tokenizer.json (default: the model directory)")
    e.add_argument("--out", required=True, help="bundle directory to write")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "int8", "int4"],
                   help="weight storage type (the codec supports fp32/fp16; int8/int4 apply to the TTS graphs)")
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
    bc = bsub.add_parser("codec", help="codec streaming vs one-pass decode")
    bc.add_argument("--bundle", required=True)
    bc.add_argument("--frames", type=int, default=24)
    bc.add_argument("--repeats", type=int, default=3)
    bc.add_argument("--json", help="also write the results as JSON here")
    runtime_flags(bc)
    bc.set_defaults(func=cmd_bench_codec)

    d = sub.add_parser("demo", help="build the built-in demo bundle and run the codec on it")
    d.add_argument("--bundle", help="demo bundle directory (default ~/.cache/mossrt/demo-bundle)")
    d.add_argument("--out", default="demo.wav")
    runtime_flags(d)
    d.set_defaults(func=cmd_demo)

    m = sub.add_parser("make-checkpoint", help="random-weight checkpoint with real dimensions (benchmarks only)")
    m.add_argument("kind", choices=["codec"])
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
    except (CliError, EngineError, CheckpointError, FileNotFoundError) as e:
        print(f"mossrt: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
