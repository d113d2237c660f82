"""A streamed audio response whose engine stream is closed when the response ends, however it ends: done,
engine error, client reset (which cancels the response while ``send`` blocks and leaves the body's generator
suspended until garbage collection) or a client that stops taking audio (``stall_timeout``). Every HTTP
route that streams audio uses it."""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import StreamingResponse

from engine.errors import EngineError
from engine.scheduler import FrameEvent, StreamError, StreamHandle, TurnEnd

from .audio_formats import StreamEncoder
from .errors import from_engine
from .metrics import FRAME_SECONDS, StreamMeter

log = logging.getLogger("mossrt.http")


class StreamEnd:
    """Closes a speech stream once, however it ends (done, engine error, client gone or stalled): the
    engine stream (its slot), the encoder, the meter, and the request counted with its final status."""

    def __init__(self, handle: StreamHandle, encoder: StreamEncoder, meter: StreamMeter, metrics, endpoint: str):
        self.handle, self.encoder, self.meter, self.metrics, self.endpoint = handle, encoder, meter, metrics, endpoint
        self.status = "client_disconnected"
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        self.handle.close()
        self.encoder.close()
        self.meter.finish()
        self.metrics.requests.labels(self.endpoint, self.status).inc()


class _ClientStalled(Exception):
    pass


class StreamedResponse(StreamingResponse):
    """The streamed body, tied to the response's lifetime rather than its generator's: when the response
    ends in any way (a client reset cancels it while ``send`` blocks, leaving the generator suspended
    until garbage collection) the stream is closed here. A chunk the client does not take within
    ``stall_timeout`` seconds ends the response (the slot is freed, ``mossrt_stalled_streams_total``)."""

    def __init__(self, content, end: StreamEnd, stall_timeout: float, **kwargs):
        super().__init__(content, **kwargs)
        self._end, self._stall_timeout = end, stall_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def bounded_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _ClientStalled:
            self._end.status = "client_stalled"
            self._end.metrics.stalled.labels(self._end.meter.transport).inc()
            log.warning("%s stream ended: the client took no audio for %g s", self._end.endpoint, self._stall_timeout)
        finally:
            self._end()
            await _close(self.body_iterator)


async def _close(iterator) -> None:
    """Finalize the body generator now (it may be suspended at a ``yield``); a no-op once it ended."""
    try:
        await iterator.aclose()
    except Exception:  # noqa: BLE001 - its own cleanup already ran or failed; the stream is closed
        pass




async def audio_events(end: StreamEnd):
    """The encoded audio of ``end``'s stream as it is generated: ``(bytes, frame, None)`` per frame that has
    audio, then ``(the encoder's tail, None, turn stats)``. The final status goes to ``end``, which closes
    everything however the loop ends; an engine error after the headers were sent is logged and re-raised
    (the body can only end early)."""
    meter, encoder = end.meter, end.encoder
    seconds_per_frame = FRAME_SECONDS / encoder.speed        # what the client plays per frame
    try:
        while True:
            event = await end.handle.aget()
            if isinstance(event, FrameEvent):
                meter.frame()
                if event.frame.audio is not None:
                    data = encoder.write(event.frame.audio)
                    meter.audio_sent(seconds_per_frame)
                    yield data, event.frame, None
            elif isinstance(event, StreamError):
                raise event.error
            elif isinstance(event, TurnEnd):
                end.status = "200"
                yield encoder.close(), None, event.stats
                return
    except EngineError as e:
        end.status = str(from_engine(e).status)
        log.error("%s stream failed after %d frames: %s", end.endpoint, meter.frames, e)
        raise
    finally:
        end()
