"""An utterance's reply over HTTP, streamed or whole, with the bounds of every session: the stream is closed
when the reply ends however it ends (done, engine error, client reset — which cancels the response while
``send`` blocks and leaves the body's generator suspended until garbage collection —, a client that stops
taking audio for ``stall_timeout``), and a whole-body reply that the client abandons while it is generated
is cancelled at the next step, as a streamed one is. Every HTTP route that speaks goes through here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.responses import ContentStream
from starlette.types import Message, Receive, Scope, Send

from engine.serving.handles import StreamHandle

from ..metrics import Metrics
from .pump import Ended, Failed, Out, TurnAudio, pump

log = logging.getLogger("mossrt.http")
T = TypeVar("T")


class StreamEnd:
    """Closes a reply's stream once, however it ends: the engine stream (its slot), the encoder, the meter,
    and the request counted with its final status."""

    def __init__(self, handle: StreamHandle, turn: TurnAudio, metrics: Metrics, endpoint: str):
        self.handle, self.turn, self.metrics, self.endpoint = handle, turn, metrics, endpoint
        self.status = "client_disconnected"
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        self.handle.close()
        self.turn.close()
        self.turn.meter.finish()
        self.metrics.requests.labels(self.endpoint, self.status).inc()

    def stalled(self, stall_timeout: float) -> None:
        self.status = "client_stalled"
        self.metrics.stalled.labels(self.turn.meter.transport).inc()
        log.warning("%s stream ended: the client took no audio for %g s", self.endpoint, stall_timeout)


async def outs(end: StreamEnd) -> AsyncIterator[Out]:
    """The reply's pump items; an error after the headers were sent is logged and ends the body (``Failed``
    is still yielded so that a format with an error event can say it). The final status goes to ``end``."""
    try:
        async for out in pump(end.handle, end.turn):
            if isinstance(out, Failed):
                end.status = str(out.error.status)
                log.error("%s stream failed after %d frames: %s", end.endpoint, end.turn.meter.frames,
                          out.error.message)
            elif isinstance(out, Ended) and end.status == "client_disconnected":
                end.status = "200"
            yield out
    finally:
        end()


class _ClientStalled(Exception):
    pass


class StreamedResponse(StreamingResponse):
    """The streamed body, tied to the response's lifetime rather than its generator's: when the response ends
    in any way the stream is closed here. A chunk the client does not take within ``stall_timeout`` seconds
    ends the response (the slot is freed, ``mossrt_stalled_streams_total`` counts it)."""

    def __init__(self, content: ContentStream, end: StreamEnd, stall_timeout: float,
                 media_type: str | None = None, headers: Mapping[str, str] | None = None,
                 background: BackgroundTask | None = None):
        super().__init__(content, media_type=media_type, headers=headers, background=background)
        self._end, self._stall_timeout = end, stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _ClientStalled:
            self._end.stalled(self._stall_timeout)
        finally:
            self._end()
            await _close(self.body_iterator)


async def _close(iterator: AsyncIterable[object]) -> None:
    """Finalize the body generator now (it may be suspended at a ``yield``); a no-op once it ended."""
    if not isinstance(iterator, AsyncGenerator):
        return                       # nothing to finalize
    try:
        await iterator.aclose()
    except Exception:  # noqa: BLE001 - its own cleanup already ran or failed; the stream is closed
        pass


async def whole(request: Request, end: StreamEnd, collect: Awaitable[T]) -> T | None:
    """Await ``collect`` (a coroutine that consumes the reply) while watching the connection: a client that
    disconnects or resets before the reply is whole cancels the stream at the next step (None is returned).
    The stream is closed either way."""
    async def until_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect), asyncio.ensure_future(until_disconnect())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        log.info("%s: the client left before its reply was whole; stream cancelled", end.endpoint)
        return None
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
        end()
