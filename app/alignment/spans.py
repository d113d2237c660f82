"""Alignment of a normalized utterance in the text as sent: the speech clock times the characters the model
reads ("ten dollars and fifty cents"); the client is told about the characters it sent ("$10.50").

A character outside every change is reported with its own time. The characters of a change are reported
together when the last character of what was read for them has been (never before it is heard), spread
evenly from the start of the first of those characters to the end of the last. Spans keep the Aligner's
contract: in order, each character once, a span's first time no earlier than where the previous one ended,
its last lasting to the end of its audio."""

from __future__ import annotations

from ..normalize import Normalized
from .characters import FRAME_MS, Span
from .contract import FrameAligner


class SentAligner:
    """An :class:`~app.alignment.characters.Aligner` fed with the text the model reads, whose spans are in the
    text as sent. Same interface: ``add`` takes the model's text (``Utterance.text``)."""

    def __init__(self, aligner: FrameAligner, normalized: Normalized):
        self._aligner = aligner
        self._normalized = normalized
        self._map = _SpanMap(normalized)
        self.clock_name = aligner.clock_name

    @property
    def text(self) -> str:
        return self._normalized.sent

    def add(self, delta: str, current: bool = True) -> None:
        self._aligner.add(delta, current)

    def frame(self, text_chars: int, audio=None, duration_ms: float = FRAME_MS) -> Span | None:
        return self._map.span(self._aligner.frame(text_chars, audio, duration_ms))

    def rest(self) -> Span | None:
        return self._map.span(self._aligner.rest())

    def final(self) -> Span | None:
        whole = self._aligner.final()
        return _SpanMap(self._normalized).span(whole) if whole is not None else None


class _SpanMap:
    """Spans over the model's text, in order, turned into spans over the sent text."""

    def __init__(self, normalized: Normalized):
        self._sent = normalized.sent
        # per character of the model's text: its sent index (unchanged) or -1 - the index of its change
        self._of: list[int] = []
        at = 0
        for k, seg in enumerate(normalized.segments):
            self._of += range(at, seg.sent_start)
            self._of += [-1 - k] * (seg.spoken_end - seg.spoken_start)
            at = seg.sent_end
        self._of += range(at, len(normalized.sent))
        self._segments = normalized.segments
        self._pos = 0                      # characters of the model's text mapped so far
        self._change_start = 0.0           # when the current change's first character began
        self._origin: float | None = None  # where an empty result's span began (the next one starts there)

    def span(self, span: Span | None) -> Span | None:
        if span is None:
            return None
        chars: list[str] = []
        starts: list[float] = []
        ends: list[float] = []
        origin = span.origin_ms if self._origin is None else self._origin
        for start, end in zip(span.starts_ms, span.ends_ms):
            of = self._of[self._pos]
            self._pos += 1
            if of >= 0:
                chars.append(self._sent[of])
                starts.append(max(start, origin))
                ends.append(max(end, origin))
                continue
            seg = self._segments[-1 - of]
            if self._pos - 1 == seg.spoken_start:
                self._change_start = start
            if self._pos == seg.spoken_end:
                sent = self._sent[seg.sent_start:seg.sent_end]
                a = max(self._change_start, origin, starts[-1] if starts else origin)
                b = max(end, a)
                bounds = [a + (b - a) * i / len(sent) for i in range(len(sent) + 1)]
                chars += sent
                starts += bounds[:-1]
                ends += bounds[1:]
        if not chars:
            self._origin = origin
            return None
        self._origin = None
        ends[-1] = max(span.ends_ms[-1], starts[-1])
        return Span(chars, starts, ends, origin)
