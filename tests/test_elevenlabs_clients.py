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

from app.alignment.clock import ALPHABETIC_CPS, RATE_BOUNDS

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
    """The Python of a client's own venv, made on first use. Two test runs at once (fp32 and fp16 side by side)
    share it: the first builds it under a lock, the other waits for it, and a venv whose install did not finish
    (no ``.installed`` mark) is built again."""
    import fcntl
    import shutil

    venv = Path(os.environ.get(f"MOSSRT_{name.upper()}_VENV") or REPO / f".venv-{name}")
    python, done = venv / "bin" / "python", venv / ".installed"
    if python.exists() and (done.exists() or os.environ.get(f"MOSSRT_{name.upper()}_VENV")):
        return python
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        unpinned = CLIENTS / f"requirements-{name}-nodeps.txt"     # a client whose own pins are not installed
        if unpinned.exists():
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(unpinned)], check=True,
                           timeout=1800)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(CLIENTS / f"requirements-{name}.txt")],
                       check=True, timeout=1800)
        done.touch()
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
    conversation: PCM equal to our WebSocket's two turns), then one interrupted while the LLM still writes and
    one interrupted after it finished (flush and close_context sent: the interruption is a second
    close_context); the server stops both, and speaks the utterance between on the same socket. Word
    timestamps in order; for an interrupted utterance the words pipecat reports are a prefix of its text,
    all within the audio it had received by the interruption, and none come after it."""
    python = client_python("pipecat")
    out = tmp_path / "pipecat.json"
    frames_before = metric(server, "mossrt_frames_generated_total")
    proc = subprocess.run([str(python), str(CLIENTS / "pipecat_elevenlabs.py"), server.base.replace("http", "ws"),
                           str(out)], input=json.dumps(SCRIPT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    frames = metric(server, "mossrt_frames_generated_total") - frames_before
    utterances = json.loads(out.read_text())["utterances"]
    assert len(utterances) == 5, [len(u["words"]) for u in utterances]
    first, second, interrupted, after, finished = utterances
    ref = asyncio.run(native_ws_turns(server, [SCRIPT["first"], SCRIPT["second"]]))
    for got, want in ((first, ref[0]), (second, ref[1])):
        a, b = pcm16(base64.b64decode(got["pcm"])), pcm16(want)
        assert got["rate"] == 24000 and a.shape == b.shape and np.abs(a - b).max() <= PCM_TOLERANCE
    for u, tokens in ((first, SCRIPT["first"]), (second, SCRIPT["second"]), (after, SCRIPT["after"])):
        words = [w for w, _ in u["words"]]
        assert words == "".join(tokens).split()
        times = [t for _, t in u["words"]]
        assert times == sorted(times)
    long_words = "".join(SCRIPT["long"]).split()
    for u in (interrupted, finished):
        words, times = [w for w, _ in u["words"]], [t for _, t in u["words"]]
        at = u["at_interruption"]
        received_s = at["pcm_bytes"] / 48000
        assert len(words) == at["words"], (words, at)                 # none reported after the interruption
        assert words == long_words[:len(words)] and times == sorted(times)
        if words:
            # pts in ns: the words span no more than the audio received (its first word starts at or after
            # the audio's start), give or take a frame still queued in pipecat's audio context
            assert (times[-1] - times[0]) / 1e9 <= received_s + 0.08, (times, received_s)
        # and no more than the clock's fastest rate could have said in it
        assert len(" ".join(words)) <= received_s * ALPHABETIC_CPS * RATE_BOUNDS[1] + 2, (words, received_s)
    # while the LLM still writes pipecat 1.14 holds its word frames (with either clock); once it has finished
    # it reports them as their alignment comes: a few words for 1.5 s of audio, not the read clock's dozens
    assert 0 < len(finished["words"])
    # nothing generated after the interruptions beyond what pipecat already had
    spoken = sum(len(base64.b64decode(u["pcm"])) // 3840 for u in (first, second, after))
    for u in (interrupted, finished):
        assert 0 < len(base64.b64decode(u["pcm"])) // 3840 < len(SCRIPT["long"])
    heard = sum(len(base64.b64decode(u["pcm"])) // 3840 for u in (interrupted, finished))
    assert frames - spoken - heard - 3 < len(SCRIPT["long"]) // 2     # (+1 EOS frame per finished turn)
    assert metric(server, "mossrt_generating_streams") == 0


def test_pipecat_agents_outnumber_the_slots(full_bundle_dir, tmp_path):
    """Four pipecat agents on a two-slot server, each speaking two turns with a pause between and keeping its
    socket open until all four have spoken both (overlapping calls): every turn completes, none is refused,
    idle conversations were parked to make room, and each agent's two turns are exactly (within PCM round-off)
    what one conversation of those two turns says on our WebSocket, parked or not. (With slots held by open
    sockets the third and fourth agents wait out the queue timeout and are refused.)"""
    python = client_python("pipecat")
    turns = [SCRIPT["second"], SCRIPT["after"]]
    plan = {"agents": 4, "turns": turns, "pause_s": 1.0}
    out = tmp_path / "agents.json"
    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "server.log", "--max-streams", "2",
                "--queue-timeout", "120", env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        proc = subprocess.run([str(python), str(CLIENTS / "pipecat_agents.py"), s.base.replace("http", "ws"),
                               str(out)], input=json.dumps(plan), capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert metric(s, "mossrt_parks_total") >= 2            # at least the two agents beyond the slots
        ref = asyncio.run(native_ws_turns(s, turns))
    agents = json.loads(out.read_text())["agents"]
    assert len(agents) == 4
    for utterances in agents:
        assert len(utterances) == 2
        for got, tokens, want in zip(utterances, turns, ref):
            assert [w for w, _ in got["words"]] == "".join(tokens).split()
            a, b = pcm16(base64.b64decode(got["pcm"])), pcm16(want)
            assert got["rate"] == 24000 and a.shape == b.shape and np.abs(a - b).max() <= PCM_TOLERANCE


def test_livekit_plugins_elevenlabs_stream(server):
    """livekit-plugins-elevenlabs' streaming TTS (base_url=http://.../v1, its default word tokenizer and
    inactivity timeout): the PCM equals our WebSocket's for the words it sends; its timed transcript gives every
    word once, in order, each attached to the audio that carries it and within the audio, never sooner than
    the speech clock's fastest rate. (livekit 1.8.9 reads a message's times as counted from the context's start,
    pipecat and ElevenLabs from the previous message's span, which we follow: livekit's times are therefore
    offsets within a message, a word across two messages may end before it starts, but *which* words it has,
    and when it has them, follow the speech.)"""
    import aiohttp
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
    from livekit.plugins import elevenlabs

    async def run(tokens):
        async with aiohttp.ClientSession() as session:
            tts = elevenlabs.TTS(voice_id="default", api_key="unused-key", base_url=server.base + "/v1",
                                 encoding="pcm_24000", http_session=session)
            stream = tts.stream()
            for token in tokens:
                stream.push_text(token)
            stream.end_input()
            pcm, words = b"", []
            async for ev in stream:
                pcm += bytes(ev.frame.data)
                for timed in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                    words.append((str(timed), timed.start_time, timed.end_time, len(pcm) / 48000))
            await stream.aclose()
            await tts.aclose()
            return pcm, words

    pcm, words = asyncio.run(run(SCRIPT["first"]))
    for tokens in (SCRIPT["first"], SCRIPT["long"]):      # the long one speaks ~14 s: most words come early
        got, timed = (pcm, words) if tokens is SCRIPT["first"] else asyncio.run(run(tokens))
        assert "".join(w for w, *_ in timed).split() == "".join(tokens).split()
        said, total = 0, len(got) / 48000
        for i, (word, start, end, received_s) in enumerate(timed):
            said += len(word)
            assert 0 <= start and end <= total, timed[i]     # (a word across two messages: see above)
            # livekit re-frames the audio and attaches words to its next frame; the last message has the rest
            if received_s < total - 0.5:
                assert said <= (received_s + 0.1) * ALPHABETIC_CPS * RATE_BOUNDS[1] + 2, (timed[:i + 1], received_s)
        assert tokens is SCRIPT["first"] or sum(r < total - 0.5 for *_, r in timed) >= 10
    sent = [w + " " for w in FIRST.split()]           # livekit sends words, each ending with a space
    ref = asyncio.run(native_ws_turns(server, [sent]))[0]
    a, b = pcm16(pcm), pcm16(ref)
    # when audio comes slower than it plays (a loaded machine), livekit's AudioEmitter flushes what it holds
    # early and ends the segment with "a tiny empty marker": 10 ms of zeros it makes itself
    marker = 24000 // 100
    if a.shape[0] == b.shape[0] + marker and not a[-marker:].any():
        a = a[:-marker]
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
