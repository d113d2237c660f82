"""`mossrt export` for a whole TTS bundle: graphs, tokenizer, manifest sections, and its errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

from conftest import GOLDEN


def mossrt(*args):
    return subprocess.run([sys.executable, "-m", "mossrt.cli", *map(str, args)], capture_output=True, text=True)


def test_export_full_bundle_cli(tmp_path):
    from export.demo import TOKENIZER_JSON

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(TOKENIZER_JSON, tok_dir / "tokenizer.json")
    proc = mossrt("export", "--model", GOLDEN / "checkpoints/tts", "--codec", GOLDEN / "checkpoints/codec",
                  "--tokenizer", tok_dir, "--out", tmp_path / "b", "--dtype", "fp16")
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert {"codec_encoder", "codec_decoder", "backbone", "depth", "sampling_filter"} <= set(m["graphs"])
    assert m["tts"]["dtype"] == "fp16" and m["codec"]["dtype"] == "fp16"
    assert m["tokenizer"]["special_ids"] == {"im_start": 151644, "im_end": 151645, "endoftext": 151643,
                                             "audio_pad": 151654, "text_pad": 151655}
    assert m["generation"]["sampling_defaults"] == {"temperature": 0.8, "top_p": 0.6, "top_k": 30,
                                                    "repetition_penalty": 1.1, "repetition_window": 50}
    assert "tokenizer.json" in m["files"]


def test_export_errors(tmp_path):
    proc = mossrt("export", "--out", tmp_path / "b")
    assert proc.returncode == 2 and "--codec" in proc.stderr
    proc = mossrt("export", "--model", GOLDEN / "checkpoints/tts", "--out", tmp_path / "b")  # no tokenizer.json there
    assert proc.returncode == 2 and "tokenizer.json" in proc.stderr
    proc = mossrt("export", "--model", tmp_path / "nowhere", "--out", tmp_path / "b")
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr


def test_int8_block_cli(tmp_path):
    """--int8-block 128 writes every int8 matmul weight (backbone, depth, codec decoder) in blocks of 128 and
    records it in the manifest; the default is 64; a bundle with no int8 weights refuses the option."""
    import onnx

    from export.demo import TOKENIZER_JSON

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(TOKENIZER_JSON, tok_dir / "tokenizer.json")
    common = ["--model", GOLDEN / "checkpoints/tts", "--codec", GOLDEN / "checkpoints/codec", "--tokenizer", tok_dir,
              "--dtype", "int8", "--codec-dtype", "int8"]
    for block, extra in ((128, ["--int8-block", "128"]), (64, [])):
        out = tmp_path / f"b{block}"
        proc = mossrt("export", *common, *extra, "--out", out)
        assert proc.returncode == 0, proc.stderr
        m = json.loads((out / "manifest.json").read_text())
        assert m["tts"]["int8_block"] == block and m["codec"]["int8_block"] == block
        for graph in ("backbone", "depth", "codec_decoder"):
            nodes = [n for n in onnx.load(str(out / f"{graph}.onnx"), load_external_data=False).graph.node
                     if n.op_type == "MatMulNBits"]
            blocks = {a.i for n in nodes for a in n.attribute if a.name == "block_size"}
            assert nodes and blocks == {block}, (graph, blocks)
    proc = mossrt("export", "--codec", GOLDEN / "checkpoints/codec", "--codec-dtype", "fp32", "--int8-block", "128",
                  "--out", tmp_path / "c")
    assert proc.returncode == 2 and "--int8-block" in proc.stderr and "Traceback" not in proc.stderr
    proc = mossrt("export", *common, "--int8-block", "96", "--out", tmp_path / "d")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_hub_id_needs_the_hub_extra(tmp_path):
    proc = mossrt("export", "--model", "OpenMOSS-Team/MOSS-TTS-Realtime", "--out", tmp_path / "b")
    # without the hub extra: how to get it; with it (no network here): the download error. Never a traceback.
    assert proc.returncode == 2 and "hub" in proc.stderr and "Traceback" not in proc.stderr


def test_sharded_bf16_tts_checkpoint(tmp_path):
    """A bf16 checkpoint split over shards (as published models often are) exports and runs; with
    bf16-rounded weights greedy decoding still follows the float32 goldens for its first frames."""
    import ml_dtypes
    from conftest import golden
    from safetensors.numpy import load_file, save_file

    from engine.model.tts import TTSModel
    from engine.offline.generate import generate
    from engine.runtime.bundle import Bundle
    from export.bundle import BundleWriter
    from export.codec_export import export_codec
    from export.demo import TOKENIZER_JSON
    from export.tokenizer_export import export_tokenizer
    from export.tts_export import export_tts

    ckpt = tmp_path / "tts"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "checkpoints/tts/config.json", ckpt)
    tensors = {k: v.astype(ml_dtypes.bfloat16)
               for k, v in load_file(GOLDEN / "checkpoints/tts/model.safetensors").items()}
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for fname, part in shards.items():
        save_file({k: tensors[k] for k in part}, ckpt / fname)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, part in shards.items() for k in part}}))
    writer = BundleWriter(tmp_path / "b")
    export_codec(GOLDEN / "checkpoints/codec", writer)
    export_tts(ckpt, writer)
    export_tokenizer(TOKENIZER_JSON, writer)
    writer.finish()
    model = TTSModel(Bundle(tmp_path / "b", device="cpu"))
    g = golden("tts/tts_text_only.npz")
    gen = generate(model, text_ids=g["text_ids"][:12], max_frames=3,
                   params=model.default_sampling(greedy=True, repetition_penalty=1.0))
    assert gen.codes.shape == (3, 16)
    assert (gen.codes[0] == g["greedy_codes"][0]).mean() >= 0.5


def test_compute_dtype_export_and_bf16_refused_on_cpu(tmp_path):
    """--compute-dtype is recorded in the manifest and sets the backbone's KV type; a bf16 bundle is refused on
    the CPU provider with a message naming CUDA (exit status 2), and verify prints each graph's node count."""
    from export.demo import TOKENIZER_JSON

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(TOKENIZER_JSON, tok_dir / "tokenizer.json")
    proc = mossrt("export", "--model", GOLDEN / "checkpoints/tts", "--codec", GOLDEN / "checkpoints/codec",
                  "--tokenizer", tok_dir, "--out", tmp_path / "b", "--dtype", "bf16", "--compute-dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["tts"]["dtype"] == "bf16" and m["tts"]["compute_dtype"] == "bf16"
    kv = [v for v in m["graphs"]["backbone"]["inputs"] if v["name"] == "past_key.0"][0]
    assert kv["dtype"] == "bfloat16"
    proc = mossrt("synth", "--bundle", tmp_path / "b", "--text", "hi", "--out", tmp_path / "o.wav", "--device", "cpu")
    assert proc.returncode == 2 and "CUDA" in proc.stderr and "--compute-dtype fp16" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = mossrt("verify", "--bundle", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"backbone +\d+ nodes", proc.stdout) and re.search(r"depth +[\d,]+ nodes", proc.stdout)
