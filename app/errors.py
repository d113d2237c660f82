"""One error catalogue: every error the service answers is a row (code → HTTP status, OpenAI error type, gRPC
status), raised as :class:`ApiError` with its code and message, and rendered by each protocol in its own shape:

- OpenAI routes: ``{"error": {"message", "type", "param", "code"}}`` (:meth:`ApiError.response`);
- ElevenLabs HTTP: ``{"detail": {"status": code, "message"}}`` (:meth:`ApiError.elevenlabs_response`), on
  ElevenLabs' routes and on a shared route (``/v1/models``) called by an ElevenLabs client (:func:`shaped`);
- our WebSocket: ``{"type": "error", "error": {"type", "code", "message"}, "fatal"}``, fatal ones closed with
  a 4xxx code (:func:`close_code`);
- ElevenLabs WebSockets: ``{"error": code, "message", "contextId"?}``, fatal ones closed with 1008/1011;
- LocalAI's gRPC backend: the row's status code (:func:`grpc_status`).

Typed engine errors map to their rows once, in :func:`from_engine`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.errors import (
    BundleError,
    CapacityError,
    ContextLimitError,
    EngineBrokenError,
    EngineError,
    GraphError,
    InputError,
    OverloadError,
    StreamClosedError,
    TextTooLongError,
)

log = logging.getLogger("mossrt.app")

RETRY_AFTER_SECONDS = 1
BAD, LIMIT, SERVER = "invalid_request_error", "rate_limit_error", "server_error"


@dataclass(frozen=True)
class Row:
    status: int                  # HTTP status
    type: str                    # OpenAI's error type
    grpc: str                    # grpc.StatusCode name
    meaning: str                 # what a client did or met (docs/errors.md shows it)


def _rows(status: int, type_: str, grpc: str, **meanings: str) -> dict[str, Row]:
    return {code: Row(status, type_, grpc, meaning) for code, meaning in meanings.items()}


CATALOGUE: dict[str, Row] = {
    # the request or message is wrong: nothing was done
    **_rows(400, BAD, "INVALID_ARGUMENT",
            invalid_json="the body or message is not JSON the parser takes (malformed, invalid UTF-8, a number "
                         "or nesting beyond its limits)",
            invalid_multipart="a multipart body without a boundary, or otherwise unreadable",
            invalid_value="a field has a value out of its range or of the wrong kind (the param names it)",
            invalid_message="a WebSocket message that is not a JSON object of the protocol's shape",
            missing_parameter="a required field is absent",
            missing_body="the request has no body",
            empty_input="the text is empty or only whitespace",
            input_too_long="the text is over the character limit, or cannot be spoken whole within a stream's "
                           "context and frame limit",
            invalid_audio="an upload or input.user audio that does not decode, or is over its bounds",
            voice_not_found="no voice of that name or id (ElevenLabs WebSockets: closed with 1008)",
            voice_unusable="a registered voice that this bundle cannot use (encoded by another codec)",
            voice_mixing_unsupported="a voice in Kokoro's mixing syntax ('a+b', 'a(0.5)+b'): this model "
                                     "speaks one voice per request",
            reserved_name="a voice name that is one of OpenAI's built-in voices",
            invalid_content_length="a Content-Length that is not a number",
            invalid_output_format="an ElevenLabs output_format that is not offered (the message lists them)",
            unknown_type="a WebSocket message type the protocol does not have",
            binary_not_expected="a binary WebSocket frame where only text frames are read",
            message_too_large="a WebSocket message or a Wyoming event over --ws-max-message-bytes",
            cors_refused="a CORS preflight from an origin not in --cors-origin",
            stream_closed="a request on a stream that has already closed"),
    # the session's state refuses it (WebSockets): the session goes on
    **_rows(400, BAD, "FAILED_PRECONDITION",
            voice_locked="session.update changes the voice after the first turn began",
            seed_locked="session.update changes the seed after the first turn began",
            turn_in_progress="a message that needs no turn running (session.update, input.user) during one",
            no_turn="input.done with no turn open",
            no_response="response.cancel or response.truncate with no response to act on",
            turn_refused="text for a turn that could not open (the error before says why); dropped",
            response_ended="text after the response ended: it was not spoken",
            context_closed="ElevenLabs: text for a context after its close_context",
            text_timeout="an open turn got no text it could speak for --ws-text-timeout: its text was ended "
                         "for it and it speaks what it has"),
    # a bound of what one client may hold
    **_rows(400, BAD, "RESOURCE_EXHAUSTED",
            text_buffer_full="text received but not yet spoken would exceed --ws-max-buffered-chars (per "
                             "socket); refused, the session goes on",
            too_many_contexts="an ElevenLabs multi-context socket opening more than --ws-max-contexts",
            max_turns="a socket's --ws-max-turns reached: the socket closes"),
    **_rows(401, BAD, "UNAUTHENTICATED",
            invalid_api_key="no key or a wrong one, checked before any other work"),
    **_rows(403, BAD, "PERMISSION_DENIED",
            forbidden_origin="a WebSocket upgrade from a browser origin not in --cors-origin (HTTP 403 at the "
                             "handshake)"),
    **_rows(404, BAD, "NOT_FOUND",
            not_found="no such route, or no registered voice of that id",
            model_not_found="GET /v1/models/{id} of a model the service does not serve"),
    **_rows(405, BAD, "UNIMPLEMENTED", method_not_allowed="the route does not take that method"),
    **_rows(408, BAD, "DEADLINE_EXCEEDED",
            request_timeout="the body did not arrive within --body-timeout",
            idle_timeout="a socket with no turn running sent no message (refused ones do not count; keep-alives "
                         "do) for --ws-idle-timeout: closed",
            input_timeout_exceeded="ElevenLabs: no message (keep-alives count, refused ones do not) for the "
                                   "socket's inactivity_timeout: closed",
            auth_timeout="ElevenLabs: a socket without a key in its handshake sent none within "
                         "--ws-auth-timeout: closed",
            client_stalled="the client took no audio for --stall-timeout: its stream ended (a status in "
                           "mossrt_requests_total; on a socket, the close)"),
    **_rows(409, BAD, "ALREADY_EXISTS", voice_exists="a voice of that name is registered"),
    **_rows(409, BAD, "RESOURCE_EXHAUSTED",
            voice_limit_reached="--max-voices voices are registered; delete one first"),
    **_rows(413, BAD, "INVALID_ARGUMENT",
            request_too_large="a JSON body over --max-body-bytes, refused before it is read or parsed",
            file_too_large="an upload over --max-upload-bytes"),
    **_rows(414, BAD, "INVALID_ARGUMENT",
            uri_too_long="a request URL over --max-url-bytes, refused before the key or the route is looked at"),
    **_rows(422, BAD, "INVALID_ARGUMENT",
            invalid_request="ElevenLabs: a body or first message whose fields do not validate"),
    **_rows(429, LIMIT, "RESOURCE_EXHAUSTED",
            no_capacity="no stream slot freed within --queue-timeout (Retry-After: 1)",
            too_many_sessions="--ws-max-sessions WebSocket sessions (or, on Wyoming, --wyoming-max-sessions "
                              "connections) are open: the socket is closed at once (Retry-After: 1)",
            context_evicted="our WebSocket, not fatal: the session's parked context was dropped "
                            "(MOSSRT_PARKED_CONTEXT_BYTES); this turn starts on a fresh context"),
    **_rows(431, BAD, "INVALID_ARGUMENT",
            header_fields_too_large="a request head over --max-header-bytes, more than --max-header-count "
                                    "header fields, or a WebSocket upgrade's field over 8 KiB: refused before the key "
                                    "or the route is looked at"),
    **_rows(503, SERVER, "UNAVAILABLE",
            loading="the model is loading (Retry-After: 5)",
            warming="the batch buckets and the first synthesis are warming up (Retry-After: 5)",
            draining="the server is shutting down: no new streams (Retry-After: 1)",
            engine_broken="the engine failed for good (see /ready): the process is to be replaced"),
    **_rows(503, SERVER, "FAILED_PRECONDITION", load_failed="the model failed to load (see /ready)"),
    **_rows(500, SERVER, "INTERNAL",
            engine_error="generation failed after it began (x-should-retry: false)",
            internal_error="an unexpected failure in the service (logged with its request id)"),
}
RETRY_HEADERS = {"no_capacity": {"Retry-After": str(RETRY_AFTER_SECONDS)},
                 "too_many_sessions": {"Retry-After": str(RETRY_AFTER_SECONDS)},
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


def catalogue_table() -> str:
    """The Markdown table of every error code (``docs/errors.md`` holds it; a test keeps them equal)."""
    rows = ["| code | HTTP | OpenAI type | gRPC | close when fatal (ours / ElevenLabs) | meaning |",
            "|---|---|---|---|---|---|"]
    for code, row in CATALOGUE.items():
        err = ApiError(code, "")
        rows.append(f"| `{code}` | {row.status} | `{row.type}` | `{row.grpc}` | {close_code(err)} / "
                    f"{close_code(err, 'elevenlabs')} | {row.meaning} |")
    return "\n".join(rows)


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
    err: dict[str, Any] = max(exc.errors(), key=lambda e: len(e.get("loc", ())),
                              default={"loc": (), "msg": "invalid request"})
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
# the error shape of an HTTP request, one per protocol: ElevenLabs' routes always answer in ElevenLabs' shape;
# a route both protocols' clients call (the model list) answers in the shape of the client that calls it
ELEVENLABS_PREFIXES = ("/v1/text-to-speech/", "/v1/voices", "/v2/voices", "/v1/user")
SHARED_PATHS = ("/v1/models",)


def elevenlabs_client(headers) -> bool:
    """Whether a request comes from an ElevenLabs client: it sends ElevenLabs' key header ``xi-api-key`` (its
    SDK with a key, Open WebUI's ElevenLabs engine) or is the SDK (``X-Fern-SDK-Name: elevenlabs``, with or
    without a key). OpenAI clients send ``Authorization`` or nothing."""
    return "xi-api-key" in headers or headers.get("x-fern-sdk-name", "").lower() == "elevenlabs"


def elevenlabs_shaped(path: str, headers, prefixes: tuple[str, ...] = ELEVENLABS_PREFIXES) -> bool:
    """Whether an error answering ``path`` is in ElevenLabs' shape (else OpenAI's): one of ElevenLabs' routes,
    or a shared route (:data:`SHARED_PATHS`) called by an ElevenLabs client (:func:`elevenlabs_client`)."""
    return path.startswith(prefixes) or (path in SHARED_PATHS and elevenlabs_client(headers))


def shaped(err: ApiError, request: Request) -> JSONResponse:
    """``err`` in the shape of the request's protocol (:func:`elevenlabs_shaped`)."""
    if elevenlabs_shaped(request.url.path, request.headers):
        return err.elevenlabs_response()
    return err.response()


def install(app: FastAPI) -> None:
    """Exception handlers that answer every error in its protocol's shape (:func:`shaped`: OpenAI's, or
    ElevenLabs' on its routes; never FastAPI's 422 ``detail``)."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return shaped(exc, request)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return shaped(from_engine(exc), request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return shaped(_validation_error(exc), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and (exc.__cause__ or exc.__context__) is not None:
            return shaped(_unparsable_body(request, exc), request)   # the body parser failed
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
        return shaped(ApiError(code, str(exc.detail), headers=headers), request)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        return shaped(from_engine(exc), request)
