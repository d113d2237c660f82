"""Character alignment on every ElevenLabs route with timestamps, against a real ``mossrt serve``: each character
once, in order, inside the audio it is sent with (never earlier than its frame, never later than the audio),
nothing for what a cancelled turn left unsaid, the read clock on request, a bad clock refused.
The estimate itself (app/alignment/clock.py) is measured against speech with known word times in
tests/test_speech_timing.py."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest
from alignment_checks import MS_PER_BYTE, Char, assert_follows_the_audio, http_chunks_chars, ws_chars
from service_helpers import LONG_TEXT, TEXT, Server

FORMAT = "output_format=pcm_24000"


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_alignment")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2",
                env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        yield s


def url(server, path: str, query: str = FORMAT) -> str:
    return server.base.replace("http", "ws") + path + "?" + query


async def recv(w) -> dict:
    return json.loads(await asyncio.wait_for(w.recv(), 120))


async def until_final(w, context_id: str | None) -> list[dict]:
    out = []
    while True:
        m = await recv(w)
        assert "error" not in m, m
        if m.get("contextId") == context_id:
            out.append(m)
            if m.get("isFinal"):
                return out[:-1]


def words_of(text: str, n: int) -> list[str]:
    return [w + " " for w in text.split()][:n]


@pytest.mark.parametrize("route", ["stream-input", "multi-stream-input"])
def test_websocket_alignment_follows_the_audio(server, route):
    """A whole utterance, streamed word by word: every character once, in order, each inside the audio of the
    message that carries it; the rest goes out with the last audio."""
    import websockets

    async def run():
        async with websockets.connect(url(server, f"/v1/text-to-speech/default/{route}"), max_size=None) as w:
            cid = "a" if route == "multi-stream-input" else None
            tag = {"context_id": cid} if cid else {}
            await w.send(json.dumps({"text": " ", **tag}))
            for word in words_of(TEXT, 100):
                await w.send(json.dumps({"text": word, **tag}))
            if cid:
                await w.send(json.dumps({"context_id": cid, "flush": True}))
                await w.send(json.dumps({"context_id": cid, "close_context": True}))
            else:
                await w.send(json.dumps({"text": ""}))
            return await until_final(w, cid)

    chars, audio = ws_chars(asyncio.run(run()))
    assert_follows_the_audio(chars, audio, " ".join(TEXT.split()) + " ")
    assert "".join(c.char for c in chars) == " ".join(TEXT.split()) + " "


@pytest.mark.parametrize("finished", [False, True])
def test_a_cancelled_context_aligns_only_what_was_heard(server, finished):
    """A barge-in (close_context while the text is still coming, or a second one after the turn was
    flushed and closed): what was aligned is a prefix of the text, each character inside audio the client
    received, and nothing is aligned after the cut; with the speech clock that prefix is what was heard."""
    import websockets

    async def run():
        async with websockets.connect(url(server, "/v1/text-to-speech/default/multi-stream-input"),
                                      max_size=None) as w:
            await w.send(json.dumps({"text": " ", "context_id": "long"}))
            for word in words_of(LONG_TEXT, 10_000):
                await w.send(json.dumps({"text": word, "context_id": "long"}))
            if finished:
                await w.send(json.dumps({"context_id": "long", "flush": True}))
                await w.send(json.dumps({"context_id": "long", "close_context": True}))
            before = []
            while sum(len(m.get("audio") or "") for m in before) < 4 * 3840 * 25:   # ~2 s of audio, base64
                m = await recv(w)
                assert "error" not in m, m
                before.append(m)
            await w.send(json.dumps({"context_id": "long", "close_context": True}))
            return before, await until_final(w, "long")

    before, after = asyncio.run(run())
    chars, audio = ws_chars(before + after)
    assert_follows_the_audio(chars, audio, " ".join(LONG_TEXT.split()) + " ")
    said = "".join(c.char for c in chars)
    assert 0 < len(said) < len(LONG_TEXT) // 2
    # what the messages after the close carried: only the frames already on their way, never the rest
    late = [c for m in after if m.get("alignment") for c in m["alignment"]["chars"]]
    assert len(late) <= 8 * 3, late               # at most a few frames' worth (~14 characters/s of speech)


def test_http_stream_with_timestamps_follows_the_audio(server):
    """/stream/with-timestamps: characters in seconds from the start, each inside its chunk's audio."""
    with httpx.stream("POST", server.base + "/v1/text-to-speech/default/stream/with-timestamps?" + FORMAT,
                      json={"text": TEXT}, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line) for line in r.iter_lines() if line.strip()]
    chars, audio = http_chunks_chars(chunks)
    assert_follows_the_audio(chars, audio, TEXT)
    assert "".join(c.char for c in chars) == TEXT


def test_http_with_timestamps_is_retimed_within_the_audio(server):
    """/with-timestamps (one body): the whole text re-timed once the speech's end is known; in order, inside
    the audio, and its first character no earlier than the streamed answer's."""
    r = httpx.post(server.base + "/v1/text-to-speech/default/with-timestamps?" + FORMAT, json={"text": TEXT},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    a = body["alignment"]
    assert body["normalized_alignment"] == a
    audio = len(base64.b64decode(body["audio_base64"])) * MS_PER_BYTE
    chars = [Char(ch, s * 1000, e * 1000, 0, audio) for ch, s, e in
             zip(a["characters"], a["character_start_times_seconds"], a["character_end_times_seconds"], strict=True)]
    assert "".join(c.char for c in chars) == TEXT
    assert_follows_the_audio(chars, audio, TEXT, whole=True)


def test_read_clock_on_request(server, model):
    """``alignment=read``: the characters of the ids the model has read by each frame (12 at the first, one
    more a frame after), far ahead of the speech; the default (speech) sends fewer characters early."""
    import websockets

    ids = model.tokenizer.encode(TEXT)
    lead = model.layout.text_lead

    async def run(query):
        async with websockets.connect(url(server, "/v1/text-to-speech/default/multi-stream-input", query),
                                      max_size=None) as w:
            await w.send(json.dumps({"text": TEXT, "context_id": "a"}))
            await w.send(json.dumps({"context_id": "a", "flush": True}))
            await w.send(json.dumps({"context_id": "a", "close_context": True}))
            return await until_final(w, "a")

    read_messages = asyncio.run(run(FORMAT + "&alignment=read"))
    read, fed = "", None
    for m in read_messages:
        read += "".join(m["alignment"]["chars"]) if m["alignment"] else ""
        n = next(n for n in range(len(ids) + 1) if model.tokenizer.decode(ids[:n]) == read)
        assert n == lead if fed is None else n in (fed, fed + 1), (fed, n, read)
        fed = n
    assert read == TEXT and fed == len(ids)
    chars, audio = ws_chars(read_messages)
    assert_follows_the_audio(chars, audio, TEXT, clock="read")
    # the speech clock on the same audio: by its first message it has claimed fewer characters
    speech = asyncio.run(run(FORMAT))
    first_speech = sum(len(m["alignment"]["chars"]) for m in speech[:1] if m["alignment"])
    first_read = sum(len(m["alignment"]["chars"]) for m in read_messages[:1] if m["alignment"])
    assert first_speech < first_read


@pytest.mark.parametrize("path", ["/v1/text-to-speech/default/with-timestamps",
                                  "/v1/text-to-speech/default/stream/with-timestamps"])
def test_bad_clock_is_a_400(server, path):
    r = httpx.post(server.base + path + "?alignment=later&" + FORMAT, json={"text": TEXT}, timeout=60)
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert detail["status"] == "invalid_value" and "alignment" in detail["message"], detail


def test_bad_clock_closes_the_websocket_with_1008(server):
    import websockets

    async def run():
        async with websockets.connect(url(server, "/v1/text-to-speech/default/multi-stream-input",
                                          FORMAT + "&alignment=later"), max_size=None) as w:
            err = await recv(w)
            await asyncio.wait_for(w.wait_closed(), 30)
            return err, w.close_code

    err, code = asyncio.run(run())
    assert err["error"] == "invalid_request" and code == 1008, err
