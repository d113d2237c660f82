"""The built-in demo bundle: tiny random weights made from a seed, no download. Its audio is noise."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .bundle import BundleWriter
from .codec_export import export_codec
from .random_checkpoint import make_codec_checkpoint

DEMO_SEED = 20261129


def build_demo_bundle(out_dir: str | Path, seed: int = DEMO_SEED, progress=lambda msg: None) -> Path:
    """Write (deterministically from ``seed``) a demo bundle, labelled ``"demo": true`` in its manifest."""
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_codec_checkpoint(Path(tmp) / "codec", seed=seed, preset="tiny")
        writer = BundleWriter(out)
        export_codec(ckpt, writer, progress=progress)
        writer.set_section("demo", {"seed": seed, "note": "random weights: the audio is noise, not speech"})
        writer.finish()
    return out
