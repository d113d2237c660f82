"""``mossrt serve``: settings from flags and ``MOSSRT_*`` variables, the bundle (the demo bundle when none
is given), then the FastAPI app under uvicorn. Composes ``export`` (demo bundle) and ``app``."""

from __future__ import annotations

import logging
import signal
import threading
import typing
from pathlib import Path

from .commands import CliError, ensure_demo_bundle, progress
from .fd_limit import raise_open_files_limit

FLUSH_SECONDS = 3     # after the drain: responses already generated finish sending, then the process exits
EXIT_MARGIN_S = 1.0   # of those: what the end needs after the sending (connections cut, the lifespan's end, the exit)
ENGINE_DEATH_GRACE_S = 2.0   # the engine core died: /ready answers 503 (engine_broken) this long, then the exit
ENGINE_DIED_STATUS = 70      # EX_SOFTWARE: what serve exits with when its engine core died


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
    from engine.runtime.bundle import Bundle

    directory = settings.bundle or ensure_demo_bundle()
    # a provider that cannot run the bundle is reported by /ready (503, with the reason), not a failed start
    # the process serves this bundle alone: one intra-op pool for all its sessions (engine.runtime.threads)
    bundle = Bundle(directory, device=settings.device, threads=settings.threads or None, defer_refusal=True,
                    shared_pool=True)
    if settings.verify == "full":
        progress(f"verifying {len(bundle.info.files)} files of {directory} (sha256)")
        bundle.verify()
    if bundle.is_demo:
        progress(f"serving the DEMO bundle {directory}: random weights, the audio is noise "
                 "(give --bundle or MOSSRT_BUNDLE for a real model)")
    return bundle


def cmd_serve(args) -> None:
    from app.server import configure_logging

    settings = load_settings(args)
    bundle = open_bundle(settings)
    if settings.bundle is None:
        settings = settings.model_copy(update={"bundle": Path(bundle.dir)})
    configure_logging(settings)
    log = logging.getLogger("mossrt.app")
    if (raised := raise_open_files_limit()) is not None:
        log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d", *raised)
    if bundle.refusal:
        log.error("the bundle cannot be served on the requested device (/ready says so): %s", bundle.refusal)
    log.info("listening on http://%s:%d (%s bundle %s, device %s: %s)", settings.host, settings.port,
             "demo" if bundle.is_demo else "model", bundle.dir, bundle.device, bundle.device_reason)
    workers = settings.api_worker_count()
    if workers > 1:
        from .workers import Supervisor

        exit_now(Supervisor(settings, bundle, workers).run())
    from app.server import create_app
    from engine.runtime.threads import describe_pools

    log.info("%s", describe_pools())
    exit_now(run_app(settings, create_app(settings, bundle)))


def run_app(settings, app, sockets=None) -> int:
    """Serve ``app`` (on ``sockets`` when given: an API worker's inherited listener, else a new one on the
    settings' host and port) until SIGTERM's drain ends or its engine core dies; returns the exit status."""
    import uvicorn

    from app.protocol_bounds import ProtocolBounds, bounded_http_protocol, bounded_ws_protocol
    from app.routes.elevenlabs_http import ROUTE_PREFIXES

    log = logging.getLogger("mossrt.app")
    # uvicorn raises a handled signal again once it has stopped: a no-op, so a drained server exits with status 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    bounds = ProtocolBounds.of(settings, elevenlabs_prefixes=ROUTE_PREFIXES)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, ws_max_size=settings.ws_max_message_bytes + 4096,
                            http=bounded_http_protocol(bounds), ws=bounded_ws_protocol(bounds),
                            timeout_graceful_shutdown=None)        # the flush is bounded by draining_server
    server = draining_server(config, app.state.service)
    died: list[str] = []

    def engine_died(why: str) -> None:
        # the streams have their engine_broken error and /ready says why; then the process exits non-zero
        # so that the orchestrator replaces it
        died.append(why)
        threading.Timer(ENGINE_DEATH_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    app.state.service.on_engine_death = engine_died
    server.run(sockets=sockets)
    if died:
        log.error("exiting with status %d: %s", ENGINE_DIED_STATUS, died[0])
    return ENGINE_DIED_STATUS if died else 0


def exit_now(status: int = 0) -> None:
    """The server has stopped: exit without the interpreter's teardown (its garbage collection over the
    loaded model's objects took 1.5-3 s on the demo bundle, outside every shutdown bound; and a model still
    loading on its daemon thread, inside onnxruntime, aborts the teardown: "terminate called without an
    active exception", status 134)."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def draining_server(config, service):
    """uvicorn's server with the shutdown a load balancer needs. On the first SIGTERM/SIGINT: readiness
    turns 503 and new streams are refused at once, while the listener stays open (probes see the 503);
    running turns get ``--drain-timeout`` seconds to finish, and the listener stays at least
    ``--shutdown-delay`` seconds (the preStop window); then the engine stops (streams still running end
    with an error), responses finish sending and the process exits 0, all within ``FLUSH_SECONDS`` of the
    drain's end: what is still open then is cut (one line says how many). A second signal stops at once."""
    import asyncio
    import threading
    import time

    import uvicorn

    log = logging.getLogger("mossrt.app")
    window = max(service.settings.drain_timeout, service.settings.shutdown_delay) + FLUSH_SECONDS - EXIT_MARGIN_S

    class _Server(uvicorn.Server):
        _drainer: threading.Thread | None = None
        _flush_ends: float | None = None       # monotonic: the end of the shutdown window, less the exit's margin

        def handle_exit(self, sig, frame) -> None:
            if self._drainer is not None:
                super().handle_exit(sig, frame)
                return
            self._captured_signals.append(sig)
            self._flush_ends = time.monotonic() + window
            self._drainer = threading.Thread(target=self._drain, name="mossrt-drain", daemon=True)
            self._drainer.start()

        async def _wait_tasks_to_complete(self) -> None:
            """uvicorn's wait for open connections and running tasks, to the end of the shutdown window rather
            than its own timeout (whose end is an ERROR line and leaves connections open): then what is
            still open is cut and what still runs is cancelled (a response cut off logs its one warning)."""
            state = self.server_state
            ends = self._flush_ends if self._flush_ends is not None else time.monotonic() + FLUSH_SECONDS
            while (state.connections or state.tasks) and not self.force_exit and time.monotonic() < ends:
                await asyncio.sleep(0.05)
            if state.connections or state.tasks:
                log.info("shutdown window over: %d connections cut, %d tasks cancelled", len(state.connections),
                         len(state.tasks))
                for connection in list(state.connections):
                    connection.transport.abort()
                for task in list(state.tasks):
                    task.cancel()
                if state.tasks:
                    await asyncio.wait(list(state.tasks), timeout=EXIT_MARGIN_S / 2)

        async def shutdown(self, sockets=None) -> None:
            """Before uvicorn's own shutdown closes every WebSocket with 1012 and no reason, each session still
            open gets the catalogue's ``draining`` error in its protocol's shape and its close code (ours
            4503, ElevenLabs' 1008), as docs/errors.md says (bounded: ``CLOSE_BOUND_S`` a socket)."""
            if not self.force_exit:
                from app.session.wire import close_sessions

                closed = await close_sessions(config.app)
                if closed:
                    log.info("shutdown: %d WebSocket sessions closed (draining)", closed)
            await super().shutdown(sockets)

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
    from app.settings import ServerSettings, bounds, choices, env_name, flag_name, is_flag, value_type

    from .argtypes import finite_float, int_in

    s = sub.add_parser("serve", help="the HTTP/WebSocket service (OpenAI /v1/audio/speech, WebSockets, the "
                                     "ElevenLabs-compatible API, voices, metrics)",
                       description="Every flag is also a MOSSRT_* environment variable (flags win); some settings "
                                   "are variables only (see docs/operations.md).")
    for name, info in ServerSettings.model_fields.items():
        if not is_flag(info):
            continue
        kw: dict = {"dest": name, "default": None}
        kind = value_type(info)
        values = choices(info)
        if values:
            kw["choices"] = list(values)
        elif typing.get_origin(info.annotation) is list:     # list[str]: get_args gave its item type
            kw["action"] = "append"
        elif kind is int:
            lo, hi, _ = bounds(info)
            kw["type"] = int_in(lo if lo is not None else -(1 << 62), hi if hi is not None else 1 << 62)
        elif kind is float:
            kw["type"] = finite_float
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        metavar = extra.get("metavar")
        if metavar:
            kw["metavar"] = metavar
        default = info.default if info.default not in (None, []) else "unset"
        kw["help"] = f"{info.description} ({env_name(name)}; default {default})"
        s.add_argument(flag_name(name), **kw)
    s.set_defaults(func=cmd_serve)
