"""``mossrt serve``: settings from flags and ``MOSSRT_*`` variables, the bundle (the demo bundle when none
is given), then the FastAPI app under uvicorn. Composes ``export`` (demo bundle) and ``app``."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path

from .commands import CliError, ensure_demo_bundle, progress

FLAG_FIELDS = ("bundle", "host", "port", "voices_dir", "max_streams", "device", "threads", "max_input_chars",
               "max_context_rows", "queue_timeout", "drain_timeout", "verify", "log_format", "log_level",
               "max_voice_seconds")
# bounds against hostile clients (issue 14): their own block so parallel additions merge mechanically
BOUND_FLAG_FIELDS = ("ws_text_timeout", "max_voices", "max_body_bytes", "header_timeout", "body_timeout",
                     "stall_timeout", "shutdown_delay")
SEND_BUFFER_BYTES = 128 * 1024   # per connection (Linux doubles it): about 5 s of 24 kHz pcm
FLUSH_SECONDS = 3     # after the drain: responses already generated finish sending, then the process exits
# the GPU step loop (issue 16)
GPU_FLAG_FIELDS = ("cuda_graphs", "warm_buckets")


def load_settings(args):
    from pydantic import ValidationError

    from app.settings import ServerSettings

    given = {k: getattr(args, k) for k in FLAG_FIELDS + BOUND_FLAG_FIELDS + GPU_FLAG_FIELDS
             if getattr(args, k, None) is not None}
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
    # uvicorn raises a handled signal again once it has stopped: a no-op, so a drained server exits with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, ws_max_size=settings.ws_max_message_bytes + 4096,
                            http=_bounded_http_protocol(settings.header_timeout),
                            timeout_graceful_shutdown=FLUSH_SECONDS)
    draining_server(config, app.state.service).run()


def _bounded_http_protocol(header_seconds: float):
    """uvicorn's HTTP protocol with two bounds per connection:

    - the time a connection may take to send a request's headers (uvicorn has none: a client sending half
      its headers holds the connection forever). Armed when the connection opens and after each
      response; a request whose headers completed (its cycle began) or an upgraded WebSocket disarms it;
    - the kernel's send buffer (``SEND_BUFFER_BYTES``, not autotuned up to 4 MiB): what a client that
      stops reading can make the server hold, and how much audio is out of the server's hands before a
      stalled stream's ``send`` blocks (so ``--stall-timeout`` counts from about 5 s of pcm, not 80).
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional: uvicorn's pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class BoundedHttpProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            cycle = self.cycle
            self._header_timer = self.loop.call_later(header_seconds, self._headers_too_slow, cycle)

        def _headers_too_slow(self, cycle) -> None:
            idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if idle and self.transport.get_protocol() is self and not self.transport.is_closing():
                logging.getLogger("mossrt.app").debug("closing a connection: no request headers within %g s",
                                                      header_seconds)
                self.transport.close()

    return BoundedHttpProtocol


def draining_server(config, service):
    """uvicorn's server with the shutdown a load balancer needs. On the first SIGTERM/SIGINT: readiness
    turns 503 and new streams are refused at once, while the listener stays open (probes see the 503);
    running turns get ``--drain-timeout`` seconds to finish, and the listener stays at least
    ``--shutdown-delay`` seconds (the preStop window); then the engine stops (streams still running end
    with an error), responses finish sending (``FLUSH_SECONDS``) and the process exits 0. A second signal
    stops at once."""
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        _drainer: threading.Thread | None = None

        def handle_exit(self, sig, frame) -> None:
            if self._drainer is not None:
                super().handle_exit(sig, frame)
                return
            self._captured_signals.append(sig)
            self._drainer = threading.Thread(target=self._drain, name="mossrt-drain", daemon=True)
            self._drainer.start()

        def _drain(self) -> None:
            logging.getLogger("mossrt.app").info("shutting down: not ready; turns may finish within %g s; listener "
                                                 "open at least %g s", service.settings.drain_timeout,
                                                 service.settings.shutdown_delay)
            try:
                service.drain(hold=service.settings.shutdown_delay)
            finally:
                self.should_exit = True

    return _Server(config)


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
    s.add_argument("--max-body-bytes", type=int_in(1024, 1 << 30), help="largest JSON request body, refused "
                                                                     "before parsing (MOSSRT_MAX_BODY_BYTES; 1 MiB)")
    s.add_argument("--header-timeout", type=finite_float, help="seconds a connection may take to send a request's "
                                                               "headers (MOSSRT_HEADER_TIMEOUT; 10)")
    s.add_argument("--body-timeout", type=finite_float, help="seconds a request's body may take to arrive "
                                                             "(MOSSRT_BODY_TIMEOUT; 60)")
    s.add_argument("--stall-timeout", type=finite_float, help="seconds a stream waits for its client to take audio "
                                                              "before it ends (MOSSRT_STALL_TIMEOUT; 30)")
    s.add_argument("--shutdown-delay", type=finite_float, help="seconds after SIGTERM that /ready answers 503 with "
                                                               "the listener open (MOSSRT_SHUTDOWN_DELAY; 0)")
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
