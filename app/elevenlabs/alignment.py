"""Character alignment of streamed audio from what the engine knows exactly.

Each frame says how many characters of its turn's text the model had *read* when it wrote that frame
(``Frame.text_chars``, counted in the NFC form the tokenizer reads). The characters first read at a frame are
given that frame's 80 ms of audio, spread evenly over it. Alignment covers the text **as sent**: the sent
text is cut where NFC cannot join a character with what precedes it (``engine.textstream``), and each piece
goes out, all its characters as sent, once every character of its NFC form was read (``"e\\u0301"`` is one NFC
character and two sent ones). The model reads text 12 tokens ahead of the audio it writes; times are in ms
and, as ElevenLabs', restart at 0 in every message (relative to that message's audio).
"""

from __future__ import annotations

import unicodedata

from engine.textstream import nfc_boundary_before

FRAME_MS = 80


class Aligner:
    """One context's alignment: the characters as sent, in order, each exactly once."""

    def __init__(self):
        self._pieces: list[str] = []   # the sent text cut at NFC boundaries (the last may still grow)
        self._ends: list[int] = []     # NFC characters up to the end of each piece
        self._base = 0                 # NFC characters of earlier turns of this context (a flush ends a turn)
        self._done = 0                 # pieces aligned so far
        self.text = ""                 # everything received, as sent

    def add(self, delta: str) -> None:
        self.text += delta
        for ch in delta:
            # a piece already aligned is never extended: what joins it comes as a piece of its own
            if self._pieces and not nfc_boundary_before(ch) and len(self._pieces) > self._done:
                self._pieces[-1] += ch
            else:
                self._pieces.append(ch)
                self._ends.append(0)
            before = self._ends[-2] if len(self._ends) > 1 else 0
            self._ends[-1] = before + len(unicodedata.normalize("NFC", self._pieces[-1]))

    def new_turn(self) -> None:
        self._base = self._ends[self._done - 1] if self._done else 0

    def frame(self, text_chars: int, duration_ms: float = FRAME_MS) -> dict | None:
        """Characters first read at a frame (``Frame.text_chars``), spread over its audio."""
        read = self._base + text_chars
        last = self._done
        while last < len(self._pieces) and self._ends[last] <= read:
            last += 1
        return self._span(last, duration_ms)

    def rest(self) -> dict | None:
        """At the end of a context's text: the characters never reached (an early end), at 0 ms."""
        return self._span(len(self._pieces), 0.0)

    def _span(self, end: int, duration_ms: float) -> dict | None:
        chars = [c for piece in self._pieces[self._done:end] for c in piece]
        if not chars:
            return None
        self._done = end
        n = len(chars)
        starts = [round(i * duration_ms / n) for i in range(n)]
        ends = starts[1:] + [round(duration_ms)]
        return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": [b - a for a, b in zip(starts, ends)]}
