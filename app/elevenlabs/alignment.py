"""Character alignment of streamed audio from what the engine knows exactly.

Each frame says how many characters of its turn's text the model had *read* when it wrote that frame
(``Frame.text_chars``). The characters first read at a frame are given that frame's 80 ms of audio,
spread evenly over it. The model reads text 12 tokens ahead of the audio it writes, so a character's
time is when it entered the model, which precedes its being spoken by up to about 12 tokens (roughly
a second of speech); after the text ends the model speaks what it already read. Times are in ms and,
as ElevenLabs', restart at 0 in every message (relative to that message's audio).
"""

from __future__ import annotations

import unicodedata

FRAME_MS = 80


class Aligner:
    """One context's alignment: characters in order, each exactly once."""

    def __init__(self):
        self.text = ""          # everything received for the context, as sent
        self._nfc = ""          # its NFC form: the characters the engine's counts refer to
        self._base = 0          # characters of earlier turns of this context (a flush ends a turn)
        self.sent = 0           # characters aligned so far

    def add(self, delta: str) -> None:
        self.text += delta
        self._nfc = unicodedata.normalize("NFC", self.text)

    def new_turn(self) -> None:
        self._base = self.sent

    def frame(self, text_chars: int, duration_ms: float = FRAME_MS) -> dict | None:
        """Characters first read at a frame (``Frame.text_chars``), spread over its audio."""
        return self._span(min(len(self._nfc), self._base + text_chars), duration_ms)

    def rest(self) -> dict | None:
        """At the end of a context's text: the characters never reached (an early end), at 0 ms."""
        return self._span(len(self._nfc), 0.0)

    def _span(self, end: int, duration_ms: float) -> dict | None:
        chars = list(self._nfc[self.sent:end])
        if not chars:
            return None
        self.sent = end
        n = len(chars)
        starts = [round(i * duration_ms / n) for i in range(n)]
        ends = starts[1:] + [round(duration_ms)]
        return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": [b - a for a, b in zip(starts, ends)]}
