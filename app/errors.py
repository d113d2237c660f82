"""Every error leaves the service in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Typed engine errors are mapped here, once, for HTTP and WebSocket (the LocalAI backend maps them to
gRPC status codes in its own module).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.errors import (BundleError, CapacityError, EngineBrokenError, EngineError, GraphError, InputError,
                           OverloadError, StreamClosedError)

log = logging.getLogger("mossrt.app")

RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the service's error shape (not text/plain)."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return ApiError(400, response.body.decode(), param=None, code="cors_refused", headers=headers).response()


def from_engine(exc: Exception, param: str | None = None) -> ApiError:
    """The API error for an engine exception (or any other: a 500 that says not to retry)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CapacityError):
        return ApiError(429, str(exc), "rate_limit_error", None, "no_capacity",
                        {"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineBrokenError):
        return ApiError(503, str(exc), "server_error", None, "engine_broken", {"x-should-retry": "false"})
    if isinstance(exc, OverloadError):
        return ApiError(503, str(exc), "server_error", None, "draining", {"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, StreamClosedError):
        return ApiError(400, str(exc), "invalid_request_error", param, "stream_closed")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), "invalid_request_error", param, "invalid_value")
    if isinstance(exc, (GraphError, BundleError, EngineError)):
        return ApiError(500, str(exc), "server_error", None, "engine_error", {"x-should-retry": "false"})
    log.exception("unexpected error", exc_info=exc)
    return ApiError(500, "internal server error", "server_error", None, "internal_error", {"x-should-retry": "false"})


def _validation_error(exc: RequestValidationError) -> ApiError:
    # of a union's errors (voice: a string or {"id"}), the one that went deepest says what is wrong
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={"loc": (), "msg": "invalid request"})
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header") and not _union_tag(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {msg}", "invalid_request_error", None, "invalid_json")
    if err.get("type") == "missing":
        if param is None:
            return ApiError(400, "the request body is missing", "invalid_request_error", None, "missing_body")
        return ApiError(400, f"missing required parameter: {param}", "invalid_request_error", param, "missing_parameter")
    return ApiError(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param, "invalid_value")


def _unparsable_body(request: Request, exc: StarletteHTTPException) -> ApiError:
    """A body FastAPI or Starlette could not parse at all (invalid UTF-8, a 5,000-digit integer, nesting
    deeper than the parser recurses, multipart without a boundary): the same codes as malformed JSON."""
    cause = exc.__cause__ or exc.__context__
    if request.headers.get("content-type", "").split(";")[0].strip().lower().startswith("multipart/"):
        return ApiError(400, f"the multipart body cannot be parsed: {exc.detail}", "invalid_request_error", None,
                        "invalid_multipart")
    reason = str(cause)[:200] if cause is not None else str(exc.detail)
    return ApiError(400, f"the request body is not valid JSON: {reason}", "invalid_request_error", None,
                    "invalid_json")


def _union_tag(part) -> bool:
    """pydantic names the member of a union it tried in the error's location (``str``, ``VoiceRef``): not a
    parameter."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part[:1].isupper())


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
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large"}.get(exc.status_code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:     # every method any route serves at this path (Starlette names one route's)
            allowed = set()
            for route in app.routes:
                methods = getattr(route, "methods", None)
                regex = getattr(route, "path_regex", None)
                if methods and regex is not None and regex.match(request.url.path):
                    allowed |= set(methods)
            headers["Allow"] = ", ".join(sorted(allowed))
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error", None, code, headers).response()

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        return from_engine(exc).response()
