"""The built-in demo bundle: tiny random weights made from a seed, no download. Its audio is noise."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .bundle import BundleWriter
from .codec_export import export_codec
from .packed_tokenizer import tokenizer_json
from .random_checkpoint import make_codec_checkpoint, make_tts_checkpoint
from .tokenizer_export import export_tokenizer
from .tts_export import export_tts

DEMO_SEED = 20261129
DEMO_VERSION = 2                 # 2: the end rule below
# Its random model never samples EOS, so every turn would run to its frame limit (three words: 8.8 s of
# noise). The manifest gives it an end rule instead: a turn whose text is all fed ends at this many frames
# per text id (~0.28 s of audio an id, about speech's rate).
END_FRAMES_PER_TEXT_ID = 3.5


def __getattr__(name: str):
    """``TOKENIZER_JSON``: the MOSS-TTS-Realtime tokenizer (Qwen3 BPE with <|audio_pad|>/<|text_pad|>
    renamed), shipped so the demo needs no download; unpacked on first use (export/packed_tokenizer.py)."""
    if name == "TOKENIZER_JSON":
        return tokenizer_json()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_demo_bundle(out_dir: str | Path, seed: int = DEMO_SEED, progress=lambda msg: None,
                      end_frames_per_text_id: float | None = END_FRAMES_PER_TEXT_ID) -> Path:
    """Write (deterministically from ``seed``) a complete demo bundle — codec, TTS graphs, tokenizer —
    labelled ``"demo"`` in its manifest, with its end rule (None: none, every turn runs to its frame limit)."""
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        codec = make_codec_checkpoint(Path(tmp) / "codec", seed=seed, preset="tiny")
        tts = make_tts_checkpoint(Path(tmp) / "tts", seed=seed + 1, preset="tiny")
        writer = BundleWriter(out)
        export_codec(codec, writer, progress=progress)
        export_tts(tts, writer, "fp32", progress)
        export_tokenizer(tokenizer_json(), writer)
        writer.set_section("demo", {"seed": seed, "note": "random weights: the audio is noise, not speech",
                                    "version": DEMO_VERSION, "end_frames_per_text_id": end_frames_per_text_id})
        writer.finish()
    return out
