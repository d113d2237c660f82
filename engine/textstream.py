"""Incremental tokenization of streamed text that feeds exactly the ids of tokenizing the whole text.

Upstream cuts the stream into segments and tokenizes each on its own, which changes ids at the joins
(extra space tokens). Here the uncommitted tail is re-tokenized after every delta and only ids that
more text can no longer change are committed: BPE never merges across pre-tokenizer chunks, so every
chunk but the last two is final (the last may still grow, the one before it may absorb a combining
mark or a digit run's regrouping), and a tail that could still become a special token (``<|im_e…``) is
held back too. Byte deltas may split UTF-8 characters; an incremental decoder joins them.
"""

from __future__ import annotations

import codecs

from tokenizers import Tokenizer

from .errors import EngineError, InputError
from .tokenizer import check_unicode


class TokenizationDrift(EngineError):
    """Committed ids stopped being a prefix of the whole-text tokenization (a bug: never expected)."""


class TextCommitter:
    HOLD_CHUNKS = 2

    def __init__(self, tokenizer: Tokenizer, special_tokens: list[str]):
        self._tok = tokenizer
        self._specials = [s for s in special_tokens if s]
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._text = ""          # text not yet committed, starting at a chunk boundary
        self.committed: list[int] = []
        self.finished = False

    @property
    def pending_text(self) -> str:
        return self._text

    def push(self, delta: str | bytes) -> list[int]:
        """Add a delta; return the ids it commits (possibly none)."""
        if self.finished:
            raise InputError("text already ended for this turn")
        if isinstance(delta, (bytes, bytearray)):
            try:
                delta = self._utf8.decode(bytes(delta))
            except UnicodeDecodeError as e:
                raise InputError(f"text delta is not valid UTF-8: {e}") from None
        elif isinstance(delta, str):
            if self._utf8.getstate()[0]:
                raise InputError("a str delta arrived while a UTF-8 character was half-received as bytes")
            check_unicode(delta)
        else:
            raise InputError(f"text delta must be str or bytes, got {type(delta).__name__}")
        self._text += delta
        return self._commit(final=False)

    def finish(self) -> list[int]:
        """End of text: commit everything that is left."""
        if self.finished:
            return []
        try:
            self._text += self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InputError("text ended in the middle of a UTF-8 character") from None
        self.finished = True
        return self._commit(final=True)

    def _commit(self, final: bool) -> list[int]:
        enc = self._tok.encode(self._text, add_special_tokens=False)
        ids, words, offsets = enc.ids, enc.word_ids, enc.offsets
        n = len(ids)
        if not final:
            held = set()
            for i in range(len(ids) - 1, -1, -1):
                w = words[i] if words[i] is not None else ("special", i)
                if w not in held and len(held) == self.HOLD_CHUNKS:
                    n = i + 1
                    break
                held.add(w)
            else:
                n = 0
            # whitespace before a possible special token is split off as its own segment once the special
            # completes, so it is held back with it
            cut = self._partial_special_start()
            cut = len(self._text[:cut].rstrip())
            while n and offsets[n - 1][1] > cut:
                n -= 1
            while 0 < n < len(ids) and words[n - 1] == words[n]:  # never stop inside a chunk
                n -= 1
        if n == 0:
            return []
        # cut where the next token starts: NFC can fold a combining mark into the previous token, whose
        # end offset then stops short of it
        end = offsets[n][0] if n < len(ids) else len(self._text)
        new = list(ids[:n])
        self._text = self._text[end:]
        self.committed.extend(new)
        return new

    def _partial_special_start(self) -> int:
        """Start of the longest suffix that is a proper prefix of a special token (len(text) if none)."""
        text = self._text
        start = text.rfind("<")
        while start != -1:
            tail = text[start:]
            if any(s.startswith(tail) and s != tail for s in self._specials):
                return start
            start = text.rfind("<", 0, start)
        return len(text)
