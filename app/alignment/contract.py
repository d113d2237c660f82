"""What every aligner answers, whichever it is (:class:`~app.alignment.characters.Aligner`,
:class:`~app.alignment.spans.SentAligner`, :class:`~app.alignment.paired.Alignments`): the interface the
replies that carry alignment, and the aligners that wrap another, rely on."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .characters import FRAME_MS, Span


class FrameAligner(Protocol):
    """Fed the text the model reads; gives each frame's span, then the turn's rest, then (a whole reply) all of
    it re-timed."""

    @property
    def clock_name(self) -> str: ...

    def add(self, delta: str, current: bool = True) -> None: ...

    def frame(self, text_chars: int, audio: np.ndarray | None = None,
              duration_ms: float = FRAME_MS) -> Span | None: ...

    def rest(self) -> Span | None: ...

    def final(self) -> Span | None: ...
