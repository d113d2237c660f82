"""The codec decoder's state on the sessions' device: rings and call buffers bound by pointer, new rows
written by the in-place ring graph, moves between slots, and the runner's fixed call sizes."""

from __future__ import annotations

import os

import numpy as np
from conftest import golden, tolerance

LONG = "codec/codec_long.npz"


def long_codes(codec) -> np.ndarray:
    return codec.check_codes(golden(LONG)["enc_codes"].T[:, :16], 16)[0]


def test_a_moved_stream_continues_exactly(codec):
    """A stream moved to another slot (as the runner does when a stream leaves) carries its rings and
    position: its audio goes on exactly, and the slot it left starts afresh."""
    codes = long_codes(codec)
    dec = codec.streaming_decoder(slots=3, n_quantizers=16)
    batch = np.zeros((3, 7, codec.num_quantizers), np.int64)
    batch[0], batch[2] = codes[40:47], codes[:7]
    first = dec.decode_checked(batch, np.array([7, 0, 7]))   # slot 0: another stream, which then leaves
    dec.move(2, 0)
    assert list(dec.frame_positions) == [7, 0, 0]
    assert list(dec.state.positions.numpy()[:3]) == [7, 0, 0]      # the graphs' own copy, on the device
    rest = dec.decode_checked(codes[None, 7:20])          # now the only stream: a call of one slot
    audio = np.concatenate([first[2], rest[0]])
    solo = golden(LONG)["dec16_audio"][:20 * 1920]     # upstream's one-pass decode (the decoder is causal)
    np.testing.assert_allclose(audio, solo, atol=tolerance(solo), rtol=0)


def test_a_rider_past_the_window_keeps_its_rings(codec):
    """A stream that rides along (0 frames) once its position is past every stage's window keeps its rows:
    its call's new rows go to the scratch slot, not over ring rows its next queries still see."""
    codes = long_codes(codec)
    assert codes.shape[0] > max(s.rows // s.tokens_per_frame for s in codec.decoder_stages) + 6
    dec = codec.streaming_decoder(slots=2, n_quantizers=16)
    plan = [(130, 0), (0, 6), (17, 0)]                     # (stream 0, stream 1) real frames per call
    parts, pos = [], 0
    for counts in plan:
        n = max(counts)
        batch = np.zeros((2, n, codec.num_quantizers), np.int64)
        batch[0, :counts[0]] = codes[pos:pos + counts[0]]
        batch[1, :counts[1]] = codes[:counts[1]]
        parts.append(dec.decode_checked(batch, np.array(counts))[0, :counts[0] * 1920])
        pos += counts[0]
    solo = golden(LONG)["dec16_audio"][:pos * 1920]    # upstream's one-pass decode (the decoder is causal)
    np.testing.assert_allclose(np.concatenate(parts), solo, atol=tolerance(solo), rtol=0)


def test_device_buffers_are_fixed_after_warm_up(codec):
    """Once each call size has run, no call allocates device memory: the rings and the new-row buffers keep
    their addresses, whatever the streams' positions and frame counts."""
    codes = long_codes(codec)
    dec = codec.streaming_decoder(slots=4, n_quantizers=16)
    sizes = (1, 2, 4, 6)
    for n in sizes:                                          # warm-up: the largest shape last
        dec.decode_checked(np.zeros((4, n, codec.num_quantizers), np.int64), np.zeros(4, np.int64))
    buffers = dec.state.device_buffers()
    rng = np.random.default_rng(0)
    for call in range(24):
        n, N = int(rng.integers(1, 5)), sizes[call % 4]
        frames = rng.integers(0, N + 1, n)
        dec.decode_checked(np.stack([codes[call:call + N]] * n), frames)
        assert dec.state.device_buffers() == buffers, call
    assert dec.state.nbytes_per_stream == codec.decoder_bytes_per_stream()


def test_runner_codec_calls_take_the_schedules_sizes(model):
    """The runner's codec calls take only its schedule's frame counts (and 1): a turn's tail is split into
    them over ticks, and the audio still equals the one-pass decode of the turn's codes."""
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

    stream = StreamState(model, params=model.default_sampling(greedy=True), seed=0)
    runner = StepRunner(model, 1, stream.limits.max_context_rows, codec_schedule=(5,))
    assert runner.codec_call_sizes == (1, 5)
    runner.attach(stream)
    stream.begin_turn(user_text="", max_frames=13)
    stream.push_token_ids(model.tokenizer.encode("A turn whose tail is not a whole chunk of five frames."))
    stream.end_text()
    frames = []
    for _ in range(2000):                                   # bounded: a turn of 13 frames needs far fewer ticks
        if stream.turn_done and not runner.has_work():
            break
        frames += [f for _, f in runner.tick().frames if f.needs_audio]
    assert stream.turn_done and not runner.has_work()
    assert len(frames) >= 7
    assert {N for _, N in runner.decoder.call_shapes} <= {1, 5}
    audio = np.concatenate([f.audio for f in frames])
    solo = model.codec.decode(np.stack([f.codes for f in frames]), model.layout.codebooks)
    np.testing.assert_allclose(audio, solo, atol=tolerance(solo), rtol=0)


def _resident_fraction(ptr: int, nbytes: int) -> float:
    """The share of the pages of ``[ptr, ptr + nbytes)`` that are present in memory (the "present" bit of
    /proc/self/pagemap, readable by any process for its own pages)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = ptr // page, (ptr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return float(np.count_nonzero(entries >> np.uint64(63))) / entries.size


def test_codec_rings_are_zeroed_and_resident_at_allocation(codec):
    """The rings are written with zeros when they are allocated, on CPU too: every page of them is resident
    from the start, so a stream's first decode, which reads its ring whole, never pays the page faults of
    lazily mapped zero pages inside its first frame (0.3-0.65 s at real dimensions, measured); decoding then
    matches the golden. Residency is read per page of the rings themselves: a growth of the process's RSS
    undercounts when the allocator hands back memory an earlier test made resident."""
    import pytest
    from conftest import TEST_DEVICE

    if TEST_DEVICE != "cpu":
        pytest.skip("page residency measures the CPU provider's memory only")
    slots = 256
    dec = codec.streaming_decoder(slots=slots, n_quantizers=16)
    rings = dec.state.rings
    ring_mib = sum(r.nbytes for r in rings) / 2**20
    resident = [_resident_fraction(r.value.data_ptr(), r.nbytes) for r in rings]
    assert ring_mib > 128 and min(resident) > 0.99, f"rings of {ring_mib:.0f} MiB; resident shares {resident}"
    codes = long_codes(codec)
    audio = dec.decode_checked(codes[None, :7], np.array([7]))[0]
    solo = golden(LONG)["dec16_audio"][:7 * 1920]
    np.testing.assert_allclose(audio, solo, atol=tolerance(solo), rtol=0)
