"""Shared fixtures: bundles exported once per test session from the golden tiny checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from fixture_pack import ensure_unpacked

FIXTURES = Path(__file__).parent / "fixtures"
# The goldens' checkpoints and arrays are tracked as one xz pack (small enough to travel to a GPU machine):
# unpacked, sha256-checked, into fixtures/set-a before any test module reads them.
ensure_unpacked()
# The provider the parity tests run on: cpu here and in CI; MOSSRT_TEST_DEVICE=cuda on a GPU machine
# (with onnxruntime-gpu) runs the same golden comparisons on the CUDA provider.
TEST_DEVICE = os.environ.get("MOSSRT_TEST_DEVICE", "cpu")
# The compute dtype (and weight storage) of the TTS bundles the engine tests run on: fp32 by default;
# fp16 or bf16 where the provider takes only those for attention (onnxruntime's CUDA GroupQueryAttention),
# as scripts/gpu-check sets it. Then the golden comparisons hold within REDUCED_PRECISION_TOLERANCE, and the
# comparisons of exact codes are skipped by `exact_codes`: greedy codes against the goldens (argmax flips under
# reduced precision), and one run's codes against another's with other batch rows or chunkings (onnxruntime's
# CPU fp16 MatMul gives a row other bits at M = 1 than at M = 2: measured 1 fp16 ulp on the depth head).
TEST_COMPUTE_DTYPE = os.environ.get("MOSSRT_TEST_COMPUTE_DTYPE", "fp32")
if TEST_COMPUTE_DTYPE not in ("fp32", "fp16", "bf16"):
    raise ValueError(f"MOSSRT_TEST_COMPUTE_DTYPE must be fp32, fp16 or bf16, not {TEST_COMPUTE_DTYPE!r}")
# Relative to max(1, max|ref|). Measured on the CPU provider at fp16: the largest hidden-state error of a
# two-turn prefill is 9e-4 of that; fp16's tolerance leaves 5x margin, and bf16 (8 significant bits to
# fp16's 11: 8x the rounding) as much again.
REDUCED_PRECISION_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 4e-2}[TEST_COMPUTE_DTYPE]
exact_codes = pytest.mark.skipif(TEST_COMPUTE_DTYPE != "fp32",
                                 reason=f"exact codes need fp32 compute (MOSSRT_TEST_COMPUTE_DTYPE="
                                        f"{TEST_COMPUTE_DTYPE})")
GOLDEN = FIXTURES / "set-a"


def golden(rel: str):
    return np.load(GOLDEN / rel)


def tolerance(ref: np.ndarray) -> float:
    """Float32 round-off bound from the golden README: 1e-4 * max(1, max|ref|)."""
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


def tts_tolerance(ref: np.ndarray) -> float:
    """The bound for what the TTS bundle computes (hidden states, audio from generated codes): tolerance()
    at fp32 compute, REDUCED_PRECISION_TOLERANCE * max(1, max|ref|) at MOSSRT_TEST_COMPUTE_DTYPE=fp16|bf16."""
    return REDUCED_PRECISION_TOLERANCE * max(1.0, float(np.abs(ref).max()))


@pytest.fixture(scope="session")
def demo_bundle_dir(tmp_path_factory) -> Path:
    """The built-in demo bundle without its end rule (tiny random weights that never end a turn early: a long
    text is a long stream, to its frame limit), for the service's bounds tests."""
    from export.demo import build_demo_bundle

    return build_demo_bundle(tmp_path_factory.mktemp("demo_bundle"), end_frames_per_text_id=None)


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
    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle

    return Codec(Bundle(codec_bundle_dir, device=TEST_DEVICE))


# ---------------------------------------------------------------------------------------------- TTS graphs
# Bundles of the MOSS-TTS-Realtime graphs (backbone, depth, sampling_filter) from the golden tiny checkpoint.
TTS_CHECKPOINT = GOLDEN / "checkpoints" / "tts"


def _export_tts_bundle(tmp_path_factory, dtype: str, compute_dtype: str) -> Path:
    from export.bundle import BundleWriter
    from export.tts_export import export_tts

    out = tmp_path_factory.mktemp(f"bundle_tts_{dtype}_{compute_dtype}")
    writer = BundleWriter(out)
    weights, _, block = dtype.partition("-b")               # "int8-b128": int8 in blocks of 128
    export_tts(TTS_CHECKPOINT, writer, dtype=weights, compute_dtype=compute_dtype, int8_block=int(block or 64))
    writer.finish()
    return out


@pytest.fixture(scope="session")
def tts_bundle_for(tmp_path_factory):
    """``tts_bundle_for(dtype, compute_dtype="fp32")``: the golden TTS checkpoint exported with that weight
    storage (``int8-b128``: int8 in blocks of 128) and compute dtype, once per session."""
    cache: dict[tuple[str, str], Path] = {}

    def get(dtype: str, compute_dtype: str = "fp32") -> Path:
        if (dtype, compute_dtype) not in cache:
            cache[dtype, compute_dtype] = _export_tts_bundle(tmp_path_factory, dtype, compute_dtype)
        return cache[dtype, compute_dtype]

    return get


@pytest.fixture(scope="session")
def tts_bundle_dir(tts_bundle_for) -> Path:
    return tts_bundle_for("fp32")


# ---------------------------------------------------------------------------------------------- full bundle
# Codec + TTS + tokenizer from the golden checkpoints: what the engine (generation, sessions) runs on.
def _export_full_bundle(tmp_path_factory, dtype: str = "fp32", compute_dtype: str = "fp32") -> Path:
    """Weights stored as dtype unless the compute dtype is reduced (then stored in it, as `fp16_model`)."""
    from export.bundle import BundleWriter
    from export.codec_export import export_codec
    from export.demo import TOKENIZER_JSON
    from export.tokenizer_export import export_tokenizer
    from export.tts_export import export_tts

    out = tmp_path_factory.mktemp(f"bundle_full_{dtype}_{compute_dtype}")
    writer = BundleWriter(out)
    export_codec(GOLDEN / "checkpoints" / "codec", writer)
    export_tts(GOLDEN / "checkpoints" / "tts", writer, dtype, compute_dtype=compute_dtype)
    export_tokenizer(TOKENIZER_JSON, writer)
    writer.finish()
    return out


@pytest.fixture(scope="session")
def full_bundle_dir(tmp_path_factory):
    """The engine tests' bundle, in MOSSRT_TEST_COMPUTE_DTYPE (fp32 unless set)."""
    return _export_full_bundle(tmp_path_factory, TEST_COMPUTE_DTYPE, TEST_COMPUTE_DTYPE)


@pytest.fixture(scope="session")
def fp32_bundle_dir(tmp_path_factory, full_bundle_dir):
    """The full golden bundle in fp32 compute whatever MOSSRT_TEST_COMPUTE_DTYPE says: for tests of what an fp32
    bundle is (its placement refusals on CUDA, its KV bytes), not of what it computes."""
    return full_bundle_dir if TEST_COMPUTE_DTYPE == "fp32" else _export_full_bundle(tmp_path_factory)


@pytest.fixture(scope="session")
def fp16_model(tmp_path_factory):
    """The full golden bundle with an fp16-compute backbone (fp16 weights, activations and KV)."""
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle

    return TTSModel(Bundle(_export_full_bundle(tmp_path_factory, "fp16", "fp16"), device=TEST_DEVICE))


@pytest.fixture(scope="session")
def model(full_bundle_dir):
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle

    return TTSModel(Bundle(full_bundle_dir, device=TEST_DEVICE))


@pytest.fixture(scope="session")
def fp32_model(fp32_bundle_dir, model):
    """``model`` in fp32 compute whatever MOSSRT_TEST_COMPUTE_DTYPE says (see ``fp32_bundle_dir``); on the CPU
    provider when the tests' own bundle is reduced-precision (CUDA refuses fp32 bundles)."""
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle

    return model if TEST_COMPUTE_DTYPE == "fp32" else TTSModel(Bundle(fp32_bundle_dir, device="cpu"))


def backbone_hidden(model, blocks: list[np.ndarray]) -> np.ndarray:
    """Feed row blocks [T, 17] one call each on a fresh KV slot; the hidden states of the last block."""
    pool = model.kv_pool(1, sum(len(b) for b in blocks) + 1)
    hidden = None
    for rows in blocks:
        hidden = model.run_backbone(rows[None], pool, 0, 1)[0]
        pool.lengths[0] += len(rows)
    return hidden
