"""What crosses between the API side and the engine core (engine.core.wire): arrays as raw bytes, typed records,
errors by name, and nothing else (no pickling: an unknown type is refused on both ends)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from engine.core.local import EngineSnapshot
from engine.core.wire import ARRAY, RECORD, WireError, pack, unpack
from engine.errors import CapacityError, ContextEvictedError, EngineError
from engine.kv.parking import ParkingStats
from engine.model.sampling import SamplingParams
from engine.serving.scheduler import SchedulerStats
from engine.serving.stream import FinishReason, Frame, TurnStats


def test_a_frame_crosses_with_its_audio_as_raw_bytes():
    audio = np.random.default_rng(0).standard_normal(1920).astype(np.float32)
    codes = np.arange(16, dtype=np.int64)
    frame = Frame(index=3, codes=codes, audio=audio, turn=2, needs_audio=True, text_chars=11)
    data = pack(["event", 7, "frame", frame])
    assert audio.tobytes() in data                    # the samples themselves, not a pickled object
    kind, sid, what, back = unpack(data)
    assert (kind, sid, what) == ("event", 7, "frame")
    assert isinstance(back, Frame) and back.index == 3 and back.turn == 2 and back.text_chars == 11
    assert back.audio is not None and back.audio.dtype == np.float32 and np.array_equal(back.audio, audio)
    assert back.codes.dtype == np.int64 and np.array_equal(back.codes, codes)
    back.audio[0] = 1.0                               # the receiver's own array
    eos = unpack(pack([Frame(index=4, codes=codes, eos=True)]))[0]
    assert eos.audio is None and eos.eos


def test_records_keep_their_types_nested():
    stats = TurnStats(text_ids=5, frames=9, finish_reason=FinishReason.MAX_FRAMES)
    parking = ParkingStats(parked=1, bytes=2, budget_bytes=3, parks=4, resumes=5, evictions=6)
    sched = SchedulerStats(capacity=4, active=1, queued=0, generating=1, bytes_per_stream=10, parking=parking)
    snap = EngineSnapshot(state="ready", stats=sched, sessions_open=2)
    params = SamplingParams(temperature=0.5, greedy=True)
    b_stats, b_snap, b_params = unpack(pack([stats, snap, params]))
    assert b_stats == stats and isinstance(b_stats.finish_reason, FinishReason)
    assert b_snap == snap and isinstance(b_snap.stats.parking, ParkingStats)
    assert b_params == params


def test_errors_cross_by_name_and_unknown_ones_as_engine_errors():
    capacity, evicted, other = unpack(pack([CapacityError("full"), ContextEvictedError("gone"), KeyError("x")]))
    assert type(capacity) is CapacityError and str(capacity) == "full"
    assert type(evicted) is ContextEvictedError
    assert type(other) is EngineError and "x" in str(other)


def test_what_is_not_ours_is_refused_on_both_ends():
    class Secret:
        pass

    with pytest.raises(TypeError, match="cannot send Secret"):
        pack(["call", 1, Secret()])
    record = msgpack.ExtType(RECORD, msgpack.packb(["Popen", {"args": "rm -rf /"}]))
    with pytest.raises(WireError, match="unknown record"):
        unpack(msgpack.packb([record]))
    with pytest.raises(WireError, match="unknown extension"):
        unpack(msgpack.packb([msgpack.ExtType(99, b"")]))
    with pytest.raises(WireError, match="non-empty list"):
        unpack(msgpack.packb({"kind": "call"}))
    assert ARRAY != RECORD
