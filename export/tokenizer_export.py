"""Copies the tokenizer into a bundle and records special-token ids and sampling defaults."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .bundle import BundleWriter
from .checkpoint import CheckpointError

# Token strings upstream relies on; their ids come from the tokenizer itself, never from literals.
SPECIAL_TOKENS = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "endoftext": "<|endoftext|>",
    "audio_pad": "<|audio_pad|>",   # voice-reference rows (Qwen's <|vision_pad|>, renamed by MOSS)
    "text_pad": "<|text_pad|>",     # fed once the text has run out (Qwen's <|image_pad|>, renamed)
}

# Model-card defaults (every upstream code path uses them).
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_p": 0.6, "top_k": 30, "repetition_penalty": 1.1,
                     "repetition_window": 50}

# The streaming delay: text leads audio by min(L, 12) tokens.
PREFILL_TEXT_TOKENS = 12


def find_tokenizer(src: str | Path) -> Path:
    """``tokenizer.json`` in ``src`` (a directory or the file itself)."""
    src = Path(src)
    path = src / "tokenizer.json" if src.is_dir() else src
    if not path.is_file():
        raise CheckpointError(f"{src}: no tokenizer.json (pass --tokenizer DIR)")
    return path


def export_tokenizer(src: str | Path, writer: BundleWriter) -> None:
    """Copy ``tokenizer.json`` from ``src`` (a directory or the file) and write the manifest's
    ``tokenizer`` and ``generation`` sections."""
    path = find_tokenizer(src)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own plain Exception
        raise CheckpointError(f"{path}: not a tokenizer.json ({str(e)[:200]})") from None
    ids = {}
    for key, text in SPECIAL_TOKENS.items():
        token_id = tok.token_to_id(text)
        if token_id is None:
            raise CheckpointError(f"{path}: token {text} is missing; the MOSS tokenizer renames Qwen's "
                                  "<|vision_pad|>/<|image_pad|> to <|audio_pad|>/<|text_pad|>")
        ids[key] = token_id
    writer.add_file("tokenizer.json", path.read_bytes())
    writer.set_section("tokenizer", {"file": "tokenizer.json", "special_ids": ids})
    writer.set_section("generation", {"sampling_defaults": dict(SAMPLING_DEFAULTS),
                                      "prefill_text_tokens": PREFILL_TEXT_TOKENS})
