"""``mossrt serve``: settings from flags and ``MOSSRT_*`` variables, the bundle (the demo bundle when none
is given), then the FastAPI app under uvicorn. Composes ``export`` (demo bundle) and ``app``."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from .commands import CliError, ensure_demo_bundle, progress

FLAG_FIELDS = ("bundle", "host", "port", "voices_dir", "max_streams", "device", "threads", "max_input_chars",
               "max_context_rows", "queue_timeout", "drain_timeout", "verify", "log_format", "log_level",
               "max_voice_seconds")
# bounds against hostile clients (issue 14): their own block so parallel additions merge mechanically
BOUND_FLAG_FIELDS = ("ws_text_timeout", "max_voices")
# the GPU step loop (issue 16)
GPU_FLAG_FIELDS = ("cuda_graphs",)


def load_settings(args):
    from pydantic import ValidationError

    from app.settings import ServerSettings

    given = {k: getattr(args, k) for k in FLAG_FIELDS + BOUND_FLAG_FIELDS + GPU_FLAG_FIELDS if getattr(args, k, None) is not None}
    if getattr(args, "api_key", None):
        given["api_keys"] = args.api_key
    if getattr(args, "cors_origin", None):
        given["cors_origins"] = args.cors_origin
    try:
        return ServerSettings(**given)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'} (flag --"
                             f"{str(err['loc'][0]).replace('_', '-') if err['loc'] else '?'} or MOSSRT_"
                             f"{str(err['loc'][0]).upper() if err['loc'] else '?'}): {err['msg']}"
                             for err in e.errors()[:5])
        raise CliError(f"invalid settings: {problems}") from None


def open_bundle(settings):
    """The bundle to serve, checked as the settings ask (a damaged bundle stops the start with status 2)."""
    from engine.bundle import Bundle

    directory = settings.bundle or ensure_demo_bundle()
    # a provider that cannot run the bundle is reported by /ready (503, with the reason), not a failed start
    bundle = Bundle(directory, device=settings.device, threads=settings.threads or None, defer_refusal=True)
    if settings.verify == "full":
        progress(f"verifying {len(bundle.info.files)} files of {directory} (sha256)")
        bundle.verify()
    if bundle.is_demo:
        progress(f"serving the DEMO bundle {directory}: random weights, the audio is noise "
                 "(give --bundle or MOSSRT_BUNDLE for a real model)")
    return bundle


def cmd_serve(args) -> None:
    import uvicorn

    from app.server import configure_logging, create_app

    settings = load_settings(args)
    bundle = open_bundle(settings)
    if settings.bundle is None:
        settings = settings.model_copy(update={"bundle": Path(bundle.dir)})
    configure_logging(settings)
    app = create_app(settings, bundle)
    log = logging.getLogger("mossrt.app")
    if bundle.refusal:
        log.error("the bundle cannot be served on the requested device (/ready says so): %s", bundle.refusal)
    log.info("listening on http://%s:%d (%s bundle %s, device %s: %s)", settings.host, settings.port,
             "demo" if bundle.is_demo else "model", bundle.dir, bundle.device, bundle.device_reason)
    # uvicorn turns SIGTERM into a graceful shutdown (the app drains its streams), then raises the signal
    # again for the previous handler: make that one a no-op so a drained server exits with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                ws_max_size=settings.ws_max_message_bytes + 4096, timeout_graceful_shutdown=int(settings.drain_timeout) + 5)


def add_serve_parser(sub, runtime_flags, int_in, finite_float) -> None:
    s = sub.add_parser("serve", help="the HTTP/WebSocket service (OpenAI /v1/audio/speech, WebSocket, voices, metrics)")
    s.add_argument("--bundle", help="bundle directory (MOSSRT_BUNDLE; default: the built-in demo bundle)")
    s.add_argument("--host", help="bind address (MOSSRT_HOST; default 127.0.0.1, containers use 0.0.0.0)")
    s.add_argument("--port", type=int_in(1, 65535), help="bind port (MOSSRT_PORT; default 8000)")
    s.add_argument("--api-key", action="append", help="accepted Bearer key, repeatable (MOSSRT_API_KEYS, comma-"
                                                      "separated); none = no authentication")
    s.add_argument("--voices-dir", help="where registered voices are stored (MOSSRT_VOICES_DIR)")
    s.add_argument("--max-streams", type=int_in(1, 1024), help="concurrent streams (MOSSRT_MAX_STREAMS; default: "
                                                               "what half the available memory holds)")
    s.add_argument("--max-context-rows", type=int_in(256, 1 << 17),
                   help="context rows per stream, i.e. its KV slot (MOSSRT_MAX_CONTEXT_ROWS; default 4096)")
    s.add_argument("--max-input-chars", type=int_in(1, 100_000), help="longest input (MOSSRT_MAX_INPUT_CHARS; 4096)")
    s.add_argument("--max-voice-seconds", type=finite_float, help="longest voice sample (MOSSRT_MAX_VOICE_SECONDS; 30)")
    s.add_argument("--queue-timeout", type=finite_float, help="seconds a request waits for a free stream before 429 "
                                                              "(MOSSRT_QUEUE_TIMEOUT; 10)")
    s.add_argument("--drain-timeout", type=finite_float, help="seconds running streams may finish after SIGTERM "
                                                              "(MOSSRT_DRAIN_TIMEOUT; 60)")
    s.add_argument("--cors-origin", action="append", help="allowed browser origin, repeatable (MOSSRT_CORS_ORIGINS)")
    s.add_argument("--verify", choices=["quick", "full", "off"], help="bundle check at start: sizes (quick, default) "
                                                                      "or every sha256 (full) (MOSSRT_VERIFY)")
    s.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON (MOSSRT_LOG_FORMAT)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="(MOSSRT_LOG_LEVEL; info)")
    s.add_argument("--ws-text-timeout", type=finite_float,
                   help="seconds a WebSocket turn waits for more text (nothing left to speak) before its text is "
                        "ended for it (MOSSRT_WS_TEXT_TIMEOUT; 30)")
    s.add_argument("--max-voices", type=int_in(1, 1_000_000),
                   help="registered voices kept at most; POST /v1/audio/voices is a 409 beyond (MOSSRT_MAX_VOICES; 1000)")
    runtime_flags(s)
    for action in s._actions:                     # device/threads default from the settings, not argparse
        if action.dest in ("device", "threads"):
            action.default = None
    s.set_defaults(func=cmd_serve)
