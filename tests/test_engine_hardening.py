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


# ---------------------------------------------------------------------------------------------- item 14
import queue  # noqa: E402
import threading  # noqa: E402

SAY = "The quick brown fox jumps over the lazy dog, and the model keeps on talking for a while."


def start(scheduler, model, text: str = SAY, max_frames: int = 24, seed: int = 0):
    h = scheduler.open_stream(params=model.default_sampling(greedy=True), seed=seed)
    h.begin_turn(max_frames=max_frames, wait=30)
    h.push_text(text)
    h.end_text()
    return h


def turn_end(h, timeout: float = 120):
    """(frames, errors, stats) of the handle's turn, within ``timeout`` s."""
    from engine.scheduler import FrameEvent, StreamError, TurnEnd

    frames, errors, deadline = [], [], time.monotonic() + timeout
    while True:
        try:
            event = h.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no turn end within {timeout} s ({len(frames)} frames, errors {errors})") from None
        if isinstance(event, FrameEvent):
            frames.append(event.frame)
        elif isinstance(event, StreamError):
            errors.append(event.error)
        elif isinstance(event, TurnEnd):
            return frames, errors, event.stats


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.01)


def failing_once(fn, exc: Exception, at: int = 1):
    """``fn`` that raises ``exc`` on its ``at``-th call."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == at:
            raise exc
        return fn(*args, **kwargs)
    wrapper.calls = calls
    return wrapper


def test_a_failing_slot_move_fails_no_stream_and_the_loop_keeps_serving(model):
    """Three streams; the first closes early, and moving the last slot into its place fails once (a device
    out-of-memory): the loop survives, the other two finish whole, the slot is freed on retry, and a new
    stream runs."""
    from engine.scheduler import Scheduler

    sch = Scheduler(model, slots=3)
    try:
        kv = sch.runner.kv
        kv.move = failing_once(kv.move, MemoryError("injected device out-of-memory"))
        a, b, c = (start(sch, model, seed=i) for i in range(3))
        wait_until(lambda: a.attached and b.attached and c.attached, 60, "three attached streams")
        a.close()
        for h in (b, c):
            frames, errors, stats = turn_end(h)
            assert not errors and stats.finish_reason.value in ("eos", "max_frames"), (errors, stats)
        assert len(kv.move.calls) >= 2                     # failed, then retried
        b.close()
        c.close()
        wait_until(lambda: sch.stats().active == 0 and sch.runner.attached == 0, 30, "every slot free")
        frames, errors, _ = turn_end(start(sch, model))
        assert frames and not errors and sch.broken is None
    finally:
        sch.stop()


def test_the_slot_copy_runs_outside_the_scheduler_lock(model):
    """While a slot move is in progress, callers (stats, admission) are not blocked by it."""
    from engine.scheduler import Scheduler

    sch = Scheduler(model, slots=2)
    entered, release = threading.Event(), threading.Event()
    real_move = sch.runner.kv.move

    def slow_move(*args):
        entered.set()
        release.wait(20)
        return real_move(*args)

    try:
        sch.runner.kv.move = slow_move
        a, b = start(sch, model, seed=1), start(sch, model, seed=2)
        wait_until(lambda: a.attached and b.attached, 60, "two attached streams")
        a.close()                                          # slot 1 moves into slot 0
        assert entered.wait(30)
        answered = threading.Event()
        threading.Thread(target=lambda: (sch.stats(), answered.set()), daemon=True).start()
        assert answered.wait(5), "stats() waited for the device copy"
        release.set()
        frames, errors, _ = turn_end(b)
        assert frames and not errors
    finally:
        release.set()
        sch.stop()


def test_a_failing_attach_fails_only_that_stream(model):
    from engine.scheduler import Scheduler

    sch = Scheduler(model, slots=2)
    try:
        sch.runner.decoder.reset = failing_once(sch.runner.decoder.reset, MemoryError("injected"))
        first = start(sch, model, seed=1)
        frames, errors, stats = turn_end(first, timeout=60)
        assert errors and stats.finish_reason.value == "error"
        first.close()
        second = start(sch, model, seed=2)
        frames, errors, _ = turn_end(second)
        assert frames and not errors
        second.close()
        wait_until(lambda: sch.stats().active == 0, 30, "every slot free")
    finally:
        sch.stop()


def break_with_a_stuck_slot(sch, model):
    """Two streams; the first leaves and moving the second into its slot always fails (a device that keeps
    failing): the second still finishes whole, and the engine is broken after the failed retries. Returns
    the second stream's handle."""
    def broken_move(*args):
        raise MemoryError("injected: the device keeps failing")

    a, b = start(sch, model, seed=1), start(sch, model, seed=2, max_frames=48)
    wait_until(lambda: a.attached and b.attached, 60, "two attached streams")
    sch.runner.kv.move = broken_move
    a.close()
    frames, errors, _ = turn_end(b)
    assert frames and not errors
    wait_until(lambda: sch.broken is not None, 60, "a broken engine")
    return b


def test_a_slot_that_cannot_be_freed_breaks_the_engine_but_running_streams_finish(model):
    from engine.errors import EngineBrokenError
    from engine.scheduler import Scheduler

    sch = Scheduler(model, slots=2)
    try:
        break_with_a_stuck_slot(sch, model)
        with pytest.raises(EngineBrokenError):
            start(sch, model)
    finally:
        sch.stop()


def test_a_prefill_after_truncate_and_new_turn_writes_at_the_truncated_length(model):
    """A truncate and a new turn landing between the runner's context check and ``want()`` (another thread)
    must not make the prefill write at the old length."""
    from engine.runner import StepRunner
    from engine.stream import StreamState

    runner = StepRunner(model, 1, 8192)
    st = StreamState(model, params=model.default_sampling(greedy=True), seed=0)
    runner.attach(st)
    st.begin_turn(max_frames=6)
    st.push_text(SAY)
    st.end_text()
    for _ in range(200):
        runner.tick()
        if st.turn_done and not st.in_flight:
            break
    assert st.turn_done and runner.kv.lengths[0] == st.fed_rows
    real_want = st.want

    def racing_want():
        st.want = real_want
        st.truncate_turn(2)
        st.begin_turn(max_frames=4)
        st.push_text("A second turn.")
        st.end_text()
        return real_want()

    st.want = racing_want
    runner.tick()
    assert runner.kv.lengths[0] == st.fed_rows


def test_a_failing_commit_after_a_batched_depth_call_fails_only_its_stream(model):
    """Two streams in one batched depth call; accepting the second one's frame fails: the first keeps its
    frame (no re-run of a consumed request) and its output equals its solo run."""
    from engine.runner import StepRunner
    from engine.stream import StreamState

    def run(n: int, broken: int | None) -> list[list]:
        runner = StepRunner(model, n, 8192)
        streams = [StreamState(model, params=model.default_sampling(), seed=7) for _ in range(n)]
        for st in streams:
            runner.attach(st)
            st.begin_turn(max_frames=8)
            st.push_text(SAY)
            st.end_text()
        if broken is not None:
            bad = streams[broken]
            bad.accept = failing_once(bad.accept, RuntimeError("injected"), at=3)   # in a batched call by then
        codes: list[list] = [[] for _ in streams]
        for _ in range(300):
            result = runner.tick()
            for stream, frame in result.frames:
                codes[streams.index(stream)].append(frame.codes.tolist())
            if all(s.turn_done and not s.in_flight for s in streams):
                break
        return codes, [s.stats.finish_reason.value for s in streams]

    solo, _ = run(1, None)
    pair, reasons = run(2, broken=1)
    assert reasons[1] == "error" and reasons[0] != "error", reasons
    assert pair[0] == solo[0]


def test_ready_reports_a_broken_engine(full_bundle_dir, tmp_path):
    """Once a stream slot cannot be freed, /ready answers 503 "broken" (so an orchestrator replaces the
    process) and new speech requests get 503 engine_broken; the stream already running finished."""
    from fastapi.testclient import TestClient

    from app.server import create_app
    from app.settings import ServerSettings
    from engine.bundle import Bundle

    settings = ServerSettings(bundle=full_bundle_dir, voices_dir=tmp_path / "v", max_streams=2, device="cpu")
    app = create_app(settings, Bundle(full_bundle_dir, device="cpu"))
    with TestClient(app) as client:
        service = app.state.service
        assert service.wait_ready(120)
        assert client.get("/ready").status_code == 200
        b = break_with_a_stuck_slot(service.scheduler, service.model)
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "broken" and "could not be freed" in r.json()["error"]
        r = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello.", "voice": "alloy"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_broken", r.text
        b.close()
