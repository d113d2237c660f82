"""A with-timestamps reply's two alignments, as ElevenLabs gives them: ``alignment`` over the text as sent and
``normalized_alignment`` over the text the model read."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..normalize import Normalized
from .characters import FRAME_MS, Aligner, Span
from .contract import FrameAligner
from .spans import SentAligner


class Alignments:
    """``alignment`` over the text as sent and ``normalized_alignment`` over the text the model read (the
    normalized text; the same as ``alignment`` when normalization changed nothing). The interface of an
    :class:`~app.alignment.characters.Aligner` (fed the model's text), whose spans are ``alignment``'s;
    :attr:`normalized` is the span the last call gave ``normalized_alignment``."""

    def __init__(self, normalized: Normalized, clock: str):
        self._read = Aligner(clock)               # over the text the model reads
        self._sent = SentAligner(_Tap(self._read, self), normalized) if normalized.changed else None
        self.clock_name = clock
        self.normalized: Span | None = None

    def add(self, delta: str, current: bool = True) -> None:
        (self._sent or self._read).add(delta, current)

    def frame(self, text_chars: int, audio: np.ndarray | None = None,
              duration_ms: float = FRAME_MS) -> Span | None:
        return self._said(lambda a: a.frame(text_chars, audio, duration_ms))

    def rest(self) -> Span | None:
        return self._said(lambda a: a.rest())

    def final(self) -> Span | None:
        return self._said(lambda a: a.final())

    def _said(self, call: Callable[[FrameAligner], Span | None]) -> Span | None:
        if self._sent is None:
            self.normalized = call(self._read)
            return self.normalized
        return call(self._sent)                   # its inner call records ``normalized`` (the tap)


class _Tap:
    """The aligner a :class:`SentAligner` maps from, recording each span it gives (the normalized one)."""

    def __init__(self, aligner: Aligner, into: Alignments):
        self._aligner, self._into = aligner, into
        self.clock_name = aligner.clock_name

    def add(self, delta: str, current: bool = True) -> None:
        self._aligner.add(delta, current)

    def frame(self, text_chars: int, audio: np.ndarray | None = None,
              duration_ms: float = FRAME_MS) -> Span | None:
        return self._record(self._aligner.frame(text_chars, audio, duration_ms))

    def rest(self) -> Span | None:
        return self._record(self._aligner.rest())

    def final(self) -> Span | None:
        return self._record(self._aligner.final())

    def _record(self, span: Span | None) -> Span | None:
        self._into.normalized = span
        return span


def normalized_span(aligner: FrameAligner | None, span: Span | None) -> Span | None:
    """The ``normalized_alignment`` of ``span``: :class:`Alignments`' own, else (any other aligner) the same."""
    return aligner.normalized if isinstance(aligner, Alignments) else span
