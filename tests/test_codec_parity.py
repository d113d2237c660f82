"""Codec parity with the upstream PyTorch goldens (set-a)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import golden, tolerance

SHORT, LONG = "codec/codec_short.npz", "codec/codec_long.npz"


def upstream_prefix(clip: str, frames: int) -> np.ndarray:
    """Upstream's one-pass 16-quantizer decode of the clip's codes, cut to its first ``frames`` frames: the
    decoder is causal, so that is also the golden for decoding just those frames (well inside the 10 s window)."""
    return golden(clip)["dec16_audio"][: frames * 1920]


def assert_matches(audio: np.ndarray, ref: np.ndarray) -> None:
    assert audio.shape == ref.shape
    assert np.abs(audio - ref).max() <= tolerance(ref)


@pytest.mark.parametrize("clip", [SHORT, LONG])
def test_encode_codes_identical(codec, clip):
    g = golden(clip)
    codes = codec.encode(g["wav"], 24000)
    assert codes.dtype == np.int64
    assert codes.shape == g["enc_codes"].T.shape  # ceil(N / 1920) frames, all 32 quantizers
    np.testing.assert_array_equal(codes, g["enc_codes"].T)


def test_encode_chunking_is_exact(codec):
    g = golden(LONG)
    np.testing.assert_array_equal(codec.encode(g["wav"], 24000, chunk_frames=7), g["enc_codes"].T)


@pytest.mark.parametrize("nq,key", [(32, "dec32_audio"), (16, "dec16_audio"), (8, "dec8_audio")])
def test_one_pass_decode(codec, nq, key):
    g = golden(SHORT)
    audio = codec.decode(g["enc_codes"].T, n_quantizers=nq)
    ref = g[key]
    assert audio.shape == ref.shape
    assert np.abs(audio - ref).max() <= tolerance(ref)


def test_long_one_pass_decode(codec):
    g = golden(LONG)
    audio = codec.decode(g["enc_codes"].T[:, :16])
    ref = g["dec16_audio"]
    assert audio.shape == ref.shape
    assert np.abs(audio - ref).max() <= tolerance(ref)


def _schedule_sizes(name: str, total: int) -> list[int]:
    if name.startswith("every"):
        n = int(name[5:])
        return [n] * (total // n) + ([total % n] if total % n else [])
    if name == "irregular":
        pattern, out = [1, 2, 7, 1, 5, 3, 11], []
        while sum(out) < total:
            out.append(min(pattern[len(out) % len(pattern)], total - sum(out)))
        return out
    if name == "straddle125":  # one chunk covering frames 120..131: crosses the 125-frame window
        return [60, 60, 12] + [total - 132]
    raise ValueError(name)


SCHEDULES = ["every1", "every3", "every6", "every8", "irregular"]


@pytest.mark.parametrize("clip,schedule", [(SHORT, s) for s in SCHEDULES] + [(LONG, s) for s in SCHEDULES]
                         + [(LONG, "straddle125")])  # the short clip has only 29 frames
def test_streaming_equals_one_pass(codec, clip, schedule):
    g = golden(clip)
    codes = g["enc_codes"].T[:, :16]
    ref = g["dec16_audio"]
    dec = codec.streaming_decoder(slots=1, n_quantizers=16)
    pieces, f = [], 0
    for n in _schedule_sizes(schedule, codes.shape[0]):
        piece = dec.decode(codes[f:f + n])
        assert piece.shape == (n * 1920,)  # audio for exactly these frames, at once
        pieces.append(piece)
        f += n
    audio = np.concatenate(pieces)
    assert np.abs(audio - ref).max() <= tolerance(ref)


def test_upstream_streaming_drift_is_not_reproduced(codec):
    """Upstream frame-by-frame streaming drifts after the 10 s window; ours stays on the one-pass decode."""
    g = golden(LONG)
    ref, upstream = g["dec16_audio"], g["stream16_frame_audio"]
    late = slice(125 * 1920, None)
    assert np.abs(upstream[late] - ref[late]).max() > 2 * tolerance(ref)  # the control can detect drift
    dec = codec.streaming_decoder(1, 16)
    audio = np.concatenate([dec.decode(g["enc_codes"].T[f:f + 1, :16]) for f in range(147)])
    assert np.abs(audio[late] - ref[late]).max() <= tolerance(ref)


def test_two_streams_in_one_batch_equal_separate_runs(codec):
    short, long = golden(SHORT), golden(LONG)
    a = long["enc_codes"].T[:29, :16]
    b = short["enc_codes"].T[:, :16]
    solo_a, solo_b = codec.decode(a, 16), codec.decode(b, 16)
    dec = codec.streaming_decoder(slots=2, n_quantizers=16)
    out = [dec.decode(np.stack([a[f:f + n], b[f:f + n]])) for f, n in ((0, 1), (1, 3), (4, 6), (10, 19))]
    audio = np.concatenate(out, axis=1)
    np.testing.assert_allclose(audio[0], solo_a, atol=tolerance(solo_a), rtol=0)
    np.testing.assert_allclose(audio[1], solo_b, atol=tolerance(solo_b), rtol=0)
    # and both against upstream: the long clip's first 29 frames, the short clip's whole decode
    assert_matches(audio[0], upstream_prefix(LONG, 29))
    assert_matches(audio[1], short["dec16_audio"])


def test_streams_at_different_positions(codec):
    """Resetting one stream of a batch leaves the other untouched; each still equals its solo decode."""
    g = golden(LONG)
    codes = g["enc_codes"].T[:, :16]
    dec = codec.streaming_decoder(slots=2, n_quantizers=16)
    first = dec.decode(np.stack([codes[0:5], codes[0:5]]))
    dec.reset(1)
    second = dec.decode(np.stack([codes[5:10], codes[0:5]]))
    assert list(dec.frame_positions) == [10, 5]
    solo = codec.decode(codes[:10], 16)
    np.testing.assert_allclose(np.concatenate([first[0], second[0]]), solo, atol=tolerance(solo), rtol=0)
    np.testing.assert_array_equal(second[1], first[1])
    assert_matches(np.concatenate([first[0], second[0]]), upstream_prefix(LONG, 10))
    assert_matches(first[1], upstream_prefix(LONG, 5))


def test_reset_gives_identical_audio(codec):
    codes = golden(SHORT)["enc_codes"].T[:, :16]
    dec = codec.streaming_decoder(1, 16)
    once = np.concatenate([dec.decode(codes[f:f + 3]) for f in range(0, 29, 3)])
    dec.reset()
    twice = np.concatenate([dec.decode(codes[f:f + 3]) for f in range(0, 29, 3)])
    np.testing.assert_array_equal(once, twice)


def test_streams_advance_by_their_own_counts(codec):
    """One call carries streams with different numbers of real frames: a rider (0 frames) keeps its state,
    a stream with fewer frames than the call advances by its own count, and all stay exact."""
    g = golden(LONG)
    codes = g["enc_codes"].T[:, :16]
    full = lambda c: codec.check_codes(c, 16)[0]
    dec = codec.streaming_decoder(slots=3, n_quantizers=16)
    pieces = [[], [], []]
    plan = [(3, 1, 0), (3, 3, 2), (1, 0, 3), (3, 2, 1)]   # real frames per stream per call (call size = max)
    pos = [0, 0, 0]
    for counts in plan:
        n = max(counts)
        batch = np.zeros((3, n, codec.num_quantizers), np.int64)
        for s, k in enumerate(counts):
            if k:
                batch[s, :k] = full(codes[pos[s]:pos[s] + k])
        audio = dec.decode_checked(batch, np.array(counts))
        for s, k in enumerate(counts):
            pieces[s].append(audio[s, : k * 1920])
            pos[s] += k
    assert list(dec.frame_positions) == pos
    for s in range(3):
        solo = codec.decode(codes[: pos[s]], 16)
        np.testing.assert_allclose(np.concatenate(pieces[s]), solo, atol=tolerance(solo), rtol=0)
        assert_matches(np.concatenate(pieces[s]), upstream_prefix(LONG, pos[s]))


def test_decoder_is_written_with_fused_ops(codec_bundle_dir):
    """Each decoder layer is LayerNorm / SkipLayerNormalization, RotaryEmbedding, MultiHeadAttention over the
    ring and the new rows, and one GELU node: no op-by-op attention, RoPE or erf left (419 nodes before on
    this checkpoint; on a GPU every node is a launch)."""
    import json

    import onnx

    nodes = onnx.load(str(codec_bundle_dir / "codec_decoder.onnx"), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    stages = json.loads((codec_bundle_dir / "manifest.json").read_text())["codec"]["spec"]["decoder"]
    layers = sum(s["layers"] for s in stages)
    assert ops.count("MultiHeadAttention") == ops.count("Gelu") == layers
    assert ops.count("RotaryEmbedding") == 2 * layers
    assert not {"Softmax", "Erf"} & set(ops)
    assert ops.count("Cos") == len(stages)                                  # one rotary table per stage
    # per stage one Concat of the ring's and the new rows' positions and one of the presents (reshaped by a
    # constant shape); outputs are their producing nodes' own values (no Identity)
    assert ops.count("Concat") == 2 * len(stages) and "Identity" not in ops
    assert len(nodes) <= 189, len(nodes)


# ---------------------------------------------------------------------------------------------- codec dtypes
# The agreement docs/export.md states for each codec dtype against the fp32 codec on set-a (one-pass decode
# of the golden codes at 16 quantizers; the encoder's codes of the golden waveform). Measured: int8 35.6 /
# 35.1 dB, log-mel 0.060 / 0.061 dB, codes 100 %; fp16 65.2 / 64.9 dB, 0.002 dB, codes 100 % / 98.7 %.
CODEC_DTYPE_FLOORS = {  # dtype: (min SNR dB, max log-mel distance dB, min share of equal encoder codes)
    "int8": (34.0, 0.08, 1.0),
    "int8-b128": (34.0, 0.08, 1.0),     # --int8-block 128: measured 34.9 / 34.6 dB, 0.065 / 0.064 dB
    "fp16": (60.0, 0.01, 0.98),
}


@pytest.fixture(scope="module")
def codec_of(tmp_path_factory):
    """dtype -> the set-a codec exported with that ``--codec-dtype`` (each exported once)."""
    from conftest import GOLDEN, TEST_DEVICE

    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle
    from export.bundle import BundleWriter
    from export.codec_export import export_codec

    made = {}

    def get(dtype: str) -> Codec:
        if dtype not in made:
            out = tmp_path_factory.mktemp(f"bundle_codec_{dtype}")
            writer = BundleWriter(out)
            weights, _, block = dtype.partition("-b")       # "int8-b128": int8 in blocks of 128
            export_codec(GOLDEN / "checkpoints" / "codec", writer, weights, int8_block=int(block or 64))
            writer.finish()
            made[dtype] = Codec(Bundle(out, device=TEST_DEVICE))
        return made[dtype]

    return get


@pytest.mark.parametrize("dtype", sorted(CODEC_DTYPE_FLOORS))
@pytest.mark.parametrize("clip", [SHORT, LONG])
def test_codec_dtype_agreement_with_fp32(codec, codec_of, dtype, clip):
    from export.codec_agreement import decode_agreement, encode_agreement

    other = codec_of(dtype)
    min_snr, max_mel, min_codes = CODEC_DTYPE_FLOORS[dtype]
    g = golden(clip)
    dec = decode_agreement(codec, other, g["enc_codes"].T, 16)
    assert dec["snr_db"] >= min_snr and dec["log_mel_db"] <= max_mel, (dtype, dec)
    enc = encode_agreement(codec, other, g["wav"], 24000)
    assert enc["codes_equal"] >= min_codes, (dtype, enc)


def test_int8_codec_decoder_reads_int8_weights(codec_bundle_dir, codec_of):
    """The int8 codec decoder's matmuls read packed int8 weights (MatMulNBits), its dequant table is
    gathered from fp16 rows, and its encoder is the fp32 one; every node keeps a CUDA kernel."""
    import onnx

    from engine.runtime.graph_stats import weight_bytes_per_call
    from engine.runtime.placement import unplaced

    other = codec_of("int8")
    path = other.bundle.file_path(other.bundle.info.graphs["codec_decoder"].file)
    model = onnx.load(str(path), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops and "DequantizeLinear" not in ops
    fp32 = onnx.load(str(codec_bundle_dir / "codec_decoder.onnx"), load_external_data=False)
    assert weight_bytes_per_call(model) < 0.4 * weight_bytes_per_call(fp32)
    assert unplaced(model, "cuda") == [] and unplaced(model, "cpu") == []
    enc = other.bundle.file_path(other.bundle.info.graphs["codec_encoder"].file)
    assert "MatMulNBits" not in {n.op_type for n in onnx.load(str(enc), load_external_data=False).graph.node}
