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
    from engine.offline.session import StreamingSession

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
    """Two slots, no queueing (a held slot shows as a 429 at once), short WebSocket bounds, two voices."""
    tmp = tmp_path_factory.mktemp("bounds")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2", "--queue-timeout", "0",
                env={"MOSSRT_WS_IDLE_TIMEOUT": "2", "MOSSRT_WS_TEXT_TIMEOUT": "1", "MOSSRT_MAX_VOICES": "2"}) as s:
        yield s


# text timeout 1 s (+0.5 s polling) + the "Hi" turn's audio (at most ~6 s generated, not paced) + idle 2 s,
# with a wide margin for a loaded CI machine
SLOTS_BACK_S = 40


def test_ws_turns_that_never_get_input_done_give_their_slots_back(bounded_server):
    """Item 2: two sockets each open a turn and never send input.done — one with "Hi", one with 100,000 ids
    (refused: text_buffer_full). Each turn gets a text_timeout error after the text timeout (1 s) and ends;
    the idle sockets then close (4008, idle timeout 2 s); mossrt_active_streams is back to 0 within
    SLOTS_BACK_S of the first message, and a fresh request is admitted (two slots, no queueing: a slot
    still held would be a 429)."""
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
    wait_metric(s, "mossrt_active_streams", 0, timeout=max(0.0, SLOTS_BACK_S - (time.monotonic() - t0)))
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
    from engine.serving.scheduler import FrameEvent, StreamError, TurnEnd

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
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=3)
    try:
        kv = sch.runner.kv
        kv.copy_slot = failing_once(kv.copy_slot, MemoryError("injected device out-of-memory"))
        a, b, c = (start(sch, model, seed=i) for i in range(3))
        wait_until(lambda: a.attached and b.attached and c.attached, 60, "three attached streams")
        a.close()
        for h in (b, c):
            frames, errors, stats = turn_end(h)
            assert not errors and stats.finish_reason.value in ("eos", "max_frames"), (errors, stats)
        assert len(kv.copy_slot.calls) >= 2                # failed, then retried
        b.close()
        c.close()
        wait_until(lambda: sch.stats().active == 0 and sch.runner.attached == 0, 30, "every slot free")
        frames, errors, _ = turn_end(start(sch, model))
        assert frames and not errors and sch.broken is None
    finally:
        sch.stop()


def test_the_slot_copy_runs_outside_the_scheduler_lock(model):
    """While a slot move is in progress, callers (stats, admission) are not blocked by it."""
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=2)
    entered, release = threading.Event(), threading.Event()
    real_move = sch.runner.kv.copy_slot

    def slow_move(*args):
        entered.set()
        release.wait(20)
        return real_move(*args)

    try:
        sch.runner.kv.copy_slot = slow_move
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
    from engine.serving.scheduler import Scheduler

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
    sch.runner.kv.copy_slot = broken_move
    a.close()
    frames, errors, _ = turn_end(b)
    assert frames and not errors
    wait_until(lambda: sch.broken is not None, 60, "a broken engine")
    return b


def test_a_slot_that_cannot_be_freed_breaks_the_engine_but_running_streams_finish(model):
    from engine.errors import EngineBrokenError
    from engine.serving.scheduler import Scheduler

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
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

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
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

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

    from conftest import TEST_COMPUTE_DTYPE

    solo, _ = run(1, None)
    pair, reasons = run(2, broken=1)
    assert reasons[1] == "error" and reasons[0] != "error", reasons
    # exact in fp32; under fp16 a row's MatMul bits depend on the batch's other rows (see conftest.exact_codes)
    assert pair[0] == solo[0] if TEST_COMPUTE_DTYPE == "fp32" else len(pair[0]) > 0


def test_ready_reports_a_broken_engine(full_bundle_dir, tmp_path):
    """Once a stream slot cannot be freed, /ready answers 503 "broken" (so an orchestrator replaces the
    process) and new speech requests get 503 engine_broken; the stream already running finished."""
    from fastapi.testclient import TestClient

    from app.server import create_app
    from app.settings import ServerSettings
    from engine.runtime.bundle import Bundle

    # the engine in this process: the test breaks its scheduler (the core process's death: test_engine_core_process)
    settings = ServerSettings(bundle=full_bundle_dir, voices_dir=tmp_path / "v", max_streams=2, device="cpu",
                              engine_process="off")
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


# ---------------------------------------------------------------------------------------------- item 4
import base64  # noqa: E402
import tracemalloc  # noqa: E402

import soundfile as sf  # noqa: E402


def silence_file(path, channels: int, rate: int, seconds: float, fmt: str, subtype: str) -> bytes:
    """Silence written second by second (the writer never holds the whole decoded signal)."""
    block = np.zeros((rate, channels), np.float32)
    with sf.SoundFile(path, "w", samplerate=rate, channels=channels, format=fmt, subtype=subtype) as f:
        for _ in range(int(seconds)):
            f.write(block)
    return path.read_bytes()


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, bytes]:
    """The issue's decompression bombs: 29 s x 255 channels of Ogg Vorbis (~33 KB, 59 M samples) and 25 s x
    8 channels of 384 kHz FLAC (~80 KB, 77 M samples)."""
    tmp = tmp_path_factory.mktemp("bombs")
    return {"ogg": silence_file(tmp / "bomb.ogg", 255, 8000, 29, "OGG", "VORBIS"),
            "flac": silence_file(tmp / "bomb.flac", 8, 384000, 25, "FLAC", "PCM_16")}


@pytest.mark.parametrize("kind", ["ogg", "flac"])
def test_decompression_bombs_are_refused_from_their_header(bombs, kind):
    from app.uploads import decode_upload
    from engine.errors import InputError
    from engine.limits import Limits

    tracemalloc.start()
    try:
        for user_audio in (False, True):
            with pytest.raises(InputError, match="samples to decode; the limit is"):
                decode_upload(bombs[kind], Limits(), "audio_sample", user_audio)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_multichannel_audio_is_decoded_in_blocks_and_mixed_as_it_goes(tmp_path):
    """A 6-channel file within the limits decodes to mono (the codec's channel average), holding the mono
    result and one block at a time, never every channel of the whole file."""
    from app.uploads import decode_upload
    from engine.limits import Limits

    rng = np.random.default_rng(0)
    wav = (0.1 * rng.standard_normal((48000 * 20, 6))).astype(np.float32)
    sf.write(tmp_path / "six.wav", wav, 48000, subtype="FLOAT")
    data = (tmp_path / "six.wav").read_bytes()
    del wav
    expect = sf.read(tmp_path / "six.wav", dtype="float32")[0].mean(axis=1)
    tracemalloc.start()
    try:
        got, rate = decode_upload(data, Limits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rate == 48000 and got.shape == expect.shape and np.array_equal(got, expect)
    all_channels = 48000 * 20 * 6 * 4
    assert peak < got.nbytes + 8 * 2**20 < all_channels, (peak, all_channels)   # mono + two 4 MiB blocks


def rss_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


BOMB_RSS_BOUND_MIB = 100


def test_four_concurrent_bombs_keep_the_server_within_its_memory_bound(bounded_server, bombs):
    """Four voice uploads and four WebSocket input.user messages of each bomb at once: every one refused
    with a 400 / recoverable error, and the server's peak RSS (VmHWM, reset first) stays within
    BOMB_RSS_BOUND_MIB of its RSS before."""
    import websockets

    s = bounded_server
    pid = s.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")                                        # VmHWM := current RSS
    before = rss_kib(pid, "VmRSS")

    async def upload(client, kind: str, i: int):
        return await client.post(s.base + "/v1/audio/voices", data={"name": f"bomb-{kind}-{i}"},
                                 files={"audio_sample": (f"bomb.{kind}", bombs[kind], "application/octet-stream")})

    async def user_audio(kind: str):
        async with websockets.connect(s.base.replace("http", "ws") + WS_PATH, max_size=None) as w:
            await next_json(w)
            await w.send(json.dumps({"type": "input.user", "audio": base64.b64encode(bombs[kind]).decode()}))
            return await next_json(w, timeout=60)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[upload(client, k, i) for k in bombs for i in range(4)],
                                        *[user_audio(k) for k in bombs for _ in range(4)])

    results = asyncio.run(run())
    peak = rss_kib(pid, "VmHWM")
    grew_mib = (peak - before) / 1024
    print(f"server RSS before {before / 1024:.0f} MiB, peak during 16 bombs {peak / 1024:.0f} MiB "
          f"(+{grew_mib:.1f} MiB)")
    for r in results[:8]:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_audio", r.text
    for msg in results[8:]:
        assert msg["type"] == "error" and not msg["fatal"] and "samples to decode" in msg["error"]["message"], msg
    assert grew_mib < BOMB_RSS_BOUND_MIB


# ---------------------------------------------------------------------------------------------- item 8
def test_voice_lookups_use_the_index_and_see_other_processes(tmp_path, monkeypatch):
    """find() parses no meta.json however many voices there are (the index is built once, at start); a voice
    another process adds or deletes in the same directory is seen; max_voices is enforced."""
    import app.voices
    from app.voices import VoiceRegistry

    codes = np.zeros((10, 16), np.int64)
    writer = VoiceRegistry(tmp_path, "bundle-x")
    made = [writer.add(f"voice {i}", codes) for i in range(200)]
    reg = VoiceRegistry(tmp_path, "bundle-x")
    parsed = []
    real_loads = app.voices.json.loads
    monkeypatch.setattr(app.voices.json, "loads", lambda *a, **k: parsed.append(1) or real_loads(*a, **k))
    for rec in made[::7]:
        assert reg.find(rec.name) == rec and reg.find(rec.id) == rec
    assert reg.find("no such voice") is None
    assert not parsed                                      # no disk read per lookup
    other = writer.add("from another process", codes)      # the directory changed: one rebuild on the miss
    assert reg.find("from another process") == other and len(reg) == 201
    writer.delete(made[0].id)
    assert made[0] not in reg.list() and reg.find(made[0].id) is None and len(reg) == 200
    # two processes adding in turn (API workers) see each other's voices, in the order they were made (within
    # one second of created_at: an index rebuilt from disk sorted those by id, unlike the adding process's)
    mine, theirs = reg.add("mine", codes), writer.add("theirs", codes)
    assert {mine, theirs} <= set(reg.list()) and {mine, theirs} <= set(writer.list())
    assert [r.name for r in reg.list()][-2:] == ["mine", "theirs"]      # in the order they were made
    reg.delete(mine.id)
    writer.delete(theirs.id)

    from engine.errors import VoiceLimitError
    capped = VoiceRegistry(tmp_path, "bundle-x", max_voices=201)
    capped.add("the last one that fits", codes)
    with pytest.raises(VoiceLimitError, match="limit of 201 voices"):
        capped.add("one too many", codes)
    capped.delete("the last one that fits")
    assert capped.add("fits again", codes).name == "fits again"


def test_max_voices_is_a_clear_409(bounded_server):
    import io

    from conftest import golden

    s = bounded_server
    buf = io.BytesIO()
    sf.write(buf, golden("codec/codec_short.npz")["wav"], 24000, format="WAV")

    def post(name):
        return httpx.post(s.base + "/v1/audio/voices", data={"name": name},
                          files={"audio_sample": ("v.wav", buf.getvalue(), "audio/wav")}, timeout=60)

    ids = [post(f"cap-{i}").json()["id"] for i in range(2)]
    full = post("cap-2")
    assert full.status_code == 409, full.text
    err = full.json()["error"]
    assert err["code"] == "voice_limit_reached" and "limit of 2 voices" in err["message"]
    assert httpx.delete(s.base + f"/v1/audio/voices/{ids[0]}").status_code == 200
    assert post("cap-2").status_code == 200
