"""A Wyoming connection (an asyncio stream of events) as a :class:`~app.session.channel.Channel`: the session
core (:class:`~app.session.wire.WireSession`) runs over it as over a WebSocket."""

from __future__ import annotations

import asyncio
import socket

from wyoming.event import Event, async_write_event

from ..protocol_bounds import SEND_BUFFER_BYTES
from ..session.wire import CLOSE_BOUND_S
from .events import read_event


class EventChannel:
    """Events in (:func:`~app.wyoming.events.read_event`, held to ``max_bytes``), events out; the protocol has
    no close of its own, so :meth:`close` ends the stream."""

    disconnected: tuple[type[Exception], ...] = (ConnectionError, asyncio.IncompleteReadError)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_bytes: int):
        self.reader, self.writer, self.max_bytes = reader, writer, max_bytes
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)   # as HTTP's: stalls show
        self._reading: asyncio.Future[Event | None] | None = None
        self._stuck = False               # a write was cancelled before it was taken: the peer reads nothing
        self.closed = False

    async def receive(self) -> Event | None:
        if self.closed:
            return None
        if self._reading is None:        # one read at a time, never cancelled half-way through an event
            self._reading = asyncio.ensure_future(read_event(self.reader, self.max_bytes))
        reading = self._reading
        await asyncio.wait({reading})    # a wait cancelled (a deadline) leaves the read going, for the next call
        self._reading = None
        if reading.cancelled():          # the channel was closed meanwhile
            return None
        return reading.result()

    async def send(self, message: Event) -> None:
        if self.closed:
            raise ConnectionResetError("the connection is closed")
        try:
            await async_write_event(message, self.writer)
        except asyncio.CancelledError:
            self._stuck = True           # its bound passed (or the session ended) with the event still buffered
            raise

    async def close(self, code: int, reason: str) -> None:
        """A half-close once what is buffered is sent: the client reads the error, then the end; events it
        still sends are taken in meanwhile (closing with them unread would reset the connection, and the client
        could lose the error), until it closes too or :data:`CLOSE_BOUND_S` passes. At once when a write was
        left untaken (a client that reads nothing cannot take the rest) or the transport is closing."""
        self.closed = True
        transport = self.writer.transport
        if not self._stuck and transport.can_write_eof() and not transport.is_closing():
            transport.write_eof()
            asyncio.get_running_loop().call_later(CLOSE_BOUND_S, transport.abort)
        else:
            transport.abort()
        if self._reading is not None and self._reading is not asyncio.current_task():
            self._reading.cancel()       # the receive loop sees the end
