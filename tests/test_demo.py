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
