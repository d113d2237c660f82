"""Character alignment of streamed audio, in ElevenLabs' shapes, on the speech's timeline.

Alignment covers the text **as sent**: the sent text is cut where NFC cannot join a character with what
precedes it (``engine.model.textstream``), and each piece (all its characters as sent: ``"e\\u0301"`` is one NFC
character and two sent ones) is one unit of the estimate.

Two clocks (the routes' ``alignment`` query parameter):

- ``speech`` (default): a piece goes out with the audio frame in which :class:`app.alignment.clock.SpeechClock`
  estimates it is spoken, never earlier (so a client that counts what it has received, or what its player
  has played, counts only what was heard), and never before the model has read it. Pieces still unspoken
  when a turn is cancelled are never sent; at the end of a turn the rest goes out with its last audio.
- ``read``: a piece goes out with the frame at which the model *read* it (``Frame.text_chars``, counted in
  the NFC form the tokenizer reads), spread over that frame: 12 tokens ahead of the audio at first, then one
  token (80 ms) a frame, far ahead of speech.

On the WebSockets times are in ms and, as ElevenLabs', restart in every message: a message's first
character counts from the end of the previous message's span (so the time of audio messages that carried
no alignment is in it) and its last lasts to the end of its message's audio, so the spans add up to the
audio's time (what pipecat sums into its word clock). Over HTTP they are seconds from the utterance's start.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

import numpy as np

from engine.model.textstream import nfc_boundary_before

from .clock import SpeechClock

FRAME_MS = 80
CLOCKS = ("speech", "read")


@dataclass(frozen=True)
class Span:
    """Characters with absolute start and end times (ms in the context), and where the previous span ended."""

    chars: list[str]
    starts_ms: list[float]
    ends_ms: list[float]
    origin_ms: float

    def message(self) -> dict:
        """ElevenLabs' WebSocket alignment: ms counted from the end of the previous span."""
        origin = round(self.origin_ms)       # rounded once, so the spans' sum is the rounded end: no drift
        starts = [round(s) - origin for s in self.starts_ms]
        ends = [round(e) - origin for e in self.ends_ms]
        return {"chars": self.chars, "charStartTimesMs": starts,
                "charDurationsMs": [e - s for s, e in zip(starts, ends)]}

    def seconds(self) -> dict:
        """ElevenLabs' HTTP alignment: seconds from the utterance's start."""
        return {"characters": self.chars, "character_start_times_seconds": [s / 1000 for s in self.starts_ms],
                "character_end_times_seconds": [e / 1000 for e in self.ends_ms]}


class Aligner:
    """One context's alignment: the characters as sent, in order, each at most once."""

    def __init__(self, clock: str = "speech"):
        if clock not in CLOCKS:
            raise ValueError(f"alignment clock {clock!r}: one of {', '.join(CLOCKS)}")
        self.clock_name = clock
        self._pieces: list[str] = []   # the sent text cut at NFC boundaries (the last may still grow)
        self._ends: list[int] = []     # NFC characters up to the end of each piece
        self._done = 0                 # pieces aligned (or skipped) so far
        self._turn_first = 0           # the current turn's first piece
        self._turn_limit = 0           # pieces that belong to the current turn (text after a flush does not)
        self._base = 0                 # NFC characters before the current turn's first piece
        self._clock = SpeechClock()
        self._turn_start_ms = 0.0      # the context's audio before this turn
        self._audio_end_ms = 0.0       # the context's audio so far
        self._span_end_ms = 0.0        # where the last span ended
        self.text = ""                 # everything received, as sent

    # ------------------------------------------------------------------ text in
    def add(self, delta: str, current: bool = True) -> None:
        """Text received for the context: for the turn that is speaking (``current``) or for a later one."""
        self.text += delta
        for ch in delta:
            # a piece already aligned is never extended: what joins it comes as a piece of its own
            if self._pieces and not nfc_boundary_before(ch) and len(self._pieces) > self._done:
                self._pieces[-1] += ch
                if self._turn_first + self._clock.units == len(self._pieces):
                    self._clock.extend(ch)               # the piece's unit is in the clock already
            else:
                self._pieces.append(ch)
                self._ends.append(0)
            before = self._ends[-2] if len(self._ends) > 1 else 0
            self._ends[-1] = before + len(unicodedata.normalize("NFC", self._pieces[-1]))
        if current:
            self._turn_limit = len(self._pieces)
            self._feed_clock()

    def new_turn(self) -> None:
        """The context's next turn begins: it speaks every piece received and not yet aligned; what a
        cancelled turn left unspoken is skipped."""
        self._done = max(self._done, self._turn_limit)
        self._base = self._ends[self._done - 1] if self._done else 0
        self._turn_first = self._done
        self._turn_limit = len(self._pieces)
        self._turn_start_ms = self._audio_end_ms
        self._clock = SpeechClock()
        self._feed_clock()

    def _feed_clock(self) -> None:
        while self._turn_first + self._clock.units < self._turn_limit:
            self._clock.add(self._pieces[self._turn_first + self._clock.units])

    # ------------------------------------------------------------------ frames out
    def frame(self, text_chars: int, audio: np.ndarray | None = None, duration_ms: float = FRAME_MS) -> Span | None:
        """What a frame whose audio is now sent aligns (``text_chars``: ``Frame.text_chars``)."""
        read = self._base + text_chars
        readable = self._done
        while readable < self._turn_limit and self._ends[readable] <= read:
            readable += 1
        frame_start = self._audio_end_ms
        self._audio_end_ms += duration_ms
        self._clock.frame(audio)
        if self.clock_name == "read":
            n = readable - self._done
            return self._span(readable, [frame_start + i * duration_ms / max(n, 1) for i in range(n)],
                              self._audio_end_ms, frame_start)
        first = self._done - self._turn_first
        spoken = self._clock.spoken_by(self._clock.audio_s, readable - self._turn_first, first)
        starts = [self._turn_start_ms + self._clock.time_of(u) * 1000 for u in range(first, spoken)]
        return self._span(self._turn_first + spoken, starts, self._audio_end_ms, frame_start)

    def rest(self) -> Span | None:
        """At the end of a turn that was not cancelled: every piece of it not yet aligned, at the end of its
        audio."""
        end = self._audio_end_ms
        return self._span(self._turn_limit, [end] * (self._turn_limit - self._done), end, end)

    def final(self) -> Span | None:
        """The whole of a one-turn utterance once its audio has ended (for a whole-body reply): with the speech
        clock every piece re-timed knowing where the speech ended."""
        if self.clock_name == "read":
            return None
        times = self._clock.final_times(self._turn_limit - self._turn_first)
        starts = [self._turn_start_ms + t * 1000 for t in times]
        pieces = self._pieces[self._turn_first:self._turn_limit]
        return _spread(pieces, starts, self._audio_end_ms, self._turn_start_ms) if pieces else None

    def _span(self, end: int, starts: list[float], span_end: float, not_before: float) -> Span | None:
        """Pieces ``_done..end`` at absolute ``starts``, the last lasting to ``span_end``."""
        pieces = self._pieces[self._done:end]
        if not pieces:
            return None
        self._done = end
        span = _spread(pieces, starts, span_end, max(self._span_end_ms, not_before), origin=self._span_end_ms)
        self._span_end_ms = span_end
        return span


def _spread(pieces: list[str], starts: list[float], span_end: float, floor: float,
            origin: float | None = None) -> Span:
    """Pieces at ``starts`` kept in order within [floor, span_end]; a piece's characters share its time."""
    clamped = []
    for s in starts:
        floor = min(max(floor, s), span_end)
        clamped.append(floor)
    chars, a_ms, b_ms = [], [], []
    for piece, s, e in zip(pieces, clamped, clamped[1:] + [span_end]):
        for i, ch in enumerate(piece):
            chars.append(ch)
            a_ms.append(s + (e - s) * i / len(piece))
            b_ms.append(s + (e - s) * (i + 1) / len(piece))
    return Span(chars, a_ms, b_ms, clamped[0] if origin is None else origin)
