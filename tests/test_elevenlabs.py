"""The ElevenLabs-compatible WebSockets against a real ``mossrt serve``: PCM equal to our own WebSocket's,
barge-in, output formats, alignment, bad input. pipecat's own client runs in tests/test_elevenlabs_clients.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import av
import numpy as np
import pytest
import soxr
from alignment_checks import assert_follows_the_audio, ws_chars
from service_helpers import LONG_TEXT, PCM_TOLERANCE, TEXT, Server, metric, native_ws_turns, pcm16, wait_for

DELTAS = [TEXT[i:i + 7] for i in range(0, len(TEXT), 7)]   # a token-streamed utterance
API_KEY = "eleven-test-key"


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_el")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "3", "--queue-timeout", "1",
                env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        yield s


def ws_url(server, path: str) -> str:
    return server.base.replace("http", "ws") + path


async def recv_json(w, timeout: float = 120) -> dict:
    return json.loads(await asyncio.wait_for(w.recv(), timeout=timeout))


async def native_pcm(server, deltas: list[str], **session) -> bytes:
    """Our own WebSocket's audio for the same text, greedy."""
    return (await native_ws_turns(server, [deltas], **session))[0]


async def context_messages(w, context_id: str | None) -> list[dict]:
    """A context's messages up to its isFinal (other contexts' are skipped)."""
    out = []
    while True:
        data = await recv_json(w)
        assert "error" not in data, data
        if data.get("contextId") != context_id:
            continue
        out.append(data)
        if data.get("isFinal") is True:
            return out


def audio_of(messages: list[dict]) -> bytes:
    return b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))


def multi(server, query: str = "output_format=pcm_24000", voice: str = "default") -> str:
    return ws_url(server, f"/v1/text-to-speech/{voice}/multi-stream-input?model_id=eleven_flash_v2_5&{query}")


def test_multi_context_pcm_equals_our_websocket_and_alignment_covers_the_text(server):
    """Two consecutive contexts on one socket (pipecat's messages): each one's PCM equals our own
    WebSocket's for its text (the second as a second turn of the same conversation is not compared: its
    context differs), and the alignment gives every character once, in order, within the audio."""
    import websockets

    async def run():
        async with websockets.connect(multi(server), max_size=None) as w:
            got = []
            for cid in ("c1", "c2"):
                await w.send(json.dumps({"text": " ", "context_id": cid, "voice_settings": {"stability": 0.5}}))
                for d in DELTAS:
                    await w.send(json.dumps({"text": d, "context_id": cid}))
                await w.send(json.dumps({"context_id": cid, "flush": True}))
                await w.send(json.dumps({"context_id": cid, "close_context": True}))
                got.append(await context_messages(w, cid))
            return got, await native_pcm(server, DELTAS)

    (first, second), ref = asyncio.run(run())
    pcm = pcm16(audio_of(first))
    want = pcm16(ref)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= PCM_TOLERANCE
    assert first[-1] == {"isFinal": True, "contextId": "c1"} and "audio" not in first[-1]
    assert len(audio_of(second)) > 0
    for messages in (first, second):
        chars, audio = ws_chars(messages[:-1])
        assert "".join(c.char for c in chars) == TEXT
        assert_follows_the_audio(chars, audio, TEXT)


def test_alignment_covers_the_characters_as_sent(server):
    """Decomposed accents, combining marks and Hangul jamo (which NFC composes): the alignment gives every
    character the client sent, once, in order, not the composed ones the tokenizer reads."""
    import websockets

    text = "Cafe\u0301 na\u0308ive \u1100\u1161\u11a8 ok, and e\u0301 again."

    async def run():
        async with websockets.connect(multi(server), max_size=None) as w:
            for piece in (text[:4], text[4:9], text[9:]):     # a cut inside "e\u0301" and inside the jamo too
                await w.send(json.dumps({"text": piece, "context_id": "n"}))
            await w.send(json.dumps({"context_id": "n", "flush": True}))
            await w.send(json.dumps({"context_id": "n", "close_context": True}))
            return await context_messages(w, "n")

    chars = [c for m in asyncio.run(run())[:-1] if m["alignment"] for c in m["alignment"]["chars"]]
    assert "".join(chars) == text and len(chars) == len(text)


def test_refused_text_opens_nothing_and_is_never_aligned(server):
    """Text that is not valid Unicode (a lone surrogate) is refused with an error and goes nowhere: it opens
    no turn, reaches no alignment and gets no audio; the socket goes on with the next text."""
    import websockets

    async def run():
        async with websockets.connect(multi(server), max_size=None) as w:
            await w.send('{"text": "hello \\ud800 there", "context_id": "bad"}')
            await w.send(json.dumps({"text": "Fine now.", "context_id": "good"}))
            await w.send(json.dumps({"context_id": "good", "flush": True}))
            await w.send(json.dumps({"context_id": "good", "close_context": True}))
            seen = []
            while not (seen and seen[-1].get("contextId") == "good" and seen[-1].get("isFinal")):
                seen.append(await recv_json(w))
            return seen

    seen = asyncio.run(run())
    bad = [m for m in seen if m.get("contextId") == "bad"]
    assert [m.get("error") for m in bad] == ["invalid_value"], bad           # its error, and nothing else
    chars = "".join(c for m in seen if m.get("alignment") for c in m["alignment"]["chars"])
    assert chars == "Fine now." and "\ud800" not in chars


@pytest.mark.parametrize("ended", [False, True])
def test_barge_in_stops_within_a_step_and_the_socket_goes_on(server, ended):
    """close_context before the text ended (or a second one after a normal end) cancels: the isFinal
    follows within a few frames (those already on their way), the conversation's next context speaks,
    and no stream stays busy."""
    import websockets

    async def run():
        async with websockets.connect(multi(server), max_size=None) as w:
            await w.send(json.dumps({"text": " ", "context_id": "long"}))
            await w.send(json.dumps({"text": LONG_TEXT, "context_id": "long"}))
            if ended:
                await w.send(json.dumps({"context_id": "long", "flush": True}))
                await w.send(json.dumps({"context_id": "long", "close_context": True}))
            heard = 0
            while heard < 3:
                if (await recv_json(w)).get("audio"):
                    heard += 1
            await w.send(json.dumps({"context_id": "long", "close_context": True}))
            after = await context_messages(w, "long")
            await w.send(json.dumps({"text": "Sorry, go on.", "context_id": "next"}))
            await w.send(json.dumps({"context_id": "next", "flush": True}))
            await w.send(json.dumps({"context_id": "next", "close_context": True}))
            nxt = await context_messages(w, "next")
            await w.send(json.dumps({"text": "more", "context_id": "long"}))
            refused = await recv_json(w)
            return after, nxt, refused

    after, nxt, refused = asyncio.run(run())
    # frames the client received after its close: those in its socket buffer then, plus the one in flight
    assert len([m for m in after if m.get("audio")]) <= 8
    assert len(audio_of(nxt)) > 0
    assert refused["error"] == "context_closed" and refused["contextId"] == "long"
    wait_for(lambda: metric(server, "mossrt_generating_streams") == 0, 10, "no stream generating")


@pytest.mark.parametrize("fmt", ["pcm_8000", "pcm_16000", "pcm_22050", "pcm_44100", "pcm_48000", "ulaw_8000",
                                 "alaw_8000", "mp3_44100_128", "mp3_22050_32", "opus_48000_64"])
def test_output_formats_decode_to_the_right_rate_and_length(server, fmt):
    """Every format decodes (PyAV) to its rate; PCM rates equal an offline soxr resample of the 24 kHz
    stream within 1e-3 RMS of full scale (the reference is another greedy run, within the service tolerance,
    rounded to int16 before resampling: measured <= 3e-4; the streaming resampler alone is within ~1e-5 of a
    whole-signal resample); G.711 round-trips."""
    import websockets

    async def run():
        async with websockets.connect(multi(server, f"output_format={fmt}"), max_size=None) as w:
            await w.send(json.dumps({"text": " ", "context_id": "f"}))
            await w.send(json.dumps({"text": TEXT, "context_id": "f"}))
            await w.send(json.dumps({"text": "", "context_id": "f", "flush": True}))
            await w.send(json.dumps({"context_id": "f", "close_context": True}))
            return audio_of(await context_messages(w, "f")), await native_pcm(server, [TEXT])

    data, ref = asyncio.run(run())
    ref24 = pcm16(ref).astype(np.float32) / 32767
    kind, rate = fmt.split("_")[0], int(fmt.split("_")[1])
    want = soxr.resample(ref24, 24000, rate, quality="HQ")
    if kind == "pcm":
        got = pcm16(data).astype(np.float32) / 32767
        assert len(got) == len(want)
        assert np.sqrt(np.mean((got - want) ** 2)) < 1e-3
        return
    container = {"ulaw": "mulaw", "alaw": "alaw"}.get(kind)
    raw_options = {"options": {"ar": "8000", "ac": "1"}} if container else {}
    with av.open(io.BytesIO(data), format=container, **raw_options) as f:
        st = f.streams.audio[0]
        decoded = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(st)])
        assert st.rate == rate
    if decoded.dtype == np.int16:
        decoded = decoded.astype(np.float32) / 32768
    if container:                       # G.711: exactly one byte per sample, ~8-bit quantisation error
        assert len(data) == len(want) == len(decoded)
        assert np.sqrt(np.mean((decoded - want) ** 2)) < 0.01
    else:                               # lossy codecs: the length within the codec's frame and delay
        assert abs(len(decoded) - len(want)) <= 2 * 1152 + rate // 10


def test_stream_input_single_context(server):
    """The single-context route: " " opens, text follows, {"text": ""} ends; the final has isFinal and the
    server closes; the PCM equals our WebSocket's."""
    import websockets

    async def run():
        url = ws_url(server, "/v1/text-to-speech/default/stream-input?output_format=pcm_24000")
        async with websockets.connect(url, max_size=None) as w:
            await w.send(json.dumps({"text": " ", "generation_config": {"chunk_length_schedule": [50]}}))
            for d in DELTAS:
                await w.send(json.dumps({"text": d, "try_trigger_generation": True}))
            await w.send(json.dumps({"text": ""}))
            msgs = await context_messages(w, None)
            await asyncio.wait_for(w.wait_closed(), 30)
            return msgs, w.close_code, await native_pcm(server, DELTAS)

    msgs, code, ref = asyncio.run(run())
    assert code == 1000 and msgs[-1] == {"isFinal": True}
    got, want = pcm16(audio_of(msgs)), pcm16(ref)
    assert got.shape == want.shape and np.abs(got - want).max() <= PCM_TOLERANCE


@pytest.mark.parametrize("message, code", [
    ({"text": "hi", "context_id": "a", "bogus": 1}, "invalid_message"),
    ({"text": 5, "context_id": "a"}, "invalid_message"),
    ({"text": "hi", "context_id": "a", "flush": "yes"}, "invalid_message"),
    ("not json", "invalid_json"),
    ("[" * 100_000 + "]" * 100_000, "invalid_json"),        # nesting past the parser's depth
    ('{"text": ' + "9" * 5_000 + "}", "invalid_json"),         # past Python's int-string limit
    (["a list"], "invalid_message"),
])
def test_bad_messages_get_an_error_and_keep_the_socket(server, message, code):
    """Errors in ElevenLabs' shape ({"error", "message"}, contextId when known); the socket stays usable
    and another client's stream is not disturbed."""
    import websockets

    async def run():
        async with websockets.connect(multi(server), max_size=None) as w:
            await w.send(message if isinstance(message, str) else json.dumps(message))
            err = await recv_json(w)
            await w.send(json.dumps({"text": "Still here.", "context_id": "ok"}))
            await w.send(json.dumps({"context_id": "ok", "flush": True}))
            await w.send(json.dumps({"context_id": "ok", "close_context": True}))
            return err, await context_messages(w, "ok")

    err, ok = asyncio.run(run())
    assert err["error"] == code and isinstance(err["message"], str) and "Traceback" not in err["message"]
    assert len(audio_of(ok)) > 0


def test_oversized_message_closes_with_1009_and_others_keep_speaking(server):
    """A message over the server's frame limit closes that socket (1009, as the protocol's peers do);
    a context speaking on another socket at the same time is not disturbed."""
    import websockets

    async def big():
        async with websockets.connect(multi(server), max_size=None) as w:
            await w.send(json.dumps({"text": "x" * 5_000_000, "context_id": "a"}))
            await asyncio.wait_for(w.wait_closed(), 30)
            return w.close_code

    async def other():
        async with websockets.connect(multi(server), max_size=None) as w:
            await w.send(json.dumps({"text": TEXT, "context_id": "o"}))
            await w.send(json.dumps({"context_id": "o", "flush": True}))
            await w.send(json.dumps({"context_id": "o", "close_context": True}))
            return audio_of(await context_messages(w, "o"))

    async def run():
        return await asyncio.gather(big(), other(), native_pcm(server, [TEXT]))

    code, audio, ref = asyncio.run(run())
    assert code == 1009
    got, want = pcm16(audio), pcm16(ref)
    assert got.shape == want.shape and np.abs(got - want).max() <= PCM_TOLERANCE


@pytest.mark.parametrize("query, voice, code", [
    ("output_format=wav_99", "default", "invalid_output_format"),
    ("inactivity_timeout=0", "default", "invalid_request"),
    ("output_format=pcm_16000", "no-such-voice", "voice_not_found"),
])
def test_bad_connections_are_refused_with_1008(server, query, voice, code):
    import websockets

    async def run():
        async with websockets.connect(multi(server, query, voice), max_size=None) as w:
            err = await recv_json(w)
            await asyncio.wait_for(w.wait_closed(), 30)
            return err, w.close_code

    err, close = asyncio.run(run())
    assert err["error"] == code and close == 1008


def test_api_keys_header_or_first_message(full_bundle_dir, tmp_path):
    """With keys set: the xi-api-key header, or xi_api_key in the first message, or our Authorization; a
    bad key closes with 1008."""
    import websockets

    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "server.log", "--api-key", API_KEY) as s:
        async def speak(headers=None, first_key=None):
            async with websockets.connect(multi(s), additional_headers=headers or {}, max_size=None) as w:
                first = {"text": " ", "context_id": "k"}
                if first_key:
                    first["xi_api_key"] = first_key
                await w.send(json.dumps(first))
                await w.send(json.dumps({"text": "Hi.", "context_id": "k"}))
                await w.send(json.dumps({"context_id": "k", "flush": True}))
                await w.send(json.dumps({"context_id": "k", "close_context": True}))
                try:
                    msgs = await context_messages(w, "k")
                except AssertionError as e:
                    await asyncio.wait_for(w.wait_closed(), 30)
                    return str(e), w.close_code
                return audio_of(msgs), None

        for kw in ({"headers": {"xi-api-key": API_KEY}}, {"first_key": API_KEY},
                   {"headers": {"Authorization": f"Bearer {API_KEY}"}}):
            audio, _ = asyncio.run(speak(**kw))
            assert isinstance(audio, bytes) and audio, kw
        err, close = asyncio.run(speak(headers={"xi-api-key": "wrong-key-123"}))
        assert "invalid_api_key" in err and close == 1008


def test_our_websocket_and_http_take_sample_rate_and_telephony_formats(server):
    """The same rates on our own API: ``sample_rate`` on session.update and /v1/audio/speech, ``ulaw`` /
    ``alaw`` as response_format; lengths follow the rate, and G.711 decodes back near the PCM."""
    import httpx

    ref = pcm16(asyncio.run(native_pcm(server, [TEXT]))).astype(np.float32) / 32767
    want16 = soxr.resample(ref, 24000, 16000, quality="HQ")

    got = pcm16(asyncio.run(native_pcm(server, [TEXT], sample_rate=16000))).astype(np.float32) / 32767
    assert len(got) == len(want16) and np.sqrt(np.mean((got - want16) ** 2)) < 1e-3
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "greedy": True}
    r = httpx.post(server.base + "/v1/audio/speech", json={**body, "response_format": "ulaw", "sample_rate": 8000},
                   timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/basic"
    with av.open(io.BytesIO(r.content), format="mulaw", options={"ar": "8000", "ac": "1"}) as f:
        decoded = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(f.streams.audio[0])]) / 32768
    want8 = soxr.resample(ref, 24000, 8000, quality="HQ")
    assert len(decoded) == len(want8) and np.sqrt(np.mean((decoded - want8) ** 2)) < 0.01
    r = httpx.post(server.base + "/v1/audio/speech", json={**body, "response_format": "pcm", "sample_rate": 4000},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sample_rate"


def test_a_full_conversation_continues_on_a_fresh_context(full_bundle_dir, tmp_path):
    """With a small context (256 rows), utterance after utterance on one socket: when the conversation's
    context nears its end, the next context starts on a fresh stream instead of failing; every context
    speaks and ends with its isFinal."""
    import websockets

    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "server.log", "--max-context-rows", "256",
                "--max-streams", "1") as s:
        async def run():
            async with websockets.connect(multi(s), max_size=None) as w:
                out = []
                for i in range(6):
                    await w.send(json.dumps({"text": TEXT, "context_id": f"c{i}"}))
                    await w.send(json.dumps({"context_id": f"c{i}", "flush": True}))
                    await w.send(json.dumps({"context_id": f"c{i}", "close_context": True}))
                    out.append(len(audio_of(await context_messages(w, f"c{i}"))))
                return out

        lengths = asyncio.run(run())
        assert all(n > 0 for n in lengths), lengths
        assert "starts a fresh one" in s.log()


BAD_SEEDS = ["%ff", "-1", "4294967296", "2**80", str(2**80), "1.5", "seven", ""]


def test_http_routes_take_a_query_seed_and_refuse_what_the_websockets_refuse(full_bundle_dir, tmp_path):
    """From the reproduction: ``?seed=7`` twice gave different audio and ``?seed=%ff`` / ``?seed=2**80`` a 200.
    The query seed seeds sampling as the body's does (the body's wins when both are given), and a bad one is
    refused as the WebSockets refuse it: ``invalid_request``, in ElevenLabs' shape (HTTP 422 as for a bad body
    seed, WebSocket 1008)."""
    import httpx
    import websockets

    with Server(full_bundle_dir, tmp_path / "v", tmp_path / "s.log") as s:      # sampling, not greedy
        def speak(query: str = "", **body) -> httpx.Response:
            return httpx.post(s.base + "/v1/text-to-speech/default/stream?output_format=pcm_24000" + query,
                              json={"text": TEXT, **body}, timeout=120)

        def differs(a: bytes, b: bytes) -> bool:         # beyond the codec's chunking round-off
            return len(a) != len(b) or np.abs(pcm16(a) - pcm16(b)).max() > PCM_TOLERANCE

        seven = speak("&seed=7")
        assert seven.status_code == 200 and seven.content, seven.text
        assert not differs(speak("&seed=7").content, seven.content)         # reproducible
        assert differs(speak("&seed=8").content, seven.content)             # and the seed is what decides it
        assert not differs(speak(seed=7).content, seven.content)            # the query's seed is the body's
        assert not differs(speak("&seed=8", seed=7).content, seven.content)  # both: the body's wins

        async def ws_refusal(bad: str):
            async with websockets.connect(multi(s, f"output_format=pcm_24000&seed={bad}"), max_size=None) as w:
                err = await recv_json(w)
                await asyncio.wait_for(w.wait_closed(), 30)
                return err["error"], w.close_code

        for bad in BAD_SEEDS:
            for path in ("/stream", "", "/with-timestamps", "/stream/with-timestamps"):
                r = httpx.post(s.base + f"/v1/text-to-speech/default{path}?seed={bad}", json={"text": TEXT},
                               timeout=60)
                # the catalogue's invalid_request: 422, as for a bad body seed (ElevenLabs answers validation so)
                assert r.status_code == 422 and r.json()["detail"]["status"] == "invalid_request", (bad, path, r.text)
                assert "seed" in r.json()["detail"]["message"], r.text
            assert asyncio.run(ws_refusal(bad)) == ("invalid_request", 1008), bad
