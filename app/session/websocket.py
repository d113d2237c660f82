"""A session over a Starlette/FastAPI WebSocket, the same for every WebSocket protocol (ours, ElevenLabs'
two): the channel (JSON text messages in, text or binary out, the close frame) and the WebSocket's gate
(``Origin``, the key, ``--ws-max-sessions``). The loop, clocks and bounds are :mod:`app.session.wire`'s."""

from __future__ import annotations

import json
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from ..errors import CLOSE_FORBIDDEN, ApiError, json_error
from .channel import FrameRefused
from .wire import SessionEnd, WireSession, open_sessions


def json_frame(message: Any, max_bytes: int) -> Any:
    """The JSON value of a received WebSocket message; FrameRefused otherwise."""
    if message.get("bytes") is not None:
        raise FrameRefused(ApiError("binary_not_expected", "send JSON text frames; binary frames are for the audio "
                                                           "the server sends"))
    text = message.get("text") or ""
    if len(text.encode()) > max_bytes:
        raise FrameRefused(ApiError("message_too_large", f"messages are limited to {max_bytes} bytes"))
    try:
        return json.loads(text)
    except Exception as e:  # noqa: BLE001 - json_error says which failures are bad JSON
        err = json_error(e)
        if err is None:
            raise
        raise FrameRefused(err) from None


class WebSocketChannel:
    """A WebSocket as a :class:`~app.session.channel.Channel`: each text message's JSON value in (a binary,
    oversized or malformed one is :class:`FrameRefused`), ``str`` out as a text message and ``bytes`` as a
    binary one. Starlette's receive may be cancelled between messages without losing one."""

    disconnected: tuple[type[Exception], ...] = (WebSocketDisconnect,)

    def __init__(self, ws: WebSocket, max_bytes: int):
        self.ws, self.max_bytes = ws, max_bytes

    async def receive(self) -> Any:
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            return None
        return json_frame(message, self.max_bytes)

    async def send(self, message: str | bytes) -> None:
        if isinstance(message, bytes):
            await self.ws.send_bytes(message)
        else:
            await self.ws.send_text(message)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code=code, reason=reason)


class WebSocketSession(WireSession[Any, str | bytes]):
    """One WebSocket session. Subclasses set :attr:`protocol` and :attr:`path` and implement
    :meth:`render_error` and :class:`~app.session.wire.WireSession`'s hooks, and :meth:`authenticate` when
    the protocol takes a key in the first message."""

    def __init__(self, ws: WebSocket, service: Any):
        super().__init__(WebSocketChannel(ws, service.policy.max_message_bytes), service, ws.app.state.metrics)
        self.ws = ws
        self._authorized = False          # a key came with the handshake
        self._claimed = False             # the session holds one of --ws-max-sessions

    # ------------------------------------------------------------------ the gate
    async def enter(self) -> bool:
        if not self.policy.origin_allowed(self.ws.headers):
            await self.ws.close(code=CLOSE_FORBIDDEN)       # before accept: the upgrade is refused with HTTP 403
            return False
        self._authorized, subprotocol = self.policy.websocket_credentials(self.ws.headers, self.ws.query_params)
        await self.ws.accept(subprotocol=subprotocol)
        self.metrics.sessions.inc()
        open_sessions(self.ws.app).add(self)
        return True

    async def gate(self) -> None:
        if not self._authorized:
            await self.authenticate()
        self._claimed = await self.service.claim_session()      # idle sessions hold no slot: their number is bounded
        if not self._claimed:
            raise SessionEnd(ApiError("too_many_sessions", f"{self.service.settings.ws_max_sessions} WebSocket "
                                                           "sessions are open on this server; retry later"))

    async def leave(self) -> None:
        open_sessions(self.ws.app).discard(self)
        self.metrics.sessions.dec()
        if self._claimed:
            self.service.release_session()

    async def authenticate(self) -> None:
        """No key came with the handshake: the protocol's default refuses at once."""
        raise SessionEnd(ApiError("invalid_api_key", "missing or invalid API key"))

    # ------------------------------------------------------------------ sending
    async def send_json(self, payload: dict[str, Any]) -> None:
        await self.send(json.dumps(payload, separators=(",", ":")))

    async def send_bytes(self, data: bytes) -> None:
        await self.send(data)

    def error_message(self, err: ApiError, fatal: bool, **context: str | None) -> str:
        return json.dumps(self.render_error(err, fatal, **context), separators=(",", ":"))

    def render_error(self, err: ApiError, fatal: bool, **context: str | None) -> dict[str, Any]:
        """The error as the protocol's JSON message."""
        raise NotImplementedError
