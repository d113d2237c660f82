"""One wire loop under every socket transport (issue 44): our WebSocket and Wyoming run the same session core
(``app/session/wire.py`` over a channel), so the idle clock keeps one rule on both (docs/api-websocket.md,
docs/wyoming.md): a turn's end moves it, and the loop looks at it once the turn is over, however the turn was
asked for — a WebSocket turn, a whole ``synthesize``, a streaming synthesis. Waits are on events (the error,
the end of the connection); the one span of time is a lower bound (the rule's own sum of timeouts), which load
cannot break."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from service_helpers import Server
from transports import wyoming_connect, wyoming_error, wyoming_events, wyoming_opening, wyoming_send

TEXT_S, IDLE_S = 2, 6
BOUND_S = TEXT_S + IDLE_S + 90     # only so a failure ends: the server closes far sooner when it works
TEXT = "Hello there."
IDLE_MESSAGE = f"no turn and no message that did something for {IDLE_S} s (refused messages do not count)"


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wire_channel")
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--ws-text-timeout", str(TEXT_S),
                env={"MOSSRT_WS_IDLE_TIMEOUT": str(IDLE_S)}, wyoming=True) as s:
        yield s


async def _ws_after(server, messages: list[dict]) -> tuple[list, float, int | None]:
    """Our WebSocket: ``messages`` sent after ``session.created``; every message back to the close (binary
    frames as None), when the last was sent, and the close code."""
    import websockets

    async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream", max_size=None,
                                  open_timeout=30) as w:
        assert json.loads(await w.recv())["type"] == "session.created"
        for m in messages:
            sent = time.monotonic()
            await w.send(json.dumps(m))
        seen: list = []
        while True:
            try:
                raw = await w.recv()
            except websockets.ConnectionClosed as e:
                return seen, sent, e.rcvd.code if e.rcvd is not None else None
            seen.append((json.loads(raw), time.monotonic()) if isinstance(raw, str) else None)


async def _wyoming_after(server, events: list) -> tuple[list, float]:
    """Wyoming: ``events`` sent; every event back to the connection's end (or :data:`BOUND_S`), each with when it
    came, and when the last was sent."""
    reader, writer = await wyoming_connect(server)
    sent = time.monotonic()
    for event in events:
        sent = time.monotonic()
        await wyoming_send(writer, [event])
    seen = []
    deadline = time.monotonic() + BOUND_S

    def stamped(event) -> bool:
        seen.append((event, time.monotonic()))
        return False

    try:
        await wyoming_events(reader, stamped, timeout=max(1.0, deadline - time.monotonic()))
    except TimeoutError:
        pass                             # the connection outlived the bound: the caller's assertions say so
    writer.close()
    return seen, sent


@pytest.mark.parametrize("how", ["ws", "wyoming-whole", "wyoming-streaming"])
def test_a_silent_connection_after_its_turn_is_closed_by_the_idle_timeout(server, how):
    """One turn to its end, then nothing: the idle timeout closes the connection, with the one rule's words,
    on Wyoming as on the WebSocket — also after a whole ``synthesize``, whose audio runs with no text clock to
    look at (the loop looks at a running turn until it ends, so the idle clock's deadline is then set)."""
    from wyoming.tts import Synthesize

    if how == "ws":
        seen, _, code = asyncio.run(asyncio.wait_for(
            _ws_after(server, [{"type": "input.text", "text": TEXT}, {"type": "input.done"}]), BOUND_S))
        messages = [m for m, _ in filter(None, seen)]
        kinds = [m["type"] for m in messages]
        assert "response.done" in kinds and kinds[-1] == "error", kinds
        assert messages[-1]["error"]["code"] == "idle_timeout" and code == 4008, (messages[-1], code)
        assert messages[-1]["error"]["message"] == IDLE_MESSAGE, messages[-1]
        return
    sent = [Synthesize(text=TEXT).event()] if how == "wyoming-whole" else wyoming_opening(TEXT)
    seen, _ = asyncio.run(asyncio.wait_for(_wyoming_after(server, sent), BOUND_S + 30))
    types = [e.type for e, _ in seen]
    end = "audio-stop" if how == "wyoming-whole" else "synthesize-stopped"
    assert end in types, types
    last = seen[-1][0]
    assert wyoming_error(last) == "idle_timeout", types[-3:]
    assert last.data["text"] == IDLE_MESSAGE, last.data


@pytest.mark.parametrize("transport", ["ws", "wyoming"])
def test_the_idle_clock_counts_from_the_turns_end(server, transport):
    """A turn opened with one piece of text and never ended by the client: the text timeout ends its text, it
    speaks what it has, and the idle timeout counts from the turn's end, not from the client's last message —
    so the idle error comes no sooner than ``TEXT_S + IDLE_S`` after that message, on both transports (on
    Wyoming the clock counted from the last event, so the error came as the audio ended)."""
    if transport == "ws":
        seen, sent, code = asyncio.run(asyncio.wait_for(_ws_after(server, [{"type": "input.text", "text": TEXT}]),
                                                        BOUND_S))
        messages = [(m, at) for m, at in filter(None, seen)]
        codes = [m["error"]["code"] for m, _ in messages if m["type"] == "error"]
        assert codes == ["text_timeout", "idle_timeout"] and code == 4008, (codes, code)
        assert any(m["type"] == "response.done" for m, _ in messages)
        idle_at = messages[-1][1]
    else:
        seen, sent = asyncio.run(asyncio.wait_for(_wyoming_after(server, wyoming_opening(TEXT, end=False)),
                                                  BOUND_S + 30))
        types = [e.type for e, _ in seen]
        assert "audio-stop" in types and wyoming_error(seen[-1][0]) == "idle_timeout", types[-3:]
        idle_at = seen[-1][1]
    assert idle_at - sent >= TEXT_S + IDLE_S, f"the idle timeout came {idle_at - sent:.2f} s after the last message"
