"""The HTTP front door, as one ASGI middleware: every request gets an id and a log line, and what a client
can make the server hold is bounded before any route runs.

- the API key of an API route (``/v1``, ``/v2``, ``/dev``) is checked before a byte of its body is read (a
  keyless client gets its 401 whatever it sends, and costs nothing; ``keyless_routes`` are the exceptions);
- a body larger than its limit is refused from its ``Content-Length`` at once, and by a running count
  while it streams in (chunked bodies), before anything parses it: 413 ``request_too_large``;
- a body must arrive within ``body_timeout`` seconds: 408 ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .errors import ApiError, elevenlabs_shaped
from .metrics import Metrics
from .session.policy import SessionPolicy
from .settings import ServerSettings

log = logging.getLogger("mossrt.app")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")   # what a client's X-Request-Id may be; else a new one
MULTIPART_OVERHEAD = 64 * 1024                          # form fields and part headers beside the upload
QUIET_PATHS = ("/health", "/ready", "/metrics")         # probes and scrapes are not logged
KEYED_PREFIXES = ("/v1", "/v2/", "/dev/")               # the API's routes: keyed (when keys are set) and counted


def request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` when it is a sane token (1..128 of ``A-Za-z0-9._:/+=-``), else a new id."""
    if given and REQUEST_ID.fullmatch(given):
        return given
    return "req_" + secrets.token_hex(8)


def body_limit(settings: ServerSettings, content_type: str) -> int:
    """Uploads (multipart) may carry an audio file; every other body is a small JSON document."""
    if content_type.split(";")[0].strip().lower() == "multipart/form-data":
        return settings.max_upload_bytes + MULTIPART_OVERHEAD
    return settings.max_body_bytes


class RequestGuard:
    def __init__(self, app, settings: ServerSettings, metrics: Metrics, counted_elsewhere: tuple[str, ...], openapi,
                 elevenlabs_prefixes: tuple[str, ...] = ()):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.policy = SessionPolicy.from_settings(settings)
        self.elevenlabs_prefixes = elevenlabs_prefixes   # routes whose refusals are in ElevenLabs' shape
        self.counted_elsewhere = counted_elsewhere   # streamed endpoints that count their requests when they end
        self._openapi = openapi                      # the app's schema: the route templates of unrouted refusals
        self._templates: list[tuple[re.Pattern, str]] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._serve(scope, receive, send)
        except asyncio.CancelledError:
            # the shutdown window ended while this response or socket was still going (a client too slow to
            # take its audio before the deadline): one line, not uvicorn's traceback of the cancellation
            service = getattr(getattr(scope.get("app"), "state", None), "service", None)
            if service is None or service.state != "draining":
                raise
            log.warning("%s %s: cut off at the end of the shutdown window (the client was still receiving)",
                        scope.get("method", "WS"), scope.get("path"))

    async def _serve(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = Headers(scope=scope)
        rid = request_id(headers.get("x-request-id"))
        state = scope.setdefault("state", {})
        state["started"], state["request_id"] = started, rid
        status = 500

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
                    message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
                self._count(scope, status)
            await send(message)

        refusal = self._refusal(scope, headers)
        try:
            if refusal is not None:
                shape = (refusal.elevenlabs_response if elevenlabs_shaped(scope["path"], headers,
                                                                          self.elevenlabs_prefixes)
                         else refusal.response)
                await shape()(scope, receive, send_with_id)
            else:
                await self.app(scope, self._bounded(receive, body_limit(self.settings, headers.get("content-type", "")),
                                                    started), send_with_id)
        finally:
            if scope["path"] not in QUIET_PATHS:
                log.info("%s %s -> %d", scope["method"], scope["path"], status,
                         extra={"request_id": rid, "method": scope["method"], "path": scope["path"], "status": status,
                                "ms": round(1000 * (time.monotonic() - started), 1)})

    def _refusal(self, scope, headers: Headers) -> ApiError | None:
        """The error a request gets before its body is read: no key, or a declared body over the limit."""
        if scope["path"].startswith(KEYED_PREFIXES) and scope["method"] != "OPTIONS":
            err = self.policy.http_key_error(headers, scope["method"], scope["path"])
            if err is not None:
                return err
        declared = headers.get("content-length")
        if declared is not None:
            limit = body_limit(self.settings, headers.get("content-type", ""))
            if not declared.strip().isdigit():
                return ApiError("invalid_content_length", "Content-Length is not a number")
            if int(declared) > limit:
                return _too_large(limit)
        return None

    def _bounded(self, receive, limit: int, started: float):
        """``receive`` that counts the body and bounds its time; after the body, a plain ``receive`` (the
        streamed responses wait on it for the client's disconnect)."""
        received, done = 0, False
        deadline = started + self.settings.body_timeout

        async def bounded_receive():
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                # Connection: close: the rest of a slow body is not waited for on a kept-alive connection
                raise HTTPException(408, f"the request body did not arrive within {self.settings.body_timeout:g} s",
                                    headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, _too_large(limit).message)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return bounded_receive

    def _count(self, scope, status: int) -> None:
        endpoint = getattr(scope.get("route"), "path", None) or self._template(scope["path"])
        # a streamed speech response counts itself when it ends (its status is only known then)
        if (status >= 400 or endpoint not in self.counted_elsewhere) and endpoint.startswith(KEYED_PREFIXES):
            self.metrics.requests.labels(endpoint, str(status)).inc()


    def _template(self, path: str) -> str:
        """The route template a path matches (a request refused before routing is still counted under its
        route; never under the raw path, which would let clients create label values)."""
        if self._templates is None:
            self._templates = [(re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(t)) + "$"), t)
                               for t in self._openapi().get("paths", {})]
        return next((t for pattern, t in self._templates if pattern.match(path)), "unmatched")


def _too_large(limit: int) -> ApiError:
    return ApiError("request_too_large", f"the request body is larger than {limit} bytes")
