"""``mossrt localai``: LocalAI's gRPC backend ``moss-tts-realtime``. Composes ``export`` (the checkpoint
exporter LoadModel may need, and the demo bundle) with ``app.localai`` (the server, which never imports
``export`` itself)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .commands import CliError, cmd_export, ensure_demo_bundle, progress
from .fd_limit import raise_open_files_limit
from .serve import exit_now


def export_checkpoint(model: str, codec: str, out_dir: Path, *, tokenizer: str | None, dtype: str,
                      codec_dtype: str | None) -> None:
    """The exporter injected into the server: exactly what ``mossrt export`` does (the LoadModel options
    ``tokenizer``, ``dtype`` and ``codec_dtype`` give the rest, their defaults in app/settings.py)."""
    cmd_export(argparse.Namespace(model=model, codec=codec, tokenizer=tokenizer, out=str(out_dir), dtype=dtype,
                                  codec_dtype=codec_dtype))


def cmd_localai(args) -> None:
    from app.localai import ServerDefaults, serve
    from app.settings import LocalAIServer, bounds

    if args.bundle is not None and not (Path(args.bundle) / "manifest.json").is_file():
        raise CliError(f"--bundle {args.bundle}: not a bundle (no manifest.json); create one with 'mossrt export'")
    least_grace = bounds(LocalAIServer.model_fields["grace"])[0]
    if args.grace < least_grace:
        raise CliError(f"--grace must be >= {least_grace:g}, got {args.grace}")
    defaults = ServerDefaults(voices_dir=args.voices_dir, max_streams=args.max_streams, device=args.device,
                              threads=args.threads)
    if (raised := raise_open_files_limit()) is not None:
        progress("open-file limit (RLIMIT_NOFILE) raised from %d to %d" % raised)
    try:
        serve(args.addr, bundle=args.bundle, exporter=export_checkpoint, demo_bundle=ensure_demo_bundle,
              defaults=defaults, grace=args.grace)
    except ValueError as e:                      # PYTHON_GRPC_MAX_WORKERS
        raise CliError(str(e)) from None
    exit_now()                                   # a load in progress must not meet the interpreter's teardown


def add_localai_parser(sub, runtime_flags, int_in) -> None:
    from app.settings import LocalAIServer, ServerSettings, bounds

    from .argtypes import finite_float

    addr, grace = LocalAIServer.model_fields["addr"], LocalAIServer.model_fields["grace"]
    workers, max_streams = LocalAIServer.model_fields["max_workers"], ServerSettings.model_fields["max_streams"]

    lp = sub.add_parser("localai", help="LocalAI gRPC backend 'moss-tts-realtime' (TTS and streamed TTSStream)",
                        description="Serve LocalAI's Backend gRPC service. LocalAI starts it with --addr; "
                                    "LoadModel names the bundle unless --bundle loads one at start. Environment: "
                                    "LOCALAI_GRPC_AUTH_TOKEN (require this bearer token), PYTHON_GRPC_MAX_WORKERS "
                                    f"(concurrent calls, default {workers.default}).")
    lp.add_argument("--addr", default=addr.default, help=f"{addr.description}; default {addr.default}")
    lp.add_argument("--bundle", help="bundle directory to load at start (default: wait for LoadModel)")
    lp.add_argument("--voices-dir", help="registered voices (default: MOSSRT_VOICES_DIR, else "
                                         "~/.local/share/mossrt/voices); the model option voices_dir overrides it")
    lp.add_argument("--max-streams", type=int_in(*bounds(max_streams)[:2]),
                    help=f"{max_streams.description}; option max_streams")
    lp.add_argument("--grace", type=finite_float, default=grace.default,
                    help=f"{grace.description} (default {grace.default:g})")
    runtime_flags(lp)
    for action in lp._actions:                   # device/threads: LoadModel's options and CUDA flag decide first
        if action.dest in ("device", "threads"):
            action.default = None
    lp.set_defaults(func=cmd_localai)
