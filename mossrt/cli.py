"""``mossrt`` command line: the parser and the one place that turns errors into messages and exit codes.

Bad input prints ``mossrt: error: ...`` and exits 2; an unexpected failure prints one line and exits
70 (``MOSSRT_DEBUG=1`` shows the traceback); never a traceback for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable

from app.settings import ServerSettings, bounds, choices
from engine.limits import DEFAULT_MAX_CONTEXT_ROWS, DEFAULT_MAX_TEXT_CHARS, HARD_MAX_FRAMES, MAX_CONTEXT_ROWS
from engine.model.sampling import MAX_TOP_K

from . import commands as c
from .argtypes import any_int, finite_float, int_in
from .doctor import CHECKS as DOCTOR_CHECKS

EX_SOFTWARE = 70


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mossrt")
    except Exception:  # noqa: BLE001 - running from a source tree without metadata
        return "unknown"


Parser = argparse.ArgumentParser
Subcommands = argparse._SubParsersAction  # what add_subparsers returns: each subcommand adds its parser to it


# ---------------------------------------------------------------------- flags several subcommands share
def runtime_flags(sp: Parser) -> None:
    # the choices and bounds are the service's settings' (app/settings.py: one declaration)
    device, threads = ServerSettings.model_fields["device"], ServerSettings.model_fields["threads"]
    lo, hi, _ = bounds(threads)
    sp.add_argument("--device", default=device.default, choices=list(choices(device) or ()),
                    help="onnxruntime provider (auto: CUDA when installed)")
    sp.add_argument("--threads", type=int_in(lo, hi), default=None,
                    help=f"intra-op threads, {lo}..{hi} (default: MOSSRT_THREADS, else all cores)")


def cuda_graphs_flag(sp: Parser) -> None:
    sp.add_argument("--cuda-graphs", choices=["on", "off"], default=None,
                    help="capture the batched backbone step and depth call as CUDA graphs, one per batch bucket "
                         "(default: on with CUDA when every node of both graphs runs there, off on CPU)")
    sp.add_argument("--warm-buckets", choices=["on", "off"], default=None,
                    help="run every batch bucket's step, depth and codec calls once on padding rows before "
                         "serving, so no stream waits on a first use or a capture (default: on when CUDA "
                         "graphs are on, else off)")


def bundle_flag(sp: Parser, required: bool = True) -> None:
    sp.add_argument("--bundle", required=required, help="bundle directory written by 'mossrt export'")


def sampling_flags(sp: Parser) -> None:
    sp.add_argument("--greedy", action="store_true", help="argmax decoding (the repetition penalty still applies)")
    sp.add_argument("--temperature", type=finite_float, help="default from the bundle (0.8); 0 = greedy")
    sp.add_argument("--top-k", type=int_in(0, MAX_TOP_K), help="keep the k most likely codes (default 30; 0 = off; "
                                                               "never negative)")
    sp.add_argument("--top-p", type=finite_float, help="nucleus probability in (0, 1] (default 0.6; 1 = off)")
    sp.add_argument("--repetition-penalty", type=finite_float, help="default 1.1; 1 = off")
    sp.add_argument("--repetition-window", type=any_int, help="frames the penalty looks back (default 50)")
    sp.add_argument("--seed", type=any_int, help="makes sampling reproducible (default: random, printed)")
    sp.add_argument("--allow-special-tokens", action="store_true",
                    help="treat strings such as <|im_end|> in the text as control tokens (default: as text)")


def limit_flags(sp: Parser, text: bool = True) -> None:
    if text:
        sp.add_argument("--max-text-chars", type=int_in(1, 1_000_000), default=DEFAULT_MAX_TEXT_CHARS,
                        help=f"longest text accepted, in characters (default {DEFAULT_MAX_TEXT_CHARS})")
    sp.add_argument("--max-voice-seconds", type=finite_float, default=None,
                    help="longest voice reference accepted, in seconds (default 30)")


# ---------------------------------------------------------------------- one function per subcommand
def add_export(sub: Subcommands) -> None:
    e = sub.add_parser("export", help="upstream checkpoint(s) -> ONNX bundle")
    e.add_argument("--codec", help="MOSS-Audio-Tokenizer checkpoint directory (or hub id, with the hub extra)")
    e.add_argument("--model", help="MOSS-TTS-Realtime checkpoint directory (or hub id, with the hub extra)")
    e.add_argument("--tokenizer", help="tokenizer.json, or a directory holding it (default: the model directory)")
    e.add_argument("--out", required=True, help="bundle directory to write")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16", "int8", "int4"],
                   help="weight storage type of the TTS graphs (and of the codec when fp32/fp16)")
    e.add_argument("--codec-dtype", choices=["fp32", "fp16", "int8"],
                   help="codec weight storage (default: --dtype if fp32/fp16, else fp32); int8: the decoder's "
                        "matmuls in 8 bits with a scale per block of 64 inputs, the encoder fp32")
    e.add_argument("--int8-block", type=int, choices=[64, 128],
                   help="inputs per fp32 scale of int8 matmul weights (--dtype int8, --codec-dtype int8): 64 "
                        "(default) or 128, fewer scales and a faster CPU kernel for a little more error "
                        "(docs/export.md)")
    # compute dtype: independent of how weights are stored (--dtype)
    e.add_argument("--compute-dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="what the TTS backbone and depth transformer compute in (and the backbone keeps its KV "
                        "in): fp32 (CPU), fp16 (CPU or CUDA: half the KV bytes), bf16 (CUDA only)")
    e.set_defaults(func=c.cmd_export)


def add_verify(sub: Subcommands) -> None:
    v = sub.add_parser("verify", help="check every file of a bundle against its manifest's sha256")
    bundle_flag(v)
    v.add_argument("--provider", choices=["cpu", "cuda"],
                   help="also list every node the provider has no kernel for, or that would copy device data to the "
                        "host inside a step (from committed kernel tables: no GPU needed); exit status 2 if any")
    v.set_defaults(func=c.cmd_verify)


def add_codec(sub: Subcommands) -> None:
    co = sub.add_parser("codec", help="run the codec of a bundle")
    csub = co.add_subparsers(dest="codec_command", required=True, metavar="ACTION")
    ce = csub.add_parser("encode", help="audio file -> codes .npy [frames, 32] int64")
    bundle_flag(ce)
    ce.add_argument("input", help="audio file (any format and rate soundfile reads; mixed to mono, resampled)")
    ce.add_argument("output", help="codes file (.npy is appended when missing)")
    runtime_flags(ce)
    ce.set_defaults(func=c.cmd_codec_encode)
    cd = csub.add_parser("decode", help="codes .npy [frames, K] -> 24 kHz audio file")
    bundle_flag(cd)
    cd.add_argument("input", help="codes .npy [frames, K] with 0 <= code < 1024")
    cd.add_argument("output", help="audio file; the extension picks the format (.wav .flac .ogg .mp3 ...)")
    cd.add_argument("--n-quantizers", type=any_int, default=None, help="levels to decode, 1..32 (default: K)")
    cd.add_argument("--chunk-frames", type=int_in(1, 250), default=None,
                    help="stream N frames per decoder call (1..250)")
    cd.add_argument("--schedule", default=None,
                    help="stream with these chunk sizes, e.g. 1,2,7 (last repeats; each 1..250)")
    cd.add_argument("--pcm16", action="store_true", help="16-bit PCM instead of 32-bit float (WAV-like formats)")
    runtime_flags(cd)
    cd.set_defaults(func=c.cmd_codec_decode)


def add_bench(sub: Subcommands) -> None:
    b = sub.add_parser("bench", help="benchmarks (medians and ratios)")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    for name, help_text, frames, lo, func in (("codec", "codec streaming vs one-pass decode", 24, 1, c.cmd_bench_codec),
                                              ("synth", "per-stage cost of synthesis", 16, 2, c.cmd_bench_synth)):
        bp = bsub.add_parser(name, help=help_text)
        bundle_flag(bp)
        bp.add_argument("--frames", type=int_in(lo, 1000), default=frames, help=f"frames per run ({lo}..1000)")
        bp.add_argument("--repeats", type=int_in(1, 100), default=3, help="runs to take the median of (1..100)")
        bp.add_argument("--json", help="also write the results as JSON here")
        runtime_flags(bp)
        bp.set_defaults(func=func)
    bs = bsub.add_parser("streams", help="N concurrent streams through the batched scheduler")
    bundle_flag(bs)
    bs.add_argument("--streams", default="1,2,4,8,16", help="stream counts to run, e.g. 1,2,4,8,16 (each 1..256)")
    bs.add_argument("--frames", type=int_in(2, HARD_MAX_FRAMES), default=32,
                    help=f"frames per stream (2..{HARD_MAX_FRAMES})")
    bs.add_argument("--json", help="also write the results as JSON here")
    bs.add_argument("--engine-process", choices=["on", "off"], default="off",
                    help="on: the scheduler runs in an engine core process, as mossrt serve --engine-process on "
                         "runs it (frames timed as they arrive here); off: in this process")
    runtime_flags(bs)
    bs.set_defaults(func=c.cmd_bench_streams)
    bc = bsub.add_parser("compare", help="every stage, time to first audio, throughput and memory against the "
                                         "upstream PyTorch CPU baseline")
    bundle_flag(bc)
    bc.add_argument("--frames", type=int_in(2, 1000), default=8, help="frames per synthesis run (2..1000)")
    bc.add_argument("--streams", type=int_in(2, 256), default=8, help="concurrent streams for the throughput figure")
    bc.add_argument("--repeats", type=int_in(1, 100), default=3, help="runs to take the median of (1..100)")
    bc.add_argument("--context-rows", type=int_in(64, 4096), default=1000,
                    help="context of the conversation whose turns are timed kept in its slot and parked (64..4096)")
    bc.add_argument("--json", help="also write the results as JSON here")
    runtime_flags(bc)
    bc.set_defaults(func=c.cmd_bench_compare)
    for bp in bsub.choices.values():
        cuda_graphs_flag(bp)
    for bp in bsub.choices.values():
        bp.add_argument("--profile", metavar="DIR", help="write onnxruntime profiles (JSON) to DIR and print the "
                                                          "top ops by time")


def add_demo(sub: Subcommands) -> None:
    d = sub.add_parser("demo", help="build the built-in demo bundle and synthesize with it")
    d.add_argument("--bundle", help="demo bundle directory (default: MOSSRT_DEMO_DIR or ~/.cache/mossrt/demo-bundle)")
    d.add_argument("--text", default="Hello from mossrt, the streaming speech service.", help="text to speak")
    d.add_argument("--max-frames", type=int_in(1, HARD_MAX_FRAMES), default=25,
                   help=f"frame limit (1..{HARD_MAX_FRAMES})")
    d.add_argument("--out", default="demo.wav", help="audio file to write (default demo.wav)")
    runtime_flags(d)
    d.set_defaults(func=c.cmd_demo)


def add_synth(sub: Subcommands) -> None:
    sy = sub.add_parser("synth", help="text (+ voice) -> speech, offline")
    sy.add_argument("--bundle", help="bundle directory written by 'mossrt export' (default: the built-in demo "
                                     "bundle, as mossrt serve)")
    sy.add_argument("--text", required=True, help="text to speak")
    sy.add_argument("--out", required=True, help="audio file; the extension picks the format (.wav = 32-bit float)")
    sy.add_argument("--voice", help="reference voice audio file (encoded with the bundle's codec)")
    sy.add_argument("--voice-codes", help="reference voice codes .npy [frames, K >= 16]")
    sampling_flags(sy)
    sy.add_argument("--max-frames", type=any_int,
                    help=f"frame limit (default: 60 + 10 per text token, at most {HARD_MAX_FRAMES})")
    limit_flags(sy)
    sy.add_argument("--codes-out", help="also write the codes .npy [frames, 16] int64")
    runtime_flags(sy)
    sy.set_defaults(func=c.cmd_synth)


def add_replay(sub: Subcommands) -> None:
    rp = sub.add_parser("replay", help="drive a streaming session from a JSON script")
    bundle_flag(rp)
    rp.add_argument("script", help="JSON script (see docs/cli.md)")
    rp.add_argument("--out-dir", required=True, help="directory for turn{i}_codes.npy and turn{i}.wav")
    sampling_flags(rp)
    rp.add_argument("--max-frames", type=any_int, help=f"frame limit per turn (1..{HARD_MAX_FRAMES})")
    rp.add_argument("--max-context-rows", type=int_in(128, MAX_CONTEXT_ROWS), default=DEFAULT_MAX_CONTEXT_ROWS,
                    help=f"context limit of the session, in rows (default {DEFAULT_MAX_CONTEXT_ROWS}; mossrt serve's "
                         "streams default to 4096)")
    limit_flags(rp)
    runtime_flags(rp)
    rp.set_defaults(func=c.cmd_replay)


def add_doctor(sub: Subcommands) -> None:
    dr = sub.add_parser("doctor", help="does this machine's onnxruntime run mossrt's graphs as the engine assumes? "
                                       "(provider, kernel registry, placement, CUDA graphs, kernel semantics)")
    dr.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="provider to check (default: cuda when onnxruntime offers it, else cpu)")
    dr.add_argument("--bundle", help="bundle for the placement and CUDA-graph checks (default: a tiny random one, "
                                     "exported to a temporary directory)")
    dr.add_argument("--compute-dtype", choices=["fp32", "fp16", "bf16"],
                    help="the tiny bundle's compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    dr.add_argument("--checks", default=",".join(DOCTOR_CHECKS),
                    help=f"comma list, run in this order (default: {','.join(DOCTOR_CHECKS)})")
    dr.add_argument("--registry-out", help="write the installed onnxruntime's kernels of the table's ops here, in "
                                           "the committed kernel table's format")
    dr.add_argument("--json", help="write every check's result and figures here")
    dr.add_argument("--threads", type=int_in(0, 256), default=None, help="intra-op threads (default: all cores)")
    dr.set_defaults(func=c.cmd_doctor)


def add_make_checkpoint(sub: Subcommands) -> None:
    m = sub.add_parser("make-checkpoint", help="random-weight checkpoint in the upstream layout (benchmarks only)")
    m.add_argument("kind", choices=["codec", "tts", "pair"], help="pair writes OUT/tts and OUT/codec")
    m.add_argument("--preset", required=True, choices=["real", "tiny"],
                   help="real: the released dimensions (pair ~16 GB on disk); tiny: seconds, for trying the pipeline")
    m.add_argument("--tokenizer", help="tokenizer.json (or a directory holding it) to put beside a TTS checkpoint "
                                       "(default: the MOSS tokenizer shipped with mossrt)")
    m.add_argument("--out", required=True, help="checkpoint directory to write")
    m.add_argument("--seed", type=int_in(0, 2**31 - 2), default=0, help="random seed")
    m.set_defaults(func=c.cmd_make_checkpoint)


def add_serve(sub: Subcommands) -> None:
    from .serve import add_serve_parser

    add_serve_parser(sub)


def add_localai(sub: Subcommands) -> None:
    from .localai_cmd import add_localai_parser

    add_localai_parser(sub, runtime_flags, int_in)


# the subcommands, in the order ``mossrt --help`` lists them
SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    add_export, add_verify, add_codec, add_bench, add_demo, add_synth, add_replay, add_doctor, add_make_checkpoint,
    add_serve, add_localai)


def build_parser() -> argparse.ArgumentParser:
    """``mossrt``'s parser: ``--version`` and every subcommand of :data:`SUBCOMMANDS`."""
    p = argparse.ArgumentParser(prog="mossrt",
                                description="MOSS-TTS-Realtime on onnxruntime: export, synthesize, serve")
    p.add_argument("--version", action="version", version=f"mossrt {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import EngineError
    from export.checkpoint import CheckpointError

    try:
        status = args.func(args)
    except (c.CliError, EngineError, CheckpointError) as e:
        print(f"mossrt: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"mossrt: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: one line, not a traceback, unless asked for
        if os.environ.get("MOSSRT_DEBUG"):
            traceback.print_exc()
        print(f"mossrt: internal error: {type(e).__name__}: {e} (MOSSRT_DEBUG=1 shows the traceback; "
              "please report it)", file=sys.stderr)
        return EX_SOFTWARE
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
