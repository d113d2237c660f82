"""Issue 14, engine side: one bad client or one failing device call never takes the service down —
truncate past the audio, turns that never get their text, decompression bombs, the voice registry's
index and cap, LocalAI reference-file confinement, and a scheduler loop that survives failures."""

from __future__ import annotations

import numpy as np
import pytest


# ---------------------------------------------------------------------------------------------- item 3
def test_truncate_past_the_end_of_the_audio_keeps_what_was_played(model):
    """``truncate_turn`` with more frames than the turn played keeps the whole turn (clamped), never an
    IndexError; the result equals truncating at exactly the frames played."""
    from engine.session import StreamingSession

    kept = []
    for extra in (1, 1000, 0):
        s = StreamingSession(model, params=model.default_sampling(greedy=True), seed=0)
        s.begin_turn(max_frames=10)
        frames = s.push_text("Hello there, this is a short test of truncation.") + s.end_text() + s.drain()
        played = sum(f.audio is not None for f in frames)
        assert 0 < played <= 10
        kept.append(s.truncate_turn(played + extra))
        assert s.stream.turn_audio_frames == played
        s.close()
    assert kept[0] == kept[1] == kept[2]


# ---------------------------------------------------------------------------------------------- the service
import asyncio  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from service_helpers import Server  # noqa: E402

WS_PATH = "/v1/audio/speech/stream"


def metric(server, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(server.base + "/metrics", timeout=10).text, re.M)
    assert m, name
    return float(m.group(1))


def wait_metric(server, name: str, value: float, timeout: float) -> float:
    """Seconds until ``name`` reads ``value`` (fails after ``timeout``)."""
    t0 = time.monotonic()
    while metric(server, name) != value:
        assert time.monotonic() - t0 < timeout, f"{name} still {metric(server, name)} after {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


async def next_json(w, timeout: float = 30) -> dict:
    """The next JSON message (binary audio frames skipped), within ``timeout`` s."""
    async def text():
        while True:
            msg = await w.recv()
            if isinstance(msg, str):
                return json.loads(msg)
    return await asyncio.wait_for(text(), timeout)


async def until_type(w, kind: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        msg = await next_json(w, max(0.1, deadline - time.monotonic()))
        seen.append(msg)
        if msg["type"] == kind:
            return msg, seen


@pytest.fixture(scope="module")
def bounded_server(full_bundle_dir, tmp_path_factory):
    """Two slots, no queueing (a held slot shows as a 429 at once), short WebSocket bounds."""
    tmp = tmp_path_factory.mktemp("bounds")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2", "--queue-timeout", "0",
                env={"MOSSRT_WS_IDLE_TIMEOUT": "2", "MOSSRT_WS_TEXT_TIMEOUT": "1"}) as s:
        yield s


def test_ws_turns_that_never_get_input_done_give_their_slots_back(bounded_server):
    """Item 2: two sockets each open a turn and never send input.done — one with "Hi", one with 100,000 ids
    (refused: text_buffer_full). Each turn gets a text_timeout error after the text timeout (1 s) and ends;
    the idle sockets then close (4008); mossrt_active_streams is back to 0 within text + idle timeout + 8 s,
    and a fresh request is admitted."""
    import websockets

    s = bounded_server
    url = s.base.replace("http", "ws") + WS_PATH

    async def hold(first: dict) -> tuple[list[dict], int]:
        async with websockets.connect(url, max_size=None) as w:
            await next_json(w)                              # session.created
            await w.send(json.dumps(first))
            _, seen = await until_type(w, "response.done", timeout=40)
            seen.append(await next_json(w, timeout=20))     # the idle timeout's fatal error, then the close
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(next_json(w), timeout=20)
            return seen, closed.value.rcvd.code

    async def both():
        return await asyncio.gather(hold({"type": "input.text", "text": "Hi"}),
                                    hold({"type": "input.tokens", "ids": [100] * 100_000}))

    t0 = time.monotonic()
    (hi, hi_code), (ids, ids_code) = asyncio.run(both())
    for seen, code in ((hi, hi_code), (ids, ids_code)):
        codes = [m["error"]["code"] for m in seen if m["type"] == "error"]
        assert codes[-2:] == ["text_timeout", "idle_timeout"] and code == 4008, seen
    assert "text_buffer_full" in [m["error"]["code"] for m in ids if m["type"] == "error"]
    assert [m for m in ids if m["type"] == "response.done"][0]["finish_reason"] == "no_text"
    wait_metric(s, "mossrt_active_streams", 0, timeout=max(0.0, 1 + 2 + 8 - (time.monotonic() - t0)) + 30)
    r = httpx.post(s.base + "/v1/audio/speech", json={"model": "tts-1", "input": "A fresh request.", "voice": "alloy",
                                                      "response_format": "pcm", "max_frames": 4}, timeout=60)
    assert r.status_code == 200, r.text


def test_ws_truncate_past_the_audio_is_clamped(bounded_server):
    """Item 3: response.truncate far past the end of a 10-frame turn keeps the session: the reply is
    clamped to the audio played and says so; the next turn works."""
    import websockets

    async def run():
        async with websockets.connect(bounded_server.base.replace("http", "ws") + WS_PATH) as w:
            await next_json(w)
            await w.send(json.dumps({"type": "session.update", "max_frames": 10, "greedy": True}))
            await until_type(w, "session.updated")
            await w.send(json.dumps({"type": "input.text", "text": "Hello there, a short turn."}))
            await w.send(json.dumps({"type": "input.done"}))
            done, _ = await until_type(w, "response.done")
            await w.send(json.dumps({"type": "response.truncate", "audio_end_ms": 100_000}))
            truncated = await next_json(w)
            await w.send(json.dumps({"type": "input.text", "text": "And again."}))
            await w.send(json.dumps({"type": "input.done"}))
            again, _ = await until_type(w, "response.done")
            return done, truncated, again

    done, truncated, again = asyncio.run(run())
    assert truncated["type"] == "response.truncated", truncated
    assert truncated["clamped"] is True and 0 < truncated["audio_frames"] <= 10
    assert truncated["audio_end_ms"] == truncated["audio_frames"] * 80
    assert again["type"] == "response.done"
