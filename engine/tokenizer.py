"""The bundle's BPE tokenizer (Hugging Face ``tokenizers``), adding no special tokens of its own."""

from __future__ import annotations

from tokenizers import Tokenizer

from .bundle import Bundle


class TextTokenizer:
    def __init__(self, bundle: Bundle):
        section = bundle.section("tokenizer")
        self._tok = Tokenizer.from_file(str(bundle.dir / section["file"]))
        self.special_ids: dict[str, int] = dict(section["special_ids"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as upstream's ``tokenizer(text)``: special-token strings map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
