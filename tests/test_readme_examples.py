"""The README's examples run as written (so they cannot rot): every code block of README.md is either run here,
against a real ``mossrt serve`` (the demo bundle, as the set-up starts it), or named below with why it is not
(a block in neither list fails the test). The only change made to a block is the server's port."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from service_helpers import Server
from test_elevenlabs_clients import client_python

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# blocks not run here, by how their first line begins, and why
NOT_RUN = {
    "python3 -m venv .venv && .venv/bin/pip install -e '.[cpu]' && .venv/bin/mossrt serve":
        "the set-up: the server these tests run is its `mossrt serve`, in the venv CI installs",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[cpu,test]' && .venv/bin/python -m pytest -q":
        "the test suite itself",
    "mossrt export --model /models/MOSS-TTS-Realtime --codec /models/MOSS-Audio-Tokenizer \\":
        "needs the upstream checkpoints (tests/test_export_cli.py exports random ones the same way)",
    "cd localai/moss-tts-realtime && make install": "needs LocalAI's local-ai binary (tests/test_localai.py "
                                                    "runs the backend with LocalAI's gRPC client)",
    "docker build -f docker/Dockerfile.cpu -t mossrt:cpu .": "needs podman/docker and helm (.ci/run builds and "
                                                             "runs the images and renders the chart)",
}
DIAGRAM = ""                 # a block with no language is a drawing, not an example


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README, in order."""
    return re.findall(r"^```(\w*)\n(.*?)\n```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def first_line(code: str) -> str:
    return code.splitlines()[0].strip()


def not_run(code: str) -> str | None:
    return next((k for k in NOT_RUN if first_line(code).startswith(k)), None)


def runner(lang: str, code: str) -> str | None:
    """Which python runs a block ("pipecat": its own venv, as tests/test_elevenlabs_clients.py), "bash", or None
    when it is not run here."""
    if lang == DIAGRAM or not_run(code):
        return None
    if lang == "bash":
        return "bash"
    if lang == "python":
        return "pipecat" if "pipecat" in code else "python"
    raise AssertionError(f"README block in {lang!r}: run it here or name it in NOT_RUN")


def test_every_block_is_run_or_said_why_not():
    seen = {not_run(code) for _, code in blocks()}
    assert set(NOT_RUN) <= seen, f"NOT_RUN names blocks the README no longer has: {set(NOT_RUN) - seen}"
    run = [runner(lang, code) for lang, code in blocks()]
    assert run.count("python") >= 3 and run.count("bash") >= 1 and "pipecat" in run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    with Server(None, tmp / "voices", tmp / "server.log") as s:
        yield s


RUN = [(lang, code) for lang, code in blocks() if runner(lang, code)]


@pytest.mark.parametrize("lang,code", RUN, ids=lambda v: first_line(v)[:40] if "\n" in v or len(v) > 12 else v)
def test_the_example_runs_as_written(server, tmp_path, lang, code):
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    how = runner(lang, code)
    if how == "bash":
        args = ["bash", "-euo", "pipefail", "-c", code]
    else:
        python = client_python("pipecat") if how == "pipecat" else Path(sys.executable)
        (tmp_path / "example.py").write_text(code, encoding="utf-8")
        args = [str(python), str(tmp_path / "example.py")]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    # what the examples say they write
    if "-o hello.wav" in code:
        info = sf.info(tmp_path / "hello.wav")
        assert info.samplerate == 24000 and info.frames > 0
    if '"hello.pcm"' in code:
        data = (tmp_path / "hello.pcm").read_bytes()
        assert data and len(data) % 2 == 0
    if '"stream.pcm"' in code:
        data = (tmp_path / "stream.pcm").read_bytes()
        assert data and len(data) % 3840 == 0
        assert proc.stdout.splitlines()[0] == "session.created"
