"""Word timestamps: Kokoro-FastAPI's ``POST /dev/captioned_speech`` (streamed and whole) and the SSE events
of ``/v1/audio/speech`` with ``return_timestamps``, against a real ``mossrt serve`` — every word of the input
once, in order, inside the audio — and from the same speech clock as the ElevenLabs ``/with-timestamps``
routes (app.alignment.words over app.alignment.characters)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
import soundfile as sf
from service_helpers import Server, assert_same_audio, pcm16

from app.alignment.words import WordTimestamps, words_of

TEXT = "Welcome to the world of MOSS TTS Realtime. Experience how text transforms, into speech!"
SECONDS_PER_BYTE = 1 / 48000          # 24 kHz s16 mono


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_captioned_demo")
    with Server(None, tmp / "voices", tmp / "server.log", "--max-streams", "2") as s:
        yield s


@pytest.fixture(scope="module")
def model(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_captioned_model")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2",
                env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        yield s


def assert_every_word_inside(words: list[dict], audio_s: float, text: str = TEXT) -> None:
    assert [w["word"] for w in words] == text.split()
    starts = [w["start_time"] for w in words]
    assert starts == sorted(starts)
    for w in words:
        assert 0 <= w["start_time"] <= w["end_time"] <= audio_s + 1e-3, (w, audio_s)


def captioned(server, **body) -> httpx.Response:
    return httpx.post(server.base + "/dev/captioned_speech", json={"input": TEXT, **body}, timeout=300)


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_captioned_speech_streamed(demo, fmt):
    """One JSON object a line: base64 audio, its content type, the words spoken by the end of that audio."""
    r = captioned(demo, response_format=fmt, max_frames=40)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert {line["audio_format"] for line in lines} == {"audio/pcm" if fmt == "pcm" else "audio/mpeg"}
    audio, words = 0, []
    for line in lines:
        audio += len(base64.b64decode(line["audio"]))
        for w in line["timestamps"]:
            if fmt == "pcm":          # a word comes with (or after) the audio it ends in
                assert w["end_time"] <= audio * SECONDS_PER_BYTE + 1e-3, (w, audio)
        words += line["timestamps"]
    seconds = audio * SECONDS_PER_BYTE if fmt == "pcm" else 40 * 0.08
    assert_every_word_inside(words, seconds)


def test_captioned_speech_whole(demo):
    """``stream: false``: one object, the whole WAV (its real sizes) and every word; ``return_timestamps: false``
    gives the audio alone, the same audio."""
    r = captioned(demo, response_format="wav", stream=False, max_frames=40, seed=3)
    body = r.json()
    assert r.status_code == 200 and body["audio_format"] == "audio/wav"
    wav = base64.b64decode(body["audio"])
    assert int.from_bytes(wav[40:44], "little") == len(wav) - 44
    info = sf.info(io.BytesIO(wav))
    assert info.frames == 40 * 1920
    assert_every_word_inside(body["timestamps"], info.frames / 24000)
    bare = captioned(demo, response_format="wav", stream=False, max_frames=40, seed=3, return_timestamps=False).json()
    assert bare["timestamps"] is None
    assert_same_audio(pcm16(base64.b64decode(bare["audio"])[44:]), pcm16(wav[44:]))


def test_speech_sse_word_timestamps(demo):
    """``stream_format: sse`` with ``return_timestamps``: ``speech.audio.timestamps`` events after the audio
    that carries their words; without ``sse`` it is refused."""
    body = {"model": "tts-1", "input": TEXT, "stream_format": "sse", "response_format": "pcm", "max_frames": 40}
    events = []
    with httpx.stream("POST", demo.base + "/v1/audio/speech", json={**body, "return_timestamps": True},
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    audio, words = 0, []
    for e in events:
        if e["type"] == "speech.audio.delta":
            audio += len(base64.b64decode(e["audio"]))
        elif e["type"] == "speech.audio.timestamps":
            assert all(w["end_time"] <= audio * SECONDS_PER_BYTE + 1e-3 for w in e["timestamps"])
            words += e["timestamps"]
    assert events[-1]["type"] == "speech.audio.done" and audio == 40 * 3840
    assert_every_word_inside(words, audio * SECONDS_PER_BYTE)
    with httpx.stream("POST", demo.base + "/v1/audio/speech", json=body, timeout=300) as r:
        assert "speech.audio.timestamps" not in "".join(r.iter_lines())          # only when asked
    r = httpx.post(demo.base + "/v1/audio/speech", json={**body, "stream_format": "audio", "return_timestamps": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_timestamps"


def test_captions_are_the_elevenlabs_speech_clock(model):
    """On the golden model (audible speech, so the clock moves): the captions' words are the characters of
    ElevenLabs' ``/with-timestamps`` (streamed: ``/stream/with-timestamps``) grouped into words, greedy both."""
    whole = captioned(model, response_format="pcm", stream=False, greedy=True).json()
    eleven = httpx.post(model.base + "/v1/text-to-speech/default/with-timestamps?output_format=pcm_24000",
                        json={"text": TEXT}, timeout=300).json()
    assert_same_audio(*(pcm16(base64.b64decode(x)) for x in (whole["audio"], eleven["audio_base64"])))
    assert_same_words(whole["timestamps"], words_of(eleven["alignment"]))
    assert_every_word_inside(whole["timestamps"], len(base64.b64decode(whole["audio"])) * SECONDS_PER_BYTE)
    assert len({w["start_time"] for w in whole["timestamps"]}) > 3          # spread over the audio
    lines = [json.loads(line) for line in captioned(model, response_format="pcm", greedy=True).text.splitlines()]
    r = httpx.post(model.base + "/v1/text-to-speech/default/stream/with-timestamps?output_format=pcm_24000",
                   json={"text": TEXT}, timeout=300)
    words = WordTimestamps()
    expected = [w for c in map(json.loads, r.text.splitlines()) for w in words.add(c["alignment"])] + words.finish()
    assert_same_words([w for line in lines for w in line["timestamps"]], expected)


def assert_same_words(got: list[dict], expected: list[dict]) -> None:
    """The same words at the same times, give or take a frame (the audio agrees to PCM_TOLERANCE only)."""
    assert [w["word"] for w in got] == [w["word"] for w in expected]
    for g, e in zip(got, expected):
        assert abs(g["start_time"] - e["start_time"]) <= 0.081 and abs(g["end_time"] - e["end_time"]) <= 0.081, (g, e)


def test_words_of_scripts_with_and_without_spaces():
    def aligned(text: str) -> dict:
        return {"characters": list(text), "character_start_times_seconds": [i / 10 for i in range(len(text))],
                "character_end_times_seconds": [(i + 1) / 10 for i in range(len(text))]}

    assert [w["word"] for w in words_of(aligned("Hello, world!  Again"))] == ["Hello,", "world!", "Again"]
    assert words_of(aligned("ab cd"))[1] == {"word": "cd", "start_time": 0.3, "end_time": 0.5}
    assert [w["word"] for w in words_of(aligned("你好，世界。OK 好"))] == ["你", "好，", "世", "界。", "OK",
                                                                         "好"]
    words = WordTimestamps()                      # a word across two alignments is one word, once
    first = {k: v[:3] for k, v in aligned("abc def").items()}
    rest = {k: v[3:] for k, v in aligned("abc def").items()}
    assert words.add(first) == [] and [w["word"] for w in words.add(rest)] == ["abc"]
    assert [w["word"] for w in words.finish()] == ["def"] and words.finish() == []
