"""Parking: a stream between turns gives its slot to a waiter (its used KV rows copied to the host), takes a
slot again at its next turn (rows copied back) and says exactly what it would have said unparked; past the
parked-context budget it is evicted and its next turn refuses with ContextEvictedError.

With one slot every call runs at batch 1 in slot 0, parked or not, so the codes are compared exactly at every
compute dtype (no batch-shape round-off to excuse); the waveform within the codec's round-off (its chunk
sizes follow the playback clock)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tts_tolerance
from service_helpers import wait_for
from test_scheduler import TEXT_A, TEXT_B, audio, codes, drain_events

SHORT = "Hello there, how are you today?"


def turn(h, ids, wait: float = 60):
    h.begin_turn(wait=wait)
    h.push_token_ids(ids)
    h.end_text()
    return drain_events(h)


def conversation(scheduler, model, greedy: bool, other_between: bool):
    """Stream A: two turns; with ``other_between`` a stream B takes the only slot between them (A parked),
    and B is parked in turn when A resumes. Returns A's frames of both turns and the scheduler's parking stats."""
    params = model.default_sampling(greedy=True) if greedy else model.default_sampling()
    a = scheduler.open_stream(params=params, seed=1234)
    first = turn(a, model.tokenizer.encode(TEXT_A)[:30])
    if other_between:
        b = scheduler.open_stream(params=params, seed=99)
        turn(b, model.tokenizer.encode(TEXT_B)[:20])            # A is idle: parked for B
        assert a.stream.parked and not a.attached
    kv_before = None if other_between else scheduler.runner.context_kv(a.stream)
    second = turn(a, model.tokenizer.encode(SHORT))             # B idle: parked for A, A resumes
    return first, second, kv_before, a


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_a_parked_conversation_resumes_exactly(model, greedy):
    from engine.serving.scheduler import Scheduler

    ref = Scheduler(model, slots=1, queue_timeout=60, parked_bytes=1 << 30)
    try:
        ref_first, ref_second, _, ref_a = conversation(ref, model, greedy, other_between=False)
        ref_kv = ref.runner.context_kv(ref_a.stream)
        assert ref.stats().parking.parks == 0
    finally:
        ref.stop()
    parked = Scheduler(model, slots=1, queue_timeout=60, parked_bytes=1 << 30)
    try:
        first, second, _, a = conversation(parked, model, greedy, other_between=True)
        stats = parked.stats().parking
        assert stats.parks == 2 and stats.resumes == 1 and stats.evictions == 0, stats
        assert stats.parked == 1 and stats.bytes > 0           # B's rows, its used rows only
        assert stats.bytes < parked.runner.kv.nbytes_per_slot
        np.testing.assert_array_equal(parked.runner.context_kv(a.stream), ref_kv)   # the rows came back bit-exact
        assert len(parked.take_resume_seconds()) == 1
    finally:
        parked.stop()
    np.testing.assert_array_equal(codes(first), codes(ref_first))
    np.testing.assert_array_equal(codes(second), codes(ref_second))
    got, ref = audio(second), audio(ref_second)        # the codec's chunking follows the clock: its round-off
    assert got.shape == ref.shape and np.abs(got - ref).max() <= tts_tolerance(ref)


def test_past_the_budget_a_parked_context_is_evicted(model):
    from engine.errors import CapacityError, ContextEvictedError
    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=1, queue_timeout=0.5, parked_bytes=0)
    try:
        params = model.default_sampling(greedy=True)
        a, b = scheduler.open_stream(params=params), scheduler.open_stream(params=params)
        turn(a, model.tokenizer.encode(SHORT))
        b.begin_turn(wait=30)                 # A idle: parked, and at once evicted (a budget of 0 bytes)
        wait_for(lambda: scheduler.stats().parking.evictions == 1, 30, "the eviction")
        stats = scheduler.stats().parking
        assert stats.evictions == 1 and stats.parked == 0 and stats.bytes == 0
        with pytest.raises(ContextEvictedError):
            a.begin_turn(wait=0)
        b.push_token_ids(model.tokenizer.encode(SHORT))
        b.end_text()
        drain_events(b)
        c = scheduler.open_stream(params=params)
        c.begin_turn(wait=30)                 # B idle: parked for C; a generating stream is never parked
        with pytest.raises(CapacityError):
            scheduler.open_stream(params=params).begin_turn(wait=0.2)
        c.close()
        a.close()
        assert scheduler.stats().active == 0
    finally:
        scheduler.stop()


def test_the_oldest_parked_context_goes_first_and_closing_frees_its_rows(model):
    from engine.serving.scheduler import Scheduler

    params = model.default_sampling(greedy=True)
    probe = Scheduler(model, slots=1, queue_timeout=30, parked_bytes=1 << 30)
    try:
        x = probe.open_stream(params=params)
        turn(x, model.tokenizer.encode(SHORT))
        probe.open_stream(params=params).begin_turn(wait=30)
        wait_for(lambda: probe.stats().parking.parks == 1, 30, "the park")
        one = probe.stats().parking.bytes               # one parked short conversation
    finally:
        probe.stop()
    scheduler = Scheduler(model, slots=1, queue_timeout=30, parked_bytes=one + one // 2)   # room for one
    try:
        a, b, c = (scheduler.open_stream(params=params) for _ in range(3))
        turn(a, model.tokenizer.encode(SHORT))
        turn(b, model.tokenizer.encode(SHORT))          # A parked
        c.begin_turn(wait=30)                            # B parked: A, parked first, is evicted
        wait_for(lambda: scheduler.stats().parking.parks == 2, 30, "B parked")
        assert a.evicted and not b.evicted
        stats = scheduler.stats().parking
        assert stats.evictions == 1 and stats.parked == 1
        b.close()                                        # a parked stream that closes frees its rows
        assert scheduler.stats().parking.bytes == 0 and scheduler.stats().parking.parked == 0
        c.close()
        a.close()
    finally:
        scheduler.stop()


def test_a_queued_stream_takes_the_slot_when_its_holder_goes_idle(model):
    """A stream waiting while the only slot's stream generates is admitted when that turn ends (the holder is
    parked for it then), well before its queue timeout."""
    import threading

    from engine.serving.scheduler import Scheduler

    scheduler = Scheduler(model, slots=1, queue_timeout=600, parked_bytes=1 << 30)
    try:
        params = model.default_sampling(greedy=True)
        a, b = scheduler.open_stream(params=params), scheduler.open_stream(params=params)
        a.begin_turn(wait=30)
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (b.begin_turn(wait=600), admitted.set()), daemon=True)
        waiter.start()
        wait_for(lambda: scheduler.stats().queued == 1, 30, "B in the queue")
        assert not admitted.is_set()
        a.push_token_ids(model.tokenizer.encode(SHORT))
        a.end_text()
        drain_events(a)
        assert admitted.wait(60), "the waiter was not admitted when the holder went idle"
        wait_for(lambda: scheduler.stats().parking.parks == 1, 30, "A parked for B")
        b.close()
        a.close()
    finally:
        scheduler.stop()


def turn_alone(model, params, ids):
    """The frames of one turn on a scheduler of one slot: what a stream says with nobody beside it."""
    from engine.serving.scheduler import Scheduler

    alone = Scheduler(model, slots=1, queue_timeout=60, warm_buckets=False)
    try:
        return turn(alone.open_stream(params=params), ids)
    finally:
        alone.stop()


def test_idle_streams_in_slots_do_not_inflate_the_batch_bucket(model):
    """Four slots: A speaks, then B (A idle in slot 0): B's turn runs at bucket 1, not 2 — it trades slots
    with the idle A as it starts — and both say exactly what they say alone."""
    from engine.serving.scheduler import Scheduler

    params = model.default_sampling(greedy=True)
    ids_a, ids_b = model.tokenizer.encode(TEXT_A)[:30], model.tokenizer.encode(SHORT)
    ref_b = turn_alone(model, params, ids_b)
    scheduler = Scheduler(model, slots=4, queue_timeout=60, warm_buckets=False)
    try:
        a, b = scheduler.open_stream(params=params), scheduler.open_stream(params=params)
        turn(a, ids_a)
        got_b = turn(b, ids_b)
        assert sorted(scheduler.runner.buckets) == [1], sorted(scheduler.runner.buckets)
        second_a = turn(a, ids_b)             # A's second turn: B idle below it now, so A moves down too
        assert sorted(scheduler.runner.buckets) == [1]
        assert scheduler.runner.context_kv(a.stream).shape[3] == a.context_rows
    finally:
        scheduler.stop()
    np.testing.assert_array_equal(codes(got_b), codes(ref_b))
    assert len(second_a) > 0


def test_a_turn_running_above_one_that_ends_moves_down_mid_turn(model):
    """A (slot 0) and B (slot 1) speak at once; A's turn is short, B's long. Once A's turn is over, B trades
    slots with it mid-turn (its rows and codec ring moved), so no step carries A's idle row; B says what it
    says alone (codes exact at fp32, audio within the codec's round-off: its ring moved mid-turn)."""
    from engine.serving.scheduler import Scheduler

    params = model.default_sampling(greedy=True)
    ids_a, ids_b = model.tokenizer.encode(SHORT)[:3], model.tokenizer.encode(TEXT_A)
    ref_b = turn_alone(model, params, ids_b)
    scheduler = Scheduler(model, slots=4, queue_timeout=60, warm_buckets=False)
    try:
        a, b = scheduler.open_stream(params=params), scheduler.open_stream(params=params)
        for h, ids in ((a, ids_a), (b, ids_b)):
            h.begin_turn(wait=60)
            h.push_token_ids(ids)
            h.end_text()
        got_a, got_b = drain_events(a), drain_events(b)
        timing = scheduler.runner.timing
        assert len(got_b) > len(got_a) + 4, (len(got_a), len(got_b))     # B spoke on alone after A's turn
        assert timing.slot_trades >= 1
        assert timing.idle_rows_stepped == 0
    finally:
        scheduler.stop()
    assert len(got_b) == len(ref_b)
    if model.compute_dtype == "fp32":
        np.testing.assert_array_equal(codes(got_b), codes(ref_b))
    got, ref = audio(got_b), audio(ref_b)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= tts_tolerance(ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_slot_move_copies_exactly_the_filled_rows(dtype):
    """BackboneKVPool.move (a stream's rows to another slot, on the device: a detach's and a trade's copy) gives
    the destination exactly the source's filled rows, leaves the other slots alone, and moves the length."""
    from engine.kv.pool import BackboneKVPool

    pool = BackboneKVPool(layers=2, kv_heads=3, head_dim=8, slots=4, rows=50, dtype=np.dtype(dtype))
    rng = np.random.default_rng(7)
    rows = {s: rng.standard_normal((2, 2, 3, n, 8)).astype(dtype) for s, n in ((1, 20), (2, 37), (3, 5))}
    for slot, r in rows.items():
        pool.write_rows(slot, r)
    pool.move(2, 0)
    assert list(pool.lengths) == [37, 20, 0, 5]
    np.testing.assert_array_equal(pool.rows_of(0), rows[2])
    np.testing.assert_array_equal(pool.rows_of(1), rows[1])
    np.testing.assert_array_equal(pool.rows_of(3), rows[3])
    np.testing.assert_array_equal(pool.park_rows(0, 37), rows[2])
