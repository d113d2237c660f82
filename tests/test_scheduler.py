"""The batched scheduler: many streams in shared graph calls give each stream exactly its solo output;
admission, cancel, stalls, joins and leaves, validation and thread safety."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import exact_codes, golden, tolerance
from service_helpers import wait_for

TEXT_A = ("Welcome to the world of MOSS TTS Realtime. Experience how text transforms into smooth, "
          "human-like speech in real time, one small step after another.")
TEXT_B = ("The quick brown fox jumps over the lazy dog, while a streaming speech model keeps talking "
          "about weather, numbers like 42, and tea.")


@dataclass
class Turn:
    ids: list[int] | None = None
    deltas: list[str] | None = None
    chunk: int = 3                      # ids per push (ids turns)
    delay: float = 0.0                  # seconds between pushes
    stall_after: int | None = None      # pushes before a long pause (the stream runs out of text)
    user_text: str = ""
    user_audio_codes: np.ndarray | None = None
    cancel_after: int | None = None     # frames the consumer takes before cancelling
    max_frames: int | None = None


@dataclass
class Spec:
    name: str
    turns: list[Turn]
    voice: np.ndarray | None = None
    seed: int = 0
    greedy: bool = True
    start_delay: float = 0.0
    results: list = field(default_factory=list)   # per turn: (frames, stats)


def params_for(model, spec: Spec):
    return model.default_sampling(greedy=True) if spec.greedy else model.default_sampling()


def pushes(turn: Turn):
    if turn.ids is not None:
        return [("ids", turn.ids[i:i + turn.chunk]) for i in range(0, len(turn.ids), turn.chunk)]
    return [("text", d) for d in turn.deltas]


def run_solo(model, spec: Spec):
    from engine.offline.session import StreamingSession

    s = StreamingSession(model, voice_codes=spec.voice, params=params_for(model, spec), seed=spec.seed)
    out = []
    for turn in spec.turns:
        s.begin_turn(user_text=turn.user_text, user_audio_codes=turn.user_audio_codes, max_frames=turn.max_frames)
        frames = []
        for kind, value in pushes(turn):
            frames += s.push_token_ids(value) if kind == "ids" else s.push_text(value)
        frames += s.end_text() + s.drain()
        if turn.cancel_after is not None:
            s.cancel()
        out.append((frames, s.stats, s.context_ids()))
    s.close()
    return out


def run_scheduled(scheduler, model, spec: Spec, errors: list):
    from engine.serving.scheduler import FrameEvent, StreamError, TurnEnd

    try:
        time.sleep(spec.start_delay)
        h = scheduler.open_stream(voice_codes=spec.voice, params=params_for(model, spec), seed=spec.seed)
        for turn in spec.turns:
            h.begin_turn(user_text=turn.user_text, user_audio_codes=turn.user_audio_codes, max_frames=turn.max_frames,
                         wait=60)
            frames: list = []
            for i, (kind, value) in enumerate(pushes(turn)):
                h.push_token_ids(value) if kind == "ids" else h.push_text(value)
                time.sleep(turn.delay)
                if turn.stall_after == i:
                    time.sleep(0.6)          # the LLM is slow: the stream runs dry, others go on
            h.end_text()
            while True:
                event = h.get(timeout=120)
                if isinstance(event, FrameEvent):
                    frames.append(event.frame)
                    if turn.cancel_after is not None and len(frames) == turn.cancel_after:
                        h.cancel()
                elif isinstance(event, StreamError):
                    raise event.error
                elif isinstance(event, TurnEnd):
                    spec.results.append((frames, event.stats, h.stream.context_ids()))
                    break
        h.close()
    except BaseException as e:  # noqa: BLE001 - reported by the test thread
        errors.append((spec.name, e))


def codes(frames):
    return np.stack([f.codes for f in frames])


def audio(frames):
    parts = [f.audio for f in frames if f.audio is not None]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def specs(model) -> list[Spec]:
    st, mt = golden("tts/tts_streaming.npz"), golden("tts/tts_multiturn.npz")
    ids_a, ids_b = model.tokenizer.encode(TEXT_A), model.tokenizer.encode(TEXT_B)
    voice = mt["voice_prompt_codes"].T
    return [
        Spec("ids one by one", [Turn(ids=list(st["streamed_text_ids"]), chunk=1, delay=0.002)]),
        Spec("text deltas", [Turn(deltas=[str(d) for d in st["deltas"]], delay=0.003)], start_delay=0.05),
        Spec("voice, two turns with user audio", [
            Turn(ids=list(mt["turn1_streamed_text_ids"]), chunk=5, user_text="Hey, I just landed in Paris.",
                 user_audio_codes=mt["turn1_user_audio_codes"].T),
            Turn(ids=list(mt["turn2_streamed_text_ids"]), chunk=12, user_text="Just a backpack.",
                 user_audio_codes=mt["turn2_user_audio_codes"].T)], voice=voice, start_delay=0.1),
        Spec("whole text at once", [Turn(ids=ids_a, chunk=len(ids_a))], start_delay=0.3),
        Spec("voice clone", [Turn(ids=ids_b, chunk=7)], voice=voice[:20], start_delay=0.02),
        Spec("sampled, seeded", [Turn(ids=ids_a, chunk=4, max_frames=40)], greedy=False, seed=777, start_delay=0.15),
        Spec("cancelled then next turn", [Turn(ids=ids_b, chunk=4, cancel_after=6), Turn(ids=ids_a[:20], chunk=20)],
             start_delay=0.2),
        Spec("stalls waiting for text", [Turn(ids=ids_a, chunk=2, stall_after=6)], start_delay=0.05),
    ]


@exact_codes
def test_concurrent_streams_equal_solo_runs(model):
    """8 streams (texts, voices, lengths, start times, greedy and sampled, multi-turn, a cancel, a stall)
    share the scheduler's calls; each gets exactly the codes (and, within float32 round-off, the audio)
    of running alone."""
    from engine.serving.scheduler import Scheduler

    all_specs = specs(model)
    scheduler = Scheduler(model, slots=8)
    errors: list = []
    threads = [threading.Thread(target=run_scheduled, args=(scheduler, model, s, errors)) for s in all_specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    peak = scheduler.runner.timing.ticks
    scheduler.stop()
    assert not errors, errors
    batched_steps = scheduler.runner.timing.step.calls
    for spec in all_specs:
        solo = run_solo(model, spec)
        assert len(spec.results) == len(spec.turns), spec.name
        for (frames, stats, ctx), (ref_frames, ref_stats, ref_ctx), turn in zip(spec.results, solo, spec.turns):
            if turn.cancel_after is not None:   # cancelled: a prefix of the solo turn, at least what was read
                assert stats.finish_reason == "cancelled" and len(frames) >= turn.cancel_after
                np.testing.assert_array_equal(codes(frames), codes(ref_frames[: len(frames)]), err_msg=spec.name)
                break   # later turns follow a context the solo run does not have: checked below
            np.testing.assert_array_equal(codes(frames), codes(ref_frames), err_msg=spec.name)
            np.testing.assert_array_equal(ctx, ref_ctx, err_msg=spec.name)
            assert stats.finish_reason == ref_stats.finish_reason, spec.name
            a, ref = audio(frames), audio(ref_frames)
            assert a.shape == ref.shape and np.abs(a - ref).max() <= tolerance(ref), spec.name
    # the turn after the cancel: equal to a session primed with exactly what the scheduler's stream had fed
    spec = all_specs[6]
    _, _, fed = spec.results[0]
    from engine.offline.session import StreamingSession

    ref = StreamingSession(model, params=params_for(model, spec), seed=spec.seed)
    ref.prime(fed)
    turn = spec.turns[1]
    ref.begin_turn()
    ref_frames = ref.push_token_ids(turn.ids) + ref.end_text() + ref.drain()
    np.testing.assert_array_equal(codes(spec.results[1][0]), codes(ref_frames))
    assert all_specs[7].results[0][1].stalls >= 1
    print(f"{peak} ticks, {batched_steps} batched backbone steps for "
          f"{sum(len(r[0]) for s in all_specs for r in s.results)} frames")
    assert batched_steps < sum(len(r[0]) for s in all_specs for r in s.results) * 0.6   # steps were shared


@exact_codes
def test_no_capacity_then_a_freed_slot(model):
    from engine.errors import CapacityError
    from engine.serving.scheduler import Scheduler

    ids = model.tokenizer.encode(TEXT_A)
    scheduler = Scheduler(model, slots=2, queue_timeout=0.2)
    try:
        a, b, c = (scheduler.open_stream(params=model.default_sampling(greedy=True)) for _ in range(3))
        a.begin_turn()
        b.begin_turn()
        with pytest.raises(CapacityError, match="slots are busy"):
            c.begin_turn(wait=0)
        assert scheduler.stats().active == 2
        a.close()
        c.begin_turn(wait=5)                      # the freed slot admits the waiting stream
        for h in (b, c):
            h.push_token_ids(ids)
            h.end_text()
        for h in (b, c):
            frames = drain_events(h)
            np.testing.assert_array_equal(codes(frames), golden("tts/tts_text_only.npz")["greedy_rep_raw_frames"])
    finally:
        scheduler.stop()


def drain_events(h, timeout: float = 120):
    from engine.serving.scheduler import FrameEvent, StreamError, TurnEnd

    frames = []
    while True:
        event = h.get(timeout=timeout)
        if isinstance(event, FrameEvent):
            frames.append(event.frame)
        elif isinstance(event, StreamError):
            raise event.error
        elif isinstance(event, TurnEnd):
            return frames


def test_handle_calls_validate(model):
    from engine.errors import InputError, StreamClosedError
    from engine.model.sampling import SamplingParams
    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=1)
    try:
        h = scheduler.open_stream()
        with pytest.raises(InputError, match="begin_turn"):
            h.push_text("hello")
        with pytest.raises(InputError, match="temperature"):
            scheduler.open_stream(params=SamplingParams(temperature=-1))
        h.begin_turn()
        h.push_text("Hello there.")
        h.end_text()
        with pytest.raises(InputError, match="already ended"):
            h.push_text("more")
        with pytest.raises(InputError, match="in progress"):
            h.begin_turn()
        drain_events(h)
        h.close()
        h.close()                                   # idempotent
        with pytest.raises(StreamClosedError):
            h.push_text("x")
        with pytest.raises(StreamClosedError):
            h.begin_turn()
    finally:
        scheduler.stop()


@exact_codes
def test_slow_consumer_pauses_its_stream(model):
    """A consumer that does not read holds its own stream (bounded buffering) and not the others."""
    from engine.serving.scheduler import Scheduler

    ids = model.tokenizer.encode(TEXT_A)
    scheduler = Scheduler(model, slots=2, max_buffered_frames=4)
    try:
        slow, fast = (scheduler.open_stream(params=model.default_sampling(greedy=True)) for _ in range(2))
        for h in (slow, fast):
            h.begin_turn()
            h.push_token_ids(ids)
            h.end_text()
        frames = drain_events(fast)                 # the fast consumer finishes its whole turn
        np.testing.assert_array_equal(codes(frames), golden("tts/tts_text_only.npz")["greedy_rep_raw_frames"])
        assert slow.stream.paused and slow.stream.stats.frames <= 5
        got = drain_events(slow)                    # reading resumes it
        np.testing.assert_array_equal(codes(got), codes(frames))
    finally:
        scheduler.stop()


def test_session_refuses_concurrent_use(model):
    """A StreamingSession is not thread-safe: a second thread entering it gets ConcurrentUseError, never a
    corrupted state (the old session raised IndexError in most trials)."""
    from engine.errors import ConcurrentUseError
    from engine.offline.session import StreamingSession

    text = TEXT_A * 3
    seen = []
    for trial in range(10):
        s = StreamingSession(model, params=model.default_sampling(greedy=True), seed=trial)
        s.begin_turn(max_frames=400)
        barrier = threading.Barrier(2)

        def push():
            barrier.wait()
            try:
                for word in text.split(" "):
                    s.push_text(word + " ")
            except ConcurrentUseError as e:
                seen.append(e)

        threads = [threading.Thread(target=push) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.close()
    assert seen, "the two threads never overlapped"


def test_admission_is_first_come_first_served_and_a_closed_slot_is_free_at_once(model):
    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=1)
    try:
        a = scheduler.open_stream()
        a.begin_turn(wait=0)
        a.close()
        b = scheduler.open_stream()
        b.begin_turn(wait=0)             # the slot a closed is free right away (not at the loop's next step)
        order, threads = [], []
        for name in ("first", "second", "third"):
            h = scheduler.open_stream()

            def wait_for_slot(h=h, name=name):
                h.begin_turn(wait=30)
                order.append(name)

            threads.append((threading.Thread(target=wait_for_slot), h))
            threads[-1][0].start()
            queued = len(threads)
            wait_for(lambda: scheduler.stats().queued == queued, 10, f"{name} in the queue")   # arrive in order
        holder = b
        for i in range(3):
            holder.close()
            wait_for(lambda: len(order) == i + 1, 10, f"waiter {i + 1} admitted")
            holder = threads[i][1]
        assert order == ["first", "second", "third"]
        threads[2][1].close()
    finally:
        scheduler.stop()


def test_codec_chunking_policy():
    """Frames go to the codec in the schedule's chunks; early only while that keeps playback going, and
    never in small calls for a listener already starved by a stream slower than real time."""
    from engine.serving.pacing import frames_to_decode

    fast, slow, codec, frame = 0.02, 0.3, 0.1, 0.08      # tick durations faster / slower than one 80 ms frame
    assert frames_to_decode(1, False, 1, None, slow, codec, frame) == 1          # the first chunk: at once
    assert frames_to_decode(4, False, 6, None, slow, codec, frame) == 0          # wait for a chunk of 6
    assert frames_to_decode(9, False, 6, 5.0, slow, codec, frame) == 6
    assert frames_to_decode(3, True, 6, 5.0, slow, codec, frame) == 3            # the turn ended: all of it
    assert frames_to_decode(3, False, 6, 5.0, fast, codec, frame) == 0           # plenty to play: keep chunking
    assert frames_to_decode(3, False, 6, 0.1, fast, codec, frame) == 3           # about to run dry: decode now
    assert frames_to_decode(3, False, 6, 0.1, slow, codec, frame) == 3
    assert frames_to_decode(3, False, 6, -0.5, fast, codec, frame) == 3          # starved, but it can catch up
    assert frames_to_decode(3, False, 6, -0.5, slow, codec, frame) == 0          # starved and slow: full chunks


def test_every_turn_starts_with_a_one_frame_codec_chunk(model):
    """A later turn of a stream gets its first frame's audio as soon as that frame exists, like the first
    turn: the chunk schedule and the playback clock start again with each turn."""
    from engine.serving.runner import SERVICE_CODEC_SCHEDULE, StepRunner
    from engine.serving.stream import StreamState

    stream = StreamState(model, params=model.default_sampling(greedy=True), seed=0)
    runner = StepRunner(model, 1, stream.limits.max_context_rows, codec_schedule=SERVICE_CODEC_SCHEDULE)
    runner.attach(stream)
    ids = model.tokenizer.encode("One sentence, spoken twice over, as two turns of one stream.")
    for user_text in ("", "And again?"):
        stream.begin_turn(user_text=user_text, max_frames=12)
        stream.push_token_ids(ids)
        stream.end_text()
        generated_at_first_audio = None
        while not stream.turn_done or runner.has_work():
            handed = runner.tick().frames
            if handed and generated_at_first_audio is None:
                assert handed[0][1].audio is not None
                generated_at_first_audio = stream.stats.frames
        assert generated_at_first_audio == 1, user_text


def test_a_stream_waiting_for_text_leaves_the_loop_asleep(model, monkeypatch):
    """While a stream waits for more text with a few frames held back for their codec chunk, the loop
    sleeps until the listener's audio runs low instead of ticking in a busy loop; the held frames still
    arrive, early, once they are needed. Counted in runner ticks (every pass of the loop is one), not in
    the process's CPU time, which other threads on a loaded machine also spend."""
    from engine.serving.scheduler import Scheduler, StreamError, TurnEnd

    scheduler = Scheduler(model, slots=1)
    ticks = itertools.count()
    tick = scheduler.runner.tick
    monkeypatch.setattr(scheduler.runner, "tick", lambda: (next(ticks), tick())[1])
    try:
        h = scheduler.open_stream(params=model.default_sampling(greedy=True), seed=0)
        h.begin_turn(max_frames=200, wait=60)
        ids = model.tokenizer.encode(" ".join(["a quiet loop sleeps"] * 20))
        h.push_token_ids(ids[:52])                     # 12 to prefill + 40 frames: ~3 s of audio ahead
        wait_for(lambda: h.stream.stats.stalls, 60, "generated up to the end of the text", interval=0.01)
        before = next(ticks)
        time.sleep(1.0)
        passes = next(ticks) - before - 1
        h.push_token_ids(ids[52:60])
        h.end_text()
        frames = []
        while not isinstance(event := h.get(timeout=60), TurnEnd):
            assert not isinstance(event, StreamError), event
            frames.append(event.frame)
        # asleep: no pass, or the one or two that hand the held frames over as the listener's audio runs
        # low; a busy loop makes thousands
        assert passes <= 3, f"the scheduler loop ticked {passes} times in 1 s of waiting"
        assert [f.index for f in frames] == list(range(len(frames))) and len(frames) > 40
        assert all(f.audio is not None for f in frames if f.needs_audio)
    finally:
        scheduler.stop()


def test_a_failed_tick_fails_each_stream_with_an_error_then_its_turn_end(model, monkeypatch):
    """Every way a stream fails (a tick that raises, here) is the one path: its consumer gets the error, then
    its turn's end (finish reason ``error``), so a consumer waiting for either never hangs; the slot is
    released as usual."""
    from engine.serving.scheduler import Scheduler, StreamError, TurnEnd
    from engine.serving.stream import FinishReason

    scheduler = Scheduler(model, slots=1)
    try:
        h = scheduler.open_stream(params=model.default_sampling(greedy=True))
        h.begin_turn(wait=30)
        real = scheduler.runner.tick
        monkeypatch.setattr(scheduler.runner, "tick", lambda: (_ for _ in ()).throw(RuntimeError("a bug")))
        h.push_text(TEXT_A)
        h.end_text()
        first = h.get(timeout=30)
        second = h.get(timeout=30)
        monkeypatch.setattr(scheduler.runner, "tick", real)
        assert isinstance(first, StreamError) and "a bug" in str(first.error)
        assert isinstance(second, TurnEnd) and second.stats.finish_reason is FinishReason.ERROR
        h.close()
        assert scheduler.stats().active == 0
    finally:
        scheduler.stop()


def test_the_runner_records_each_working_tick(model):
    """The loop's cost per tick (what ``bench streams`` reports as host time): every working tick is kept
    with its wall time, the part of it inside onnxruntime runs, and how many streams it fed."""
    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=2)
    try:
        timing = scheduler.runner.timing
        handles = [scheduler.open_stream(params=model.default_sampling(greedy=True), seed=i) for i in range(2)]
        for h in handles:
            h.begin_turn(max_frames=4, wait=60)
            h.push_text("Hello there, how are you?")
            h.end_text()
        frames = sum(len(drain_events(h)) for h in handles)
        ticks = list(timing.recent_ticks)
        assert len(ticks) == timing.ticks and abs(sum(w for w, _, _ in ticks) - timing.tick_s) < 1e-9
        assert all(0 <= run <= wall for wall, run, _ in ticks), ticks
        # no bucket warm-up on this scheduler: every graph run it made was inside a tick
        assert abs(sum(run for _, run, _ in ticks) - timing.run_s()) < 1e-9 and timing.run_s() > 0
        assert {k for _, _, k in ticks} <= {0, 1, 2} and max(k for _, _, k in ticks) == 2
        # every frame came from a tick that fed its stream a row (a frame's depth call follows a fed row)
        assert sum(k for _, _, k in ticks) >= frames > 0
    finally:
        for h in handles:
            h.close()
        scheduler.stop()
