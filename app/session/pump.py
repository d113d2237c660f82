"""The event pump: one turn's engine events as what every transport sends, fed to the metrics as it goes.

:class:`TurnAudio` turns events into :class:`Audio` (a frame's encoded bytes), :class:`Failed` (the error, in
the catalogue's terms) and :class:`Ended` (the encoder's tail and the turn's stats); :func:`pump` awaits them
from a handle (asyncio transports), :func:`blocking_pump` waits for them on a thread (gRPC) and gives up
when the client is gone. A frame counts as sent once the transport takes the next item: the meter sees the
audio after it left.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from engine.serving.handles import Event, FrameEvent, StreamError, StreamHandle, TurnEnd
from engine.serving.stream import Frame, TurnStats

from ..audio_formats import StreamEncoder
from ..errors import ApiError, from_engine
from ..metrics import FRAME_SECONDS, StreamMeter
from .policy import TextLedger


@dataclass(frozen=True)
class Audio:
    data: bytes                  # the frame's audio, encoded
    frame: Frame


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass(frozen=True)
class Ended:
    tail: bytes                  # what the encoder still held (a resampler's last samples, a format's trailer)
    stats: TurnStats


Out = Audio | Failed | Ended


class TurnAudio:
    """One turn's events → :data:`Out`, with its meter and its encoder: ``make_encoder()`` at the turn's first
    audio (a WAV header goes before each turn's first samples), or ``encoder`` made beforehand (HTTP: its
    format is checked before the stream opens). :attr:`text` counts the turn's characters received and read
    (the text buffer's measure)."""

    def __init__(self, meter: StreamMeter, make_encoder: Callable[[], StreamEncoder] | None = None,
                 encoder: StreamEncoder | None = None):
        self._make = make_encoder
        self.encoder = encoder
        self.meter = meter
        self.seconds_per_frame = FRAME_SECONDS
        self.text = TextLedger()

    def on_event(self, event: Event) -> Out | None:
        if isinstance(event, FrameEvent):
            self.meter.frame()
            self.text.saw_frame(event.frame.text_chars)
            if event.frame.audio is None:
                return None
            if self.encoder is None:
                assert self._make is not None, "a TurnAudio made without an encoder is given make_encoder"
                self.encoder = self._make()
            self.seconds_per_frame = FRAME_SECONDS / self.encoder.speed      # what the client plays per frame
            return Audio(self.encoder.write(event.frame.audio), event.frame)
        if isinstance(event, StreamError):
            return Failed(from_engine(event.error))
        if isinstance(event, TurnEnd):
            tail = self.encoder.close() if self.encoder is not None else b""
            self.encoder = None
            self.meter.finish()
            return Ended(tail, event.stats)
        return None

    def sent(self) -> None:
        """The last :class:`Audio` left for the client."""
        self.meter.audio_sent(self.seconds_per_frame)

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None


def _handed_over(turn: TurnAudio, out: Out) -> bool:
    """Bookkeeping once the transport took ``out``; True when the turn is over."""
    if isinstance(out, Audio):
        turn.sent()
    return isinstance(out, Ended)


async def pump(handle: StreamHandle, turn: TurnAudio) -> AsyncIterator[Out]:
    """The turn's :data:`Out` items as its events arrive (``AsyncSink``), until :class:`Ended`."""
    while True:
        out = turn.on_event(await handle.aget())
        if out is not None:
            yield out
            if _handed_over(turn, out):
                return


def blocking_pump(handle: StreamHandle, turn: TurnAudio, gone: Callable[[], bool],
                  poll_seconds: float = 0.25) -> Iterator[Out]:
    """:func:`pump` on a thread (``QueueSink``): looks every ``poll_seconds`` whether the client is
    ``gone``, and returns at once when it is (the caller cancels and closes the stream)."""
    while True:
        if gone():
            return
        try:
            event = handle.get(timeout=poll_seconds)
        except queue.Empty:
            continue
        out = turn.on_event(event)
        if out is not None:
            yield out
            if _handed_over(turn, out):
                return
