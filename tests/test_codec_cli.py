"""The codec CLI forms scripts rely on, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from conftest import GOLDEN, golden, tolerance

from engine.audio.codec import MAX_FRAMES_PER_CALL
from engine.runtime.manifest import FORMAT_VERSION


def mossrt(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", *map(str, args)], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"mossrt {args} failed:\n{proc.stderr}")
    return proc


def test_manifest_lists_graphs_and_hashes(codec_bundle_dir, tmp_path):
    import hashlib

    m = json.loads((codec_bundle_dir / "manifest.json").read_text())
    assert m["format"] == "mossrt-bundle" and m["format_version"] == FORMAT_VERSION
    assert set(m["graphs"]) >= {"codec_encoder", "codec_decoder"}
    dec = m["graphs"]["codec_decoder"]
    names = [i["name"] for i in dec["inputs"]]
    assert names[:3] == ["codes", "n_quantizers", "frame_pos"]
    assert {"codec_decoder.onnx", "codec_decoder.onnx.data"} <= set(m["files"])
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    assert m["codec"]["source_config"]["downsample_rate"] == 1920
    # every file of the directory is listed with its real size and hash (computed here, independently)
    on_disk = {p.name for p in codec_bundle_dir.iterdir() if p.name != "manifest.json"}
    assert set(m["files"]) == on_disk
    for name, entry in m["files"].items():
        data = (codec_bundle_dir / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    # and verify catches a same-size corruption that the size check at load cannot see
    copy = tmp_path / "b"
    shutil.copytree(codec_bundle_dir, copy)
    data = bytearray((copy / "codec_decoder.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "codec_decoder.onnx.data").write_bytes(bytes(data))
    ok, bad = mossrt("verify", "--bundle", codec_bundle_dir), mossrt("verify", "--bundle", copy, check=False)
    assert "every sha256 matches" in ok.stdout
    assert bad.returncode == 2 and "codec_decoder.onnx.data does not match its manifest checksum" in bad.stderr


def test_encode_decode_round_trip_cli(codec_bundle_dir, tmp_path):
    g = golden("codec/codec_short.npz")
    wav = tmp_path / "in.wav"
    sf.write(wav, g["wav"], 24000, subtype="FLOAT")
    codes_path = tmp_path / "codes.npy"
    mossrt("codec", "encode", "--bundle", codec_bundle_dir, wav, codes_path)
    codes = np.load(codes_path)
    assert codes.dtype == np.int64 and codes.shape == (29, 32)
    np.testing.assert_array_equal(codes, g["enc_codes"].T)
    np.save(tmp_path / "c16.npy", codes[:, :16])
    ref = g["dec16_audio"]
    for extra in ([], ["--chunk-frames", "3"], ["--schedule", "1,2,7"]):
        out = tmp_path / f"out{len(extra)}.wav"
        mossrt("codec", "decode", "--bundle", codec_bundle_dir, tmp_path / "c16.npy", out, *extra)
        audio, sr = sf.read(out, dtype="float32")
        info = sf.info(out)
        assert sr == 24000 and info.subtype == "FLOAT"
        assert np.abs(audio - ref).max() <= tolerance(ref)
    # all 32 columns with --n-quantizers 8 and 16-bit output
    out = tmp_path / "nq8.wav"
    mossrt("codec", "decode", "--bundle", codec_bundle_dir, codes_path, out, "--n-quantizers", "8", "--pcm16")
    assert sf.info(out).subtype == "PCM_16"
    audio, _ = sf.read(out, dtype="float32")
    assert np.abs(audio - np.clip(g["dec8_audio"], -1, 1)).max() < 1e-3


def test_resampled_stereo_input(codec):
    g = golden("codec/codec_short.npz")
    stereo = np.stack([g["wav"], g["wav"]], axis=1)
    codes = codec.encode(stereo, 24000)
    np.testing.assert_array_equal(codes, g["enc_codes"].T)
    import soxr
    at16k = soxr.resample(g["wav"], 24000, 16000)
    assert codec.encode(at16k, 16000).shape[0] == -(-round(at16k.size * 1.5) // 1920)


@pytest.mark.parametrize("codes,flags,message", [
    (np.full((4, 16), 1024), [], "0..1023"),
    (np.full((4, 16), -1), [], "0..1023"),
    (np.zeros((2, 4, 16), np.int64), [], "rank 2"),
    (np.zeros((0, 16), np.int64), [], "zero frames"),
    (np.zeros((4, 16), np.int64), ["--n-quantizers", "0"], "1..32"),
    (np.zeros((4, 16), np.int64), ["--n-quantizers", "33"], "1..32"),
    (np.zeros((4, 8), np.int64), ["--n-quantizers", "16"], "n_quantizers=16"),
    (np.zeros((4, 16), np.float32), [], "integers"),
])
def test_decode_rejects_bad_codes(codec_bundle_dir, tmp_path, codes, flags, message):
    path = tmp_path / "bad.npy"
    np.save(path, codes)
    proc = mossrt("codec", "decode", "--bundle", codec_bundle_dir, path, tmp_path / "o.wav", *flags, check=False)
    assert proc.returncode == 2
    assert "error" in proc.stderr and message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("content", [b"", b"this is not audio at all" * 10])
def test_encode_rejects_non_audio(codec_bundle_dir, tmp_path, content):
    path = tmp_path / "x.wav"
    path.write_bytes(content)
    proc = mossrt("codec", "encode", "--bundle", codec_bundle_dir, path, tmp_path / "c.npy", check=False)
    assert proc.returncode == 2 and "not a readable audio file" in proc.stderr


def test_encode_rejects_empty_audio(codec_bundle_dir, tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), 24000)
    proc = mossrt("codec", "encode", "--bundle", codec_bundle_dir, path, tmp_path / "c.npy", check=False)
    assert proc.returncode == 2 and "no samples" in proc.stderr


def test_export_fails_on_missing_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "checkpoints/codec/config.json", ckpt)
    tensors = load_file(GOLDEN / "checkpoints/codec/model.safetensors")
    del tensors["decoder.2.transformer.layers.0.linear1.weight"]
    del tensors["quantizer.quantizers.3.codebook.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    proc = mossrt("export", "--codec", ckpt, "--out", tmp_path / "b", check=False)
    assert proc.returncode == 2
    assert "decoder.2.transformer.layers.0.linear1.weight" in proc.stderr
    assert "quantizer.quantizers.3.codebook.weight" in proc.stderr


def test_export_fails_on_unmapped_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "checkpoints/codec/config.json", ckpt)
    tensors = load_file(GOLDEN / "checkpoints/codec/model.safetensors")
    tensors["decoder.9.surprise.weight"] = np.zeros(3, np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    proc = mossrt("export", "--codec", ckpt, "--out", tmp_path / "b", check=False)
    assert proc.returncode == 2 and "unmapped tensors: decoder.9.surprise.weight" in proc.stderr


def test_sharded_bf16_checkpoint_exports(tmp_path):
    """Sharded safetensors with bfloat16 tensors load (widened to float32) and export."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle
    from export.bundle import BundleWriter
    from export.codec_export import export_codec

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "checkpoints/codec/config.json", ckpt)
    tensors = {k: v.astype(ml_dtypes.bfloat16)
               for k, v in load_file(GOLDEN / "checkpoints/codec/model.safetensors").items()}
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, ckpt / "a.safetensors")
    save_file({k: tensors[k] for k in names[half:]}, ckpt / "b.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: ("a.safetensors" if i < half else "b.safetensors") for i, k in enumerate(names)}}))
    writer = BundleWriter(tmp_path / "bundle")
    export_codec(ckpt, writer)
    writer.finish()
    codec = Codec(Bundle(tmp_path / "bundle", device="cpu"))
    g = golden("codec/codec_short.npz")
    audio = codec.decode(g["enc_codes"].T[:, :16])
    # bf16 weights: the same graph, only weight rounding differs from the float32 golden
    assert audio.shape == g["dec16_audio"].shape
    assert np.corrcoef(audio, g["dec16_audio"])[0, 1] > 0.99


def test_fp16_codec_bundle(tmp_path):
    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle
    from export.bundle import BundleWriter
    from export.codec_export import export_codec

    writer = BundleWriter(tmp_path / "b16")
    export_codec(GOLDEN / "checkpoints/codec", writer, dtype="fp16")
    writer.finish()
    codec = Codec(Bundle(tmp_path / "b16", device="cpu"))
    g = golden("codec/codec_short.npz")
    ref = g["dec16_audio"]
    audio = codec.decode(g["enc_codes"].T[:, :16])
    snr = 10 * np.log10(np.sum(ref ** 2) / np.sum((audio - ref) ** 2))
    assert snr > 40, snr


def test_bench_codec_reports_consistent_figures(codec_bundle_dir, tmp_path):
    proc = mossrt("bench", "codec", "--bundle", codec_bundle_dir, "--frames", "6", "--repeats", "1",
                  "--json", tmp_path / "b.json", "--profile", tmp_path / "prof")
    r = json.loads((tmp_path / "b.json").read_text())
    assert set(r["streaming"]) == {"1", "3", "6"} and r["frames"] == 6
    spec = json.loads((codec_bundle_dir / "manifest.json").read_text())["codec"]["spec"]["decoder"]
    rings = sum(s["layers"] * 2 * s["heads"] * (s["context"] - 1) * s["head_dim"] * 4 for s in spec)
    assert r["kv_bytes_per_stream"] == rings                      # the rings of one stream, all stages
    one = r["one_pass_ms_per_frame"]
    assert one > 0 and r["encode_ms_per_frame"] > 0
    for n, s in r["streaming"].items():
        assert s["ms_per_frame"] > 0 and 0 <= s["host_share"] < 1
        assert abs(s["ratio_to_one_pass"] - s["ms_per_frame"] / one) < 1e-9
        assert abs(s["realtime_factor"] - s["ms_per_frame"] / 80) < 1e-9
    assert f"{r['one_pass_ms_per_frame']:9.2f} ms/frame" in proc.stdout
    # the profile names the codec's modules (node names follow the module path)
    assert list((tmp_path / "prof").glob("codec_decoder*.json")) and "top modules" in proc.stdout
    assert "decoder." in proc.stdout.split("top modules")[1]


def test_bundle_errors(tmp_path):
    from engine.errors import BundleError
    from engine.runtime.bundle import Bundle

    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle(tmp_path, device="cpu")
    proc = mossrt("codec", "decode", "--bundle", tmp_path, tmp_path / "x.npy", tmp_path / "y.wav", check=False)
    assert proc.returncode == 2 and "not a bundle" in proc.stderr


def test_cli_usage_errors(codec_bundle_dir, tmp_path):
    np.save(tmp_path / "c.npy", np.zeros((3, 16), np.int64))
    cases = [
        (("codec", "decode", "--bundle", codec_bundle_dir, tmp_path / "c.npy", tmp_path / "missing" / "o.wav"),
         "does not exist"),
        (("bench", "codec", "--bundle", codec_bundle_dir, "--repeats", "0"), "--repeats: must be an integer in 1..100"),
        (("make-checkpoint", "codec", "--preset", "tiny", "--seed", "-1", "--out", tmp_path / "ck"), "--seed"),
        (("codec", "decode", "--bundle", codec_bundle_dir, tmp_path / "c.npy", tmp_path / "o.wav", "--threads", "-2"),
         "threads"),
        (("codec", "decode", "--bundle", codec_bundle_dir, tmp_path / "c.npy", tmp_path / "o.wav", "--schedule", "1,x"),
         "--schedule"),
        (("codec", "decode", "--bundle", codec_bundle_dir, tmp_path / "nope.npy", tmp_path / "o.wav"),
         "not a readable"),
    ]
    for args, message in cases:
        proc = mossrt(*args, check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_long_decode_is_chunked(codec):
    """Without a schedule, long code files go through calls of at most MAX_FRAMES_PER_CALL frames (the
    audio is the same for any chunking); a size beyond the bound is refused."""
    g = golden("codec/codec_long.npz")
    codes = np.tile(g["enc_codes"].T[:, :16], (4, 1))          # 588 frames: more than two full calls
    dec = codec.streaming_decoder(1, 16)
    a = codec.decode(codes, 16, decoder=dec)
    assert dec.timing.calls == -(-len(codes) // MAX_FRAMES_PER_CALL) == 3
    b = codec.decode(codes, 16, max_frames_per_call=100)
    assert np.abs(a - b).max() <= tolerance(b)
    ref = g["dec16_audio"]
    assert np.abs(a[: ref.size] - ref).max() <= tolerance(ref)
    with pytest.raises(Exception, match="chunk sizes must be integers in 1..250"):
        codec.decode(codes, 16, max_frames_per_call=10**9)
