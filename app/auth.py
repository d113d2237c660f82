"""Optional API keys: ``Authorization: Bearer <key>``; browsers, which cannot set headers on a WebSocket,
may send the key as the ``api_key`` query parameter or the subprotocol ``mossrt.key.<key>``."""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi import Request, WebSocket

from .errors import ApiError

SUBPROTOCOL_PREFIX = "mossrt.key."


def _known(keys: list[str], candidate: str | None) -> bool:
    return candidate is not None and any(hmac.compare_digest(candidate.encode(), k.encode()) for k in keys)


def _bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def http_key_error(headers, keys: list[str]) -> ApiError | None:
    """The 401 for an HTTP request without a valid key (None when keys are off or it has one). The request
    guard calls it before the body is read."""
    # ElevenLabs' clients (the compatible routes) send their key as ``xi-api-key``
    if keys and not (_known(keys, _bearer(headers.get("authorization"))) or _known(keys, headers.get("xi-api-key"))):
        return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'xi-api-key: <key>')",
                        "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    return None


async def require_key(request: Request) -> None:
    """FastAPI dependency for the /v1 HTTP routes (async: it never waits in the shared thread pool). The
    request guard has already refused keyless requests before their bodies; this keeps each route's
    requirement explicit wherever it is mounted."""
    err = http_key_error(request.headers, request.app.state.service.settings.api_keys)
    if err is not None:
        raise err


def websocket_key(ws: WebSocket, keys: list[str]) -> tuple[bool, str | None]:
    """(authorized, subprotocol to accept with)."""
    protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    chosen = next((p for p in protocols if p.startswith(SUBPROTOCOL_PREFIX)), None)
    if not keys:
        return True, chosen
    for candidate in (_bearer(ws.headers.get("authorization")), ws.query_params.get("api_key"),
                      chosen[len(SUBPROTOCOL_PREFIX):] if chosen else None):
        if _known(keys, candidate):
            return True, chosen
    return False, chosen


def websocket_origin_allowed(ws: WebSocket, cors_origins: list[str]) -> bool:
    """Browsers always send ``Origin`` on a WebSocket upgrade and never enforce CORS on it, so the server
    must: a page of this server (same host), or one of ``--cors-origin`` (``*`` = any). No ``Origin`` is a
    non-browser client: allowed (API keys guard those)."""
    origin = ws.headers.get("origin")
    if origin is None or "*" in cors_origins or origin in cors_origins:
        return True
    return urlsplit(origin).netloc.lower() == ws.headers.get("host", "").lower()
