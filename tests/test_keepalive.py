"""Keep-alives keep a socket, never a turn: an empty ``input.text`` on our WebSocket, and ElevenLabs' ``{"text":
""}`` / ``{"text": " "}`` keep-alives, open no turn (so no text timeout, no audio, no slot held by a turn) and
move only the socket's clocks: the socket stays open while they come, and closes on its idle timeout once they
stop (issue 29, measurement 2 and item 3). Waits are on events (a message, the close frame); the one span of
time is a lower bound (the keep-alives outlast the idle timeout twice), which load cannot break."""

from __future__ import annotations

import asyncio
import json

import pytest
from service_helpers import Server

TEXT_S, IDLE_S = 4, 6
HOLD_S = 2 * IDLE_S                # keep-alives for twice the idle timeout (and three text timeouts)
BOUND_S = HOLD_S + 4 * IDLE_S + 60  # only so a failure ends: the server closes far sooner when it works


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


async def _hold(w, messages: list[dict]) -> list:
    """Send each keep-alive every second for ``HOLD_S``; whatever the server sends meanwhile (nothing, when
    keep-alives keep the socket and open no turn), the close included."""
    import websockets

    tickers = [asyncio.create_task(_tick(w, m)) for m in messages]
    seen: list = []
    try:
        async with asyncio.timeout(HOLD_S):
            while True:
                raw = await w.recv()
                seen.append(json.loads(raw) if isinstance(raw, str) else raw)
    except TimeoutError:
        pass
    except websockets.ConnectionClosed as e:
        seen.append(("closed", e.rcvd.code if e.rcvd is not None else None))
    finally:
        for t in tickers:
            t.cancel()
    return seen


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


def test_empty_text_every_second_opens_no_turn_and_keeps_only_the_socket(server):
    """After one finished turn, ``{"type":"input.text","text":""}`` every second for twice the idle timeout:
    nothing comes back (no ``response.created``, so no turn and no text timeout) and the socket stays open;
    once they stop, the idle timeout closes it (4008 ``idle_timeout``)."""
    import websockets

    async def run():
        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream",
                                      max_size=None, open_timeout=30) as w:
            assert json.loads(await w.recv())["type"] == "session.created"
            for m in ({"type": "session.update", "greedy": True}, {"type": "input.text", "text": "Hello there."},
                      {"type": "input.done"}):
                await w.send(json.dumps(m))
            first, _ = await _until_closed(w, lambda m: isinstance(m, dict) and m.get("type") == "response.done")
            held = await _hold(w, [{"type": "input.text", "text": ""}])
            after, code = await _until_closed(w)
            return first, held, after, code

    first, held, after, code = asyncio.run(asyncio.wait_for(run(), BOUND_S))
    assert first[-1]["type"] == "response.done" and first[-1]["finish_reason"] == "eos", first[-1]
    assert held == [], held                        # no turn opened, no audio, no error, not closed
    events = [m for m in after if isinstance(m, dict)]
    assert not any(isinstance(m, bytes) for m in after), "no audio after the turn"
    assert [m["error"]["code"] for m in events] == ["idle_timeout"], events
    assert events[-1]["fatal"] and code == 4008, (events[-1], code)


@pytest.mark.parametrize("route", ["multi-stream-input", "stream-input"])
def test_elevenlabs_keepalives_open_no_turn_and_keep_only_the_socket(server, route):
    """ElevenLabs' keep-alives on an open context that has spoken (multi-stream-input) or been opened
    (stream-input): ``{"text": " "}`` and ``{"text": ""}`` every second for twice the server's idle timeout
    open no turn (no audio after the first turn) and keep the socket (neither ElevenLabs'
    ``inactivity_timeout``, 2 s here, nor the idle timeout fires); once they stop, the inactivity timeout
    closes it (``input_timeout_exceeded``, 1008)."""
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
            held = await _hold(w, alive)
            after, code = await _until_closed(w)
            return first, held, after, code

    first, held, after, code = asyncio.run(asyncio.wait_for(run(), BOUND_S))
    if multi:
        assert any(m.get("audio") for m in first) and first[-1] == {"isFinal": True, "contextId": "c1"}, first[-2:]
    assert held == [], held                                                  # no turn, no audio, not closed
    assert not any(m.get("audio") for m in after), after[-2:]
    assert [m.get("error") for m in after] == ["input_timeout_exceeded"], after
    assert code == 1008, code
