"""Voice-agent frameworks, unmodified, against a real ``mossrt serve`` through the ElevenLabs-compatible API.

pipecat pins protobuf<7 (we need >=7.35.1), so it runs from its own venv: ``$MOSSRT_PIPECAT_VENV``, else
``.venv-pipecat`` in the repository, created here from tests/clients/requirements-pipecat.txt when missing
(CI creates it on its first run; the test never skips)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service_helpers import PCM_TOLERANCE, Server, native_ws_turns, pcm16

REPO = Path(__file__).resolve().parents[1]
CLIENTS = Path(__file__).parent / "clients"
FIRST = "Welcome to the world of MOSS TTS Realtime. Experience how text transforms into smooth, human-like speech."
SCRIPT = {
    "first": [FIRST[i:i + 5] for i in range(0, len(FIRST), 5)],           # LLM tokens
    "second": ["And ", "a ", "second ", "one."],
    "long": [w + " " for w in ("The quick brown fox jumps over the lazy dog and keeps on talking " * 10).split()],
    "after": ["Sorry, ", "go ", "on."],
}


def client_python(name: str) -> Path:
    venv = Path(os.environ.get(f"MOSSRT_{name.upper()}_VENV") or REPO / f".venv-{name}")
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(CLIENTS / f"requirements-{name}.txt")],
                       check=True, timeout=1800)
    return python


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_agents")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2",
                env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        yield s


def metric(server, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(server.base + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no metric {name}")


def test_pipecat_elevenlabs_tts_service(server, tmp_path):
    """pipecat's ElevenLabsTTSService(url=ws://...) speaks two token-streamed bot utterances (two turns of one
    conversation: PCM equal to our WebSocket's two turns), then one interrupted after its first audio
    (the server stops it, and speaks the next utterance on the same socket). Word timestamps in order."""
    python = client_python("pipecat")
    out = tmp_path / "pipecat.json"
    frames_before = metric(server, "mossrt_frames_generated_total")
    proc = subprocess.run([str(python), str(CLIENTS / "pipecat_elevenlabs.py"), server.base.replace("http", "ws"),
                           str(out)], input=json.dumps(SCRIPT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    frames = metric(server, "mossrt_frames_generated_total") - frames_before
    utterances = json.loads(out.read_text())["utterances"]
    assert len(utterances) == 4, [len(u["words"]) for u in utterances]
    first, second, interrupted, after = utterances
    ref = asyncio.run(native_ws_turns(server, [SCRIPT["first"], SCRIPT["second"]]))
    for got, want in ((first, ref[0]), (second, ref[1])):
        a, b = pcm16(base64.b64decode(got["pcm"])), pcm16(want)
        assert got["rate"] == 24000 and a.shape == b.shape and np.abs(a - b).max() <= PCM_TOLERANCE
    for u, tokens in ((first, SCRIPT["first"]), (second, SCRIPT["second"]), (after, SCRIPT["after"])):
        words = [w for w, _ in u["words"]]
        assert words == "".join(tokens).split()
        times = [t for _, t in u["words"]]
        assert times == sorted(times)
    # the interrupted utterance: some audio, far less than its text would take, and nothing generated for it
    # after the interruption beyond what pipecat already had (the whole run's frames are the four turns')
    spoken = sum(len(base64.b64decode(u["pcm"])) // 3840 for u in (first, second, after))
    assert 0 < len(base64.b64decode(interrupted["pcm"])) // 3840 < len(SCRIPT["long"])
    assert frames - spoken - 3 < len(SCRIPT["long"]) // 2     # (+1 EOS frame per finished turn)
    assert metric(server, "mossrt_generating_streams") == 0


def test_livekit_plugins_elevenlabs_stream(server):
    """livekit-plugins-elevenlabs' streaming TTS (base_url=http://.../v1, its default word tokenizer and
    inactivity timeout): the PCM equals our WebSocket's for the words it sends, its timed transcript is in
    order and covers the text."""
    import aiohttp
    from livekit.plugins import elevenlabs

    async def run():
        async with aiohttp.ClientSession() as session:
            tts = elevenlabs.TTS(voice_id="default", api_key="unused-key", base_url=server.base + "/v1",
                                 encoding="pcm_24000", http_session=session)
            stream = tts.stream()
            for token in SCRIPT["first"]:
                stream.push_text(token)
            stream.end_input()
            pcm, words = b"", []
            async for ev in stream:
                pcm += bytes(ev.frame.data)
            await stream.aclose()
            await tts.aclose()
            return pcm, words

    pcm, _ = asyncio.run(run())
    sent = [w + " " for w in FIRST.split()]           # livekit sends words, each ending with a space
    ref = asyncio.run(native_ws_turns(server, [sent]))[0]
    a, b = pcm16(pcm), pcm16(ref)
    assert a.shape == b.shape and np.abs(a - b).max() <= PCM_TOLERANCE


def test_elevenlabs_sdk_http(server):
    """The elevenlabs SDK (base_url=http://...) over HTTP: convert and stream give the PCM of our WebSocket
    for the text, stream_with_timestamps' alignment covers it in order, voices list ``default``; an unknown
    voice is the SDK's ApiError with ElevenLabs' detail. (Its realtime WebSocket helper forces wss://, so it
    cannot reach a plain-HTTP server: the WebSocket routes are proven with pipecat and livekit above.)"""
    from elevenlabs import ElevenLabs
    from elevenlabs.core.api_error import ApiError

    client = ElevenLabs(api_key="unused-key", base_url=server.base)
    ref = pcm16(asyncio.run(native_ws_turns(server, [[FIRST]]))[0])
    for call in (client.text_to_speech.convert, client.text_to_speech.stream):
        got = pcm16(b"".join(call("default", text=FIRST, output_format="pcm_24000")))
        assert got.shape == ref.shape and np.abs(got - ref).max() <= PCM_TOLERANCE, call
    chunks = list(client.text_to_speech.stream_with_timestamps("default", text=FIRST, output_format="pcm_24000"))
    got = pcm16(b"".join(base64.b64decode(c.audio_base_64) for c in chunks if c.audio_base_64))
    assert got.shape == ref.shape and np.abs(got - ref).max() <= PCM_TOLERANCE
    chars, starts, ends = [], [], []
    for c in chunks:
        if c.alignment:
            chars += c.alignment.characters
            starts += c.alignment.character_start_times_seconds
            ends += c.alignment.character_end_times_seconds
    assert "".join(chars) == FIRST and starts == sorted(starts)
    assert all(s <= e for s, e in zip(starts, ends)) and ends[-1] <= len(ref) / 24000
    whole = client.text_to_speech.convert_with_timestamps("default", text=FIRST, output_format="pcm_24000")
    assert "".join(whole.alignment.characters) == FIRST
    assert [v.voice_id for v in client.voices.get_all().voices][:1] == ["default"]
    with pytest.raises(ApiError) as e:
        b"".join(client.text_to_speech.convert("no-such-voice", text=FIRST, output_format="pcm_24000"))
    assert e.value.status_code == 400 and e.value.body["detail"]["status"] == "voice_not_found"
    with pytest.raises(ApiError) as e:
        b"".join(client.text_to_speech.convert("default", text=FIRST, output_format="wav_1"))
    assert e.value.body["detail"]["status"] == "invalid_output_format"
