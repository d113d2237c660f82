"""Optional API keys: ``Authorization: Bearer <key>``; browsers, which cannot set headers on a WebSocket,
may send the key as the ``api_key`` query parameter or the subprotocol ``mossrt.key.<key>``."""

from __future__ import annotations

import hmac

from fastapi import Request, WebSocket

from .errors import ApiError

SUBPROTOCOL_PREFIX = "mossrt.key."


def _known(keys: list[str], candidate: str | None) -> bool:
    return candidate is not None and any(hmac.compare_digest(candidate.encode(), k.encode()) for k in keys)


def _bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def require_key(request: Request) -> None:
    """FastAPI dependency for the /v1 HTTP routes."""
    keys = request.app.state.service.settings.api_keys
    if keys and not _known(keys, _bearer(request.headers.get("authorization"))):
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


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
