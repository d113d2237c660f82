"""TTS graph parity with the upstream PyTorch goldens (set-a): backbone, depth (local transformer + sampling),
sampling filter, reduced-precision exports and checkpoint validation.

The graphs are driven by a minimal numpy host loop (KV buffer written from ``present``), so these tests
pin the graph interfaces independently of the engine.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from conftest import GOLDEN, TTS_CHECKPOINT, golden, tolerance

CASES = ["text_only", "voice_clone"]
PREFILL_TEXT = 12          # text leads audio by min(12, L) tokens
TEXT_PAD, EOS, HIST_PAD = 151655, 1026, 1027
WINDOW = 50                # upstream repetition_window


def tts_golden(case: str):
    return golden(f"tts/tts_{case}.npz")


class Graphs:
    """The three graphs of one bundle plus a numpy KV buffer per batch of streams."""

    def __init__(self, bundle_dir):
        self.manifest = json.loads((bundle_dir / "manifest.json").read_text())
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1   # deterministic reductions
        make = lambda name: ort.InferenceSession(str(bundle_dir / f"{name}.onnx"), opts,
                                                 providers=["CPUExecutionProvider"])
        self.cfg = self.manifest["tts"]["config"]
        self.kv_dtype = {"fp32": np.float32, "fp16": np.float16}[self.manifest["tts"].get("compute_dtype", "fp32")]
        self.backbone, self.depth, self.filter = make("backbone"), make("depth"), make("sampling_filter")

    def kv_buffer(self, batch: int, capacity: int) -> np.ndarray:
        c = self.cfg
        return np.zeros((c["layers"], 2, batch, c["kv_heads"], capacity, c["head_dim"]), self.kv_dtype)

    def step(self, kv: np.ndarray, rows: np.ndarray, past_len) -> np.ndarray:
        """rows [B, T, 17] at positions past_len[b].. → hidden [B, T, H]; the graph writes the new K/V into
        kv in place (each layer's K and V are bound as both past and present)."""
        binding = self.backbone.io_binding()
        binding.bind_output("hidden", "cpu")
        binding.bind_cpu_input("grid", np.ascontiguousarray(rows, dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.asarray(past_len, np.int64)[:, None] + np.arange(rows.shape[1]))
        binding.bind_cpu_input("seqlens_k", (np.asarray(past_len) + rows.shape[1] - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(kv.shape[4], np.int32))   # the capacity
        for layer in range(self.cfg["layers"]):
            for j, kind in enumerate(("key", "value")):
                view = kv[layer, j]
                assert view.flags.c_contiguous   # an OrtValue over a copy would lose the in-place write
                value = ort.OrtValue.ortvalue_from_numpy(view)
                binding.bind_ortvalue_input(f"past_{kind}.{layer}", value)
                binding.bind_ortvalue_output(f"present_{kind}.{layer}", value)
        self.backbone.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def frame(self, hidden, history, penalty=1.0, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
              uniform=None):
        """hidden [B, H], history [B, W, 16] → codes [B, 16], logits [B, 16, 1027]."""
        B = hidden.shape[0]
        vec = lambda v, dt: np.broadcast_to(np.asarray(v, dtype=dt), (B,)).copy()
        feed = {"hidden": hidden.astype(np.float32), "history": history.astype(np.int64),
                "repetition_penalty": vec(penalty, np.float32), "temperature": vec(temperature, np.float32),
                "top_k": vec(top_k, np.int64), "top_p": vec(top_p, np.float32), "greedy": vec(greedy, np.bool_),
                "uniform": np.zeros((B, 16), np.float32) if uniform is None else uniform.astype(np.float32)}
        return self.depth.run(["codes", "logits"], feed)

    def sampling_filter(self, logits, history, penalty, temperature, top_k, top_p):
        B = logits.shape[0]
        vec = lambda v, dt: np.broadcast_to(np.asarray(v, dtype=dt), (B,)).copy()
        return self.filter.run(None, {"logits": logits.astype(np.float32), "history": history.astype(np.int64),
                                      "repetition_penalty": vec(penalty, np.float32),
                                      "temperature": vec(temperature, np.float32),
                                      "top_k": vec(top_k, np.int64), "top_p": vec(top_p, np.float32)})


def history_of(frames: list, penalty: float) -> np.ndarray:
    """[1, 50, 16] window of the last 50 frames (padded with 1027); no penalty history on frame 0."""
    hist = np.full((1, WINDOW, 16), HIST_PAD, np.int64)
    if frames and penalty != 1.0:
        last = np.array(frames[-WINDOW:])
        hist[0, WINDOW - len(last):] = last
    return hist


def greedy_generate(g: Graphs, prefill_ids: np.ndarray, text_ids: np.ndarray, penalty: float,
                    max_frames: int = 60, capacity: int = 256) -> dict:
    """The upstream non-streaming greedy loop, batch 1: prefill, then one row per frame
    (next text id or <|text_pad|>, previous frame's codes) until code 0 is EOS."""
    kv = g.kv_buffer(1, capacity)
    hidden = g.step(kv, prefill_ids[None], [0])[0, -1]
    pos = prefill_ids.shape[0]
    out = {"frames": [], "rows": [], "hidden": [], "ch0": [], "logits": []}
    for t in range(max_frames):
        codes, logits = g.frame(hidden[None], history_of(out["frames"], penalty), penalty)
        out["frames"].append(codes[0])
        out["hidden"].append(hidden)
        out["ch0"].append(logits[0, 0])
        out["logits"].append(logits[0])
        if codes[0, 0] == EOS:
            break
        j = PREFILL_TEXT + t
        row = np.concatenate([[text_ids[j] if j < len(text_ids) else TEXT_PAD], codes[0]])
        out["rows"].append(row)
        hidden = g.step(kv, row[None, None], [pos])[0, -1]
        pos += 1
    return {k: np.array(v) for k, v in out.items()}


def max_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.fixture(scope="session")
def graphs(tts_bundle_dir) -> Graphs:
    return Graphs(tts_bundle_dir)


@pytest.fixture(scope="session")
def greedy_runs(graphs) -> dict:
    runs = {}
    for case in CASES:
        gd = tts_golden(case)
        for penalty in (1.0, 1.1):
            runs[case, penalty] = greedy_generate(graphs, gd["prefill_ids"], gd["text_ids"], penalty)
    return runs


# ---------------------------------------------------------------------------------------------- backbone
@pytest.mark.parametrize("case", CASES)
def test_prefill_hidden(graphs, case):
    gd = tts_golden(case)
    kv = graphs.kv_buffer(1, gd["prefill_ids"].shape[0])
    hidden = graphs.step(kv, gd["prefill_ids"][None], [0])[0]
    ref = gd["prefill_hidden"]
    assert hidden.shape == ref.shape
    err = max_err(hidden, ref)
    print(f"{case} prefill_hidden max|diff| {err:.3g}")
    assert err <= tolerance(ref)


def teacher_forced_hidden(graphs, gd, rep: str) -> np.ndarray:
    """Last-row backbone hidden of the golden prefill and of each golden step row, fed one per call."""
    kv = graphs.kv_buffer(1, 200)
    hidden = [graphs.step(kv, gd["prefill_ids"][None], [0])[0, -1]]
    pos = gd["prefill_ids"].shape[0]
    for row in gd[f"{rep}_step_ids"]:
        hidden.append(graphs.step(kv, row[None, None], [pos])[0, -1])
        pos += 1
    return np.array(hidden)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rep", ["greedy", "greedy_rep"])
def test_teacher_forced_steps(graphs, case, rep):
    """Golden step rows, one per call, on a KV buffer: per-step hidden, codebook-0 logits, frame 0 logits."""
    gd = tts_golden(case)
    hidden = teacher_forced_hidden(graphs, gd, rep)
    ref = gd[f"{rep}_step_hidden"]
    err_h = max_err(hidden, ref)
    assert hidden.shape == ref.shape and err_h <= tolerance(ref)
    # codebook-0 logits are the raw head output for the backbone state: no penalty, no earlier code
    _, logits = graphs.frame(hidden, np.full((len(hidden), 1, 16), HIST_PAD))
    err_l = max_err(logits[:, 0], gd[f"{rep}_ch0_logits"])
    assert err_l <= tolerance(gd[f"{rep}_ch0_logits"])
    err_f0 = max_err(logits[0], gd["frame0_logits"])
    assert err_f0 <= tolerance(gd["frame0_logits"])
    print(f"{case} {rep}: step_hidden {err_h:.3g}, ch0_logits {err_l:.3g}, frame0_logits {err_f0:.3g}")


def test_batched_streams_at_different_positions(graphs):
    """Two streams with different past lengths in one call equal their solo runs (golden step 1)."""
    a, b = tts_golden("text_only"), tts_golden("voice_clone")
    kv = graphs.kv_buffer(2, 160)
    la, lb = a["prefill_ids"].shape[0], b["prefill_ids"].shape[0]
    # prefill each stream separately into its own batch slot
    for slot, gd in ((0, a), (1, b)):   # batch-1 views of the shared buffer
        graphs.step(kv[:, :, slot:slot + 1], gd["prefill_ids"][None], [0])
    rows = np.stack([a["greedy_step_ids"][:1], b["greedy_step_ids"][:1]])          # [2, 1, 17]
    hidden = graphs.step(kv, rows, [la, lb])[:, -1]
    for i, gd in enumerate((a, b)):
        assert max_err(hidden[i], gd["greedy_step_hidden"][1]) <= tolerance(gd["greedy_step_hidden"])
    # stale data beyond past_len must be ignored: garbage there changes nothing
    kv2 = graphs.kv_buffer(2, 160)
    kv2[:] = 1e3
    for slot, gd in ((0, a), (1, b)):   # batch-1 views of the shared buffer
        graphs.step(kv2[:, :, slot:slot + 1], gd["prefill_ids"][None], [0])
    hidden2 = graphs.step(kv2, rows, [la, lb])[:, -1]
    np.testing.assert_allclose(hidden2, hidden, atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_pass(graphs):
    gd = tts_golden("voice_clone")
    ids = gd["prefill_ids"]
    kv = graphs.kv_buffer(1, 128)
    parts, pos = [], 0
    for n in (50, 1, 33, ids.shape[0] - 84):
        parts.append(graphs.step(kv, ids[None, pos:pos + n], [pos])[0])
        pos += n
    hidden = np.concatenate(parts)
    assert max_err(hidden, gd["prefill_hidden"]) <= tolerance(gd["prefill_hidden"])


# ---------------------------------------------------------------------------------------------- greedy loop
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("penalty,rep", [(1.0, "greedy"), (1.1, "greedy_rep")])
def test_greedy_generation_exact(greedy_runs, case, penalty, rep):
    gd = tts_golden(case)
    run = greedy_runs[case, penalty]
    raw = gd[f"{rep}_raw_frames"]
    # host-built step rows are exactly upstream's
    np.testing.assert_array_equal(run["rows"], gd[f"{rep}_step_ids"])
    np.testing.assert_array_equal(run["frames"], raw)
    assert run["frames"][-1, 0] == EOS
    np.testing.assert_array_equal(run["frames"][:-1], gd[f"{rep}_codes"])
    err_h = max_err(run["hidden"], gd[f"{rep}_step_hidden"])
    err_l = max_err(run["ch0"], gd[f"{rep}_ch0_logits"])
    err_f0 = max_err(run["logits"][0], gd["frame0_logits"])
    print(f"{case} {rep}: {len(raw)} frames exact; step_hidden {err_h:.3g}, ch0_logits {err_l:.3g}, "
          f"frame0_logits {err_f0:.3g}")
    assert err_h <= tolerance(gd[f"{rep}_step_hidden"])
    assert err_l <= tolerance(gd[f"{rep}_ch0_logits"])
    assert err_f0 <= tolerance(gd["frame0_logits"])


# ---------------------------------------------------------------------------------------------- sampling
def test_sampling_probs(graphs):
    gd = tts_golden("text_only")
    hist = np.full((1, 1, 16), HIST_PAD)
    penalized, probs = graphs.sampling_filter(gd["frame0_logits"][None], hist, 1.0, 0.8, 30, 0.6)
    np.testing.assert_array_equal(penalized[0], gd["frame0_logits"])
    ref = gd["sampling_probs"]
    np.testing.assert_array_equal(probs[0] > 0, ref > 0)     # the same surviving set
    err = max_err(probs[0], ref)
    print(f"sampling_probs max|diff| {err:.3g}; survivors per codebook {(ref > 0).sum(1).tolist()}")
    assert err <= tolerance(ref)


def test_repetition_penalty(graphs):
    gd = tts_golden("text_only")
    logits = np.zeros((1, 16, 1027), np.float32)
    logits[0, 0] = gd["rep_penalty_in"][0]
    logits[0, 1:] = gd["frame0_logits"][1:]
    hist = np.full((1, 4, 16), HIST_PAD)
    hist[0, 1:, 0] = gd["rep_penalty_hist"][0, -3:]    # window 3 (+ one padding entry)
    hist[0, :2, 5] = [7, 7]                              # an id repeated counts once
    penalized, _ = graphs.sampling_filter(logits, hist, 1.1, 1.0, 0, 1.0)
    ref = gd["rep_penalty_out"][0]
    err = max_err(penalized[0, 0], ref)
    print(f"rep_penalty_out max|diff| {err:.3g}")
    assert err <= tolerance(ref)
    expect5 = logits[0, 5].copy()
    expect5[7] = expect5[7] * np.float32(1.1) if expect5[7] < 0 else expect5[7] / np.float32(1.1)
    np.testing.assert_array_equal(penalized[0, 5], expect5)
    untouched = [c for c in range(1, 16) if c != 5]
    np.testing.assert_array_equal(penalized[0, untouched], logits[0, untouched])


def test_empty_history_window(graphs):
    """A window of 0 frames is no penalty (the host may also pad with 1027)."""
    h = tts_golden("text_only")["prefill_hidden"][-1:]
    padded = graphs.frame(h, np.full((1, 3, 16), HIST_PAD), penalty=1.1)
    empty = graphs.frame(h, np.zeros((1, 0, 16), np.int64), penalty=1.1)
    np.testing.assert_array_equal(empty[0], padded[0])
    np.testing.assert_array_equal(empty[1], padded[1])


def _reference_filter(logits, hist, penalty, temperature, top_k, top_p):
    """numpy transcription of upstream sample_token's filter chain for one [V] row."""
    x = logits.astype(np.float32).copy()
    for i in {int(h) for h in hist if 0 <= h < x.size}:
        x[i] = x[i] * np.float32(penalty) if x[i] < 0 else x[i] / np.float32(penalty)
    penalized = x.copy()
    x = x / np.float32(temperature)
    if 0 < top_k < x.size:
        x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
    if top_p < 1:
        order = np.argsort(x, kind="stable")
        z = x[order] - x.max()
        sp = np.exp(z) / np.exp(z).sum()
        drop = np.cumsum(sp.astype(np.float64)).astype(np.float32) <= np.float32(1) - np.float32(top_p)
        drop[-1] = False
        x[order[drop]] = -np.inf
    e = np.exp(x - x.max())
    return penalized, e / e.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 30, 0.6), (1.0, 0, 0.95), (1.3, 200, 1.0),
                                                      (0.5, 5, 0.99), (2.0, 1026, 0.3)])
def test_filter_matches_numpy_reference(graphs, temperature, top_k, top_p):
    rng = np.random.default_rng(top_k)
    logits = (rng.standard_normal((2, 16, 1027)) * 3).astype(np.float32)
    if 0 < top_k < 1000:                                    # ties at the top-k boundary are all kept
        order = np.argsort(-logits[1], axis=-1)
        for c in range(16):
            logits[1, c, order[c, top_k:top_k + 4]] = logits[1, c, order[c, top_k - 1]]
    hist = rng.integers(0, 1028, size=(2, 7, 16))
    penalized, probs = graphs.sampling_filter(logits, hist, 1.3, temperature, top_k, top_p)
    for b in range(2):
        for c in range(16):
            ref_pen, ref_probs = _reference_filter(logits[b, c], hist[b, :, c], 1.3, temperature, top_k, top_p)
            np.testing.assert_array_equal(penalized[b, c], ref_pen)
            np.testing.assert_array_equal(probs[b, c] > 0, ref_probs > 0)
            assert max_err(probs[b, c], ref_probs) <= 1e-5


def test_filter_switches(graphs):
    """top_k 0 and top_p 1 are off; top_k 1 leaves only the max; temperature scales the softmax."""
    logits = tts_golden("voice_clone")["frame0_logits"][None]
    hist = np.full((1, 1, 16), HIST_PAD)
    _, probs = graphs.sampling_filter(logits, hist, 1.0, 0.7, 0, 1.0)
    z = logits[0] / np.float32(0.7)
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    assert max_err(probs[0], ref) <= 1e-5
    _, probs = graphs.sampling_filter(logits, hist, 1.0, 1.0, 1, 0.9)
    np.testing.assert_array_equal(probs[0].argmax(-1), logits[0].argmax(-1))
    assert np.allclose(probs[0].max(-1), 1.0)


def test_top_p_zero_keeps_only_the_max(graphs):
    """top_p 0 drops every entry of the ascending cumulative sum but the max (upstream always keeps it)."""
    logits = tts_golden("text_only")["frame0_logits"][None]
    _, probs = graphs.sampling_filter(logits, np.full((1, 1, 16), HIST_PAD), 1.0, 1.0, 0, 0.0)
    np.testing.assert_array_equal(probs[0], np.eye(1027, dtype=np.float32)[logits[0].argmax(-1)])


# inputs onnxruntime reads on the host (shapes, counts, axes): fed from graph data, each is a device→host copy
# per call and a shape that changes with the data (no CUDA graph capture)
HOST_SIDE_INPUTS = {"TopK": [1], "Reshape": [1], "Expand": [1], "ConstantOfShape": [0], "Range": [0, 1, 2],
                    "Slice": [1, 2, 3, 4], "Tile": [1], "Squeeze": [1], "Unsqueeze": [1], "Split": [1],
                    "ReduceSum": [1], "ReduceMean": [1], "ReduceMax": [1], "CumSum": [1],
                    "GroupQueryAttention": [6]}


def data_to_shape_paths(path) -> list[str]:
    """Nodes whose host-side inputs depend on the values (not only the shapes) of the graph's inputs."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    data = {i.name for i in graph.input}
    bad = []
    for node in graph.node:
        host = HOST_SIDE_INPUTS.get(node.op_type, [])
        bad += [f"{node.name} ({node.op_type} input {i} from {name})" for i, name in enumerate(node.input)
                if i in host and name in data]
        if node.op_type != "Shape" and any(name in data for name in node.input):
            data.update(node.output)
    return bad


@pytest.mark.parametrize("graph", ["depth", "sampling_filter"])
def test_sampler_shapes_do_not_depend_on_data(tts_bundle_dir, graph):
    """The frame sampler sorts the whole vocabulary (K = 1027, a constant): no top_k or finite-window
    reduction feeds a shape, so a call needs no device→host copy and its shapes are fixed per batch."""
    assert data_to_shape_paths(tts_bundle_dir / f"{graph}.onnx") == []


def test_depth_mixed_batch_and_draws(graphs):
    """Row 0 greedy, row 1 sampled in one call: row 0 equals its greedy frame; row 1's codes are the
    inverse-CDF draws (from the host uniforms) of the filter's distribution for its own logits, taken in
    the ascending stable order of the temperature-scaled logits (the sampler's one sort)."""
    gd = tts_golden("text_only")
    hidden = gd["greedy_step_hidden"][3:5]
    frames = list(gd["greedy_rep_raw_frames"][:3])
    hist = np.concatenate([history_of(frames, 1.1)] * 2)
    rng = np.random.default_rng(5)
    uniform = rng.random((2, 16), dtype=np.float32)
    params = dict(penalty=[1.1, 1.1], temperature=[0.8, 0.8], top_k=[30, 30], top_p=[0.6, 0.6])
    codes, logits = graphs.frame(hidden, hist, greedy=[True, False], uniform=uniform, **params)
    solo, _ = graphs.frame(hidden[:1], hist[:1], penalty=1.1)
    np.testing.assert_array_equal(codes[0], solo[0])
    penalized, probs = graphs.sampling_filter(logits, hist, 1.1, 0.8, 30, 0.6)
    np.testing.assert_array_equal(codes[0], penalized[0].argmax(-1))
    order = np.argsort(penalized[1] / np.float32(0.8), axis=-1, kind="stable")          # [16, V]
    cdf = np.cumsum(np.take_along_axis(probs[1], order, -1), -1)
    first = (cdf / cdf[:, -1:] <= uniform[1][:, None]).sum(-1)
    np.testing.assert_array_equal(codes[1], order[np.arange(16), first])
    assert (probs[1][np.arange(16), codes[1]] > 0).all()
    # deterministic: same uniforms, same frame; top_k 1 is greedy whatever the uniforms
    again, _ = graphs.frame(hidden, hist, greedy=[True, False], uniform=uniform, **params)
    np.testing.assert_array_equal(again, codes)
    k1, _ = graphs.frame(hidden[1:], hist[1:], penalty=1.1, greedy=False, temperature=0.8, top_k=1,
                         top_p=1.0, uniform=rng.random((1, 16), dtype=np.float32))
    ref_greedy, _ = graphs.frame(hidden[1:], hist[1:], penalty=1.1)
    np.testing.assert_array_equal(k1, ref_greedy)


def test_depth_is_written_with_fused_ops(tts_bundle_dir):
    """The local transformer's 16 positions use GroupQueryAttention over this frame's earlier positions, one
    packed q/k/v and one packed gate/up projection per layer and position, and no per-position transposes:
    under a fifth of the nodes of the op-by-op graph (5,933 on this checkpoint), the launch count on a GPU."""
    import onnx

    nodes = onnx.load(str(tts_bundle_dir / "depth.onnx"), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    cfg = json.loads((tts_bundle_dir / "manifest.json").read_text())["tts"]["config"]["local"]
    per_position = cfg["layers"] * 16
    assert ops.count("GroupQueryAttention") == per_position and "Transpose" not in ops[-100:]
    assert ops.count("MatMul") + ops.count("MatMulNBits") == per_position * 4 + 16   # qkv, o, gate_up, down; heads
    # the backbone's q/k path at a constant position: per-head RMSNorm, RotaryEmbedding, the select for v
    assert ops.count("BranchwiseRMSNorm") == ops.count("RotaryEmbedding") == per_position and ops.count("Reshape") <= 1
    assert ops.count("QuickGelu") == per_position and "Sigmoid" not in ops                # SiLU as one node
    # the draw in sorted order: a count per codebook, no ArgMax (greedy rows are draw settings), no scatter back to
    # id order (the one ScatterElements marks the window's ids, once per frame), no clamp or fallback
    assert "ArgMax" not in ops and ops.count("ScatterElements") == 1 and "Min" not in ops
    # SwiGLU's per layer and position, the penalty's per codebook
    assert ops.count("Mul") == per_position + 16
    # each code comes out of the draw as [B, 1] (a batched GatherND), ready for the next embedding lookup
    assert ops.count("GatherND") == 16 and "Squeeze" not in ops
    assert len(nodes) <= 1277, len(nodes)


# ---------------------------------------------------------------------------------------------- reduced precision
def _agreement(bundle_dir) -> dict:
    """Greedy code agreement with the goldens over the four greedy runs (two prompts, penalty 1.0 / 1.1).

    * teacher_forced: every frame computed from the golden context (golden rows in the backbone, golden
      history), codes compared with the golden frame (codes inside a frame still feed each other);
    * codebook0: the same, codebook 0 only (the EOS decision);
    * free_running: the whole autoregressive loop; after a first flip the trajectories diverge, so this
      is position-wise agreement up to the golden length (missing frames count as mismatches).
    """
    g = Graphs(bundle_dir)
    tf = tf0 = free = n_codes = n_frames = 0
    for case in CASES:
        gd = tts_golden(case)
        for penalty, rep in ((1.0, "greedy"), (1.1, "greedy_rep")):
            raw = gd[f"{rep}_raw_frames"]
            hidden = teacher_forced_hidden(g, gd, rep)
            for f in range(len(raw)):
                codes, _ = g.frame(hidden[f][None], history_of(list(raw[:f]), penalty), penalty)
                tf += int((codes[0] == raw[f]).sum())
                tf0 += int(codes[0, 0] == raw[f, 0])
            frames = greedy_generate(g, gd["prefill_ids"], gd["text_ids"], penalty)["frames"]
            n = min(len(frames), len(raw))
            free += int((frames[:n] == raw[:n]).sum())
            n_codes += raw.size
            n_frames += len(raw)
    return {"teacher_forced": tf / n_codes, "codebook0": tf0 / n_frames, "free_running": free / n_codes}


# int4 (4-bit, one scale per block of 32 inputs) on this hidden-32 random model: 12.8% / 67.6% / 1.7%;
# real-model quality cannot be measured here (no trained weights), see docs/parity.md.
INT4_FLOOR, INT4_FLOOR0 = 0.10, 0.60


# Floors a little under what set-a measures (teacher_forced / codebook0 / free_running):
# fp16 98.3% / 99.1% / 90.3%, int8 68.9% / 95.4% / 3.7%. The tiny random-weight model is very sensitive:
# the smallest golden top-2 margins are ~1e-3, int8 per-channel scales over 32..96 inputs give ~3%
# hidden-state error, and every flipped code changes all later inputs of the frame (and of the run).
@pytest.mark.parametrize("dtype,floors", [("fp16", {"teacher_forced": 0.95, "codebook0": 0.97, "free_running": 0.85}),
                                          ("int8", {"teacher_forced": 0.62, "codebook0": 0.92}),
                                          ("int8-b128", {"teacher_forced": 0.62, "codebook0": 0.92}),
                                          ("int4", {"teacher_forced": INT4_FLOOR, "codebook0": INT4_FLOOR0})])
def test_reduced_precision_agreement(tts_bundle_for, dtype, floors):
    bundle_dir = tts_bundle_for(dtype)
    rates = _agreement(bundle_dir)
    print(f"{dtype}: greedy code agreement with the goldens " + ", ".join(f"{k} {v:.2%}" for k, v in rates.items()))
    for key, floor in floors.items():
        assert rates[key] >= floor, (key, rates)


def golden_hidden_rel_error(bundle_dir) -> np.ndarray:
    """Relative L2 error of a bundle's teacher-forced backbone hidden states against the goldens' (every case,
    greedy and with repetition penalty, one value per step)."""
    g = Graphs(bundle_dir)
    rel = []
    for case in CASES:
        gd = tts_golden(case)
        for rep in ("greedy", "greedy_rep"):
            hidden, ref = teacher_forced_hidden(g, gd, rep), gd[f"{rep}_step_hidden"]
            rel += list(np.linalg.norm(hidden - ref, axis=-1) / np.linalg.norm(ref, axis=-1))
    return np.array(rel)


# Teacher-forced backbone hidden states against the goldens, relative error median / max, as docs/export.md
# states them beside the code rates of test_reduced_precision_agreement. Measured on set-a: fp16 1.7e-4 /
# 3.4e-4, int8 4.5e-3 / 8.7e-3, int4 5.3e-2 / 9.4e-2 (fp16 compute: test_fp16_compute_on_cpu); the bounds
# sit a little outside.
# int8 in blocks of 128 (--int8-block 128): 5.0e-3 / 1.2e-2, held to int8's bounds.
HIDDEN_BOUNDS = {"fp16": (3e-4, 6e-4), "int8": (7e-3, 1.5e-2), "int8-b128": (7e-3, 1.5e-2), "int4": (8e-2, 0.15)}


@pytest.mark.parametrize("dtype", list(HIDDEN_BOUNDS))
def test_reduced_precision_hidden_state_agreement(tts_bundle_for, dtype):
    rel = golden_hidden_rel_error(tts_bundle_for(dtype))
    print(f"{dtype} weights: teacher-forced hidden relative error against the goldens median {np.median(rel):.2e} "
          f"max {np.max(rel):.2e}")
    median, worst = HIDDEN_BOUNDS[dtype]
    assert np.median(rel) <= median and np.max(rel) <= worst, (np.median(rel), np.max(rel))


def test_tts_agreement_tool_follows_the_fp32_bundle(tts_bundle_for):
    """export.tts_agreement (the tool that states agreement at real dimensions, where no goldens exist) on set-a:
    an fp32 bundle agrees with itself exactly, and int8 is as far from fp32 as the golden comparison says."""
    from export.tts_agreement import tts_agreement

    same = tts_agreement(tts_bundle_for("fp32"), tts_bundle_for("fp32"))
    assert same["hidden_rel_error_max"] == 0 and same["codes_equal"] == 1.0
    r = tts_agreement(tts_bundle_for("fp32"), tts_bundle_for("int8"))
    bound = HIDDEN_BOUNDS["int8"]
    assert 0 < r["hidden_rel_error_median"] <= bound[0] and r["hidden_rel_error_max"] <= bound[1], r
    assert r["codebook0_equal"] >= 0.9 and len(r["per_codebook_equal"]) == 16, r


@pytest.mark.parametrize("level", [1, 4])
def test_int8_matmul_weight(tmp_path, level):
    """GraphBuilder int8 matmul weights: symmetric int8, one scale per block of 64 inputs of each output row
    (graph.INT8_BLOCK), read by MatMulNBits (K padded to whole blocks, one packed weight shared by two nodes).
    accuracy_level 1 computes exactly with the dequantized weight; level 4 (the export default) also
    quantizes activations per block on CPU."""
    from onnx import TensorProto

    from export.graph import INT8_BLOCK, GraphBuilder, quantize_blocks

    assert INT8_BLOCK == 64
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 140)) * np.array([1e-3, 1, 10, 0, 1, 100])[:, None]).astype(np.float32)  # [out, in]
    w[4, 64:128] *= 50                                   # one block of row 4 far larger than the rest of it
    gb = GraphBuilder("q", tmp_path / "q.onnx", np.int8, int8_accuracy_level=level)
    x = gb.input("x", TensorProto.FLOAT, [2, 3, 140])
    handle = gb.matmul_weight(w, "w")
    gb.output(gb.op("Add", [gb.matmul(x, handle), gb.matmul(x, handle)]), "y", TensorProto.FLOAT, [2, 3, 6])
    gb.save()
    xv = rng.standard_normal((2, 3, 140)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    packed, scales = quantize_blocks(w, 64, 8)
    assert packed.shape == (6, 3, 64) and scales.shape == (18,)
    deq = ((packed.astype(np.float32) - 128) * scales.reshape(6, 3, 1)).reshape(6, 192)[:, :140]
    # each block has its own scale: row 4's small blocks keep their precision beside its large one
    assert np.abs(deq[4, :64] - w[4, :64]).max() <= np.abs(w[4, :64]).max() / 254 + 1e-6
    exact = 2 * xv @ deq.T
    if level == 1:
        np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-5)
    else:   # int8 activations: ~1% of each output's magnitude scale
        mag = 2 * np.abs(xv) @ np.abs(w.T)
        assert (np.abs(y - exact) <= 0.02 * mag + 1e-6).all()


def test_int4_matmul_weight(tmp_path):
    """4-bit MatMulNBits weights: symmetric per block of 32 inputs, packed two per byte (low nibble first)."""
    from onnx import TensorProto

    from export.graph import GraphBuilder, quantize_int4_blocks

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((5, 70)) * np.array([1e-3, 1, 10, 0, 100])[:, None]).astype(np.float32)
    gb = GraphBuilder("q4", tmp_path / "q4.onnx", np.int8, int8_accuracy_level=1, matmul_bits=4)
    x = gb.input("x", TensorProto.FLOAT, [3, 70])
    gb.output(gb.matmul(x, gb.matmul_weight(w, "w")), "y", TensorProto.FLOAT, [3, 5])
    gb.save()
    xv = rng.standard_normal((3, 70)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "q4.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    packed, scales = quantize_int4_blocks(w, 32)
    assert packed.shape == (5, 3, 16) and scales.shape == (15,)
    q = np.stack([packed & 15, packed >> 4], -1).reshape(5, 3, 32).astype(np.float32) - 8
    deq = (q * scales.reshape(5, 3, 1)).reshape(5, 96)[:, :70]
    np.testing.assert_allclose(y, xv @ deq.T, rtol=1e-5, atol=1e-5)
    assert np.abs(deq - w).max() <= np.abs(w).max(axis=1).max() / 14 + 1e-6  # half a step of the largest scale


def test_int8_storage(tts_bundle_dir, tts_bundle_for):
    import onnx

    int8_dir = tts_bundle_for("int8")
    model = onnx.load(str(int8_dir / "backbone.onnx"), load_external_data=False)
    dtypes = {t.name: t.data_type for t in model.graph.initializer}
    assert dtypes["language_model.layers.0.self_attn.qkv_proj.qw"] == onnx.TensorProto.UINT8
    assert dtypes["language_model.layers.0.self_attn.qkv_proj.qw_scale"] == onnx.TensorProto.FLOAT
    assert dtypes["embed_tokens.stored"] == onnx.TensorProto.FLOAT16     # the 17 tables, stacked
    assert not [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
                and not t.name.startswith("rotary.") and not t.name.endswith(".qk_norm")]
    # RoPE tables and the per-head q/k norm rows are in the compute dtype, like every norm vector
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulNBits" in ops and "DequantizeLinear" not in ops
    size = lambda d: sum(p.stat().st_size for p in d.glob("*.onnx.data"))
    assert size(int8_dir) < 0.6 * size(tts_bundle_dir)


# ---------------------------------------------------------------------------------------------- export
def test_manifest_section(tts_bundle_dir):
    manifest = json.loads((tts_bundle_dir / "manifest.json").read_text())
    tts = manifest["tts"]
    assert tts["dtype"] == "fp32"
    cfg = tts["config"]
    assert (cfg["hidden"], cfg["layers"], cfg["kv_heads"], cfg["head_dim"], cfg["vocab"]) == (32, 2, 2, 8, 151936)
    assert (cfg["rvq"], cfg["audio_vocab"], cfg["rope_theta"]) == (16, 1027, 1e6)
    assert tts["source_config"] == json.loads((TTS_CHECKPOINT / "config.json").read_text())
    assert tts["ignored_tensors"] == ["language_model.embed_tokens.weight"]
    bb = manifest["graphs"]["backbone"]
    assert [i["name"] for i in bb["inputs"][:4]] == ["grid", "position_ids", "seqlens_k", "total_sequence_length"]
    assert bb["outputs"][:2] == [{"name": f"present_{k}.0", "dtype": "float32", "shape": ["batch", 2, "capacity", 8]}
                                 for k in ("key", "value")]
    assert bb["outputs"][-1] == {"name": "hidden", "dtype": "float32", "shape": ["batch", "rows", 32]}
    depth = manifest["graphs"]["depth"]
    assert [o["name"] for o in depth["outputs"]] == ["codes", "logits", "finite"]
    assert {"backbone.onnx", "depth.onnx", "sampling_filter.onnx"} <= set(manifest["files"])


def _rewrite_checkpoint(out, drop=(), add=None):
    """A copy of the golden TTS checkpoint in ``out`` without ``drop`` and with ``add``."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    (out / "config.json").write_text((TTS_CHECKPOINT / "config.json").read_text())
    with safe_open(TTS_CHECKPOINT / "model.safetensors", framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, out / "model.safetensors")
    return out


def test_missing_tensor_is_named(tmp_path):
    from export.bundle import BundleWriter
    from export.checkpoint import CheckpointError
    from export.tts_export import export_tts

    missing = ["local_transformer.local_lm_heads.7.weight", "language_model.layers.1.self_attn.k_norm.weight"]
    ckpt = _rewrite_checkpoint(tmp_path / "ckpt", drop=missing)
    with pytest.raises(CheckpointError) as err:
        export_tts(ckpt, BundleWriter(tmp_path / "bundle"))
    assert all(name in str(err.value) for name in missing)
    assert not list((tmp_path / "bundle").glob("*.onnx"))   # failed before writing any graph


def test_unmapped_tensor_fails_but_dead_text_table_may_be_absent(tmp_path):
    from export.bundle import BundleWriter
    from export.checkpoint import CheckpointError
    from export.tts_export import export_tts

    extra = _rewrite_checkpoint(tmp_path / "a", add={"lm_head.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        export_tts(extra, BundleWriter(tmp_path / "bundle_a"))
    lean = _rewrite_checkpoint(tmp_path / "b", drop=["language_model.embed_tokens.weight"])
    writer = BundleWriter(tmp_path / "bundle_b")
    export_tts(lean, writer)
    assert writer.manifest["tts"]["ignored_tensors"] == []


def test_bad_config_and_dtype(tmp_path):
    from export.bundle import BundleWriter
    from export.checkpoint import CheckpointError
    from export.tts import parse_tts_config
    from export.tts_export import export_tts

    cfg = json.loads((TTS_CHECKPOINT / "config.json").read_text())
    cfg["language_config"]["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(CheckpointError, match="yarn"):
        parse_tts_config(cfg)
    with pytest.raises(ValueError, match="dtype"):
        export_tts(TTS_CHECKPOINT, BundleWriter(tmp_path), dtype="int2")
    with pytest.raises(ValueError, match="compute dtype"):
        export_tts(TTS_CHECKPOINT, BundleWriter(tmp_path), compute_dtype="fp8")


def test_fixtures_are_local():
    """The goldens the tests read live in the project (a fresh clone passes without the shared dir): every
    fixture file is a byte-exact copy of the golden set's manifest entry, and no test reads the shared dir."""
    import hashlib
    from pathlib import Path

    from export.demo import TOKENIZER_JSON  # the golden tokenizer, shipped with the package

    tests = Path(__file__).parent
    assert GOLDEN.resolve().is_relative_to(tests.resolve())
    entries = {e["path"]: e for e in json.loads((GOLDEN / "manifest.json").read_text())}
    local = [p for p in GOLDEN.rglob("*") if p.is_file() and p.suffix in (".npz", ".json", ".safetensors")
             and p.name != "manifest.json"]
    assert len(local) >= 10
    for path in local:
        entry = entries[path.relative_to(GOLDEN).as_posix()]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], path
    tok = json.loads(TOKENIZER_JSON.read_text())
    assert (tok["added_tokens"][11]["content"] == "<|audio_pad|>"
            and tok["added_tokens"][12]["content"] == "<|text_pad|>")
    shared = "/".join(("..", "shared"))   # spelled apart so this file does not match itself
    for source in tests.glob("*.py"):
        assert shared not in source.read_text(), source


# ---------------------------------------------------------------------------------------------- compute dtype
def test_fp16_compute_on_cpu(tts_bundle_dir, tts_bundle_for):
    """An fp16-compute backbone (fp16 weights, activations and KV) on the CPU provider against the fp32
    goldens: teacher-forced hidden states stay close and greedy codes mostly agree (tiny random models
    have ~1e-3 top-2 margins, so agreement is a stated figure, not exact)."""
    import onnx

    fp16_dir = tts_bundle_for("fp16", "fp16")
    manifest = json.loads((fp16_dir / "manifest.json").read_text())
    assert manifest["tts"]["compute_dtype"] == "fp16"
    bb = {v["name"]: v["dtype"]
          for v in manifest["graphs"]["backbone"]["inputs"] + manifest["graphs"]["backbone"]["outputs"]}
    assert bb["past_key.0"] == bb["present_value.1"] == "float16" and bb["hidden"] == "float32"
    model = onnx.load(str(fp16_dir / "backbone.onnx"), load_external_data=False)
    assert not [n.name for n in model.graph.node if n.op_type == "Cast"][1:], "only the hidden output is cast"
    rel = golden_hidden_rel_error(fp16_dir)
    rates = _agreement(fp16_dir)
    print(f"fp16 compute: teacher-forced hidden relative error median {np.median(rel):.2e} max {np.max(rel):.2e}; "
          "greedy code agreement " + ", ".join(f"{k} {v:.2%}" for k, v in rates.items()))
    assert np.median(rel) < 2e-3 and np.max(rel) < 1e-2
    # free running follows the first flip: with the depth graph in fp16 too, voice_clone flips at frame 1,
    # codebook 14 (golden top-2 margin 2.3e-3) and both of its runs diverge from there (48% measured)
    assert rates["teacher_forced"] >= 0.95 and rates["codebook0"] >= 0.97 and rates["free_running"] >= 0.4


def test_fp16_depth_keeps_a_float32_sampler(tts_bundle_dir, tts_bundle_for):
    """The depth transformer computes in fp16 and its head logits are cast to float32 for the sampler, so the
    interface is unchanged; teacher-forced against the fp32 depth graph (golden hidden states and history),
    the logits of the codebooks whose inputs agree stay close and the codes agree per codebook."""
    import onnx

    fp16_dir = tts_bundle_for("fp16", "fp16")
    manifest = json.loads((fp16_dir / "manifest.json").read_text())["graphs"]["depth"]
    assert {v["dtype"] for v in manifest["inputs"] + manifest["outputs"]
            if v["name"] in ("hidden", "logits")} == {"float32"}
    graph = onnx.load(str(fp16_dir / "depth.onnx"), load_external_data=False).graph
    casts = [n for n in graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT]
    assert len([n for n in casts if "local_lm_heads" in n.name]) == 16          # one per head, nothing else
    g32, g16 = Graphs(tts_bundle_dir), Graphs(fp16_dir)
    rel, agree, frames = [], np.zeros(16), 0
    for case in CASES:
        gd = tts_golden(case)
        for penalty, rep in ((1.0, "greedy"), (1.1, "greedy_rep")):
            raw, hidden = gd[f"{rep}_raw_frames"], gd[f"{rep}_step_hidden"]
            for f in range(len(raw)):
                hist = history_of(list(raw[:f]), penalty)
                (c32, l32), (c16, l16) = (g32.frame(hidden[f][None], hist, penalty),
                                          g16.frame(hidden[f][None], hist, penalty))
                same_inputs = np.concatenate([[True], np.cumprod(c32[0] == c16[0])[:-1] > 0])
                rel += list(np.linalg.norm(l16[0] - l32[0], axis=-1)[same_inputs]
                            / np.linalg.norm(l32[0], axis=-1)[same_inputs])
                agree += c32[0] == c16[0]
                frames += 1
    print(f"fp16 depth vs fp32: logits relative error median {np.median(rel):.2e} max {np.max(rel):.2e}; "
          f"code agreement per codebook {' '.join(f'{a / frames:.0%}' for a in agree)} "
          f"(all {agree.sum() / agree.size / frames:.2%})")
    assert np.median(rel) < 3e-3 and np.max(rel) < 2e-2
    assert agree.sum() / (16 * frames) >= 0.95 and agree[0] / frames >= 0.97


def test_backbone_is_fused_and_host_driven(tts_bundle_dir):
    """The backbone is written with onnxruntime's fused ops and takes its lengths from the host: no unfused
    RMSNorm, one packed q/k/v and one packed gate/up matmul per layer, the packed q/k/v handed to
    GroupQueryAttention as its one query input (no splits around the q/k path), and no device-side
    reduction that would feed GroupQueryAttention's host-side total_sequence_length; every node is named by
    module path."""
    import onnx

    model = onnx.load(str(tts_bundle_dir / "backbone.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    layers = json.loads((tts_bundle_dir / "manifest.json").read_text())["tts"]["config"]["layers"]
    assert not {"ReduceMean", "Sqrt", "Reciprocal", "ReduceMax", "Cos", "Sin"} & set(ops)
    # every head of the flat packed projection: one per-head RMSNorm (each head's own weight), one
    # RotaryEmbedding and one select that keeps the v heads as projected; no reshape anywhere
    assert ops.count("GroupQueryAttention") == layers and ops.count("RotaryEmbedding") == layers
    assert ops.count("BranchwiseRMSNorm") == layers and "Reshape" not in ops
    assert ops.count("SimplifiedLayerNormalization") + ops.count("SkipSimplifiedLayerNormalization") == 2 * layers + 1
    assert ops.count("MatMul") == 4 * layers and ops.count("Gather") == 1
    assert ops.count("Split") == layers and ops.count("Where") == layers                    # gate/up only
    assert len(ops) <= 13 * layers + 4, len(ops)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert all(n.input[1] == n.input[2] == "" for n in gqa)                                 # packed q/k/v
    assert all(n.input[5] == "seqlens_k" and n.input[6] == "total_sequence_length" for n in gqa)
    unscoped = [n.name for n in model.graph.node if "/" not in n.name and n.op_type != "Identity"]
    assert not unscoped, unscoped
