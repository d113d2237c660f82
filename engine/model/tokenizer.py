"""The bundle's BPE tokenizer (Hugging Face ``tokenizers``), in two modes.

* text mode (the default for every caller text): added-token strings such as ``<|im_end|>`` are
  tokenized as the characters they are, so a request cannot rewrite the prompt's structure;
* special mode (an explicit option): added-token strings become their ids, as upstream's
  ``tokenizer(text)`` does.

Prompt templates mix both: their own markup is trusted, the caller's text inside them is not
(:meth:`TextTokenizer.encode_parts`). Without added-token strings in the caller's text every mode
gives upstream's ids exactly.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from engine.errors import BundleError, InputError
from engine.runtime.bundle import Bundle


def check_unicode(text: str) -> str:
    """Text must be encodable as UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
    return text


@dataclass(frozen=True)
class Trusted:
    """Template text whose added-token strings are control tokens (never caller text)."""

    text: str


def _load(path: Path, added_as_text: bool) -> Tokenizer:
    """The tokenizer; with ``added_as_text`` every added token is promoted to special and
    ``encode_special_tokens`` makes the tokenizer treat special strings as plain text."""
    tok = Tokenizer.from_file(str(path))
    if added_as_text:
        plain = [t for t in tok.get_added_tokens_decoder().values() if not t.special]
        tok.add_special_tokens([AddedToken(t.content, special=True, normalized=t.normalized, lstrip=t.lstrip,
                                           rstrip=t.rstrip, single_word=t.single_word) for t in plain])
        tok.encode_special_tokens = True
    return tok


class TextTokenizer:
    """The bundle's tokenizer in text mode, and in special mode on request (see the module doc)."""

    def __init__(self, path: str | Path, special_ids: dict[str, int]) -> None:
        self._path = Path(path)
        try:
            self._text = _load(self._path, added_as_text=True)
        except Exception as e:  # OSError, and the tokenizers library's own plain Exception
            raise BundleError(f"{path}: not a usable tokenizer.json "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
        self._special_mode: Tokenizer | None = None   # loaded on first use: special mode is an explicit option
        self._lock = threading.Lock()
        self.special_ids = dict(special_ids)
        self.vocab_size = self._text.get_vocab_size(with_added_tokens=True)
        added = sorted(self.added_tokens(), key=len, reverse=True)
        # leftmost-longest match of added-token strings, as the tokenizer's own added vocabulary splits text
        self._added_re = re.compile("|".join(re.escape(t) for t in added)) if added else None
        for key, token_id in self.special_ids.items():
            if not 0 <= token_id < self.vocab_size:
                raise BundleError(f"{path}: special id {key}={token_id} is outside the vocabulary")

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "TextTokenizer":
        """The tokenizer a bundle's manifest names, with its special ids."""
        section = bundle.section("tokenizer")
        return cls(bundle.file_path(section.file), section.special_ids.model_dump())

    def backend(self, allow_special: bool = False) -> Tokenizer:
        """The ``tokenizers`` object of a mode (for incremental tokenization)."""
        if not allow_special:
            return self._text
        with self._lock:
            if self._special_mode is None:
                self._special_mode = _load(self._path, added_as_text=False)
            return self._special_mode

    def added_tokens(self) -> list[str]:
        """Every added token's text (``<|im_end|>``, ``<think>``, ...)."""
        return [t.content for t in self._text.get_added_tokens_decoder().values() if t.content]

    def split_added(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut into (piece, is_added_token) in order, added tokens matched leftmost-longest."""
        if self._added_re is None:
            return [(text, False)] if text else []
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in self._added_re.finditer(text):
            if m.start() > pos:
                out.append((text[pos:m.start()], False))
            out.append((m.group(), True))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], False))
        return out

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Ids of caller text. Text mode by default; ``allow_special`` maps added-token strings to their ids
        (upstream's ``tokenizer(text)``)."""
        return self.backend(allow_special).encode(check_unicode(text), add_special_tokens=False).ids

    def encode_parts(self, parts: list[str | Trusted], allow_special: bool = False) -> list[int]:
        """Ids of a template: :class:`Trusted` parts keep their added tokens, other parts are caller text
        (text mode unless ``allow_special``). Plain text between added tokens is tokenized as one piece
        across part boundaries, exactly as tokenizing the concatenated string would."""
        pieces: list[tuple[str, bool]] = []     # (text, is_added_token)
        for part in parts:
            if isinstance(part, Trusted) or allow_special:
                pieces += self.split_added(part.text if isinstance(part, Trusted) else check_unicode(part))
            elif part:
                pieces.append((check_unicode(part), False))
        ids: list[int] = []
        plain = ""
        for text, added in pieces:
            if added:
                if plain:
                    ids += self._text.encode(plain, add_special_tokens=False).ids
                    plain = ""
                token_id = self._text.token_to_id(text)
                assert token_id is not None, "split_added matched it among the tokenizer's added tokens"
                ids.append(token_id)
            else:
                plain += text
        if plain:
            ids += self._text.encode(plain, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, added tokens spelled out."""
        return self._text.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token's text (None: not in the vocabulary)."""
        return self._text.token_to_id(token)
