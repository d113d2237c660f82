"""``mossrt serve``: settings from flags and ``MOSSRT_*`` variables, the bundle (the demo bundle when none
is given), then the FastAPI app under uvicorn. Composes ``export`` (demo bundle) and ``app``."""

from __future__ import annotations

import logging
import signal
import socket
import typing
from pathlib import Path

from .commands import CliError, ensure_demo_bundle, progress

SEND_BUFFER_BYTES = 128 * 1024   # per connection (Linux doubles it): about 5 s of 24 kHz pcm
FLUSH_SECONDS = 3     # after the drain: responses already generated finish sending, then the process exits


def load_settings(args):
    """The settings from the flags given (each named like its setting), then ``MOSSRT_*`` variables."""
    from pydantic import ValidationError

    from app.settings import ServerSettings, env_name, flag_name, is_flag

    given = {name: getattr(args, name) for name, info in ServerSettings.model_fields.items()
             if is_flag(info) and getattr(args, name, None) not in (None, [])}
    try:
        return ServerSettings(**given)
    except ValidationError as e:
        def where(err) -> str:
            name = str(err["loc"][0]) if err["loc"] else ""
            info = ServerSettings.model_fields.get(name)
            if info is None:
                return name or "settings"
            return f"{name} ({flag_name(name)} or {env_name(name)})" if is_flag(info) else f"{name} ({env_name(name)})"

        problems = "; ".join(f"{where(err)}: {err['msg']}" for err in e.errors()[:5])
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


def add_serve_parser(sub) -> None:
    """``mossrt serve``'s flags: one per setting that takes one (app.settings), with its bounds and help."""
    from app.settings import ServerSettings, bounds, choices, env_name, flag_name, is_flag

    from .argtypes import finite_float, int_in

    s = sub.add_parser("serve", help="the HTTP/WebSocket service (OpenAI /v1/audio/speech, WebSockets, the "
                                     "ElevenLabs-compatible API, voices, metrics)",
                       description="Every flag is also a MOSSRT_* environment variable (flags win); some settings "
                                   "are variables only (see docs/operations.md).")
    for name, info in ServerSettings.model_fields.items():
        if not is_flag(info):
            continue
        kw: dict = {"dest": name, "default": None}
        args = [a for a in typing.get_args(info.annotation) if a is not type(None)] or [info.annotation]
        kind = args[0]
        values = choices(info)
        if values:
            kw["choices"] = list(values)
        elif typing.get_origin(kind) is list:
            kw["action"] = "append"
        elif kind is int:
            lo, hi, _ = bounds(info)
            kw["type"] = int_in(lo if lo is not None else -(1 << 62), hi if hi is not None else 1 << 62)
        elif kind is float:
            kw["type"] = finite_float
        metavar = (info.json_schema_extra or {}).get("metavar")
        if metavar:
            kw["metavar"] = metavar
        default = info.default if info.default not in (None, []) else "unset"
        kw["help"] = f"{info.description} ({env_name(name)}; default {default})"
        s.add_argument(flag_name(name), **kw)
    s.set_defaults(func=cmd_serve)
