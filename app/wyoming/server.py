"""The Wyoming listener inside the serve process: started and stopped with the app's lifespan, on its event
loop, with the ``wyoming`` package's server (``tcp://HOST:PORT`` or ``unix://PATH``). Each connection is a
:class:`~app.wyoming.session.WyomingSession`."""

from __future__ import annotations

import logging

from wyoming.server import AsyncServer

from .session import SessionCount, WyomingSession

log = logging.getLogger("mossrt.wyoming")


class WyomingListener:
    def __init__(self, uri: str, service, metrics, version: str):
        self.uri, self.service, self.metrics, self.version = uri, service, metrics, version
        self.sessions = SessionCount(service.settings.wyoming_max_sessions)
        self._server: AsyncServer | None = None

    async def start(self) -> None:
        """Listen (a port in use fails the start, as the HTTP listener's does)."""
        server = AsyncServer.from_uri(self.uri)
        await server.start(lambda reader, writer: WyomingSession(reader, writer, self.service, self.metrics,
                                                                 self.version, self.sessions))
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
