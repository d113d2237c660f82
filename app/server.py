"""The FastAPI application: routes, error handlers, request ids and logs, CORS, and the lifecycle
(load and warm up in the background, drain on shutdown)."""

from __future__ import annotations

import json
import logging
import socket
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from engine.core.client import CoreAddress
from engine.runtime.bundle import Bundle

from . import errors
from .errors import JsonCORSMiddleware
from .guard import RequestGuard
from .metrics import Metrics
from .routes import captioned, elevenlabs_http, elevenlabs_ws, ops, speech, voices, web, ws
from .service import TTSService
from .settings import ServerSettings
from .wyoming import session as wyoming_session
from .wyoming.server import WyomingListener

log = logging.getLogger("mossrt.app")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        for key in ("request_id", "method", "path", "status", "ms"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(settings: ServerSettings) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mossrt")
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    root.propagate = False


def create_app(settings: ServerSettings, bundle: Bundle, core: CoreAddress | None = None,
               wyoming_socket: socket.socket | None = None) -> FastAPI:
    """The service for an opened bundle; the model loads in the background once the app starts (``core``:
    the running engine core an API worker joins instead; ``wyoming_socket``: the Wyoming listener's socket,
    bound already by the supervisor of API workers)."""
    service = TTSService(settings, bundle, core)
    metrics = Metrics()
    metrics.info.info({"bundle": str(bundle.dir), "bundle_id": bundle.identity, "device": bundle.device,
                       "tts_dtype": bundle.info.tts.dtype if bundle.info.tts else "none",
                       "demo": str(bundle.is_demo).lower()})

    wyoming = WyomingListener(settings.wyoming_uri, service, metrics, _version(), wyoming_socket) \
        if settings.wyoming_uri else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        if wyoming is not None:           # on this event loop, beside the HTTP listener
            await wyoming.start()
        yield
        if wyoming is not None:
            await wyoming.stop()
        await run_in_threadpool(service.drain)

    app = FastAPI(title="mossrt", description="Streaming text-to-speech for MOSS-TTS-Realtime on onnxruntime",
                  version=_version(), lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics
    errors.install(app)
    # added first, so it runs inside CORS: preflights are answered before it, its refusals get CORS headers
    app.add_middleware(RequestGuard, settings=settings, metrics=metrics,
                       counted_elsewhere=(speech.ENDPOINT, captioned.ENDPOINT, *elevenlabs_http.STREAMED_PATHS),
                       openapi=lambda: app.openapi(), elevenlabs_prefixes=elevenlabs_http.ROUTE_PREFIXES)
    if settings.cors_origins:
        app.add_middleware(JsonCORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])

    for module in (ops, speech, captioned, voices, ws, elevenlabs_ws, elevenlabs_http, web):
        app.include_router(module.router)
    # the series an SLO divides by exist at 0 from the start (a counter first seen at 5 shows no rate)
    metrics.initialise(endpoints=(speech.ENDPOINT, captioned.ENDPOINT, ws.PATH, elevenlabs_ws.MULTI_PATH,
                                  elevenlabs_ws.SINGLE_PATH, *elevenlabs_http.STREAMED_PATHS,
                                  *((wyoming_session.ENDPOINT,) if wyoming is not None else ())),
                       transports=("http", "sse", "ws", "elevenlabs", "elevenlabs_http",
                                   *((wyoming_session.PROTOCOL,) if wyoming is not None else ())))
    # FastAPI's documented way to customise the schema: replace the app's openapi method
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


# Error statuses each route can answer, documented with OpenAI's error body (FastAPI's own 422 never happens).
_ERRORS = {"400": "invalid input", "401": "missing or invalid API key (when keys are configured)",
           "404": "not found", "409": "a voice with this name exists", "413": "upload too large",
           "429": "no stream slot freed within the queue timeout (see Retry-After)",
           "503": "the model is loading or the server is draining (see Retry-After)"}
_ROUTE_ERRORS = {("post", "/v1/audio/speech"): ("400", "401", "429", "503"),
                 ("post", "/dev/captioned_speech"): ("400", "401", "429", "503"),
                 ("get", "/v1/audio/models"): ("401",),
                 ("post", "/v1/audio/voices"): ("400", "401", "409", "413", "503"),
                 ("get", "/v1/audio/voices"): ("401",),
                 ("get", "/v1/audio/voices/{voice_id}"): ("401", "404"),
                 ("delete", "/v1/audio/voices/{voice_id}"): ("401", "404"),
                 ("get", "/v1/models"): ("401",),
                 ("get", "/v1/models/{model_id}"): ("401", "404"),
                 ("get", "/ready"): ("503",)}


def _openapi(app: FastAPI) -> dict:
    from fastapi.openapi.utils import get_openapi

    from .schemas import ErrorBody

    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs", {}))
    components["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _ROUTE_ERRORS.get((method, path), ()):
                responses[status] = {"description": _ERRORS[status], "content": ref}
    app.openapi_schema = schema
    return schema


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mossrt")
    except Exception:  # noqa: BLE001
        return "0"
