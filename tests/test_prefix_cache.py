"""The prefix KV cache: streams that start from cached system-block rows produce exactly (bitwise) the KV,
codes and audio of streams that prefill everything, with other streams running beside them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import golden, tolerance

from engine.kv.prefix import prefix_key
from engine.runtime.device import DeviceTensor

TEXT = ("Welcome to the world of MOSS TTS Realtime. Experience how text transforms into smooth, "
        "human-like speech in real time, one small step after another.")


def run_all(model, cache_bytes: int):
    """Six streams at once (text-only, voice-clone, multi-turn with user context), greedy; returns per
    stream (codes per turn, context rows, KV rows) and the scheduler."""
    from engine.serving.scheduler import FrameEvent, Scheduler, StreamError, TurnEnd

    mt = golden("tts/tts_multiturn.npz")
    voice = mt["voice_prompt_codes"].T
    ids = model.tokenizer.encode(TEXT)
    plans = [
        (None, [dict(ids=ids)]),
        (None, [dict(ids=ids[:20])]),
        (voice, [dict(ids=ids)]),
        (voice, [dict(ids=ids[5:], user_text="Tell me about it.")]),
        (voice, [dict(ids=list(mt["turn1_streamed_text_ids"]), user_text="Hey, I just landed in Paris.",
                      user_audio_codes=mt["turn1_user_audio_codes"].T),
                 dict(ids=list(mt["turn2_streamed_text_ids"]), user_text="Just a backpack.",
                      user_audio_codes=mt["turn2_user_audio_codes"].T)]),
        (voice[:10], [dict(ids=ids)]),
    ]
    scheduler = Scheduler(model, slots=len(plans), prefix_cache_bytes=cache_bytes)
    handles = [scheduler.open_stream(voice_codes=v, params=model.default_sampling(greedy=True), seed=0)
               for v, _ in plans]
    out = [[] for _ in plans]
    errors = []

    def drive(i):
        try:
            h = handles[i]
            for turn in plans[i][1]:
                h.begin_turn(user_text=turn.get("user_text", ""), user_audio_codes=turn.get("user_audio_codes"),
                             wait=60)
                for k in range(0, len(turn["ids"]), 4):
                    h.push_token_ids(turn["ids"][k:k + 4])
                h.end_text()
                frames = []
                while True:
                    event = h.get(timeout=120)
                    if isinstance(event, FrameEvent):
                        frames.append(event.frame)
                    elif isinstance(event, StreamError):
                        raise event.error
                    elif isinstance(event, TurnEnd):
                        break
                out[i].append(frames)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    scheduler.stop()                  # the loop has ended: the KV slots can be read safely
    assert not errors, errors
    results = [(out[i], h.stream.context_ids(), scheduler.runner.context_kv(h.stream)) for i, h in enumerate(handles)]
    return results, scheduler


def plain_prefill_rows(ctx: np.ndarray) -> int:
    """Rows of the first turn's prefill: up to the audio BOS (column 1 == 1025) that ends it."""
    return int(np.flatnonzero(ctx[:, 1] == 1025)[0]) + 1


def test_prefix_cache_is_bitwise_exact_under_load(model):
    plain, s0 = run_all(model, 0)
    cached, s1 = run_all(model, 64 * 2**20)
    assert s0.prefix_cache is None
    stats = s1.prefix_cache.stats
    entry = s1.prefix_cache.peek(prefix_key(model.prompt.system_block(None)))
    assert isinstance(entry, DeviceTensor) and entry.dtype == model.kv_dtype      # device memory, not host numpy
    assert stats.hits >= 2 and stats.entries >= 2 and s1.runner.timing.prefix_rows_copied > 0
    assert s1.runner.timing.prefill.calls < s0.runner.timing.prefill.calls     # fewer rows computed
    for (frames_a, ctx_a, kv_a), (frames_b, ctx_b, kv_b) in zip(plain, cached):
        assert len(frames_a) == len(frames_b)
        for fa, fb in zip(frames_a, frames_b):
            np.testing.assert_array_equal(np.stack([f.codes for f in fa]), np.stack([f.codes for f in fb]))
            audio_a = np.concatenate([f.audio for f in fa if f.audio is not None])
            audio_b = np.concatenate([f.audio for f in fb if f.audio is not None])
            assert np.abs(audio_a - audio_b).max() <= tolerance(audio_a)   # codec batches differ run to run
        np.testing.assert_array_equal(ctx_a, ctx_b)
        # every layer's K and V, i.e. the hidden states: the prefill (batch-1 calls at fixed chunk boundaries,
        # cached or computed) bitwise; later step rows were batched with whoever was running (round-off only)
        n = plain_prefill_rows(ctx_a)
        np.testing.assert_array_equal(kv_a[:, :, :, :n], kv_b[:, :, :, :n])
        assert np.abs(kv_a - kv_b).max() <= tolerance(kv_a)


def test_warm_prefix_equals_a_prefill(model):
    from engine.offline.session import StreamingSession
    from engine.serving.scheduler import Scheduler

    voice = golden("tts/tts_multiturn.npz")["voice_prompt_codes"].T
    scheduler = Scheduler(model, slots=1, prefix_cache_bytes=16 * 2**20)
    try:
        entry = scheduler.warm_prefix(voice)
        assert isinstance(entry, DeviceTensor) and scheduler.prefix_cache.stats.entries == 1
        assert scheduler.warm_prefix(voice) is entry and scheduler.prefix_cache.stats.entries == 1
        kv = scheduler.prefix_to_host(entry)
        assert scheduler.prefix_cache.stats.bytes == kv.nbytes == entry.nbytes
    finally:
        scheduler.stop()
    s = StreamingSession(model, voice_codes=voice, params=model.default_sampling(greedy=True))
    s.begin_turn()
    s.push_token_ids(model.tokenizer.encode(TEXT))
    rows = len(model.prompt.tts_prompt(model.prompt.check_codes(voice)))     # system block + assistant header
    assert kv.shape[3] == rows
    np.testing.assert_array_equal(kv, s.runner.context_kv(s.stream)[:, :, :, :rows])


def test_cache_is_bounded_lru():
    from engine.kv.prefix import PrefixCache

    cache = PrefixCache(1000)
    a, b, c = (np.zeros(100, np.float32) for _ in range(3))          # 400 bytes each
    assert cache.put("a", a) and cache.put("b", b)
    assert cache.get("a") is a                                         # a is now the most recent
    cache.put("c", c)                                                  # evicts b
    assert "b" not in cache and "a" in cache and "c" in cache and cache.stats.bytes == 800
    assert cache.get("b") is None and (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)
    cache.put("c", np.zeros(100, np.float32))                          # a replacement is no eviction
    assert not cache.put("huge", np.zeros(1000, np.float32))          # larger than the budget: not kept
    assert cache.stats.evictions == 1
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_text_only_turns_copy_the_header_too_and_user_turns_the_system_block(model):
    """A text-only first turn takes the system block and the assistant header from the cache; a turn with
    user context takes only the system block's rows of that same entry."""
    from engine.serving.scheduler import Scheduler, StreamError, TurnEnd

    system, opening = len(model.prompt.system_block(None)), len(model.prompt.tts_prompt(None))
    assert opening > system
    ids = model.tokenizer.encode(TEXT)[:16]
    scheduler = Scheduler(model, slots=1, prefix_cache_bytes=16 * 2**20)
    try:
        assert scheduler.runner.kv.prefix_rows(scheduler.warm_prefix(None)) == opening

        def copied_by_turn(user_text: str) -> int:
            before = scheduler.runner.timing.prefix_rows_copied
            h = scheduler.open_stream(params=model.default_sampling(greedy=True), seed=0)
            h.begin_turn(user_text=user_text, max_frames=3, wait=60)
            h.push_token_ids(ids)
            h.end_text()
            while not isinstance(event := h.get(timeout=120), TurnEnd):
                assert not isinstance(event, StreamError), event
            h.close()
            return scheduler.runner.timing.prefix_rows_copied - before

        assert copied_by_turn("") == opening
        assert copied_by_turn("Read this aloud, please.") == system
        assert scheduler.prefix_cache.stats.entries == 1
    finally:
        scheduler.stop()


def test_fp16_kv_slots_and_prefixes(fp32_model, fp16_model):
    """An fp16-compute bundle keeps its KV slots and cached prefixes in float16: half the bytes per row of
    fp32, and a warmed prefix is still bitwise the rows a prefill writes."""
    from engine.offline.session import StreamingSession
    from engine.serving.scheduler import Scheduler

    assert fp32_model.kv_dtype == np.float32 and fp16_model.kv_dtype == np.float16
    assert 2 * fp16_model.kv_bytes_per_slot(4096) == fp32_model.kv_bytes_per_slot(4096)
    pool = fp16_model.kv_pool(2, 64)
    assert pool.nbytes_per_slot == fp16_model.kv_bytes_per_slot(64)
    voice = golden("tts/tts_multiturn.npz")["voice_prompt_codes"].T
    scheduler = Scheduler(fp16_model, slots=1, prefix_cache_bytes=16 * 2**20)
    try:
        kv = scheduler.prefix_to_host(scheduler.warm_prefix(voice))
    finally:
        scheduler.stop()
    assert kv.dtype == np.float16 and scheduler.prefix_cache.stats.bytes == kv.nbytes
    s = StreamingSession(fp16_model, voice_codes=voice, params=fp16_model.default_sampling(greedy=True))
    s.begin_turn()
    s.push_token_ids(fp16_model.tokenizer.encode(TEXT))
    np.testing.assert_array_equal(kv, s.runner.context_kv(s.stream)[:, :, :, :kv.shape[3]])
    frames = s.end_text() + s.drain(max_frames=8)        # the fp16 stream goes on to speak
    assert frames and all(np.isfinite(f.audio).all() for f in frames if f.audio is not None)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_kv_pool_rows_in_every_compute_dtype(dtype):
    """Prefix uploads, copies into a slot, slot moves, copies out to a prefix and reads keep the pool's own
    type bit for bit (bfloat16 too: onnxruntime's Python API has no numpy bfloat16, so rows travel by
    pointer); bytes per row follow the type."""
    from engine.kv.pool import BackboneKVPool
    from engine.runtime.device import KV_DTYPES

    dt = KV_DTYPES[dtype]
    pool = BackboneKVPool(2, 2, 8, slots=3, rows=16, dtype=dt)
    rows = (np.random.default_rng(0).standard_normal((2, 2, 2, 5, 8))).astype(dt)
    prefix = pool.upload_prefix(rows)
    assert prefix.dtype == dt and pool.prefix_rows(prefix) == 5 and prefix.nbytes == rows.nbytes
    pool.copy_rows(prefix, 0)
    pool.move(0, 2)
    back = pool.rows_of(2)
    assert back.dtype == dt and pool.lengths[2] == 5
    np.testing.assert_array_equal(back.view(np.uint8), rows.view(np.uint8))
    again = pool.prefix_of(2, 5)                       # slot -> a new prefix, on the device
    np.testing.assert_array_equal(pool.download_prefix(again).view(np.uint8), rows.view(np.uint8))
    pool.copy_rows(again, 1, 3)                        # a prefix's first rows only
    assert pool.lengths[1] == 3
    np.testing.assert_array_equal(pool.rows_of(1).view(np.uint8), rows[:, :, :, :3].view(np.uint8))
    assert pool.nbytes_per_slot == BackboneKVPool.bytes_per_slot(2, 2, 8, 16, dt) == 2 * 2 * 2 * 17 * 8 * dt.itemsize


def test_persisted_voice_prefix_follows_the_compute_dtype(tmp_path):
    """A voice's persisted prefix KV is read back only in the bundle's compute dtype (bfloat16 too, which
    numpy saves as raw voids); one of another dtype reads as None, so the voice's prefix is recomputed."""
    from app.voices import VoiceRegistry
    from engine.runtime.device import KV_DTYPES

    registry = VoiceRegistry(tmp_path, "bundle-x")
    rec = registry.add("narrator", np.zeros((3, 16), np.int64))
    kv = np.random.default_rng(0).standard_normal((2, 2, 2, 5, 8))
    for dtype in ("fp32", "fp16", "bf16"):
        registry.save_prefix(rec, kv.astype(KV_DTYPES[dtype]))
        back = registry.load_prefix(rec, KV_DTYPES[dtype])
        assert back.dtype == KV_DTYPES[dtype]
        np.testing.assert_array_equal(back.view(np.uint8), kv.astype(KV_DTYPES[dtype]).view(np.uint8))
        other = "fp16" if dtype != "fp16" else "fp32"
        assert registry.load_prefix(rec, KV_DTYPES[other]) is None


def test_kv_pool_is_bounded_by_the_rope_tables(model):
    """The backbone's RoPE tables have max_position_embeddings rows: a pool whose slots hold more rows is
    refused up front (onnxruntime would fail on the first call past the table)."""
    from engine.errors import InputError

    positions = model.config.backbone.max_positions
    assert positions == 40960
    model.kv_pool(1, 16)
    with pytest.raises(InputError, match="RoPE positions"):
        model.kv_pool(1, positions)


def test_a_persisted_voice_prefix_round_trips_through_the_device_cache(model, tmp_path):
    """A voice's prefix is read back from the device once to persist it, uploaded once by another scheduler
    (as a restarted server does), and a stream there starts from it: a cache hit that copies the rows, with
    bitwise the KV a plain prefill writes. One larger than the cache's budget is not uploaded."""
    from app.voices import VoiceRegistry
    from engine.offline.session import StreamingSession
    from engine.serving.scheduler import Scheduler, StreamError, TurnEnd

    voice = golden("tts/tts_multiturn.npz")["voice_prompt_codes"].T
    registry = VoiceRegistry(tmp_path, "bundle-x")
    rec = registry.add("narrator", voice)
    first = Scheduler(model, slots=1, prefix_cache_bytes=16 * 2**20)
    try:
        registry.save_prefix(rec, first.prefix_to_host(first.warm_prefix(voice)))
    finally:
        first.stop()
    kv = registry.load_prefix(rec, model.kv_dtype)
    system = model.prompt.system_block(model.prompt.check_codes(voice))
    second = Scheduler(model, slots=1, prefix_cache_bytes=16 * 2**20)
    try:
        assert second.cache_prefix(system, kv)
        entry = second.prefix_cache.peek(prefix_key(system))
        assert isinstance(entry, DeviceTensor) and second.prefix_cache.stats.bytes == kv.nbytes
        np.testing.assert_array_equal(second.prefix_to_host(entry), kv)
        h = second.open_stream(voice_codes=voice, params=model.default_sampling(greedy=True), seed=0)
        h.begin_turn(max_frames=2, wait=60)
        h.push_token_ids(model.tokenizer.encode(TEXT)[:16])
        h.end_text()
        while not isinstance(event := h.get(timeout=120), TurnEnd):
            assert not isinstance(event, StreamError), event
        assert second.prefix_cache.stats.hits == 1 and second.runner.timing.prefix_rows_copied == kv.shape[3]
        h.close()
        small = Scheduler(model, slots=1, prefix_cache_bytes=kv.nbytes - 1)
        try:
            assert not small.cache_prefix(system, kv) and small.prefix_cache.stats.entries == 0
        finally:
            small.stop()
    finally:
        second.stop()
    s = StreamingSession(model, voice_codes=voice, params=model.default_sampling(greedy=True))
    s.begin_turn()
    s.push_token_ids(model.tokenizer.encode(TEXT))
    np.testing.assert_array_equal(kv, s.runner.context_kv(s.stream)[:, :, :, :kv.shape[3]])
