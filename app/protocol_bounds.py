"""The bounds of the protocol layers below the application: uvicorn's HTTP protocol (httptools) and its
WebSocket protocol (websockets' sans-I/O), per connection. What they parse and write never reaches a route,
so a route's own bounds (the body limit, the stall timeout) cannot see it.

HTTP, per request head (the request line and the header fields):

- the time a connection may take to send it (``--header-timeout``; uvicorn has none): armed when the
  connection opens and after each response, disarmed once a request's head completed or the socket upgraded;
- its size (``--max-header-bytes``), the URL (``--max-url-bytes``), the number of header fields
  (``--max-header-count``) and, on a WebSocket upgrade, one field (:data:`MAX_FIELD_BYTES`): counted as the
  parser is fed, before it buffers more. Past a bound the client gets 431 ``header_fields_too_large`` or 414
  ``uri_too_long`` in its route's error shape (ElevenLabs' for the ElevenLabs routes, OpenAI's otherwise),
  before the key is looked at; what it sends after that is read and dropped for :data:`LINGER_S` (so it reads
  the answer rather than a reset), then the connection is cut. A head costs the server at most about its bound;
- the kernel's send buffer (:data:`SEND_BUFFER_BYTES`, not autotuned up to 4 MiB): what a client that stops
  reading can make the server hold, and how much audio is out of the server's hands before a stalled
  stream's ``send`` blocks (so ``--stall-timeout`` counts from about 5 s of pcm, not 80).

WebSocket, per socket:

- unsent bytes, pongs included: while the transport's buffer is over its high-water mark a ping gets no
  pong (RFC 6455 lets a pong answer only the latest ping), so a ping flood from a client that never reads
  holds at most the high-water mark; a socket over the mark for ``--stall-timeout`` + :data:`CLOSE_GRACE_S`
  is cut (the session's own stall handling, and the close frame it may send, come first);
- a handshake websockets itself refuses (its line and header-count limits) gets websockets' answer and
  the connection is closed, not left open unanswered;
- a socket the protocol layer closed (a frame over the message limit, the keep-alive ping unanswered) is
  gone for the application: its next send raises a disconnect, which ends the session quietly.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .errors import ApiError

log = logging.getLogger("mossrt.app")

SEND_BUFFER_BYTES = 128 * 1024   # per connection (Linux doubles it): about 5 s of 24 kHz pcm
MAX_FIELD_BYTES = 8 * 1024       # one header field of a WebSocket upgrade (websockets' handshake reads 8 KiB lines)
LINGER_S = 2.0                   # a refused head: what the client still sends is dropped this long, then the cut
CLOSE_GRACE_S = 5.0              # a WebSocket over its send buffer: cut this long after the stall timeout


@dataclass(frozen=True)
class ProtocolBounds:
    header_timeout: float
    max_header_bytes: int
    max_header_count: int
    max_url_bytes: int
    stall_timeout: float
    elevenlabs_prefixes: tuple[str, ...] = ()

    @classmethod
    def of(cls, settings, elevenlabs_prefixes: tuple[str, ...] = ()) -> ProtocolBounds:
        return cls(settings.header_timeout, settings.max_header_bytes, settings.max_header_count,
                   settings.max_url_bytes, settings.stall_timeout, elevenlabs_prefixes)


class _HeadRefused(Exception):
    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


def refusal(err: ApiError, elevenlabs: bool) -> bytes:
    """A whole HTTP/1.1 response carrying ``err`` in the route's error shape; the connection closes after it."""
    response = err.elevenlabs_response() if elevenlabs else err.response()
    head = [STATUS_LINE[err.status]]
    head += [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
    return b"".join(head) + b"connection: close\r\n\r\n" + bytes(response.body)


def set_send_buffer(transport: asyncio.Transport) -> None:
    """The connection's kernel send buffer to :data:`SEND_BUFFER_BYTES` (not autotuned up to 4 MiB)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


class HeadSizeBounds(HttpToolsProtocol):
    """The head's size, URL, field count and an upgrade's field, counted as the parser is fed; a head past one
    is answered in its route's error shape (:func:`refusal`) and the connection cut after :data:`LINGER_S`.
    ``bounds`` and ``elevenlabs_prefixes`` are set by :func:`bounded_http_protocol`."""

    bounds: ClassVar[ProtocolBounds]
    elevenlabs_prefixes: ClassVar[tuple[bytes, ...]] = ()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._in_head, self._head_bytes, self._url_bytes, self._fields = True, 0, 0, 0
        self._refused = False
        set_send_buffer(transport)

    def data_received(self, data: bytes) -> None:
        while data and not self._refused and self.transport.get_protocol() is self:
            if self._in_head:
                room = self.bounds.max_header_bytes - self._head_bytes
                if room <= 0:
                    self._refuse(ApiError("header_fields_too_large", "the request line and headers are over "
                                                                     f"{self.bounds.max_header_bytes} bytes"))
                    return
                chunk, data = data[:room], data[room:]
                self._head_bytes += len(chunk)
            else:
                chunk, data = data, b""
            self._feed(chunk)       # upgraded: what followed the head in this read is dropped, as uvicorn does

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with a refused head answered as such."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _HeadRefused):
                self._refuse(e.__context__.error)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._url_bytes, self._fields, self._longest = 0, 0, 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self.bounds.max_url_bytes:
            if len(self.url) < 256:
                super().on_url(url[:256])                       # the path: the refusal's shape
            raise _HeadRefused(ApiError("uri_too_long", f"the URL is over {self.bounds.max_url_bytes} bytes"))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.bounds.max_header_count:
            raise _HeadRefused(ApiError("header_fields_too_large",
                                        f"more than {self.bounds.max_header_count} header fields"))
        self._longest = max(self._longest, len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._longest > MAX_FIELD_BYTES and self._should_upgrade():
            raise _HeadRefused(ApiError("header_fields_too_large", "a WebSocket upgrade's header field is "
                                                                   f"over {MAX_FIELD_BYTES} bytes"))
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def _refuse(self, err: ApiError) -> None:
        """Answer, stop reading requests, drop what still comes for LINGER_S, then cut the connection."""
        self._refused = True
        if self.transport.is_closing():
            return
        url = getattr(self, "url", b"") or b""
        prefixes = self.elevenlabs_prefixes
        log.info("refused a request head: %s (%s)", err.message, err.code)
        self.transport.write(refusal(err, url.startswith(prefixes) if prefixes else False))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.abort)


class HeadTimeBound(HeadSizeBounds):
    """The time a connection may take to send a request head (``--header-timeout``): armed when it opens and
    after each response; an idle connection still without one when it fires is closed."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
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
        self._header_timer = self.loop.call_later(self.bounds.header_timeout, self._headers_too_slow, cycle)

    def _headers_too_slow(self, cycle) -> None:
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and self.transport.get_protocol() is self and not self.transport.is_closing():
            log.debug("closing a connection: no request headers within %g s", self.bounds.header_timeout)
            self.transport.close()


def bounded_http_protocol(bounds: ProtocolBounds) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the bounds of the module's docstring: the head's size
    (:class:`HeadSizeBounds`) and time (:class:`HeadTimeBound`), and the send buffer, for ``bounds``."""
    return type("BoundedHttpProtocol", (HeadTimeBound,),
                {"bounds": bounds, "elevenlabs_prefixes": tuple(p.encode() for p in bounds.elevenlabs_prefixes)})


def bounded_ws_protocol(bounds: ProtocolBounds) -> type[WebSocketsSansIOProtocol]:
    """uvicorn's WebSocket protocol (websockets' sans-I/O) with the bounds of the module's docstring."""
    over_for = bounds.stall_timeout + CLOSE_GRACE_S

    class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
        _backlog_timer = None
        _closed_here = False            # the protocol layer closed the socket: the application's sends are void

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.handshake_initiated and self.conn.handshake_exc is not None \
                    and not self.transport.is_closing():
                self.transport.write(b"".join(self.conn.data_to_send()))      # websockets' 400/414/431
                self.transport.close()

        # -------------------------------------------------------------- unsent bytes
        def handle_ping(self) -> None:
            if self.writable.is_set():
                super().handle_ping()
            else:
                self.conn.data_to_send()        # over the high-water mark: this ping's pong is dropped

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._backlog_timer is None:
                self._backlog_timer = self.loop.call_later(over_for, self._backlog_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_backlog_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_backlog_timer()
            super().connection_lost(exc)

        def _cancel_backlog_timer(self) -> None:
            if self._backlog_timer is not None:
                self._backlog_timer.cancel()
                self._backlog_timer = None

        def _backlog_stalled(self) -> None:
            self._backlog_timer = None
            log.warning("closing a WebSocket: its client took none of %d unsent bytes for %g s",
                        self.transport.get_write_buffer_size(), over_for)
            self._closed_here = True
            self.transport.abort()

        # -------------------------------------------------------------- closed below the application
        def handle_parser_exception(self) -> None:
            self._closed_here = True
            super().handle_parser_exception()

        def keepalive_timeout(self) -> None:
            self._closed_here = True
            super().keepalive_timeout()

        async def send(self, message) -> None:
            if self._closed_here and message["type"] in ("websocket.send", "websocket.close"):
                raise ClientDisconnected()
            await super().send(message)

    return BoundedWebSocketProtocol
