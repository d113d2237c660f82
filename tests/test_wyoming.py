"""The Wyoming listener (``mossrt serve --wyoming-uri``), driven by the ``wyoming`` package's own client as Home
Assistant drives it: ``describe`` lists every voice, an uploaded one included, and streaming; ``synthesize``
returns 24 kHz audio; a streaming synthesis speaks text as it arrives; refusals are ``error`` events. The
transport-bounds suite (``test_transport_bounds.py``) holds it to every bound of a client session too."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys

import httpx
import numpy as np
import pytest
import soundfile as sf
from service_helpers import Server, metric, requests_counted, wait_for

RATE = 24000
FRAME_BYTES = 2 * 1920           # one 80 ms frame of s16le at 24 kHz
TEXT = "Hello from the kitchen."
IDLE_S = 6
BUFFERED_CHARS = 2000            # --ws-max-buffered-chars of the module's server


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wyoming")
    env = {"MOSSRT_WS_IDLE_TIMEOUT": str(IDLE_S), "MOSSRT_WS_MAX_TURNS": "2",
           "MOSSRT_WS_MAX_BUFFERED_CHARS": str(BUFFERED_CHARS)}
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--max-streams", "2", "--queue-timeout", "0",
                env=env, wyoming=True) as s:
        yield s


@pytest.fixture(autouse=True)
def no_stream_left(server):
    yield
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, 30, "every slot free after the test")


def client(server):
    from wyoming.client import AsyncTcpClient

    return AsyncTcpClient("127.0.0.1", server.wyoming_port, connect_timeout=30, read_timeout=60)


async def until(c, types: tuple[str, ...]) -> list:
    """Events of client ``c`` up to the first of ``types`` (or the connection's end)."""
    out = []
    while True:
        event = await c.read_event()
        if event is None:
            return out
        out.append(event)
        if event.type in types:
            return out


def audio_of(events) -> bytes:
    return b"".join(e.payload or b"" for e in events if e.type == "audio-chunk")


def upload_voice(server, name: str) -> None:
    t = np.arange(RATE) / RATE
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), RATE, format="WAV")
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": name},
                   files={"audio_sample": ("v.wav", buf.getvalue(), "audio/wav")}, timeout=120)
    assert r.status_code in (200, 409), r.text


def test_describe_lists_every_voice_and_streaming_synthesis(server):
    from wyoming.info import Describe, Info

    upload_voice(server, "kitchen")

    async def describe():
        async with client(server) as c:
            await c.write_event(Describe().event())
            return Info.from_event((await until(c, ("info",)))[-1])

    info = asyncio.run(describe())
    (program,) = info.tts
    assert program.installed and program.supports_synthesize_streaming
    names = [v.name for v in program.voices]
    assert names[:2] == ["default", "alloy"] and "kitchen" in names, names
    assert all(v.installed and v.languages for v in program.voices)


@pytest.mark.parametrize("voice", [None, "alloy", "kitchen"])
def test_synthesize_returns_24khz_audio(server, voice):
    from wyoming.tts import Synthesize, SynthesizeVoice

    upload_voice(server, "kitchen")
    before = requests_counted(server).get(("wyoming", "200"), 0)

    async def synthesize():
        async with client(server) as c:
            await c.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name=voice) if voice else None).event())
            return await until(c, ("audio-stop", "error"))

    events = asyncio.run(synthesize())
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-1] == "audio-stop" and set(types[1:-1]) == {"audio-chunk"}, types
    assert events[0].data == {"rate": RATE, "width": 2, "channels": 1, "timestamp": None}
    assert all(e.data["rate"] == RATE and e.data["width"] == 2 and e.data["channels"] == 1 for e in events[1:-1])
    audio = audio_of(events)
    assert audio and len(audio) % FRAME_BYTES == 0, len(audio)
    assert np.abs(np.frombuffer(audio, "<i2")).max() > 0
    wait_for(lambda: requests_counted(server).get(("wyoming", "200"), 0) == before + 1, 10, "the request counted")


def test_streaming_synthesis_speaks_text_as_it_arrives(server):
    """Home Assistant's order: synthesize-start, chunks as the LLM writes them (here the second only once the
    first one's audio is playing), the whole text again as ``synthesize``, synthesize-stop; back: one
    audio-start, the chunks, audio-stop, synthesize-stopped. The ``synthesize`` copy is not spoken again."""
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

    first = "Hello there, this is the first sentence of a reply, and it keeps going for a while. "
    second = "And here is the second one, written a moment later."
    before = requests_counted(server).get(("wyoming", "200"), 0)

    async def stream():
        async with client(server) as c:
            await c.write_event(SynthesizeStart().event())
            await c.write_event(SynthesizeChunk(text=first).event())
            head = await until(c, ("audio-chunk", "error"))        # audio of the first text, the rest not sent
            await c.write_event(SynthesizeChunk(text=second).event())
            await c.write_event(Synthesize(text=first + second).event())
            await c.write_event(SynthesizeStop().event())
            return head, await until(c, ("synthesize-stopped", "error"))

    head, rest = asyncio.run(stream())
    assert [e.type for e in head] == ["audio-start", "audio-chunk"], [e.type for e in head]
    types = [e.type for e in rest]
    assert types[-2:] == ["audio-stop", "synthesize-stopped"], types
    assert set(types[:-2]) <= {"audio-chunk"} and "audio-start" not in types, types
    assert len(audio_of(head + rest)) % FRAME_BYTES == 0
    wait_for(lambda: requests_counted(server).get(("wyoming", "200"), 0) == before + 1, 10, "one request counted")
    assert requests_counted(server).get(("wyoming", "200"), 0) == before + 1


@pytest.mark.parametrize("chunks", [[], [" ", "\u00a0", "\u200b"]], ids=["no-chunk", "unspeakable-chunks"])
def test_streaming_synthesis_without_chunks_speaks_the_whole_text(server, chunks):
    """``synthesize-start``, the whole text as ``synthesize``, ``synthesize-stop``, and no chunk with anything
    to speak (the protocol allows a streaming client to send none): the ``synthesize`` is the text, spoken once,
    in one audio-start .. audio-stop, then synthesize-stopped."""
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

    before = requests_counted(server).get(("wyoming", "200"), 0)

    async def stream():
        async with client(server) as c:
            await c.write_event(SynthesizeStart().event())
            for chunk in chunks:
                await c.write_event(SynthesizeChunk(text=chunk).event())
            await c.write_event(Synthesize(text=TEXT).event())
            await c.write_event(SynthesizeStop().event())
            return await until(c, ("synthesize-stopped", "error"))

    events = asyncio.run(stream())
    types = [e.type for e in events]
    assert types[0] == "audio-start" and types[-2:] == ["audio-stop", "synthesize-stopped"], types
    assert set(types[1:-2]) == {"audio-chunk"}, types
    audio = audio_of(events)
    assert audio and len(audio) % FRAME_BYTES == 0, len(audio)
    wait_for(lambda: requests_counted(server).get(("wyoming", "200"), 0) == before + 1, 10, "one request counted")


@pytest.mark.parametrize("text", [" ", "\u00a0", "\u200b", " \u200b\ufeff "])
def test_a_whole_text_with_nothing_to_speak_is_refused(server, text):
    """Whitespace, a no-break space, a zero-width space: a ``synthesize`` with nothing to speak is refused
    (``empty_input``), as over HTTP, before it takes a slot."""
    from wyoming.tts import Synthesize

    async def refused():
        async with client(server) as c:
            await c.write_event(Synthesize(text=text).event())
            return [(e.type, e.data.get("code")) for e in await until(c, ())]

    assert asyncio.run(refused()) == [("error", "empty_input")]


def test_streamed_chunks_are_bounded_in_characters(server):
    """``--ws-max-buffered-chars`` counts characters of chunks received and not yet read by the model, as on
    the WebSocket, not the token ids they commit to: 10,000 characters of " understanding" (about 700 ids, 14
    characters each) are refused with ``text_buffer_full`` once 2,000 wait. The ``ping`` after the chunks is
    answered only when every chunk was taken."""
    from wyoming.ping import Ping
    from wyoming.tts import SynthesizeChunk, SynthesizeStart

    chunk = " understanding" * 71                  # 994 characters
    assert len(chunk) * 10 > 4 * BUFFERED_CHARS

    async def stream():
        async with client(server) as c:
            await c.write_event(SynthesizeStart().event())
            for _ in range(10):
                await c.write_event(SynthesizeChunk(text=chunk).event())
            await c.write_event(Ping(text="after the chunks").event())
            return [(e.type, e.data.get("code")) for e in await until(c, ("pong", "error"))]

    got = asyncio.run(stream())
    assert got[-1] == ("error", "text_buffer_full"), got


@pytest.mark.parametrize("streaming", [False, True])
def test_a_voice_that_does_not_exist_is_an_error_event(server, streaming):
    from wyoming.tts import Synthesize, SynthesizeStart, SynthesizeVoice

    voice = SynthesizeVoice(name="nobody-here")

    async def refused():
        async with client(server) as c:
            await c.write_event(SynthesizeStart(voice=voice).event() if streaming else
                                Synthesize(text=TEXT, voice=voice).event())
            return await until(c, ())                                # to the connection's end

    events = asyncio.run(refused())
    assert [(e.type, e.data.get("code")) for e in events] == [("error", "voice_not_found")], events
    assert "nobody-here" in events[0].data["text"]


def test_refusals_and_bounds_are_error_events(server):
    """A chunk with no synthesis open, more syntheses than a connection's turn limit, and a connection that
    sends nothing for the idle timeout: each an ``error`` event with the catalogue's code, then the end of the
    connection. The server goes on serving."""
    from wyoming.tts import Synthesize, SynthesizeChunk

    async def events_after(*sent):
        async with client(server) as c:
            for event in sent:
                await c.write_event(event.event())
            return [(e.type, e.data.get("code")) for e in await until(c, ())]

    async def one_after_another(n: int):
        async with client(server) as c:
            got = []
            for _ in range(n):
                await c.write_event(Synthesize(text="Hi.").event())
                got += [(e.type, e.data.get("code")) for e in await until(c, ("audio-stop", "error"))]
            return got

    assert asyncio.run(events_after(SynthesizeChunk(text="orphan"))) == [("error", "no_turn")]
    # one synthesis at a time: a second one while the first still speaks is refused
    overlapping = asyncio.run(events_after(*[Synthesize(text="Hi.")] * 2))
    assert overlapping[-1] == ("error", "turn_in_progress") and ("audio-stop", None) not in overlapping, overlapping
    two_then_one = asyncio.run(one_after_another(3))
    assert two_then_one.count(("audio-stop", None)) == 2 and two_then_one[-1] == ("error", "max_turns"), two_then_one
    assert asyncio.run(events_after()) == [("error", "idle_timeout")]


def test_pings_do_not_hold_an_idle_connection(server):
    """``ping`` is answered with ``pong``, but a connection that only pings is idle all the same: closed with
    ``idle_timeout`` (a client that pings every second gets its error, not a connection held for ever)."""
    from wyoming.ping import Ping

    async def pinging():
        async with client(server) as c:
            got = []

            async def ping():
                while True:
                    await c.write_event(Ping(text="hi").event())
                    await asyncio.sleep(1)

            pinger = asyncio.create_task(ping())
            try:
                got = [(e.type, e.data.get("code")) for e in await until(c, ("error",))]
            finally:
                pinger.cancel()
            return got

    got = asyncio.run(asyncio.wait_for(pinging(), IDLE_S + 60))
    assert got[-1] == ("error", "idle_timeout") and ("pong", None) in got, got


def test_no_free_stream_is_an_error_event(server):
    """Both stream slots held (--max-streams 2, --queue-timeout 0): a third synthesis gets ``no_capacity``."""
    from wyoming.tts import Synthesize

    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)

    async def third():
        holders = []
        for _ in range(2):
            c = client(server)
            await c.connect()
            await c.write_event(Synthesize(text=long_text).event())
            assert (await c.read_event()).type == "audio-start"
            holders.append(c)
        try:
            async with client(server) as c:
                await c.write_event(Synthesize(text=TEXT).event())
                return [(e.type, e.data.get("code")) for e in await until(c, ())]
        finally:
            for c in holders:
                await c.disconnect()

    assert asyncio.run(third()) == [("error", "no_capacity")]


def test_a_uri_that_is_not_tcp_or_unix_stops_the_start():
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "serve", "--wyoming-uri", "http://0.0.0.0:10200"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--wyoming-uri" in proc.stderr and "tcp://HOST:PORT" in proc.stderr, proc.stderr


def test_connections_count_toward_their_own_session_bound(demo_bundle_dir, tmp_path):
    """Wyoming connections have their own bound (--wyoming-max-sessions): one past it gets
    ``too_many_sessions``; once one closes, a new one is served. They do not count toward --ws-max-sessions
    (test_wyoming_exposure.py)."""
    from wyoming.info import Describe

    async def sessions():
        held = []
        for _ in range(2):                       # each past its gate: it answered a describe
            c = client(s)
            await c.connect()
            await c.write_event(Describe().event())
            assert (await c.read_event()).type == "info"
            held.append(c)
        async with client(s) as c:
            refused = [(e.type, e.data.get("code")) for e in await until(c, ())]
        await held.pop().disconnect()
        async def served():
            async with client(s) as c:
                await c.write_event(Describe().event())
                return [e.type for e in await until(c, ("info", "error"))]
        got = await served()
        for _ in range(50):                      # the closed one is released once the server sees its end
            if got == ["info"]:
                break
            await asyncio.sleep(0.2)
            got = await served()
        for c in held:
            await c.disconnect()
        return refused, got

    with Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", env={"MOSSRT_WYOMING_MAX_SESSIONS": "2"},
                wyoming=True) as s:
        refused, served = asyncio.run(sessions())
    assert refused == [("error", "too_many_sessions")]
    assert served == ["info"]
