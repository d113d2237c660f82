"""End-to-end tests of ``mossrt serve`` as a real process on loopback: OpenAI speech (every format, SSE,
the official client), the WebSocket protocol against ``mossrt replay``, voices, metrics, bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import subprocess
import sys

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import TEST_DEVICE, golden
from service_helpers import (
    LONG_TEXT,
    PCM_TOLERANCE,
    TEXT,
    Server,
    assert_same_audio,
    metric,
    pcm16,
    synth_reference,
    to_pcm16,
    wait_for,
)


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "4", "--queue-timeout", "1") as s:
        yield s


def speech(server, **body):
    payload = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "pcm", "greedy": True, **body}
    return httpx.post(server.base + "/v1/audio/speech", json=payload, timeout=120)


# ---------------------------------------------------------------------------------------------- speech
def test_pcm_stream_equals_synth(server, tmp_path, full_bundle_dir):
    r = speech(server)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert r.headers["x-accel-buffering"] == "no"
    ref = synth_reference(tmp_path, full_bundle_dir)
    got = pcm16(r.content)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= PCM_TOLERANCE


def test_audio_streams_before_generation_ends(server):
    """The first chunk arrives while the stream is still generating: at that moment the server's frame
    counter has not reached the request's frames yet (counters, not wall time)."""
    def frames_generated() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(server.base + "/metrics").text
        for fam in text_string_to_metric_families(text):
            if fam.name == "mossrt_frames_generated":
                return fam.samples[0].value
        raise AssertionError("no frames counter")

    before = frames_generated()
    with httpx.stream("POST", server.base + "/v1/audio/speech", timeout=120,
                      json={"model": "x", "input": LONG_TEXT, "response_format": "pcm", "greedy": True}) as r:
        chunks = r.iter_bytes()
        first = next(chunks)
        at_first = frames_generated() - before
        rest = b"".join(chunks)
    total = (len(first) + len(rest)) // (1920 * 2)
    assert total > 150 and at_first < total, (at_first, total)


@pytest.mark.parametrize("fmt,content_type", [("mp3", "audio/mpeg"), ("opus", "audio/ogg"), ("aac", "audio/aac"),
                                              ("flac", "audio/flac"), ("wav", "audio/wav")])
def test_every_format_decodes_to_the_right_length(server, fmt, content_type):
    pcm = pcm16(speech(server).content)
    r = speech(server, response_format=fmt)
    assert r.status_code == 200 and r.headers["content-type"] == content_type
    with av.open(io.BytesIO(r.content)) as c:
        stream = c.streams.audio[0]
        decoded = sum(f.samples for f in c.decode(stream))
        rate = stream.codec_context.sample_rate
    seconds, expect = decoded / rate, len(pcm) / 24000
    assert abs(seconds - expect) <= 0.1, (fmt, seconds, expect)       # codec delay and padding
    if fmt == "wav":
        assert r.content[4:8] == b"\xff\xff\xff\xff" and r.content[40:44] == b"\xff\xff\xff\xff"
        assert_same_audio(pcm16(r.content[44:]), pcm)


def test_speed_stretches_time(server):
    normal = len(speech(server).content)
    fast = len(speech(server, speed=2.0).content)
    assert abs(fast / normal - 0.5) < 0.05


def test_sse_events_concatenate_to_the_same_audio(server):
    r = speech(server, stream_format="sse")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    done = events[-1]
    assert deltas and done["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert_same_audio(pcm16(audio), pcm16(speech(server).content))
    usage = done["usage"]
    assert usage["input_tokens"] == 32 and usage["output_tokens"] == len(audio) // 3840 + 1   # + the EOS frame
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert done["metrics"]["audio_seconds"] == round(0.08 * (usage["output_tokens"] - 1), 3)
    # at speed 2 the client gets half the seconds of audio per frame, and the metrics say so
    fast = [json.loads(line[6:]) for line in speech(server, stream_format="sse", speed=2.0).text.splitlines()
            if line.startswith("data: ")][-1]
    assert fast["type"] == "speech.audio.done" and fast["usage"]["output_tokens"] == usage["output_tokens"]
    assert fast["metrics"]["audio_seconds"] == round(0.04 * (usage["output_tokens"] - 1), 3)


def test_openai_client_unmodified(server, tmp_path):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="coral", input=TEXT, response_format="wav",
            extra_body={"greedy": True, "seed": 3}) as response:
        response.stream_to_file(tmp_path / "o.wav")
    data = (tmp_path / "o.wav").read_bytes()
    assert_same_audio(pcm16(data[44:]), pcm16(speech(server).content))
    models = client.models.list()
    assert {"moss-tts-realtime", "tts-1"} <= {m.id for m in models.data}


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": "x" * 5000}, "input"),
    ({"voice": "no-such-voice"}, "voice"),
    ({"voice": {"id": "voice_missing"}}, "voice"),
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 0}, "speed"),
    ({"speed": 9}, "speed"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": 10**30}, "top_k"),
    ({"max_frames": 0}, "max_frames"),
    ({"input": 12}, "input"),
    ({"model": None}, "model"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    r = speech(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


@pytest.mark.parametrize("text,code", [("   ", "empty_input"), ("x" * 5000, "input_too_long"),
                                       ("half a surrogate pair \ud800 is not text", "invalid_value")])
def test_input_errors_say_what_is_wrong(server, text, code):
    body = json.dumps({"model": "tts-1", "input": text, "response_format": "pcm"})   # ASCII: \ud800 escaped
    r = httpx.post(server.base + "/v1/audio/speech", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_malformed_json_and_unknown_routes(server):
    r = httpx.post(server.base + "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server.base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.base + "/v1/models/dall-e")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_more_requests_than_slots_queue_or_get_429(server):
    """More concurrent requests than stream slots (4) with a 1 s queue: at least as many as there are slots
    finish, the others finish (queued) or get 429, never another status. (Which of the extra ones get a 429
    depends on timing: the 429 itself is pinned down deterministically below.)"""
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "x", "input": LONG_TEXT, "response_format": "pcm", "greedy": True}
            return await asyncio.gather(*[client.post(server.base + "/v1/audio/speech", json=body) for _ in range(7)])

    results = asyncio.run(run())
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 4 and set(codes) <= {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "no_capacity"
    assert speech(server).status_code == 200


def test_overload_answers_429_and_keeps_serving(full_bundle_dir, tmp_path):
    """One stream slot and no queue, held by a WebSocket turn whose text has not ended: every speech request
    meanwhile gets a 429 at once, with Retry-After and OpenAI's error body; the holder's stream then
    completes in full, and the server serves the next request."""
    body = {"model": "x", "input": TEXT, "response_format": "pcm", "greedy": True}
    with Server(full_bundle_dir, tmp_path / "v", tmp_path / "o.log", "--max-streams", "1", "--queue-timeout", "0") as s:
        async def run():
            import websockets

            async with websockets.connect(s.base.replace("http", "ws") + "/v1/audio/speech/stream") as w, \
                    httpx.AsyncClient(timeout=120) as client:
                holder, audio = WsClient(w), []
                await holder.until("session.created")
                await holder.send(type="session.update", greedy=True)
                await holder.until("session.updated")
                await holder.send(type="input.text", text=TEXT)
                await holder.until("response.created", audio)       # the only slot is taken until input.done
                refused = await asyncio.gather(*[client.post(s.base + "/v1/audio/speech", json=body)
                                                 for _ in range(3)])
                await holder.send(type="input.done")
                done = await holder.until("response.done", audio)
                return refused, b"".join(audio), done

        refused, held_audio, done = asyncio.run(run())
        assert [r.status_code for r in refused] == [429, 429, 429], [(r.status_code, r.text) for r in refused]
        for r in refused:
            assert r.headers["retry-after"] == "1" and r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, r.text
            assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "no_capacity", None), err
            assert isinstance(err["message"], str) and err["message"]
        # the holder's stream was not disturbed: it ran to EOS and every frame's audio arrived
        assert done["finish_reason"] == "eos", done
        assert len(held_audio) == (done["usage"]["frames"] - 1) * 3840 > 0, (len(held_audio), done["usage"])
        after = httpx.post(s.base + "/v1/audio/speech", json=body, timeout=120)
        assert after.status_code == 200 and len(after.content) > 0 and len(after.content) % 3840 == 0
        metrics = httpx.get(s.base + "/metrics").text
        assert 'mossrt_requests_total{endpoint="/v1/audio/speech",status="429"} 3.0' in metrics


# ---------------------------------------------------------------------------------------------- voices
def test_voices_round_trip_and_survive_a_restart(server, tmp_path, full_bundle_dir):
    wav = golden("codec/codec_short.npz")["wav"]
    buf = io.BytesIO()
    sf.write(buf, wav, 24000, format="FLAC")
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": "narrator"},
                   files={"audio_sample": ("ref.flac", buf.getvalue(), "audio/flac")})
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["object"] == "audio.voice" and voice["name"] == "narrator" and voice["id"].startswith("voice_")
    dup = httpx.post(server.base + "/v1/audio/voices", data={"name": "narrator"},
                     files={"audio_sample": ("ref.flac", buf.getvalue(), "audio/flac")})
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "voice_exists"
    assert voice["id"] in [v["id"] for v in httpx.get(server.base + "/v1/audio/voices").json()["data"]]
    by_name = speech(server, voice="narrator")
    by_id = speech(server, voice={"id": voice["id"]})
    assert by_name.status_code == 200 and by_id.status_code == 200
    assert_same_audio(pcm16(by_name.content), pcm16(by_id.content))
    sf.write(tmp_path / "ref.wav", wav, 24000)
    ref = synth_reference(tmp_path, full_bundle_dir, TEXT, "--voice", str(tmp_path / "ref.wav"))
    assert np.abs(pcm16(by_name.content) - ref).max() <= PCM_TOLERANCE

    # the voice's system-block KV was computed at registration and kept beside it
    assert list((server.log_path.parent / "voices" / voice["id"]).glob("prefix-kv-*.npy"))
    # a second server on the same voices directory knows the voice, and starts its streams from that KV
    with Server(full_bundle_dir, server.log_path.parent / "voices", tmp_path / "s2.log") as other:
        assert httpx.get(other.base + f"/v1/audio/voices/{voice['id']}").json()["name"] == "narrator"
        again = httpx.post(other.base + "/v1/audio/speech", timeout=120, json={
            "model": "x", "input": TEXT, "voice": "narrator", "response_format": "pcm", "greedy": True})
        assert_same_audio(pcm16(again.content), pcm16(by_name.content))
        hits = [line for line in httpx.get(other.base + "/metrics").text.splitlines()
                if line.startswith("mossrt_prefix_cache_hits_total ")]
        assert hits and float(hits[0].split()[1]) >= 1
        assert httpx.delete(other.base + f"/v1/audio/voices/{voice['id']}").json()["deleted"] is True
        assert httpx.get(other.base + f"/v1/audio/voices/{voice['id']}").status_code == 404


@pytest.mark.parametrize("name,payload,status,code", [
    ("../../etc", b"RIFF", 400, "invalid_value"),
    ("alloy", b"x", 400, "reserved_name"),
    ("ok-name", b"this is not audio at all", 400, "invalid_audio"),
    ("big", b"\0" * (10 * 1024 * 1024 + 10), 413, "file_too_large"),
])
def test_bad_voice_uploads(server, name, payload, status, code):
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": name},
                   files={"audio_sample": ("x.wav", payload, "audio/wav")}, timeout=60)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text


def test_long_voice_upload_is_refused(server):
    buf = io.BytesIO()
    sf.write(buf, np.zeros(31 * 16000, np.int16), 16000, format="WAV", subtype="PCM_16")
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": "long"},
                   files={"audio_sample": ("l.wav", buf.getvalue(), "audio/wav")})
    assert r.status_code == 400 and "the limit is 30 s" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- operations
def test_models_health_ready_metrics(server):
    assert httpx.get(server.base + "/health").json() == {"status": "ok", "pid": server.proc.pid}
    ready = httpx.get(server.base + "/ready").json()
    assert ready["status"] == "ready" and ready["demo"] is False and ready["streams"]["capacity"] == 4
    from prometheus_client.parser import text_string_to_metric_families

    def sample(name, **labels):
        text = httpx.get(server.base + "/metrics").text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    before = (sample("mossrt_requests_total", endpoint="/v1/audio/speech", status="200"),
              sample("mossrt_frames_generated_total"), sample("mossrt_audio_seconds_total"),
              sample("mossrt_time_to_first_audio_seconds_count", transport="http"))
    assert speech(server).status_code == 200
    # the request is counted as its response ends, and the time to first audio once it is sent: wait for them
    wait_for(lambda: sample("mossrt_requests_total", endpoint="/v1/audio/speech", status="200") > before[0] and
             sample("mossrt_time_to_first_audio_seconds_count", transport="http") > before[3], 30, "the speech counted")
    after = (sample("mossrt_requests_total", endpoint="/v1/audio/speech", status="200"),
             sample("mossrt_frames_generated_total"), sample("mossrt_audio_seconds_total"),
             sample("mossrt_time_to_first_audio_seconds_count", transport="http"))
    assert after[0] == before[0] + 1 and after[1] > before[1] and after[2] > before[2] and after[3] == before[3] + 1
    assert sample("mossrt_capacity_streams") == 4 and sample("mossrt_ready") == 1
    for name in ("mossrt_active_streams", "mossrt_queued_streams", "mossrt_stream_underruns_total",
                 "mossrt_inter_chunk_gap_seconds_count", "mossrt_realtime_factor_count"):
        assert name in httpx.get(server.base + "/metrics").text


def test_api_keys(full_bundle_dir, tmp_path):
    with Server(full_bundle_dir, tmp_path / "v", tmp_path / "k.log", "--api-key", "secret-key-1") as s:
        body = {"model": "x", "input": "Hello there.", "response_format": "pcm"}
        r = httpx.post(s.base + "/v1/audio/speech", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(s.base + "/v1/audio/speech", json=body, headers={"Authorization": "Bearer secret-key-1"})
        assert r.status_code == 200
        assert httpx.get(s.base + "/health").status_code == 200       # probes stay open

        async def ws(url, **kw):
            import websockets

            async with websockets.connect(url, **kw) as w:
                return json.loads(await w.recv())

        denied = asyncio.run(ws(s.base.replace("http", "ws") + "/v1/audio/speech/stream"))
        assert denied["type"] == "error" and denied["fatal"] and denied["error"]["code"] == "invalid_api_key"
        ok = asyncio.run(ws(s.base.replace("http", "ws") + "/v1/audio/speech/stream?api_key=secret-key-1"))
        assert ok["type"] == "session.created"
        ok = asyncio.run(ws(s.base.replace("http", "ws") + "/v1/audio/speech/stream",
                            subprotocols=["mossrt.key.secret-key-1"]))
        assert ok["type"] == "session.created"


# ---------------------------------------------------------------------------------------------- websocket
class WsClient:
    def __init__(self, ws):
        self.ws = ws

    async def send(self, **msg):
        await self.ws.send(json.dumps(msg))

    async def until(self, kind: str, audio: list | None = None, seen: list | None = None) -> dict:
        """Messages until one of ``kind``; binary frames are appended to ``audio``; errors raise."""
        while True:
            msg = await asyncio.wait_for(self.ws.recv(), timeout=120)
            if isinstance(msg, bytes):
                if audio is not None:
                    audio.append(msg)
                continue
            data = json.loads(msg)
            if seen is not None:
                seen.append(data)
            if data["type"] == kind:
                return data
            if data["type"] == "error":
                raise AssertionError(data)


def random_deltas(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(5, 25)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_websocket_session_equals_replay(server, tmp_path, full_bundle_dir):
    """Two turns with user context (text + audio), the first as text deltas cut at random places, the
    second as token ids, with a registered voice: the audio equals ``mossrt replay`` of the same script.
    Then a cancelled turn, and the session goes on."""
    g = golden("tts/tts_multiturn.npz")
    rng = random.Random(11)
    ref_wav = golden("codec/codec_short.npz")["wav"]
    sf.write(tmp_path / "voice.wav", ref_wav, 24000)
    user_wav = golden("codec/codec_long.npz")["wav"][: 24000 * 2]
    sf.write(tmp_path / "user.wav", user_wav, 24000)
    with open(tmp_path / "voice.wav", "rb") as f:
        r = httpx.post(server.base + "/v1/audio/voices", data={"name": "ws-voice"},
                       files={"audio_sample": ("voice.wav", f.read(), "audio/wav")})
    assert r.status_code == 200, r.text
    deltas = random_deltas(TEXT, rng)
    ids = [int(i) for i in g["turn2_streamed_text_ids"]]
    script = {"voice_wav": "voice.wav", "turns": [
        {"user_text": "Hey, I just landed in Paris.", "user_audio_wav": "user.wav", "assistant_deltas": deltas},
        {"user_text": "Just a backpack.", "assistant_token_ids": ids}]}
    (tmp_path / "s.json").write_text(json.dumps(script))
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "replay", "--bundle", str(full_bundle_dir),
                           str(tmp_path / "s.json"), "--out-dir", str(tmp_path / "out"), "--greedy", "--seed", "5",
                           "--max-context-rows", "4096", "--device", TEST_DEVICE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    async def run():
        import websockets

        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream",
                                      max_size=None) as w:
            c = WsClient(w)
            created = await c.until("session.created")
            assert created["sample_rate"] == 24000 and created["format"] == "pcm"
            await c.send(type="session.update", voice="ws-voice", greedy=True, seed=5)
            await c.until("session.updated")
            turns = []
            # turn 1: user context, then text deltas
            await c.send(type="input.user", text="Hey, I just landed in Paris.",
                         audio=base64.b64encode((tmp_path / "user.wav").read_bytes()).decode())
            await c.until("input.user.accepted")
            for i, d in enumerate(deltas):
                await c.send(type="input.text", text=d)
                if i == 0:
                    created = await c.until("response.created")
            await c.send(type="input.done")
            audio = []
            done = await c.until("response.done", audio)
            assert done["response_id"] == created["response_id"] and done["finish_reason"] == "eos"
            turns.append((audio, done))
            # turn 2: user text, then token ids
            await c.send(type="input.user", text="Just a backpack.")
            await c.until("input.user.accepted")
            await c.send(type="input.tokens", ids=ids)
            await c.send(type="input.done")
            audio = []
            turns.append((audio, await c.until("response.done", audio)))
            # turn 3: cancelled mid-way; the session goes on
            await c.send(type="input.text", text=LONG_TEXT)
            await c.send(type="input.done")
            heard, seen = [], []
            await c.until("response.created")
            while len(heard) < 3:
                msg = await w.recv()
                if isinstance(msg, bytes):
                    heard.append(msg)
            await c.send(type="response.cancel")
            cancelled = await c.until("response.done", heard, seen)
            assert cancelled["finish_reason"] == "cancelled"
            await c.send(type="response.truncate", audio_end_ms=200)
            truncated = await c.until("response.truncated")
            assert truncated["audio_frames"] == 3 and truncated["context_rows"] > 0
            await c.send(type="input.text", text="And one more thing.")
            await c.send(type="input.done")
            assert (await c.until("response.done"))["finish_reason"] == "eos"
            return turns, cancelled

    turns, cancelled = asyncio.run(run())
    for i, (audio, done) in enumerate(turns):
        got = pcm16(b"".join(audio))
        ref = to_pcm16(sf.read(tmp_path / "out" / f"turn{i}.wav", dtype="float32")[0])
        assert got.shape == ref.shape and np.abs(got - ref).max() <= PCM_TOLERANCE, i
        assert done["usage"]["frames"] == len(np.load(tmp_path / "out" / f"turn{i}_codes.npy")) + 1
        assert done["timing"]["first_audio_ms"] is not None


def test_websocket_bad_messages_keep_the_socket(server):
    async def run():
        import websockets

        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream") as w:
            c = WsClient(w)
            await c.until("session.created")
            codes = []
            for raw in (b"\x00binary", "{not json", json.dumps([1, 2]), json.dumps({"type": "nope"}),
                        json.dumps({"type": "input.text"}), json.dumps({"type": "input.done"}),
                        json.dumps({"type": "session.update", "voice": "no-such-voice"}),
                        json.dumps({"type": "session.update", "temperature": -2}),
                        json.dumps({"type": "response.truncate", "audio_end_ms": 10}),
                        json.dumps({"type": "input.tokens", "ids": [10**12]}),
                        json.dumps({"type": "input.user", "audio": "not base64!"})):
                await w.send(raw)
                msg = json.loads(await asyncio.wait_for(w.recv(), timeout=30))
                assert msg["type"] == "error" and msg["fatal"] is False, msg
                codes.append(msg["error"]["code"])
            # text after input.done: refused, the next turn works
            await c.send(type="input.text", text="Hello there, friend.")
            await c.send(type="input.done")
            await c.send(type="input.text", text="more")
            seen = []
            while True:
                msg = json.loads(await asyncio.wait_for(_text(w), timeout=60))
                seen.append(msg)
                if msg["type"] == "response.done":
                    break
            await c.send(type="input.text", text="A second turn.")
            await c.send(type="input.done")
            assert (await c.until("response.done"))["finish_reason"] == "eos"
            return codes, seen

    codes, seen = asyncio.run(run())
    assert codes[:4] == ["binary_not_expected", "invalid_json", "invalid_message", "unknown_type"]
    assert "voice_not_found" in codes and "no_turn" in codes and "no_response" in codes
    late = [m for m in seen if m["type"] == "error"]
    assert late and late[0]["error"]["code"] in ("response_ended", "invalid_value"), seen


async def _text(w):
    while True:
        msg = await w.recv()
        if isinstance(msg, str):
            return msg


def test_websocket_idle_timeout_closes_with_4008(full_bundle_dir, tmp_path):
    with Server(full_bundle_dir, tmp_path / "v", tmp_path / "i.log", env={"MOSSRT_WS_IDLE_TIMEOUT": "1"}) as s:
        async def run():
            import websockets

            async with websockets.connect(s.base.replace("http", "ws") + "/v1/audio/speech/stream") as w:
                await w.recv()
                msg = json.loads(await asyncio.wait_for(w.recv(), timeout=10))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(w.recv(), timeout=10)
                return msg, closed.value.rcvd.code

        msg, code = asyncio.run(run())
        assert msg["error"]["code"] == "idle_timeout" and msg["fatal"] and code == 4008


def test_websocket_turn_without_capacity_is_refused_cleanly(full_bundle_dir, tmp_path):
    """With every slot taken, a turn's first text gets no_capacity (counted as a 429); the rest of that
    turn's text is refused at once (not re-queued), input.done closes the attempt, and the next turn
    opens once a slot is free."""
    with Server(full_bundle_dir, tmp_path / "v", tmp_path / "c.log", "--max-streams", "1", "--queue-timeout", "0") as s:
        async def run():
            import websockets

            url = s.base.replace("http", "ws") + "/v1/audio/speech/stream"
            async with websockets.connect(url) as holder, websockets.connect(url) as other:
                h, o = WsClient(holder), WsClient(other)
                await h.until("session.created")
                await o.until("session.created")
                await h.send(type="input.text", text="I hold the only stream slot. ")
                await h.until("response.created")
                codes = []
                for text in ("Hello ", "there, ", "friend."):
                    await o.send(type="input.text", text=text)
                    codes.append(json.loads(await _text(other))["error"]["code"])
                await o.send(type="input.done")
                refused = json.loads(await _text(other))
                await holder.close()                          # frees the slot: wait for it, not for a time
                await asyncio.to_thread(wait_for, lambda: metric(s, "mossrt_active_streams") == 0, 30,
                                        "the holder's slot freed")
                await o.send(type="input.text", text="Now it works.")
                await o.send(type="input.done")
                done = await o.until("response.done")
                return codes, refused, done

        codes, refused, done = asyncio.run(run())
        assert codes == ["no_capacity", "turn_refused", "turn_refused"]
        assert refused["type"] == "response.refused" and done["finish_reason"] == "eos"
        metrics = httpx.get(s.base + "/metrics").text
        assert 'mossrt_requests_total{endpoint="/v1/audio/speech/stream",status="429"} 1.0' in metrics
        assert 'endpoint="/v1/audio/speech/stream",status="400"' not in metrics   # refusal echoes are not requests


# ---------------------------------------------------------------------------------------------- bucket warm-up
def test_ready_is_503_warming_until_the_buckets_are_warm(full_bundle_dir, tmp_path, monkeypatch):
    """``--warm-buckets on`` (MOSSRT_WARM_BUCKETS): /ready answers 503 ``warming`` and speech 503 code
    ``warming`` while the scheduler's loop warms its buckets (held here at the start of the real warm-up,
    within a bound); then 200, every bucket made before the first request."""
    import threading

    from fastapi.testclient import TestClient

    from app.server import create_app
    from app.settings import ServerSettings
    from engine.runtime.bundle import Bundle
    from engine.serving.runner import StepRunner

    gate, entered = threading.Event(), threading.Event()
    real = StepRunner.warm_up

    def held(runner):
        entered.set()
        gate.wait(timeout=60)
        return real(runner)

    monkeypatch.setattr(StepRunner, "warm_up", held)
    monkeypatch.setenv("MOSSRT_WARM_BUCKETS", "on")
    settings = ServerSettings(bundle=full_bundle_dir, voices_dir=tmp_path / "v", max_streams=4, device="cpu",
                              engine_process="off")        # in this process: the test holds its warm-up
    assert settings.warm_buckets == "on"
    app = create_app(settings, Bundle(full_bundle_dir, device="cpu"))
    with TestClient(app) as client:
        service = app.state.service
        try:
            assert entered.wait(timeout=120)
            r = client.get("/ready")
            assert r.status_code == 503 and r.json()["status"] == "warming", r.text
            r = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello.", "voice": "alloy"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming", r.text
        finally:
            gate.set()
        assert service.wait_ready(120), service.error
        assert client.get("/ready").status_code == 200
        runner = service.scheduler.runner
        assert runner.warmed and set(runner.buckets) == {1, 2, 4} and service.scheduler.warm_seconds is not None


def test_warm_buckets_flag_and_variable(full_bundle_dir, monkeypatch):
    """``--warm-buckets on|off`` on serve and bench reaches the settings and the model; the default follows
    the CUDA-graph decision (off on CPU); bad values are refused with status 2."""
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle
    from mossrt.cli import build_parser, main
    from mossrt.commands import warm_buckets_choice
    from mossrt.serve import load_settings

    assert load_settings(build_parser().parse_args(["serve", "--warm-buckets", "on"])).warm_buckets == "on"
    assert load_settings(build_parser().parse_args(["serve"])).warm_buckets is None
    args = build_parser().parse_args(["bench", "streams", "--bundle", str(full_bundle_dir), "--warm-buckets", "off"])
    assert warm_buckets_choice(args) is False
    bundle = Bundle(full_bundle_dir, device="cpu")
    assert TTSModel(bundle).warm_buckets is False
    assert TTSModel(bundle, warm_buckets=warm_buckets_choice(build_parser().parse_args(
        ["bench", "compare", "--bundle", str(full_bundle_dir), "--warm-buckets", "on"]))).warm_buckets is True
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--warm-buckets", "maybe"])
    assert exit_.value.code == 2
    monkeypatch.setenv("MOSSRT_WARM_BUCKETS", "sometimes")
    assert main(["serve", "--bundle", str(full_bundle_dir)]) == 2
