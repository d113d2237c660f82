"""Keep-alives keep a socket, never a turn: an empty ``input.text`` on our WebSocket, and ElevenLabs' ``{"text":
""}`` / ``{"text": " "}`` keep-alives, open no turn and do not hold the socket past the idle timeout (issue 29,
measurement 2). Every wait is on an event (a message, the close frame), bounded only so that a failure ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from service_helpers import Server

TEXT_S, IDLE_S = 4, 10
BOUND_S = 4 * IDLE_S + 60          # only so a failure ends: the server closes far sooner when it works


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keepalive")
    with Server(full_bundle_dir, tmp / "v", tmp / "k.log", "--ws-text-timeout", str(TEXT_S),
                "--ws-idle-timeout", str(IDLE_S), env={"MOSSRT_ELEVENLABS_GREEDY": "1"}) as s:
        yield s


async def _tick(w, message: dict, every: float = 1.0) -> None:
    while True:
        await w.send(json.dumps(message))
        await asyncio.sleep(every)


async def _until_closed(w, stop=lambda m: False) -> tuple[list, int | None]:
    """Every message until the socket closes (or ``stop(message)``), and the close code."""
    import websockets

    seen = []
    while True:
        try:
            raw = await w.recv()
        except websockets.ConnectionClosed as e:
            return seen, e.rcvd.code if e.rcvd is not None else None
        msg = json.loads(raw) if isinstance(raw, str) else raw
        seen.append(msg)
        if stop(msg):
            return seen, None


def test_empty_text_every_second_opens_no_turn_and_the_idle_timeout_closes_the_socket(server):
    """After one finished turn, ``{"type":"input.text","text":""}`` every second: no ``response.created`` (no
    turn, so no text timeout either), and the socket is closed by the idle timeout (4008 ``idle_timeout``),
    not held for as long as the client keeps sending."""
    import websockets

    async def run():
        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream",
                                      max_size=None, open_timeout=30) as w:
            assert json.loads(await w.recv())["type"] == "session.created"
            for m in ({"type": "session.update", "greedy": True}, {"type": "input.text", "text": "Hello there."},
                      {"type": "input.done"}):
                await w.send(json.dumps(m))
            first, _ = await _until_closed(w, lambda m: isinstance(m, dict) and m.get("type") == "response.done")
            ticker = asyncio.create_task(_tick(w, {"type": "input.text", "text": ""}))
            try:
                after, code = await _until_closed(
                    w, lambda m: isinstance(m, dict) and m.get("type") in ("response.created", "response.done"))
            finally:
                ticker.cancel()
            return first, after, code

    first, after, code = asyncio.run(asyncio.wait_for(run(), BOUND_S))
    assert first[-1]["type"] == "response.done" and first[-1]["finish_reason"] == "eos", first[-1]
    events = [m for m in after if isinstance(m, dict)]
    assert not any(m.get("type") == "response.created" for m in events), events    # no turn was opened
    assert not any(isinstance(m, bytes) for m in after), "no audio after the turn"
    assert [m["error"]["code"] for m in events] == ["idle_timeout"], events        # no text_timeout: no turn
    assert events[-1]["fatal"] and code == 4008, (events[-1], code)


@pytest.mark.parametrize("route", ["multi-stream-input", "stream-input"])
def test_elevenlabs_keepalives_open_no_turn_and_the_idle_timeout_closes_the_socket(server, route):
    """ElevenLabs' keep-alives on an open context that has spoken (multi-stream-input) or been opened
    (stream-input): ``{"text": " "}`` and ``{"text": ""}`` every second open no turn (no audio after the first
    turn) and move only the socket's keep-alive clock: ElevenLabs' ``inactivity_timeout`` (2 s here) never
    fires, and the server's idle timeout closes the socket all the same (``idle_timeout``, 1008)."""
    import websockets

    multi = route == "multi-stream-input"
    url = (server.base.replace("http", "ws") + f"/v1/text-to-speech/default/{route}"
           "?output_format=pcm_24000&inactivity_timeout=2")

    async def run():
        async with websockets.connect(url, max_size=None, open_timeout=30) as w:
            first = []
            if multi:           # one utterance spoken to its end; the context stays open for the next
                for m in ({"text": " ", "context_id": "c1"}, {"text": "Hello there.", "context_id": "c1"},
                          {"context_id": "c1", "flush": True}, {"context_id": "c1", "close_context": True},
                          {"text": " ", "context_id": "c2"}):
                    await w.send(json.dumps(m))
                first, _ = await _until_closed(w, lambda m: m.get("isFinal") is True)
                alive = [{"text": " ", "context_id": "c2"}, {"text": "", "context_id": "c2"}, {"text": ""}]
            else:
                await w.send(json.dumps({"text": " "}))
                alive = [{"text": " "}]
            tickers = [asyncio.create_task(_tick(w, m)) for m in alive]
            try:
                after, code = await _until_closed(w, lambda m: bool(m.get("audio")))
            finally:
                for t in tickers:
                    t.cancel()
            return first, after, code

    first, after, code = asyncio.run(asyncio.wait_for(run(), BOUND_S))
    if multi:
        assert any(m.get("audio") for m in first) and first[-1] == {"isFinal": True, "contextId": "c1"}, first[-2:]
    assert not any(m.get("audio") for m in after), after[-2:]                 # no turn was opened
    assert [m.get("error") for m in after] == ["idle_timeout"], after          # not input_timeout_exceeded
    assert code == 1008, code
