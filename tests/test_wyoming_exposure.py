"""Wyoming as a deliberately exposed port (docs/wyoming.md, "Trust"): the protocol has no keys, so with
``--api-key`` set a keyless Wyoming peer reaches only what the server lets it. A bind off loopback needs
``--wyoming-allow-keyless-remote on``; its connections have their own bound (``--wyoming-max-sessions``), so they
cannot take the WebSocket sessions keyed clients need; it lists and speaks the built-in voices only (unless
``--wyoming-voices all``); its syntheses take free slots only, never parking a keyed conversation's context.
Driven against a real ``mossrt serve`` with the ``wyoming`` package's own client."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile as sf
from service_helpers import Server, free_port, metric, wait_for
from test_wyoming import client, until

KEY = "wyoming-test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
RATE = 24000
WYOMING_SESSIONS = 2
WS_SESSIONS = 2


@pytest.fixture(scope="module")
def keyed(demo_bundle_dir, tmp_path_factory):
    """Keys set, one stream slot, no queueing, two WebSocket sessions and two Wyoming connections at most; an
    uploaded voice ``kitchen``."""
    tmp = tmp_path_factory.mktemp("wyoming_exposure")
    env = {"MOSSRT_WS_MAX_SESSIONS": str(WS_SESSIONS), "MOSSRT_WYOMING_MAX_SESSIONS": str(WYOMING_SESSIONS)}
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--api-key", KEY, "--max-streams", "1",
                "--queue-timeout", "0", env=env, wyoming=True) as s:
        t = np.arange(RATE) / RATE
        buf = io.BytesIO()
        sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), RATE, format="WAV")
        r = httpx.post(s.base + "/v1/audio/voices", data={"name": "kitchen"}, headers=AUTH,
                       files={"audio_sample": ("v.wav", buf.getvalue(), "audio/wav")}, timeout=120)
        assert r.status_code == 200, r.text
        yield s


@pytest.fixture(autouse=True)
def no_stream_left(request):
    yield
    if "keyed" in request.fixturenames:
        server = request.getfixturevalue("keyed")
        wait_for(lambda: metric(server, "mossrt_active_streams") == 0, 30, "every slot free after the test")
        wait_for(lambda: metric(server, "mossrt_websocket_sessions") == 0, 30, "every WebSocket closed")


def codes(events) -> list:
    return [(e.type, e.data.get("code")) for e in events if e.type in ("error", "audio-stop")]


async def keyed_socket(server):
    """Our WebSocket with the key, past its gate (``session.created``)."""
    import websockets

    w = await websockets.connect(server.base.replace("http", "ws") + f"/v1/audio/speech/stream?api_key={KEY}",
                                 max_size=None)
    msg = json.loads(await asyncio.wait_for(w.recv(), 60))
    return w, msg


async def keyed_turn(w, text: str) -> dict:
    """One turn of a keyed socket, to its ``response.done``."""
    await w.send(json.dumps({"type": "input.text", "text": text}))
    await w.send(json.dumps({"type": "input.done"}))
    while True:
        msg = await asyncio.wait_for(w.recv(), 120)
        if isinstance(msg, str) and json.loads(msg)["type"] in ("response.done", "error"):
            return json.loads(msg)


def serve_exit(*flags: str) -> subprocess.CompletedProcess:
    # a bundle that does not exist: what passes the settings stops at the bundle, also with status 2
    return subprocess.run([sys.executable, "-m", "mossrt.cli", "serve", "--bundle", "/nonexistent/bundle",
                           "--api-key", KEY, *flags], capture_output=True, text=True, timeout=120)


def test_a_remote_bind_with_keys_needs_the_explicit_flag():
    """Keys set and a Wyoming TCP bind off loopback: refused at start (status 2, a message naming the flag); the
    loopback, a unix socket, or ``--wyoming-allow-keyless-remote on`` pass the settings (and stop at the
    missing bundle here)."""
    refused = serve_exit("--wyoming-uri", f"tcp://0.0.0.0:{free_port()}")
    assert refused.returncode == 2, refused.stderr
    assert "--wyoming-allow-keyless-remote" in refused.stderr and "not a loopback address" in refused.stderr, \
        refused.stderr
    for flags in (["--wyoming-uri", "tcp://0.0.0.0:10200", "--wyoming-allow-keyless-remote", "on"],
                  ["--wyoming-uri", "tcp://127.0.0.1:10200"], ["--wyoming-uri", "tcp://[::1]:10200"],
                  ["--wyoming-uri", "unix:///tmp/mossrt-wyoming.sock"]):
        passed = serve_exit(*flags)
        assert passed.returncode == 2 and "/nonexistent/bundle" in passed.stderr, (flags, passed.stderr)
        assert "keyless" not in passed.stderr, (flags, passed.stderr)


def test_keyless_peers_list_and_speak_the_builtin_voices_only(keyed):
    """``describe`` lists ``default`` and OpenAI's names, not the uploaded ``kitchen`` (kept behind the key on
    /v1/audio/voices); ``synthesize`` and ``synthesize-start`` naming it get ``voice_not_found``, as a voice that
    does not exist would; a built-in voice is spoken."""
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeStart, SynthesizeVoice

    kitchen = SynthesizeVoice(name="kitchen")

    async def run():
        async with client(keyed) as c:
            await c.write_event(Describe().event())
            info = Info.from_event((await until(c, ("info",)))[-1])
        got = []
        for event in (Synthesize(text="Hello.", voice=kitchen), SynthesizeStart(voice=kitchen),
                      Synthesize(text="Hello.", voice=SynthesizeVoice(name="alloy"))):
            async with client(keyed) as c:
                await c.write_event(event.event())
                got.append(codes(await until(c, ("audio-stop", "error"))))
        return info, got

    info, got = asyncio.run(run())
    names = [v.name for v in info.tts[0].voices]
    assert names[:2] == ["default", "alloy"] and "kitchen" not in names, names
    assert got == [[("error", "voice_not_found")], [("error", "voice_not_found")], [("audio-stop", None)]], got
    listed = httpx.get(keyed.base + "/v1/audio/voices", headers=AUTH, timeout=30).json()
    assert "kitchen" in json.dumps(listed), "the keyed list still has it"


def test_wyoming_connections_do_not_take_keyed_sessions(keyed):
    """Every Wyoming connection the bound allows held open (and one more refused, ``too_many_sessions``): every
    keyed WebSocket session --ws-max-sessions allows still opens, since it counts WebSocket sessions only."""
    from wyoming.info import Describe

    async def run():
        held = []
        try:
            for _ in range(WYOMING_SESSIONS):           # each past its gate: it answered a describe
                c = client(keyed)
                await c.connect()
                await c.write_event(Describe().event())
                assert (await c.read_event()).type == "info"
                held.append(c)
            async with client(keyed) as c:
                refused = codes(await until(c, ()))
            sockets = [await keyed_socket(keyed) for _ in range(WS_SESSIONS)]
            for w, _ in sockets:
                await w.close()
            return refused, [created["type"] for _, created in sockets]
        finally:
            for c in held:
                await c.disconnect()

    refused, created = asyncio.run(run())
    assert refused == [("error", "too_many_sessions")]
    assert created == ["session.created"] * WS_SESSIONS, created


def test_a_keyless_synthesis_never_parks_a_keyed_conversation(keyed):
    """The only slot held by a keyed conversation between its turns (idle, parkable): a Wyoming synthesis does
    not park it to take the slot (a share of 0 of the keyed contexts) but gets ``no_capacity``, and nothing was
    parked; the conversation's next turn goes on in its slot."""
    from wyoming.tts import Synthesize

    async def run():
        w, created = await keyed_socket(keyed)
        try:
            assert created["type"] == "session.created", created
            first = await keyed_turn(w, "Hello there.")
            wait_for(lambda: metric(keyed, "mossrt_conversations", state="idle") == 1, 30, "the conversation idle")
            parked_before = metric(keyed, "mossrt_parks_total")
            async with client(keyed) as c:
                await c.write_event(Synthesize(text="Hello.").event())
                wyoming = codes(await until(c, ("audio-stop", "error")))
            parks = metric(keyed, "mossrt_parks_total") - parked_before
            second = await keyed_turn(w, "And again.")
            return first, wyoming, parks, second
        finally:
            await w.close()

    first, wyoming, parks, second = asyncio.run(run())
    assert first["type"] == "response.done", first
    assert wyoming == [("error", "no_capacity")], wyoming
    assert parks == 0
    assert second["type"] == "response.done" and not second.get("context_lost"), second
