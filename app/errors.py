"""One error catalogue: every error the service answers is a row (code → HTTP status, OpenAI error type, gRPC
status), raised as :class:`ApiError` with its code and message, and rendered by each protocol in its own shape:

- OpenAI routes: ``{"error": {"message", "type", "param", "code"}}`` (:meth:`ApiError.openai`);
- ElevenLabs HTTP: ``{"detail": {"status": code, "message"}}`` (:meth:`ApiError.elevenlabs`);
- our WebSocket: ``{"type": "error", "error": {"type", "code", "message"}, "fatal"}``, fatal ones closed with
  a 4xxx code (:func:`close_code`);
- ElevenLabs WebSockets: ``{"error": code, "message", "contextId"?}``, fatal ones closed with 1008/1011;
- LocalAI's gRPC backend: the row's status code (:func:`grpc_status`).

Typed engine errors map to their rows once, in :func:`from_engine`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.errors import (BundleError, CapacityError, ContextLimitError, EngineBrokenError, EngineError, GraphError,
                           InputError, OverloadError, StreamClosedError, TextTooLongError)

log = logging.getLogger("mossrt.app")

RETRY_AFTER_SECONDS = 1
BAD, LIMIT, SERVER = "invalid_request_error", "rate_limit_error", "server_error"


@dataclass(frozen=True)
class Row:
    status: int                  # HTTP status
    type: str                    # OpenAI's error type
    grpc: str                    # grpc.StatusCode name


def _rows(status: int, type_: str, grpc: str, *codes: str) -> dict[str, Row]:
    return {code: Row(status, type_, grpc) for code in codes}


CATALOGUE: dict[str, Row] = {
    # the request or message is wrong: nothing was done
    **_rows(400, BAD, "INVALID_ARGUMENT",
            "invalid_json", "invalid_multipart", "invalid_value", "invalid_message", "missing_parameter",
            "missing_body", "empty_input", "input_too_long", "invalid_audio", "voice_not_found", "voice_unusable",
            "reserved_name", "invalid_content_length", "invalid_output_format", "unknown_type",
            "binary_not_expected", "message_too_large", "cors_refused", "stream_closed"),
    # the session's state refuses it (WebSockets): the session goes on
    **_rows(400, BAD, "FAILED_PRECONDITION",
            "voice_locked", "seed_locked", "turn_in_progress", "no_turn", "no_response", "turn_refused",
            "response_ended", "context_closed", "text_timeout"),
    # a bound of what one client may hold
    **_rows(400, BAD, "RESOURCE_EXHAUSTED", "text_buffer_full", "too_many_contexts", "max_turns"),
    **_rows(401, BAD, "UNAUTHENTICATED", "invalid_api_key"),
    **_rows(403, BAD, "PERMISSION_DENIED", "forbidden_origin", "output_path_refused"),
    **_rows(404, BAD, "NOT_FOUND", "not_found", "model_not_found"),
    **_rows(405, BAD, "UNIMPLEMENTED", "method_not_allowed"),
    **_rows(408, BAD, "DEADLINE_EXCEEDED", "request_timeout", "idle_timeout", "input_timeout_exceeded",
            "auth_timeout", "client_stalled"),
    **_rows(409, BAD, "ALREADY_EXISTS", "voice_exists"),
    **_rows(409, BAD, "RESOURCE_EXHAUSTED", "voice_limit_reached"),
    **_rows(413, BAD, "INVALID_ARGUMENT", "request_too_large", "file_too_large"),
    **_rows(422, BAD, "INVALID_ARGUMENT", "invalid_request"),
    **_rows(429, LIMIT, "RESOURCE_EXHAUSTED", "no_capacity"),
    **_rows(503, SERVER, "UNAVAILABLE", "loading", "warming", "draining", "engine_broken", "unavailable"),
    **_rows(503, SERVER, "FAILED_PRECONDITION", "load_failed"),
    **_rows(500, SERVER, "INTERNAL", "engine_error", "internal_error"),
}
RETRY_HEADERS = {"no_capacity": {"Retry-After": str(RETRY_AFTER_SECONDS)},
                 "draining": {"Retry-After": str(RETRY_AFTER_SECONDS)},
                 "loading": {"Retry-After": "5"}, "warming": {"Retry-After": "5"},
                 "engine_error": {"x-should-retry": "false"}, "internal_error": {"x-should-retry": "false"},
                 "engine_broken": {"x-should-retry": "false"}, "invalid_api_key": {"WWW-Authenticate": "Bearer"}}

# our WebSocket's close codes for a fatal error, by class; the ElevenLabs WebSockets close as ElevenLabs does
CLOSE_UNAUTHORIZED, CLOSE_FORBIDDEN, CLOSE_POLICY, CLOSE_INTERNAL, CLOSE_UNAVAILABLE = 4001, 4003, 4008, 4500, 4503
ELEVENLABS_POLICY, ELEVENLABS_INTERNAL = 1008, 1011


class ApiError(Exception):
    """An error of the catalogue: ``code`` names its row (status, type, gRPC status); ``param`` the request
    field it is about."""

    def __init__(self, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        if code not in CATALOGUE:
            raise ValueError(f"{code!r} is not in the error catalogue")
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        row = CATALOGUE[code]
        self.status, self.type = row.status, row.type
        self.headers = {**RETRY_HEADERS.get(code, {}), **(headers or {})}

    # ------------------------------------------------------------------ renderings
    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def elevenlabs_response(self) -> JSONResponse:
        """ElevenLabs' HTTP error body, which its SDK and pipecat surface as they are."""
        return JSONResponse({"detail": {"status": self.code, "message": self.message}}, status_code=self.status,
                            headers=self.headers)

    def ws_message(self, fatal: bool = False, event_id: str | None = None) -> dict:
        """Our WebSocket's error message."""
        payload = {"type": "error", "error": {"type": self.type, "code": self.code, "message": self.message},
                   "fatal": fatal}
        if event_id:
            payload["event_id"] = event_id
        return payload

    def elevenlabs_message(self, context_id: str | None = None) -> dict:
        """ElevenLabs' WebSocket error message (livekit fails the named context with it; pipecat logs it)."""
        payload = {"error": self.code, "message": self.message}
        if context_id is not None:
            payload["contextId"] = context_id
        return payload


def close_code(err: ApiError, protocol: str = "ws") -> int:
    """The close code of a WebSocket ended by ``err`` (``protocol``: ``ws`` ours, ``elevenlabs``)."""
    if protocol == "elevenlabs":
        return ELEVENLABS_INTERNAL if err.status >= 500 and err.status != 503 else ELEVENLABS_POLICY
    if err.status == 401:
        return CLOSE_UNAUTHORIZED
    if err.status == 403:
        return CLOSE_FORBIDDEN
    if err.status == 503:
        return CLOSE_UNAVAILABLE
    return CLOSE_INTERNAL if err.status >= 500 else CLOSE_POLICY


def grpc_status(err: ApiError) -> str:
    """The ``grpc.StatusCode`` name of ``err`` (LocalAI's backend)."""
    return CATALOGUE[err.code].grpc


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the service's error shape (not text/plain)."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return ApiError("cors_refused", response.body.decode(), headers=headers).response()


def from_engine(exc: Exception, param: str | None = None) -> ApiError:
    """The catalogue's row for an engine exception (or any other: a 500 that says not to retry)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CapacityError):
        return ApiError("no_capacity", str(exc))
    if isinstance(exc, EngineBrokenError):
        return ApiError("engine_broken", str(exc))
    if isinstance(exc, OverloadError):
        return ApiError("draining", str(exc))
    if isinstance(exc, StreamClosedError):
        return ApiError("stream_closed", str(exc), param)
    if isinstance(exc, (TextTooLongError, ContextLimitError)):
        return ApiError("input_too_long", str(exc), param)
    if isinstance(exc, InputError):
        return ApiError("invalid_value", str(exc), param)
    if isinstance(exc, (GraphError, BundleError, EngineError)):
        return ApiError("engine_error", str(exc))
    log.exception("unexpected error", exc_info=exc)
    return ApiError("internal_error", "internal server error")


def json_error(exc: BaseException) -> ApiError | None:
    """The ``invalid_json`` error of a JSON parser's failure — malformed text, invalid UTF-8, a 5,000-digit
    integer, nesting deeper than the parser recurses — else None. Every route and message parser uses it."""
    if isinstance(exc, (ValueError, RecursionError)):        # JSONDecodeError and UnicodeDecodeError too
        return ApiError("invalid_json", f"not valid JSON: {str(exc)[:200]}")
    return None


def _validation_error(exc: RequestValidationError) -> ApiError:
    # of a union's errors (voice: a string or {"id"}), the one that went deepest says what is wrong
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"})
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header") and not _union_tag(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        return ApiError("invalid_json", f"the request body is not valid JSON: {msg}")
    if err.get("type") == "missing":
        if param is None:
            return ApiError("missing_body", "the request body is missing")
        return ApiError("missing_parameter", f"missing required parameter: {param}", param)
    return ApiError("invalid_value", f"{param}: {msg}" if param else msg, param)


def _unparsable_body(request: Request, exc: StarletteHTTPException) -> ApiError:
    """A body FastAPI or Starlette could not parse at all (invalid UTF-8, a 5,000-digit integer, nesting
    deeper than the parser recurses, multipart without a boundary): the same codes as malformed JSON."""
    cause = exc.__cause__ or exc.__context__
    if request.headers.get("content-type", "").split(";")[0].strip().lower().startswith("multipart/"):
        return ApiError("invalid_multipart", f"the multipart body cannot be parsed: {exc.detail}")
    reason = str(cause)[:200] if cause is not None else str(exc.detail)
    return ApiError("invalid_json", f"the request body is not valid JSON: {reason}")


def _union_tag(part) -> bool:
    """pydantic names the member of a union it tried in the error's location (``str``, ``VoiceRef``): not a
    parameter."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part[:1].isupper())


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}


def install(app: FastAPI) -> None:
    """Exception handlers that answer every error in OpenAI's shape (never FastAPI's 422 ``detail``)."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return from_engine(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and (exc.__cause__ or exc.__context__) is not None:
            return _unparsable_body(request, exc).response()        # the body parser failed
        headers = dict(exc.headers or {})
        if exc.status_code == 405:     # every method any route serves at this path (Starlette names one route's)
            allowed = set()
            for route in app.routes:
                methods = getattr(route, "methods", None)
                regex = getattr(route, "path_regex", None)
                if methods and regex is not None and regex.match(request.url.path):
                    allowed |= set(methods)
            headers["Allow"] = ", ".join(sorted(allowed))
        code = HTTP_CODES.get(exc.status_code)
        if code is None:                # a status the catalogue has no row for: said as Starlette says it
            return JSONResponse({"error": {"message": str(exc.detail), "type": BAD, "param": None, "code": None}},
                                status_code=exc.status_code, headers=headers)
        return ApiError(code, str(exc.detail), headers=headers).response()

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        return from_engine(exc).response()
