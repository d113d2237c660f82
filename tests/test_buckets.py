"""Batch buckets at fixed addresses (engine/model/buckets.py): sizes, the CUDA-graph id registry and capture
decision, a padded bucket's exactness against the unpadded batch, and no device allocation per step."""

import time

import numpy as np
import pytest

SAY = "The quick brown fox jumps over the lazy dog, and the model keeps on talking for a while."


# ---------------------------------------------------------------------------------------------- pure logic
def test_bucket_sizes_are_powers_of_two_up_to_the_slot_count():
    from engine.errors import InputError
    from engine.model.buckets import bucket_for, bucket_sizes, window_for

    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert [bucket_for(n, bucket_sizes(100)) for n in (1, 2, 3, 5, 9, 64, 65, 100)] == [1, 2, 4, 8, 16, 64, 100, 100]
    with pytest.raises(InputError):
        bucket_for(101, bucket_sizes(100))
    with pytest.raises(InputError):
        bucket_sizes(0)
    assert [window_for(w) for w in (1, 50, 64, 65, 4096)] == [64, 64, 64, 128, 4096]


def test_graph_registry_refuses_an_id_replayed_with_other_shapes():
    from engine.model.buckets import GraphKey, GraphRegistry

    reg = GraphRegistry()
    a = reg.id_for(GraphKey("backbone", 8), {"grid": (8, 1, 17)})
    b = reg.id_for(GraphKey("backbone", 16), {"grid": (16, 1, 17)})
    d = reg.id_for(GraphKey("depth", 8, 64), {"history": (8, 64, 16)})
    assert len({a, b, d}) == 3 and min(a, b, d) >= 1          # -1 is "uncaptured", 0 onnxruntime's default
    assert reg.id_for(GraphKey("backbone", 8), {"grid": [8, 1, 17]}) == a
    with pytest.raises(RuntimeError, match="refusing to replay"):
        reg.id_for(GraphKey("backbone", 8), {"grid": (4, 1, 17)})
    assert reg.shapes(a) == {"grid": (8, 1, 17)} and len(reg) == 3


def test_capture_decision():
    from engine.model.buckets import capture_decision

    placed = {"backbone": [], "depth": []}
    assert capture_decision(None, "cuda", placed)[0] is True
    assert capture_decision(True, "cuda", placed)[0] is True
    assert capture_decision(False, "cuda", placed) == (False, "CUDA graphs off (--cuda-graphs off)")
    assert capture_decision(None, "cpu", placed)[0] is False
    on, why = capture_decision(True, "cpu", placed)
    assert not on and "refused" in why
    on, why = capture_decision(None, "cuda", {"backbone": ["backbone/layers.0/attn/GroupQueryAttention"], "depth": []})
    assert not on and "refused" in why and "backbone: 1 nodes off CUDA" in why and "uncaptured" in why


# ---------------------------------------------------------------------------------------------- exactness
def _filled_pools(model, lengths: list[int], slots: int):
    """Two identical KV pools whose first slots hold prefills of the given lengths."""
    prompt = model.prompt.tts_prompt(None)
    text = model.prompt.prefill_text(model.tokenizer.encode(SAY))
    rows = np.concatenate([prompt, text])
    pools = [model.kv_pool(slots, 256) for _ in range(2)]
    for pool in pools:
        for slot, n in enumerate(lengths):
            model.run_backbone(rows[None, :n], pool, slot, slot + 1)
            pool.lengths[slot] = n
    return pools, rows


def test_a_padded_bucket_equals_the_unpadded_batch(model):
    """Three streams step in a bucket of 8 (a fourth attached but idle, four free slots): the same hidden
    rows and KV as the unpadded three-row batch, the idle stream's rows untouched, the same codes."""
    from engine.model.buckets import BufferStats

    lengths = [30, 41, 36, 33]
    (plain, padded), rows = _filled_pools(model, lengths, 8)
    idle_before = padded.rows_of(3)
    step = np.stack([rows[n] for n in lengths[:3]])[:, None]            # each stream's next row
    hidden = model.run_backbone(step, plain, 0, 3)[:, 0]
    for pool in (plain,):
        pool.lengths[:3] += 1

    bufs = model.step_buffers(8, padded, BufferStats())
    rider = model.prompt.text_rows([model.layout.text_pad_id])[0]
    bufs.stage_step({s: step[s, 0] for s in range(3)}, padded.lengths[:8], rider)
    model.run_step(bufs)
    padded.lengths[:3] += 1
    got = bufs.hidden.value.numpy()[:3, 0]
    # MLAS's GEMM is row-independent for these shapes: bitwise equal (no tolerance)
    np.testing.assert_array_equal(got, hidden)
    for s in range(3):
        np.testing.assert_array_equal(padded.rows_of(s), plain.rows_of(s))
    np.testing.assert_array_equal(padded.rows_of(3), idle_before)

    # depth: sampled rows (penalty, top-k/top-p, draws) in the bucket vs the three-row call
    rng = np.random.default_rng(3)
    params = [model.default_sampling(), model.default_sampling(temperature=1.2, top_k=5),
              model.default_sampling(greedy=True)]
    history = rng.integers(0, model.layout.codebook_size, (3, 50, model.layout.codebooks))
    uniform = rng.random((3, model.layout.codebooks), dtype=np.float32)
    first = np.array([False, True, False])
    ref = model.run_depth(hidden, history, params, uniform, first)
    window = bufs.stage_depth([(s, history[s], params[s], uniform[s], bool(first[s])) for s in range(3)],
                              model.history_pad)
    codes, finite = model.run_bucket_depth(bufs, window)
    np.testing.assert_array_equal(codes[:3], ref)
    assert finite.all()


def test_no_device_allocation_or_binding_per_step_after_warm_up(model):
    """Five streams through a runner of 8 slots, three turns each: every buffer and binding is made during
    the first turn (the buckets and windows it uses); later turns allocate and bind nothing."""
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

    runner = StepRunner(model, 8, 8192)
    streams = [StreamState(model, params=model.default_sampling(greedy=True), seed=i) for i in range(5)]
    for st in streams:
        runner.attach(st)

    def turn():
        for st in streams:
            st.begin_turn(max_frames=5)
            st.push_text(SAY)
            st.end_text()
        for _ in range(400):
            runner.tick()
            if all(st.turn_done and not st.in_flight for st in streams):
                return
        pytest.fail("the turn did not end")

    turn()
    warm = (runner.buffer_stats.allocations, runner.buffer_stats.bindings)
    steps = runner.timing.step.calls
    assert warm[0] > 0 and steps > 0
    turn()
    turn()
    assert runner.timing.step.calls > steps
    assert (runner.buffer_stats.allocations, runner.buffer_stats.bindings) == warm


def test_the_depth_graph_flags_non_finite_rows(model):
    """A row whose hidden state is NaN gets ``finite`` False (the host reads [B] flags, not the logits);
    every other row of the bucket is unaffected."""
    from engine.model.buckets import BufferStats

    pool = model.kv_pool(4, 16)
    bufs = model.step_buffers(4, pool, BufferStats())
    h = np.random.default_rng(0).standard_normal((3, model.config.hidden)).astype(np.float32)
    h[2, 5] = np.nan
    bufs.hidden.host[[0, 1, 3], 0] = h
    bufs.hidden.upload()
    p = model.default_sampling()
    empty = np.full((50, model.layout.codebooks), model.history_pad, np.int64)
    u = np.full(model.layout.codebooks, 0.5, np.float32)
    window = bufs.stage_depth([(s, empty, p, u, True) for s in (0, 1, 3)], model.history_pad)
    codes, finite = model.run_bucket_depth(bufs, window)
    assert finite.tolist() == [True, True, True, False]
    ref = model.run_depth(h[:2], np.stack([empty, empty]), [p, p], np.stack([u, u]), np.array([True, True]))
    np.testing.assert_array_equal(codes[:2], ref)


# ---------------------------------------------------------------------------------------------- CUDA graphs
def turn_frames(h, timeout: float = 120) -> list:
    """The frames of the handle's turn (its errors fail the test), within ``timeout`` s."""
    from engine.serving.scheduler import FrameEvent, StreamError, TurnEnd

    frames, deadline = [], time.monotonic() + timeout
    while True:
        event = h.get(timeout=max(0.01, deadline - time.monotonic()))      # queue.Empty past the deadline
        assert not isinstance(event, StreamError), event.error
        if isinstance(event, FrameEvent):
            frames.append(event.frame)
        elif isinstance(event, TurnEnd):
            return frames


def test_cuda_graph_ids_per_bucket_for_the_scheduler_only(full_bundle_dir):
    """The capture bookkeeping, driven on CPU (onnxruntime's CPU provider ignores ``gpu_graph_id``): with
    capture forced on, the scheduler's runner claims capture and each bucket's step and depth get their own
    id, registered with that bucket's shapes and addresses; a StreamingSession on the same model runs
    uncaptured and registers nothing; codes are those of the uncaptured model."""
    from conftest import TEST_DEVICE

    from engine.model.buckets import GraphKey
    from engine.model.tts import TTSModel
    from engine.offline.session import StreamingSession
    from engine.runtime.bundle import Bundle
    from engine.serving.scheduler import Scheduler

    def frames(model, n: int) -> list[list]:
        sch = Scheduler(model, slots=4)
        try:
            handles = [sch.open_stream(params=model.default_sampling(greedy=True), seed=i) for i in range(n)]
            for h in handles:
                h.begin_turn(max_frames=4, wait=30)
                h.push_text(SAY)
                h.end_text()
            return [[f.codes.tolist() for f in turn_frames(h)] for h in handles]
        finally:
            sch.stop()

    plain = TTSModel(Bundle(full_bundle_dir, device=TEST_DEVICE))
    assert plain.cuda_graphs is False                       # CPU: capture refused/off
    captured = TTSModel(Bundle(full_bundle_dir, device=TEST_DEVICE))
    captured.cuda_graphs = True                             # what a CUDA placement would decide
    session = StreamingSession(captured, params=captured.default_sampling(greedy=True), seed=0)
    session.begin_turn()
    session.push_token_ids(captured.tokenizer.encode(SAY))
    solo = session.end_text() + session.drain()
    assert solo and len(captured.graph_ids) == 0             # the session's runner did not capture
    assert frames(captured, 3) == frames(plain, 3)
    keys = set(captured.graph_ids._ids)
    assert GraphKey("backbone", 4) in keys and GraphKey("depth", 4, 64) in keys
    assert {k.graph for k in keys} == {"backbone", "depth"} and all(k.bucket in (1, 2, 4) for k in keys)
    assert not captured.claim_capture()                     # once per model


def test_cuda_graphs_flag_reaches_the_model_and_is_refused_off_cuda(full_bundle_dir, caplog):
    """``--cuda-graphs on`` on CPU: a clear log line, uncaptured runs; serve takes the flag into its settings."""
    import logging

    from conftest import TEST_DEVICE

    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle
    from mossrt.cli import build_parser
    from mossrt.commands import cuda_graphs_choice
    from mossrt.serve import load_settings

    if TEST_DEVICE != "cpu":
        pytest.skip("the refusal is for a non-CUDA device")
    args = build_parser().parse_args(["bench", "streams", "--bundle", str(full_bundle_dir), "--cuda-graphs", "on"])
    assert cuda_graphs_choice(args) is True
    with caplog.at_level(logging.INFO, logger="mossrt.tts"):
        model = TTSModel(Bundle(full_bundle_dir, device="cpu"), cuda_graphs=cuda_graphs_choice(args))
    assert model.cuda_graphs is False and not model.claim_capture()
    assert any("CUDA graphs refused" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    serve = build_parser().parse_args(["serve", "--cuda-graphs", "off"])
    assert load_settings(serve).cuda_graphs == "off"
    assert load_settings(build_parser().parse_args(["serve"])).cuda_graphs is None


# ---------------------------------------------------------------------------------------------- warm-up
def _run_turns(runner, model, seeds: list[int], turns: int = 2,
               windows: dict[int, int] | None = None) -> list[list[tuple[list, np.ndarray]]]:
    """Streams through ``runner``'s ticks, ``turns`` turns each: per stream its frames' (codes, audio);
    ``windows``: a repetition window per seed (the default one otherwise)."""
    from dataclasses import replace

    from engine.serving.stream import StreamState

    params = lambda s: replace(model.default_sampling(),
                               **({"repetition_window": windows[s]} if s in (windows or {}) else {}))
    streams = [StreamState(model, params=params(s), seed=s) for s in seeds]
    for st in streams:
        runner.attach(st)
    out = [[] for _ in streams]
    for _ in range(turns):
        for st in streams:
            st.begin_turn(max_frames=7)
            st.push_text(SAY)
            st.end_text()
        for _ in range(600):
            result = runner.tick()
            for st, frame in result.frames:
                out[streams.index(st)].append((frame.codes.tolist(), frame.audio))
            if all(st.turn_done and not st.in_flight for st in streams) and not any(
                    e.pending for e in runner.entries):
                break
        else:
            pytest.fail("the turn did not end")
    for st in streams:
        runner.detach(st)
    return out


def test_warm_up_makes_every_call_shape_before_any_stream(model):
    """``StepRunner.warm_up`` binds and runs every bucket's step and depth call and each codec call shape on
    padding rows: the KV lengths and codec positions stay as they were, streams run afterwards allocate and
    bind nothing new (backbone/depth buffers at every history window, so a request's long repetition window
    too; codec call bindings and device buffers), and their codes and audio equal those of a runner that was
    not warmed."""
    from engine.model.buckets import history_windows
    from engine.serving.runner import SERVICE_CODEC_SCHEDULE, StepRunner

    warm = StepRunner(model, 8, 8192, codec_schedule=SERVICE_CODEC_SCHEDULE)
    lengths, positions = warm.kv.lengths.copy(), warm.decoder.state.positions.numpy().copy()
    assert warm.warm_up() == [1, 2, 4, 8]
    np.testing.assert_array_equal(warm.kv.lengths, lengths)
    np.testing.assert_array_equal(warm.decoder.state.positions.numpy(), positions)
    np.testing.assert_array_equal(warm.decoder.frame_positions, positions[:-1])
    made = (warm.buffer_stats.allocations, warm.buffer_stats.bindings, set(warm.buckets),
            set(warm.decoder._calls), warm.decoder.state.device_buffers())
    assert made[2] == {1, 2, 4, 8} and made[3] == {(n, f) for n in (1, 2, 4, 8) for f in (1, 2, 4, 6)}
    assert all(set(b._depth) == set(history_windows()) == {64, 128, 256, 512, 1024, 2048, 4096}
               for b in warm.buckets.values())
    assert warm.timing.step.calls == 0 and not warm.decoder.call_shapes     # warm-up calls are not measured

    seeds, windows = [11, 12, 13, 14, 15], {12: 4096, 14: 300}             # windows of 4,096 and 512 frames
    got = _run_turns(warm, model, seeds, windows=windows)
    assert warm.timing.step.calls > 0 and set(warm.decoder.call_shapes) <= made[3]
    assert (warm.buffer_stats.allocations, warm.buffer_stats.bindings, set(warm.buckets),
            set(warm.decoder._calls), warm.decoder.state.device_buffers()) == made
    ref = _run_turns(StepRunner(model, 8, 8192, codec_schedule=SERVICE_CODEC_SCHEDULE), model, seeds, windows=windows)
    assert [[c for c, _ in s] for s in got] == [[c for c, _ in s] for s in ref]
    # the audio within float round-off, not bitwise: how many frames each codec call takes follows the
    # listener's playback clock (the unwarmed runner's first ticks are slower), and two chunkings of the same
    # codes differ by up to ~2e-7 here; a stale or clobbered codec state would differ by orders more
    for s_got, s_ref in zip(got, ref):
        for (_, a), (_, b) in zip(s_got, s_ref):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_warmed_scheduler_captures_nothing_after_start(full_bundle_dir):
    """With capture forced on (as a CUDA placement decides) the scheduler's loop warms every bucket before
    it serves: each bucket's backbone and depth graph id exists when ``wait_warm`` returns, and streams
    then register no new id and allocate or bind no buffer; the codes equal an unwarmed scheduler's."""
    from conftest import TEST_DEVICE

    from engine.model.buckets import GraphKey, history_windows
    from engine.model.tts import TTSModel
    from engine.runtime.bundle import Bundle
    from engine.serving.scheduler import Scheduler

    captured = TTSModel(Bundle(full_bundle_dir, device=TEST_DEVICE))
    captured.cuda_graphs = True                             # what a CUDA placement would decide
    plain = TTSModel(Bundle(full_bundle_dir, device=TEST_DEVICE))
    assert captured.warm_buckets is False and plain.warm_buckets is False     # CPU: off unless asked

    def frames(sch, n: int) -> list[list]:
        handles = [sch.open_stream(params=sch.model.default_sampling(greedy=True), seed=i) for i in range(n)]
        for h in handles:
            h.begin_turn(max_frames=4, wait=60)
            h.push_text(SAY)
            h.end_text()
        out = [[f.codes.tolist() for f in turn_frames(h)] for h in handles]
        for h in handles:
            h.close()
        return out

    sch = Scheduler(captured, slots=4, warm_buckets=True)
    try:
        assert sch.wait_warm(timeout=300) and sch.broken is None and sch.warm_seconds is not None
        keys = set(captured.graph_ids._ids)
        assert keys == ({GraphKey("backbone", b, 0) for b in (1, 2, 4)}
                        | {GraphKey("depth", b, w) for b in (1, 2, 4) for w in history_windows()})
        stats = (sch.runner.buffer_stats.allocations, sch.runner.buffer_stats.bindings)
        got = frames(sch, 3)
        assert set(captured.graph_ids._ids) == keys
        assert (sch.runner.buffer_stats.allocations, sch.runner.buffer_stats.bindings) == stats
    finally:
        sch.stop()
    ref_sch = Scheduler(plain, slots=4)
    try:
        assert ref_sch.wait_warm(timeout=60) and ref_sch.warm_seconds is None
        assert frames(ref_sch, 3) == got
    finally:
        ref_sch.stop()

# ---------------------------------------------------------------------------------------------- prefill
def test_prefill_hidden_stays_on_the_device(model, monkeypatch):
    """After a warm-up turn, turns through the runner (each with a prefill of chunks, a prefix from the
    cache, then steps) bind ``hidden`` only to the runner's fixed device buffers, download no hidden rows
    (not a prefill's, not a step's) and allocate or bind no step buffer; the host-returning
    ``run_backbone`` is never called."""
    import onnxruntime as ort

    from engine.kv.prefix import PrefixCache
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

    runner = StepRunner(model, 4, 8192, prefill_chunk_rows=8, prefix_cache=PrefixCache(64 * 2**20))

    def turn():
        """Three new streams' first turns: the system block from the cache (but for the very first
        stream), the rest of the prompt in chunks of 8 rows, then steps."""
        streams = [StreamState(model, params=model.default_sampling(greedy=True), seed=i) for i in range(3)]
        for st in streams:
            runner.attach(st)
            st.begin_turn(max_frames=4)
            st.push_text(SAY)
            st.end_text()
        for _ in range(400):
            assert not runner.tick().failed
            if all(st.turn_done and not st.in_flight for st in streams):
                for st in streams:
                    runner.detach(st)
                return
        pytest.fail("the turn did not end")

    turn()
    warm = (runner.buffer_stats.allocations, runner.buffer_stats.bindings)
    prefills = runner.timing.prefill.calls
    H = model.config.hidden
    fixed = {runner.prefill_buffers.hidden.value.data_ptr()} | {b.hidden.value.data_ptr()
                                                                for b in runner.buckets.values()}
    hidden_binds, downloads = [], []
    bind_output, numpy = ort.IOBinding.bind_output, ort.OrtValue.numpy

    def recording_bind_output(self, name, *args, **kwargs):
        if name == "hidden":
            hidden_binds.append(args)
        return bind_output(self, name, *args, **kwargs)

    def recording_numpy(self):
        arr = numpy(self)
        if arr.dtype == np.float32 and arr.ndim >= 2 and arr.shape[-1] == H:
            downloads.append(arr.shape)
        return arr

    def host_backbone(*args, **kwargs):
        raise AssertionError("the runner called the host-returning run_backbone")

    monkeypatch.setattr(ort.IOBinding, "bind_output", recording_bind_output)
    monkeypatch.setattr(ort.OrtValue, "numpy", recording_numpy)
    monkeypatch.setattr(model, "run_backbone", host_backbone)
    copied = runner.timing.prefix_rows_copied
    turn()
    turn()
    assert runner.timing.prefill.calls >= prefills + 12 and runner.timing.prefix_rows_copied > copied
    assert hidden_binds and all(len(a) == 5 and a[0] == model.bundle.device and a[4] in fixed for a in hidden_binds), \
        hidden_binds[:3]
    assert downloads == []
    assert (runner.buffer_stats.allocations, runner.buffer_stats.bindings) == warm


def test_a_nan_prefix_is_refused_at_the_first_frame_after_its_prefill(model):
    """A prefill whose rows attend to NaN KV (here a damaged cached prefix) gives NaN hidden states; they
    never reach the host: the depth call's ``finite`` flag refuses the stream at its first frame, with the
    depth's GraphError, and a stream prefilled beside it in the same tick speaks."""
    from conftest import golden

    from engine.errors import GraphError
    from engine.kv.prefix import PrefixCache, prefix_key
    from engine.model.tts import NON_FINITE_LOGITS
    from engine.serving.runner import StepRunner
    from engine.serving.stream import StreamState

    cache = PrefixCache(64 * 2**20)
    runner = StepRunner(model, 2, 8192, prefix_cache=cache)
    system = model.prompt.system_block(None)
    c = model.config
    nan = np.full((c.layers, 2, c.kv_heads, len(system), c.head_dim), np.nan, model.kv_dtype)
    cache.put(prefix_key(system), runner.kv.upload_prefix(nan))
    damaged = StreamState(model, params=model.default_sampling(greedy=True), seed=0)
    voiced = StreamState(model, voice_codes=golden("tts/tts_multiturn.npz")["voice_prompt_codes"].T,
                         params=model.default_sampling(greedy=True), seed=0)
    for st in (damaged, voiced):
        runner.attach(st)
        st.begin_turn(max_frames=3)
        st.push_text(SAY)
        st.end_text()
    failed, frames = [], {id(damaged): 0, id(voiced): 0}
    for _ in range(200):
        result = runner.tick()
        failed += result.failed
        for st, _ in result.frames:
            frames[id(st)] += 1
        if voiced.turn_done and not voiced.in_flight and failed:
            break
    assert [st for st, _ in failed] == [damaged]
    assert isinstance(failed[0][1], GraphError) and str(failed[0][1]) == NON_FINITE_LOGITS
    assert frames[id(damaged)] == 0 and frames[id(voiced)] == 3
    assert runner.timing.prefix_rows_copied == len(system)
