"""Word timestamps from character alignment: the words of an utterance, each once and in order, with the
start of its first character and the end of its last, as the characters arrive (Kokoro-FastAPI's
``{"word", "start_time", "end_time"}``, seconds from the utterance's start).

A word is a run of characters between white space, its punctuation included (``"Hello,"``); in scripts
written without spaces each Han character or kana is a word of its own (with the punctuation after it).
The characters come from :class:`app.alignment.characters.Aligner`, on the same speech clock as the
ElevenLabs routes (``/with-timestamps``), in its HTTP shape (:meth:`Span.seconds`).
"""

from __future__ import annotations

import unicodedata


def _unspaced(ch: str) -> bool:
    """A character of a script written without spaces between words (Han, kana)."""
    return unicodedata.name(ch, "").startswith(("CJK UNIFIED", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA"))


class WordTimestamps:
    """One utterance's words: :meth:`add` each alignment as it comes (a word is out once white space or the
    next word follows it), :meth:`finish` at the end for the last one."""

    def __init__(self) -> None:
        self._chars: list[str] = []
        self._start = 0.0
        self._end = 0.0
        self._letters = False        # the current word has a letter or digit
        self._unspaced = False       # ... and its last one is Han or kana

    def add(self, alignment: dict | None) -> list[dict]:
        """The words this alignment (``characters``, ``character_start_times_seconds``,
        ``character_end_times_seconds``) completes."""
        out: list[dict] = []
        if not alignment:
            return out
        for ch, start, end in zip(alignment["characters"], alignment["character_start_times_seconds"],
                                  alignment["character_end_times_seconds"], strict=True):
            if ch.isspace():
                out += self.finish()
                continue
            word_char = unicodedata.category(ch)[0] in "LN"
            if word_char and self._letters and (_unspaced(ch) or self._unspaced):
                out += self.finish()
            if not self._chars:
                self._start = start
            self._chars.append(ch)
            self._end = end
            if word_char:
                self._letters, self._unspaced = True, _unspaced(ch)
        return out

    def finish(self) -> list[dict]:
        """The word still open, if any."""
        if not self._chars:
            return []
        word = {"word": "".join(self._chars), "start_time": round(self._start, 3), "end_time": round(self._end, 3)}
        self._chars, self._letters, self._unspaced = [], False, False
        return [word]


def words_of(alignment: dict | None) -> list[dict]:
    """Every word of a whole alignment."""
    words = WordTimestamps()
    return words.add(alignment) + words.finish()
