"""Incremental tokenization of streamed text that feeds exactly the ids of tokenizing the whole text.

Upstream cuts the stream into segments and tokenizes each on its own, which changes ids at the joins
(extra space tokens). Here ids are committed only where more text can no longer change them:

* **BPE**: BPE never merges across pre-tokenizer chunks, so every chunk but the last two is final
  (the last may still grow, the one before it may be regrouped, e.g. a whitespace run that loses its
  last space to the next word);
* **Unicode normalisation**: the tokenizer normalises to NFC, which composes and reorders across
  delta boundaries. The pending text is kept in NFC (``NFC(NFC(a) + b) == NFC(a + b)``) and a cut is
  only made before a character that starts a normalisation boundary (a starter that cannot combine
  with what precedes it: Unicode's NFC_Quick_Check and canonical combining classes, derived from
  ``unicodedata`` at first use, not from a list of examples);
* **added tokens** (only when they are allowed): a tail that could still become one (``<|im_e``) is
  held back, with the whitespace before it.

Cost is linear in the text: each character goes through BPE once, when its chunk commits; the
pending tail is re-split after each delta while it is short, and only after it grew by half once it
is long (a long run without any chunk boundary cannot commit anyway).
"""

from __future__ import annotations

import codecs
import functools
import logging
import unicodedata

from tokenizers import Tokenizer

from engine.errors import EngineError, InputError
from engine.model.tokenizer import TextTokenizer, check_unicode

log = logging.getLogger("mossrt.textstream")


class TokenizationDrift(EngineError):
    """Committed ids are not the whole-text tokenization (a bug: never expected; checked at finish)."""


@functools.lru_cache(maxsize=1)
def _composes_with_previous() -> frozenset[str]:
    """Characters that can combine with a preceding character under NFC (NFC_Quick_Check = Maybe): the
    second character of every canonical pair that NFC recomposes, plus the Hangul vowel/trailing jamo."""
    out = set()
    for cp in range(0x2FA20):   # the last canonical decomposition is U+2FA1D
        d = unicodedata.decomposition(chr(cp))
        if not d or d[0] == "<":
            continue
        parts = d.split()
        if len(parts) == 2:
            first, second = chr(int(parts[0], 16)), chr(int(parts[1], 16))
            if unicodedata.normalize("NFC", first + second) == chr(cp):
                out.add(second)
    out.update(chr(c) for c in range(0x1161, 0x1176))   # Hangul V jamo (compose with L)
    out.update(chr(c) for c in range(0x11A8, 0x11C3))   # Hangul T jamo (compose with LV)
    return frozenset(out)


def nfc_boundary_before(ch: str) -> bool:
    """Whether NFC never joins ``ch`` with anything before it: ``NFC(a + ch + b) == NFC(a) + NFC(ch + b)``.
    True for a starter (combining class 0) whose decomposition starts with a starter, none of which
    composes with a preceding character."""
    maybe = _composes_with_previous()
    if ch in maybe or unicodedata.combining(ch):
        return False
    first = unicodedata.normalize("NFD", ch)[0]
    return first not in maybe and not unicodedata.combining(first)


def nfc_append(normalized: str, delta: str) -> str:
    """``NFC(raw + delta)`` given ``normalized == NFC(raw)``: only the part after the last
    normalisation boundary is normalised again."""
    b = len(normalized)
    while b > 0 and not nfc_boundary_before(normalized[b - 1]):
        b -= 1
    start = b - 1 if b > 0 else 0
    return normalized[:start] + unicodedata.normalize("NFC", normalized[start:] + delta)


class TextCommitter:
    """Turns text deltas (str or UTF-8 bytes, any split) into committed token ids; not thread-safe."""

    HOLD_CHUNKS = 2
    RESCAN_EVERY_DELTA_BELOW = 256   # characters of pending text

    def __init__(self, tokenizer: TextTokenizer, allow_special: bool = False):
        self._tok = tokenizer
        self._allow_special = allow_special
        self._backend: Tokenizer = tokenizer.backend(allow_special)
        self._pre = self._backend.pre_tokenizer
        specials = [s for s in tokenizer.added_tokens() if s] if allow_special else []
        self._special_prefixes = {s[:i] for s in specials for i in range(1, len(s))}
        self._longest_special = max(map(len, specials), default=0)
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._tail = ""          # NFC text not yet committed, starting at a final chunk boundary
        self._raw: list[str] = []  # every decoded delta, for the drift check at finish
        self._scan_len = 0       # tail length at the last split that could not commit
        self.work_chars = 0      # characters pre-tokenized or encoded so far (a linear-cost witness)
        self.committed: list[int] = []
        # per committed id: how many characters of the (NFC) text it and the ids before it cover
        self.char_ends: list[int] = []
        self._committed_chars = 0
        self.finished = False

    @property
    def pending_text(self) -> str:
        return self._tail

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
        if not delta:
            return []
        self._raw.append(delta)
        self._tail = nfc_append(self._tail, delta)
        return self._commit(final=False)

    def finish(self) -> list[int]:
        """End of text: commit everything that is left (then :meth:`check` can verify the whole)."""
        if self.finished:
            return []
        try:
            rest = self._utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InputError("text ended in the middle of a UTF-8 character") from None
        if rest:
            self._raw.append(rest)
            self._tail = nfc_append(self._tail, rest)
        self.finished = True
        return self._commit(final=True)

    def check(self) -> None:
        """After :meth:`finish`: raise :class:`TokenizationDrift` unless the committed ids are exactly the
        tokenization of the whole text received (one more tokenization of it: linear)."""
        whole = self._backend.encode("".join(self._raw), add_special_tokens=False).ids
        if whole != self.committed:
            first = next((i for i, (a, b) in enumerate(zip(whole, self.committed)) if a != b),
                         min(len(whole), len(self.committed)))
            raise TokenizationDrift(f"streamed ids differ from the whole text's from id {first} "
                                    f"({len(self.committed)} vs {len(whole)} ids)")

    # ------------------------------------------------------------------ internals
    def _chunks(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of every pre-tokenizer chunk of ``text`` (an added token is one chunk)."""
        self.work_chars += len(text)
        out = []
        pieces = self._tok.split_added(text) if self._allow_special else [(text, False)]
        pos = 0
        for piece, added in pieces:
            if added:
                out.append((pos, pos + len(piece)))
            else:
                out += [(pos + a, pos + b) for _, (a, b) in self._pre.pre_tokenize_str(piece)]
            pos += len(piece)
        return out

    def _commit(self, final: bool) -> list[int]:
        tail = self._tail
        if not tail:
            return []
        if final:
            cut = len(tail)
        else:
            if len(tail) >= self.RESCAN_EVERY_DELTA_BELOW and 2 * len(tail) < 3 * self._scan_len:
                return []
            chunks = self._chunks(tail)
            k = len(chunks) - self.HOLD_CHUNKS
            if self._special_prefixes:
                held = self._partial_special_start(tail)
                held = len(tail[:held].rstrip())   # whitespace before a special becomes its own chunk
                while k > 0 and chunks[k - 1][1] > held:
                    k -= 1
            while k > 0 and not nfc_boundary_before(tail[chunks[k][0]]):
                k -= 1
            if k <= 0:
                self._scan_len = len(tail)
                return []
            cut = chunks[k][0]
        enc = self._backend.encode(tail[:cut], add_special_tokens=False)
        new = enc.ids
        self.work_chars += cut
        self._tail = tail[cut:]
        self._scan_len = 0
        self.committed.extend(new)
        self._record_char_ends(enc.offsets, cut)
        return new

    def _record_char_ends(self, offsets: list[tuple[int, int]], cut: int) -> None:
        """Character ends of newly committed ids: monotonic (byte-level pieces of one character share
        it), and the last id of a commit ends at the cut, so every character belongs to exactly one id."""
        end = self._committed_chars
        for i, (_, b) in enumerate(offsets):
            end = self._committed_chars + cut if i == len(offsets) - 1 else max(end, self._committed_chars + b)
            self.char_ends.append(end)
        self._committed_chars += cut

    def _partial_special_start(self, text: str) -> int:
        """Start of the longest suffix that is a proper prefix of an added token (len(text) if none)."""
        for i in range(max(0, len(text) - self._longest_special + 1), len(text)):
            if text[i:] in self._special_prefixes:
                return i
        return len(text)
