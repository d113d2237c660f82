"""The built-in demo bundle is deterministic, labelled, and runs end to end through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import soundfile as sf


def test_demo_bundle_is_deterministic_and_labelled(tmp_path):
    from export.demo import build_demo_bundle

    a = json.loads((build_demo_bundle(tmp_path / "a") / "manifest.json").read_text())
    b = json.loads((build_demo_bundle(tmp_path / "b") / "manifest.json").read_text())
    assert a["files"] == b["files"]  # same bytes, same hashes
    assert a["demo"]["note"].startswith("random weights")


def test_demo_command(tmp_path):
    env = dict(os.environ, MOSSRT_DEMO_DIR=str(tmp_path / "demo"))
    out = tmp_path / "demo.wav"
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "demo", "--out", str(out), "--device", "cpu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "expect noise" in proc.stdout
    info = sf.info(out)
    assert info.samplerate == 24000 and info.frames == 25 * 1920  # random weights: runs to the frame limit
    manifest = json.loads((tmp_path / "demo" / "manifest.json").read_text())
    assert {"codec_encoder", "codec_decoder", "backbone", "depth"} <= set(manifest["graphs"])


def test_synth_on_demo_bundle_says_it_is_a_demo(tmp_path):
    from export.demo import build_demo_bundle

    bundle = build_demo_bundle(tmp_path / "demo")
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "synth", "--bundle", str(bundle), "--text", "Hi there.",
                           "--out", str(tmp_path / "o.wav"), "--max-frames", "3", "--seed", "1", "--device", "cpu"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "demo bundle" in proc.stderr and "noise" in proc.stderr
    assert sf.info(tmp_path / "o.wav").frames == 3 * 1920


def _demo_env(tmp_path):
    return dict(os.environ, MOSSRT_DEMO_DIR=str(tmp_path / "demo"))


def test_synth_without_bundle_uses_the_demo_bundle_and_its_turn_ends_near_its_text(tmp_path):
    """As ``mossrt serve``: no --bundle is the demo bundle; its random model's turn ends by the manifest's end
    rule (the log says so), at 3.5 frames per text token, not at the frame limit (60 + 10 per token)."""
    import math

    from tokenizers import Tokenizer

    from export.demo import END_FRAMES_PER_TEXT_ID, TOKENIZER_JSON

    text = "Three short words."
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "synth", "--text", text, "--out",
                           str(tmp_path / "o.wav"), "--seed", "1", "--device", "cpu"],
                          capture_output=True, text=True, env=_demo_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "demo bundle" in proc.stderr and "end rule" in proc.stderr and "stopped at EOS" in proc.stderr
    ids = len(Tokenizer.from_file(str(TOKENIZER_JSON)).encode(text, add_special_tokens=False).ids)
    assert sf.info(tmp_path / "o.wav").frames == math.ceil(END_FRAMES_PER_TEXT_ID * ids) * 1920


def test_the_end_rule_is_the_demo_manifests_and_nothing_else(tmp_path, model):
    """The same demo bundle without the manifest's rule runs to its frame limit; a real bundle (no demo
    section) has no rule."""
    import shutil

    from engine.model.tts import TTSModel
    from engine.offline.generate import generate
    from engine.runtime.bundle import Bundle
    from export.demo import build_demo_bundle

    assert model.demo_end_frames_per_text_id is None and not model.bundle.is_demo
    demo = build_demo_bundle(tmp_path / "demo")
    ruled = generate(TTSModel(Bundle(demo, device="cpu")), text="Hi there.", seed=1)
    assert ruled.stopped_on_eos
    plain_dir = tmp_path / "plain"
    shutil.copytree(demo, plain_dir)
    manifest = json.loads((plain_dir / "manifest.json").read_text())
    del manifest["demo"]["end_frames_per_text_id"]
    (plain_dir / "manifest.json").write_text(json.dumps(manifest))
    unruled = build_demo_bundle(tmp_path / "unruled", end_frames_per_text_id=None)   # the bounds tests' bundle
    assert json.loads((unruled / "manifest.json").read_text())["demo"]["end_frames_per_text_id"] is None
    plain = generate(TTSModel(Bundle(plain_dir, device="cpu")), text="Hi there.", seed=1, max_frames=40)
    assert not plain.stopped_on_eos and plain.codes.shape[0] == 40
    assert ruled.codes.shape[0] < 40
    # up to its end the ruled turn is the model's own: the rule only replaces the last frame by EOS
    assert (plain.raw_frames[:ruled.codes.shape[0]] == ruled.codes).all()


def test_an_older_demo_bundle_is_rebuilt(tmp_path):
    from export.demo import DEMO_VERSION, build_demo_bundle
    from mossrt.commands import ensure_demo_bundle

    path = build_demo_bundle(tmp_path / "demo")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["demo"] = {"seed": manifest["demo"]["seed"], "note": manifest["demo"]["note"]}    # version 1's
    (path / "manifest.json").write_text(json.dumps(manifest))
    ensure_demo_bundle(path)
    assert json.loads((path / "manifest.json").read_text())["demo"]["version"] == DEMO_VERSION
