"""The Wyoming listener inside the serve process: started and stopped with the app's lifespan, on its event
loop, with the ``wyoming`` package's server (``tcp://HOST:PORT`` or ``unix://PATH``). Each connection is a
:class:`~app.wyoming.session.WyomingSession` over an :class:`~app.wyoming.channel.EventChannel`."""

from __future__ import annotations

import asyncio
import logging
import socket
from functools import partial

from wyoming.event import Event
from wyoming.server import AsyncEventHandler, AsyncServer, AsyncTcpServer

from .channel import EventChannel
from .session import SessionCount, WyomingSession

log = logging.getLogger("mossrt.wyoming")


class Connection(AsyncEventHandler):
    """The package server's handler of one connection: its session, which reads the events itself (the
    server's ``stop`` ends the stream, and so the session)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener: WyomingListener):
        super().__init__(reader, writer)
        self.listener = listener

    async def handle_event(self, event: Event) -> bool:
        raise NotImplementedError("the session reads its own events")

    async def run(self) -> None:
        listener = self.listener
        channel = EventChannel(self.reader, self.writer, listener.service.policy.max_message_bytes)
        await WyomingSession(channel, listener.service, listener.metrics, listener.version,
                             listener.sessions).serve()


class InheritedTcpServer(AsyncTcpServer):
    """The package's TCP server on a listening socket bound already (by ``mossrt serve --api-workers``'
    supervisor: connections wait in its backlog while the worker that serves them starts or restarts)."""

    def __init__(self, sock: socket.socket) -> None:
        host, port = sock.getsockname()[:2]
        super().__init__(host, port)
        self.sock = sock

    async def start(self, handler_factory) -> None:
        self._server = await asyncio.start_server(partial(self._handler_callback, handler_factory), sock=self.sock)
        await self._server.start_serving()


class WyomingListener:
    """``uri``'s listener (``sock``: its socket, bound and listening already)."""

    def __init__(self, uri: str, service, metrics, version: str, sock: socket.socket | None = None):
        self.uri, self.service, self.metrics, self.version = uri, service, metrics, version
        self.sock = sock
        self.sessions = SessionCount(service.settings.wyoming_max_sessions)
        self._server: AsyncServer | None = None

    async def start(self) -> None:
        """Listen (a port in use fails the start, as the HTTP listener's does)."""
        server = InheritedTcpServer(self.sock) if self.sock is not None else AsyncServer.from_uri(self.uri)
        await server.start(lambda reader, writer: Connection(reader, writer, self))
        self._server = server
        settings = self.service.settings
        if self.service.policy.keys_required:
            log.info("Wyoming listening on %s (no authentication: the API keys do not apply to it; voices: %s; "
                     "its syntheses take free slots only, never parking a conversation)", self.uri,
                     "all" if settings.wyoming_uploaded_voices() else "built-in only")
        else:
            log.info("Wyoming listening on %s", self.uri)

    async def stop(self) -> None:
        """Stop listening and close every connection (after the drain: their syntheses have ended)."""
        if self._server is not None:
            await self._server.stop()
            self._server = None
