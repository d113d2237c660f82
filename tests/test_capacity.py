"""Capacity follows speech: a stream slot is held by a generating turn, not by an open socket. Between turns
a conversation is parked when a stream waits for a slot (its KV rows kept on the host), and its next turn
resumes exactly; past the parked-context budget it continues on a fresh context (our WebSocket is told);
open sockets are bounded by their own count. Against a real ``mossrt serve``, with real client libraries."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
from service_helpers import PCM_TOLERANCE, Server, metric, pcm16, wait_for

SHORT = "Hi there."
TURNS = ["Welcome to the world of MOSS TTS Realtime.", "The quick brown fox jumps over the lazy dog."]
EL_PATH = "/v1/text-to-speech/default/multi-stream-input?model_id=eleven_flash_v2_5&output_format=pcm_24000"


def url(server, path: str) -> str:
    return server.base.replace("http", "ws") + path


async def recv(w, timeout: float = 120):
    msg = await asyncio.wait_for(w.recv(), timeout)
    return json.loads(msg) if isinstance(msg, str) else msg


class Ours:
    """A session of our WebSocket: turns of text, their audio, and every JSON message seen."""

    def __init__(self, w):
        self.w, self.messages = w, []

    @classmethod
    async def open(cls, server, **session) -> "Ours":
        import websockets

        self = cls(await websockets.connect(url(server, "/v1/audio/speech/stream"), max_size=None))
        await recv(self.w)                                              # session.created
        await self.w.send(json.dumps({"type": "session.update", "response_format": "pcm", **session}))
        await recv(self.w)
        return self

    async def turn(self, text: str) -> bytes:
        await self.w.send(json.dumps({"type": "input.text", "text": text}))
        await self.w.send(json.dumps({"type": "input.done"}))
        audio = []
        while True:
            msg = await recv(self.w)
            if isinstance(msg, bytes):
                audio.append(msg)
                continue
            self.messages.append(msg)
            assert msg["type"] != "error" or msg["error"]["code"] == "context_evicted", msg
            if msg["type"] == "response.done":
                assert msg["finish_reason"] != "error", msg
                return b"".join(audio)


class Eleven:
    """A multi-context ElevenLabs socket: each turn is a context (text, flush, close_context, then isFinal)."""

    def __init__(self, w):
        self.w, self.n = w, 0

    @classmethod
    async def open(cls, server, query: str = "") -> "Eleven":
        import websockets

        return cls(await websockets.connect(url(server, EL_PATH + query), max_size=None))

    async def turn(self, text: str) -> bytes:
        self.n += 1
        cid = f"c{self.n}"
        for m in ({"text": " ", "context_id": cid}, {"text": text, "context_id": cid},
                  {"context_id": cid, "flush": True}, {"context_id": cid, "close_context": True}):
            await self.w.send(json.dumps(m))
        audio = []
        while True:
            data = await recv(self.w)
            assert "error" not in data, data
            if data.get("audio"):
                audio.append(base64.b64decode(data["audio"]))
            if data.get("isFinal") is True and data.get("contextId") == cid:
                return b"".join(audio)


def speech(server, text: str = SHORT) -> httpx.Response:
    return httpx.post(server.base + "/v1/audio/speech", json={"model": "x", "input": text, "response_format": "pcm",
                                                                "max_frames": 20}, timeout=120)


@pytest.fixture(scope="module")
def two_slots(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capacity")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2") as s:
        yield s


def test_idle_sockets_of_both_protocols_hold_no_slot(two_slots):
    """--max-streams 2, one socket on our WebSocket and one on multi-stream-input, each idle after a finished
    turn: three POST /v1/audio/speech are all 200 (the idle conversations are parked for them), and each socket's
    next turn then resumes and completes; two POSTs at once are both 200 too."""
    server = two_slots

    async def run():
        ours, el = await Ours.open(server, max_frames=20), await Eleven.open(server)
        try:
            assert await ours.turn(SHORT) and await el.turn(SHORT)
            wait_for(lambda: metric(server, "mossrt_generating_streams") == 0, 30, "both turns over")
            statuses = []
            for _ in range(3):                  # the sockets stay idle, each sending its protocol's keep-alive
                await ours.w.send(json.dumps({"type": "input.text", "text": ""}))
                await el.w.send(json.dumps({"text": ""}))
                statuses.append((await asyncio.to_thread(speech, server)).status_code)
            assert statuses == [200, 200, 200]
            # and two at once, as the second measurement (429 after the queue timeout, before)
            together = await asyncio.gather(*[asyncio.to_thread(speech, server) for _ in range(2)])
            assert [r.status_code for r in together] == [200, 200]
            assert metric(server, "mossrt_conversations", state="parked") >= 1
            assert await ours.turn(SHORT) and await el.turn(SHORT)     # resumed (or never parked): both speak
        finally:
            await ours.w.close()
            await el.w.close()

    asyncio.run(run())
    assert metric(server, "mossrt_parks_total") >= 1 and metric(server, "mossrt_resumes_total") >= 1


def test_ten_conversations_of_two_turns_share_two_slots(two_slots):
    """Ten conversations (five per protocol), two short turns each with a gap between them, on 2 slots: every
    turn completes (no no_capacity)."""
    server = two_slots

    async def conversation(i: int) -> int:
        client = await (Ours.open(server, max_frames=20) if i % 2 else Eleven.open(server))
        try:
            done = 0
            for _ in range(2):
                assert await client.turn(SHORT)
                done += 1
                # the caller listens 3-5 s (the gaps), the socket stays open
                await asyncio.sleep(3.0 + 0.2 * i)
            return done
        finally:
            await client.w.close()

    async def run():
        return await asyncio.gather(*[conversation(i) for i in range(10)])

    assert asyncio.run(run()) == [2] * 10


@pytest.fixture(scope="module")
def one_slot(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capacity_exact")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log",
                "--max-streams", "1", "--queue-timeout", "30") as s:
        yield s


@pytest.mark.parametrize("protocol, greedy", [("ours", True), ("ours", False), ("elevenlabs", False)],
                         ids=["ours-greedy", "ours-seeded", "elevenlabs-seeded"])
def test_a_parked_conversation_says_exactly_what_it_would_have(one_slot, protocol, greedy):
    """One slot: conversation A's second turn after another conversation took the slot between A's turns (A
    parked, then resumed) equals the second turn of the same conversation that kept its slot (one slot: every
    call at batch 1, so at any compute dtype; the waveform within the codec's round-off)."""
    server = one_slot

    async def open_client():
        if protocol == "ours":
            return await Ours.open(server, seed=7, greedy=greedy)
        return await Eleven.open(server, "&seed=7")          # the ElevenLabs routes sample (greedy is a setting)

    async def run():
        ref = await open_client()
        ref_audio = [await ref.turn(t) for t in TURNS]
        await ref.w.close()
        a, b = await open_client(), await Ours.open(server, greedy=True)
        try:
            first = await a.turn(TURNS[0])
            await b.turn(SHORT)                         # A is idle: parked for B
            second = await a.turn(TURNS[1])             # B is idle: parked for A, which resumes
        finally:
            await a.w.close()
            await b.w.close()
        return ref_audio, [first, second]

    ref, got = asyncio.run(run())
    for g, r in zip(got, ref):
        g, r = pcm16(g), pcm16(r)
        assert g.shape == r.shape and np.abs(g - r).max() <= PCM_TOLERANCE
    assert metric(server, "mossrt_resumes_total") >= 1


def test_an_evicted_context_continues_fresh_and_our_client_is_told(full_bundle_dir, tmp_path):
    """A parked-context budget of 0: a parked conversation loses its context; its next turn speaks as the first
    turn of a fresh conversation would, our WebSocket says so first (context_evicted, not fatal), and the
    ElevenLabs socket goes on as when its context is full."""
    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "server.log", "--max-streams", "1",
                "--queue-timeout", "30", env={"MOSSRT_PARKED_CONTEXT_BYTES": "0"}) as server:
        async def run():
            fresh = await Ours.open(server, seed=3, greedy=True)
            ref = await fresh.turn(TURNS[1])
            await fresh.w.close()
            a, el = await Ours.open(server, seed=3, greedy=True), await Eleven.open(server)
            try:
                await a.turn(TURNS[0])
                await el.turn(SHORT)                    # A parked and evicted at once
                told = len(a.messages)
                second = await a.turn(TURNS[1])
                notice = [m for m in a.messages[told:] if m["type"] == "error"]
                assert await el.turn(SHORT)             # EL parked (evicted) for A: it goes on, fresh
            finally:
                await a.w.close()
                await el.w.close()
            return ref, second, notice

        ref, second, notice = asyncio.run(run())
        assert [m["error"]["code"] for m in notice] == ["context_evicted"] and notice[0]["fatal"] is False
        g, r = pcm16(second), pcm16(ref)
        assert g.shape == r.shape and np.abs(g - r).max() <= PCM_TOLERANCE
        assert metric(server, "mossrt_parked_evictions_total") >= 2


def test_open_sockets_are_bounded_per_server(demo_bundle_dir, tmp_path):
    """--ws-max-sessions 2: a third socket, of either protocol, is refused in its protocol's shape
    (too_many_sessions; closed with 4008 / 1008); one closing makes room."""
    import websockets

    with Server(demo_bundle_dir, tmp_path / "voices", tmp_path / "server.log", "--ws-max-sessions", "2") as server:
        async def refused(path: str) -> tuple[dict, int]:
            async with websockets.connect(url(server, path), max_size=None) as w:
                msg = await recv(w)
                try:
                    await asyncio.wait_for(w.recv(), 30)
                except websockets.ConnectionClosed as e:
                    return msg, e.rcvd.code
                raise AssertionError("the refused socket stayed open")

        async def run():
            held = [await Ours.open(server), await Eleven.open(server)]
            ours_msg, ours_code = await refused("/v1/audio/speech/stream")
            el_msg, el_code = await refused(EL_PATH)
            await held[0].w.close()
            wait_for(lambda: metric(server, "mossrt_websocket_sessions") == 1, 30, "a socket closed")
            again = await Ours.open(server)              # room again
            await again.w.close()
            await held[1].w.close()
            return ours_msg, ours_code, el_msg, el_code

        ours_msg, ours_code, el_msg, el_code = asyncio.run(run())
        assert ours_msg["type"] == "error" and ours_msg["error"]["code"] == "too_many_sessions" and ours_msg["fatal"]
        assert ours_code == 4008
        assert el_msg["error"] == "too_many_sessions" and el_code == 1008
