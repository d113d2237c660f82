"""The connection a session runs over (:class:`~app.session.wire.WireSession`), whatever carries it: a
WebSocket (:mod:`app.session.websocket`) or a Wyoming stream of events (:mod:`app.wyoming.channel`). The
session's deadlines, bounded sends, clocks, stall handling and teardown are written once against this; an
adapter only moves one message at a time and closes."""

from __future__ import annotations

from typing import Protocol, TypeVar

from ..errors import ApiError

In_co = TypeVar("In_co", covariant=True)
Out_contra = TypeVar("Out_contra", contravariant=True)


class FrameRefused(Exception):
    """A message the channel could not read as one of its protocol within the size limit (``code``:
    ``binary_not_expected``, ``message_too_large``, ``invalid_json``, ``invalid_message``): the session refuses
    it."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class Channel(Protocol[In_co, Out_contra]):
    """One client connection: messages in (``In_co``), messages out (``Out_contra``), a close."""

    @property
    def disconnected(self) -> tuple[type[Exception], ...]:
        """What :meth:`receive` and :meth:`send` raise when the peer has gone."""
        ...

    async def receive(self) -> In_co | None:
        """The next message; None once the peer has gone or the channel was closed; :class:`FrameRefused` for
        one that cannot be read. Cancelling the wait loses nothing: the next call gets the same message (the
        session's deadlines cancel it)."""
        ...

    async def send(self, message: Out_contra) -> None:
        """One message out (the session bounds the wait with the stall timeout and cancels it past that)."""
        ...

    async def close(self, code: int, reason: str) -> None:
        """End the connection, after what was sent where the peer still takes it; ``code`` and ``reason`` where
        the protocol has a close of its own (a WebSocket's close frame)."""
        ...
