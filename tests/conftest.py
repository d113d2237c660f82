"""Shared fixtures: bundles exported once per test session from the golden tiny checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "set-a"


def golden(rel: str):
    return np.load(GOLDEN / rel)


def tolerance(ref: np.ndarray) -> float:
    """Float32 round-off bound from the golden README: 1e-4 * max(1, max|ref|)."""
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.fixture(scope="session")
def codec_bundle_dir(tmp_path_factory) -> Path:
    from export.bundle import BundleWriter
    from export.codec_export import export_codec

    out = tmp_path_factory.mktemp("bundle_codec")
    writer = BundleWriter(out)
    export_codec(GOLDEN / "checkpoints" / "codec", writer)
    writer.finish()
    return out


@pytest.fixture(scope="session")
def codec(codec_bundle_dir):
    from engine.bundle import Bundle
    from engine.codec import Codec

    return Codec(Bundle(codec_bundle_dir, device="cpu"))
