"""The bundle's BPE tokenizer (Hugging Face ``tokenizers``), adding no special tokens of its own."""

from __future__ import annotations

from tokenizers import Tokenizer

from .bundle import Bundle
from .errors import InputError


def check_unicode(text: str) -> str:
    """Text must be encodable as UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
    return text


class TextTokenizer:
    def __init__(self, bundle: Bundle):
        section = bundle.section("tokenizer")
        self._tok = Tokenizer.from_file(str(bundle.dir / section["file"]))
        self.special_ids: dict[str, int] = dict(section["special_ids"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers`` object (offsets and chunk ids, for incremental tokenization)."""
        return self._tok

    def added_tokens(self) -> list[str]:
        """Every added token's text (``<|im_end|>``, ``<think>``, ...): each is one id wherever it appears."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as upstream's ``tokenizer(text)``: special-token strings map to their ids."""
        return self._tok.encode(check_unicode(text), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
