"""Issue 43, items 3 and 4: the slot core's races, each forced by holding the device loop (or one of its device
copies) at the point where it happened, and one-shot streams that leave their slot without a copy.

The loop is held by wrapping one of its steps (``Scheduler._attach``, ``Scheduler._park``) or one device copy
with a function that waits on an event: the test then does what another thread would do in that window."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from service_helpers import Server, metric, raw_request, wait_for
from test_engine_hardening import failing_once, wait_until
from test_parking import SHORT, turn, turn_alone
from test_scheduler import TEXT_A, codes, drain_events

HOLD_S = 60           # how long a held loop step waits for the test before it goes on anyway


def held(fn, entered: threading.Event, release: threading.Event, only=None):
    """``fn`` that, on a call whose first argument is ``only`` (any call: None), sets ``entered`` and waits
    for ``release`` before it runs."""
    def wrapper(*args, **kwargs):
        if only is None or (args and args[0] is only):
            entered.set()
            release.wait(HOLD_S)
        return fn(*args, **kwargs)
    return wrapper


def params(model):
    return model.default_sampling(greedy=True)


# ---------------------------------------------------------------------------------------------- one-shot streams
def test_a_one_shot_stream_leaves_its_slot_without_a_copy_when_its_turn_ends(model):
    """One slot: a one-shot stream's turn ends while its consumer has read nothing yet (a slow HTTP reader).
    Its slot is free at once — the next stream is admitted with no park (no device-to-host copy of a context
    nobody resumes) — its frames still all reach the consumer, and a second turn is refused."""
    from engine.errors import InputError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=60, parked_bytes=1 << 30)
    try:
        copies = []
        real_park_rows = sch.runner.kv.park_rows
        sch.runner.kv.park_rows = lambda *a: (copies.append(a), real_park_rows(*a))[1]
        one = sch.open_stream(params=params(model), one_shot=True)
        one.begin_turn(wait=30)
        one.push_token_ids(model.tokenizer.encode(SHORT))
        one.end_text()
        wait_until(lambda: one.turns_ended == 1, 120, "the one-shot turn's end")     # nothing read yet
        wait_until(lambda: sch.stats().active == 0 and sch.runner.attached == 0, 30, "its slot given back")
        other = sch.open_stream(params=params(model))
        said = turn(other, model.tokenizer.encode(SHORT))
        stats = sch.stats().parking
        assert stats.parks == 0 and stats.parked == 0 and not copies, (stats, len(copies))
        frames = drain_events(one)                       # what it said before it left is all delivered
        np.testing.assert_array_equal(codes(frames), codes(said))      # the same text, the same first turn
        with pytest.raises(InputError, match="one-shot"):
            one.begin_turn(wait=0)
        one.close()
        other.close()
        wait_until(lambda: sch.stats().active == 0, 30, "every slot free")
    finally:
        sch.stop()


def test_a_stream_that_may_not_park_others_takes_only_a_free_slot(model):
    """One slot held by an idle conversation: a stream opened with ``may_park_others=False`` (a keyless
    Wyoming synthesis) is refused at its deadline without parking it; a stream that may park takes the slot
    past it; the non-parking one, queued, takes the next free slot (it keeps its place)."""
    from engine.errors import CapacityError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=60, parked_bytes=1 << 30)
    try:
        idle = sch.open_stream(params=params(model))
        turn(idle, model.tokenizer.encode(SHORT))
        shy = sch.open_stream(params=params(model), may_park_others=False)
        with pytest.raises(CapacityError):
            shy.begin_turn(wait=0.3)
        assert sch.stats().parking.parks == 0 and idle.attached
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (shy.begin_turn(wait=120), admitted.set()), daemon=True)
        waiter.start()
        wait_until(lambda: sch.stats().queued == 1, 30, "the non-parking stream queued")
        bold = sch.open_stream(params=params(model))
        bold.begin_turn(wait=30)                       # passes the non-parking waiter: parks the idle one
        wait_until(lambda: sch.stats().parking.parks == 1, 30, "the idle conversation parked")
        assert not admitted.is_set()
        bold.push_token_ids(model.tokenizer.encode(SHORT))
        bold.end_text()
        drain_events(bold)
        bold.close()                                   # a free slot: the queued non-parking stream takes it
        assert admitted.wait(60), "the non-parking waiter did not take the freed slot"
        assert sch.stats().parking.parks == 1
        shy.push_token_ids(model.tokenizer.encode(SHORT))
        shy.end_text()
        assert drain_events(shy)
        for h in (idle, shy):
            h.close()
    finally:
        sch.stop()


@pytest.fixture(scope="module")
def one_slot_server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_shot")
    with Server(demo_bundle_dir, tmp / "voices", tmp / "s.log", "--max-streams", "1", "--stall-timeout", "600",
                "--queue-timeout", "60") as s:
        yield s


def test_a_finished_http_stream_is_not_parked_while_its_reader_is_slow(one_slot_server):
    """``--max-streams 1``: an HTTP request whose client reads nothing (a 4 KiB receive buffer) finishes
    generating and is still writing its answer; its slot is free already, and a second request takes it
    without parking the first (no copy of a context nobody resumes; before, it was parked)."""
    s = one_slot_server
    parks = metric(s, "mossrt_parks_total")
    body = {"model": "x", "input": TEXT_A, "response_format": "pcm", "speed": 0.25, "max_frames": 200}
    slow = raw_request(s, json.dumps(body).encode(), rcvbuf=4096)
    try:
        wait_for(lambda: metric(s, "mossrt_generating_streams") == 1, 60, "the slow request generating")
        wait_for(lambda: metric(s, "mossrt_generating_streams") == 0, 120, "its turn over")
        wait_for(lambda: metric(s, "mossrt_active_streams") == 0, 30, "its slot given back")
        second = dict(body, input=SHORT, max_frames=20, speed=1.0)
        import httpx
        r = httpx.post(s.base + "/v1/audio/speech", json=second, timeout=120)
        assert r.status_code == 200 and r.content, r.text
        assert metric(s, "mossrt_parks_total") == parks
        assert slow.recv(4096), "the slow reader's answer was cut off"
    finally:
        slow.close()


# --------------------------------------------------------------------------------------- a turn failing after admission
def test_a_turn_refused_for_its_inputs_takes_no_slot(model):
    """A turn whose prompt does not fit the stream's context is refused before it asks for a slot, so the
    loop can never attach it for a turn that never opens (before: when the loop took it between the
    admission and the refusal, it kept the slot)."""
    from engine.errors import ContextLimitError
    from engine.limits import Limits
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30)
    try:
        real_reserve = sch.admission.reserve

        def reserve_then_let_the_loop_attach(handle, *args, **kwargs):
            got = real_reserve(handle, *args, **kwargs)
            wait_until(lambda: handle.attached, 30, "the loop attaching the admitted stream")
            return got

        sch.admission.reserve = reserve_then_let_the_loop_attach
        h = sch.open_stream(params=params(model), limits=Limits(max_context_rows=64))
        with pytest.raises(ContextLimitError):
            h.begin_turn(user_text=TEXT_A * 4, wait=30)
        assert sch.stats().active == 0 and sch.runner.attached == 0 and not h.attached
        sch.admission.reserve = real_reserve
        assert turn(sch.open_stream(params=params(model)), model.tokenizer.encode(SHORT))
    finally:
        sch.stop()


def failing_open(stream, entered_loop: threading.Event | None = None, wait_attached=None):
    """Make the stream's next turn fail as it opens (after admission), once the loop has taken it
    (``entered_loop`` set) or attached it (``wait_attached`` true)."""
    from engine.errors import InputError

    real = stream.open_turn

    def open_turn(inputs):
        stream.open_turn = real
        if entered_loop is not None:
            assert entered_loop.wait(30), "the loop never took the stream"
        if wait_attached is not None:
            wait_until(wait_attached, 30, "the loop attaching the stream")
        raise InputError("injected: the turn could not open")
    stream.open_turn = open_turn


def test_a_turn_failing_while_the_loop_attaches_it_gives_the_slot_back(model):
    """The loop has taken an admitted stream and is about to attach it when its turn fails to open: it is
    not attached, and its slot is free (before: attached anyway for a turn that never opened, the slot held)."""
    from engine.errors import InputError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30)
    entered, release = threading.Event(), threading.Event()
    try:
        h = sch.open_stream(params=params(model))
        sch._attach = held(sch._attach, entered, release, only=h)
        failing_open(h.stream, entered_loop=entered)
        done = threading.Event()

        def fail_then_release():
            with pytest.raises(InputError):
                h.begin_turn(wait=30)
            release.set()
            done.set()
        threading.Thread(target=fail_then_release, daemon=True).start()
        assert done.wait(60)
        wait_until(lambda: sch.stats().active == 0, 30, "the promise given back")
        wait_until(lambda: entered.is_set() and not h.attached and sch.runner.attached == 0, 30, "no attach")
        assert turn(h, model.tokenizer.encode(SHORT))          # the stream is whole: its next turn runs
        h.close()
        assert turn(sch.open_stream(params=params(model)), model.tokenizer.encode(SHORT))
    finally:
        release.set()
        sch.stop()


def test_a_turn_failing_once_attached_detaches_it_again(model):
    """The loop attached the admitted stream before its turn failed to open: it is detached again, the slot
    free for the next stream."""
    from engine.errors import InputError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30)
    try:
        h = sch.open_stream(params=params(model))
        failing_open(h.stream, wait_attached=lambda: h.attached)
        with pytest.raises(InputError):
            h.begin_turn(wait=30)
        wait_until(lambda: sch.stats().active == 0 and sch.runner.attached == 0, 30, "the slot given back")
        assert turn(sch.open_stream(params=params(model)), model.tokenizer.encode(SHORT))
    finally:
        sch.stop()


def test_a_parked_streams_failing_turn_leaves_its_rows_parked(model):
    """A parked conversation's turn is admitted (the idle stream in the slot parked for it), the loop takes
    it, and the turn fails to open: its rows stay parked (no re-upload for a turn that never opened), the
    slot is free, and its next turn resumes it exactly."""
    from engine.errors import InputError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30, parked_bytes=1 << 30)
    entered, release = threading.Event(), threading.Event()
    try:
        a, b = sch.open_stream(params=params(model)), sch.open_stream(params=params(model))
        turn(a, model.tokenizer.encode(TEXT_A)[:30])
        turn(b, model.tokenizer.encode(SHORT))                  # A parked for B
        assert a.stream.parked and sch.stats().parking.parks == 1
        sch._attach = held(sch._attach, entered, release, only=a)
        failing_open(a.stream, entered_loop=entered)
        with pytest.raises(InputError):
            a.begin_turn(wait=30)                               # B parked for A, then A's turn fails
        release.set()
        wait_until(lambda: sch.stats().active == 0 and sch.runner.attached == 0, 30, "the slot given back")
        stats = sch.stats().parking
        assert a.stream.parked and stats.resumes == 0 and stats.parked == 2, stats
        assert turn(a, model.tokenizer.encode(SHORT))          # resumes from its parked rows
        assert sch.stats().parking.resumes == 1
        assert sch.runner.context_kv(a.stream).shape[3] == a.context_rows
    finally:
        release.set()
        sch.stop()


# ---------------------------------------------------------------------------------------------- all-or-nothing moves
def test_a_failing_codec_ring_move_leaves_the_moved_stream_whole(model):
    """Three idle streams; the first closes and moving the last one's codec ring into its slot fails once:
    the retry (at the next wake: the second stream's turn) moves the same rows, and the moved stream's
    context is bit-exact (before: the KV lengths had moved already, the retry moved 0 rows and the
    stream's context was silently empty)."""
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=3)
    try:
        a, b, c = (sch.open_stream(params=params(model), seed=i) for i in range(3))
        for h in (a, b, c):
            turn(h, model.tokenizer.encode(SHORT))
        wait_until(lambda: sch.stats().generating == 0, 30, "three idle streams")
        by_slot = {e.slot: e.stream for e in sch.runner.entries}       # where the trades left them
        first, moved = next(h for h in (a, b, c) if h.stream is by_slot[0]), by_slot[2]
        other = next(h for h in (a, b, c) if h.stream not in (by_slot[0], moved))
        before = {id(h.stream): sch.runner.context_kv(h.stream) for h in (a, b, c)}
        writer = sch.runner.decoder.state._writer
        writer.move = failing_once(writer.move, MemoryError("injected device out-of-memory"))
        first.close()                                    # the stream in slot 2 moves into slot 0
        wait_until(lambda: len(writer.move.calls) == 1, 30, "the failed ring move")
        assert turn(other, model.tokenizer.encode(SHORT))   # wakes the loop: the detach is retried
        wait_until(lambda: not first.attached, 30, "the retried detach")
        assert len(writer.move.calls) >= 2
        np.testing.assert_array_equal(sch.runner.context_kv(moved), before[id(moved)])
        last = next(h for h in (a, b, c) if h.stream is moved)
        assert turn(last, model.tokenizer.encode(SHORT))
        assert sch.runner.context_kv(moved).shape[3] == last.context_rows
        other.close()
        last.close()
        wait_until(lambda: sch.runner.attached == 0, 30, "every slot free")
    finally:
        sch.stop()


def trade_scenario(model, inject):
    """Four slots: A speaks (slot 0), then B starts while A is idle in slot 0, so B trades slots with A;
    ``inject(kv)`` makes one of the trade's copies fail once. Returns B's frames, A's rows before and after,
    and A's context rows."""
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=4, queue_timeout=60, warm_buckets=False)
    try:
        a, b = sch.open_stream(params=params(model)), sch.open_stream(params=params(model))
        turn(a, model.tokenizer.encode(TEXT_A)[:30])
        before = sch.runner.context_kv(a.stream)
        inject(sch.runner.kv)
        got_b = turn(b, model.tokenizer.encode(SHORT))      # raises B's error, if any
        after = sch.runner.context_kv(a.stream)
        assert turn(a, model.tokenizer.encode(SHORT))      # A's next turn runs on its context
        return got_b, before, after, a, sch.broken
    finally:
        sch.stop()


@pytest.mark.parametrize("copy", ["write_rows", "copy_slot"])
def test_a_failing_slot_trade_fails_no_stream_and_loses_no_context(model, copy):
    """A slot trade's device copy fails once (the generating stream's rows over the idle one's, or the idle
    one's rows into the freed slot): neither stream fails (before: the tick's error failed the generating
    one), the idle stream's context is bit-exact, and the generating one says what it says alone."""
    got_b, before, after, a, broken = trade_scenario(
        model, lambda kv: setattr(kv, copy, failing_once(getattr(kv, copy), MemoryError("injected"))))
    assert broken is None
    np.testing.assert_array_equal(after, before)
    ref_b = turn_alone(model, params(model), model.tokenizer.encode(SHORT))
    if copy == "write_rows":                   # the trade completed for B: it ran at batch 1, as alone
        np.testing.assert_array_equal(codes(got_b), codes(ref_b))
    else:                                      # the trade was given up for that tick: batch 2 then, its round-off
        assert codes(got_b).shape == codes(ref_b).shape


# ------------------------------------------------------------------------------------------ the budget before the copy
def counting_park_rows(sch) -> list:
    calls = []
    real = sch.runner.kv.park_rows
    sch.runner.kv.park_rows = lambda *a: (calls.append(a), real(*a))[1]
    return calls


@pytest.mark.parametrize("budget", [0, 1], ids=["zero", "smaller-than-one-context"])
def test_a_park_the_budget_would_not_keep_copies_nothing(model, budget):
    """A budget of 0 bytes, or one smaller than the context: the idle stream is evicted without a copy
    (before: its rows were copied to the host, then dropped)."""
    from engine.errors import ContextEvictedError
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30, parked_bytes=budget)
    try:
        a, b = sch.open_stream(params=params(model)), sch.open_stream(params=params(model))
        turn(a, model.tokenizer.encode(SHORT))
        copies = counting_park_rows(sch)
        assert turn(b, model.tokenizer.encode(SHORT))
        stats = sch.stats().parking
        assert stats.evictions == 1 and stats.parked == 0 and stats.bytes == 0, stats
        assert not copies, f"{len(copies)} copies for a context the budget could not keep"
        with pytest.raises(ContextEvictedError):
            a.begin_turn(wait=0)
    finally:
        sch.stop()


def test_a_stream_closed_after_it_was_chosen_for_parking_is_not_copied(model):
    """The loop is about to park an idle stream when its client closes it: its slot is freed without a copy
    and nothing stays parked."""
    from engine.serving.scheduler import Scheduler

    sch = Scheduler(model, slots=1, queue_timeout=30, parked_bytes=1 << 30)
    entered, release = threading.Event(), threading.Event()
    try:
        a, b = sch.open_stream(params=params(model)), sch.open_stream(params=params(model))
        turn(a, model.tokenizer.encode(SHORT))
        copies = counting_park_rows(sch)
        sch._park = held(sch._park, entered, release, only=a)
        t = threading.Thread(target=lambda: b.begin_turn(wait=30), daemon=True)
        t.start()
        assert entered.wait(30)
        a.close()
        release.set()
        t.join(30)
        b.push_token_ids(model.tokenizer.encode(SHORT))
        b.end_text()
        assert drain_events(b)
        stats = sch.stats().parking
        assert not copies and stats.parked == 0 and stats.bytes == 0, (len(copies), stats)
    finally:
        release.set()
        sch.stop()


def test_parking_an_owner_again_replaces_its_bytes():
    """``ParkedContexts.put`` for an owner already parked (an invariant says it never is) keeps the byte count
    exact: the newer rows replace the older."""
    from engine.kv.parking import ParkedContexts

    parked = ParkedContexts(1 << 20)
    owner = object()
    parked.put(owner, np.zeros(1000, np.float32), lambda h: True)
    parked.put(owner, np.zeros(10, np.float32), lambda h: True)
    assert parked.bytes == 40 and parked.stats().parked == 1
    assert parked.take(owner).nbytes == 40 and parked.bytes == 0
