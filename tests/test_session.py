"""Streaming sessions against the upstream goldens: token ids and text deltas in, frames out, pacing,
multi-turn context, cancel, limits, and the replay CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from conftest import TEST_DEVICE, backbone_hidden, exact_codes, golden, tolerance, tts_tolerance

SPEC_PROMPTS = {
    "turn1_user": "Hey, I just landed in Paris. I have about six hours before my next flight. Any ideas?",
    "turn2_user": "Just a backpack.",
}


def greedy(model):
    return model.default_sampling(greedy=True, repetition_penalty=1.1)


def new_session(model, voice=None, **kw):
    from engine.offline.session import StreamingSession

    return StreamingSession(model, voice_codes=voice, params=greedy(model), **kw)


def run_turn_ids(session, ids, chunks, **turn):
    session.begin_turn(**turn)
    frames, f = [], 0
    for n in chunks:
        frames += session.push_token_ids(ids[f:f + n])
        f += n
    frames += session.push_token_ids(ids[f:]) if f < len(ids) else []
    frames += session.end_text()
    frames += session.drain()
    return frames


def codes_of(frames):
    return np.stack([f.codes for f in frames])


# ---------------------------------------------------------------------------------------------- parity
@exact_codes
@pytest.mark.parametrize("chunks", [[1] * 40, [12], [5, 7, 3, 20], [36]])
def test_streamed_token_ids_reproduce_upstream_frames(model, chunks):
    g = golden("tts/tts_streaming.npz")
    s = new_session(model)
    frames = run_turn_ids(s, list(g["streamed_text_ids"]), chunks)
    np.testing.assert_array_equal(codes_of(frames), g["frames"])     # EOS frame included
    assert frames[-1].eos and frames[-1].audio is None
    np.testing.assert_array_equal(s.context[0][: len(g["turn_input_ids"])], g["turn_input_ids"])
    np.testing.assert_array_equal(s.context_ids(), g["context_ids"])
    assert s.stats.finish_reason == "eos"


def test_text_deltas_feed_whole_text_ids(model):
    g = golden("tts/tts_streaming.npz")
    s = new_session(model)
    s.begin_turn()
    frames = []
    for d in g["deltas"]:
        frames += s.push_text(str(d))
    frames += s.end_text() + s.drain()
    text_rows = np.concatenate(s.context)[len(g["turn_input_ids"]):, 0]
    fed = [int(t) for t in text_rows if t != model.layout.text_pad_id]
    assert fed == list(g["whole_text_ids"])
    np.testing.assert_array_equal(codes_of(frames[:-1]), g["nonstream_whole_codes"])


@pytest.mark.parametrize("seed", range(6))
def test_random_splits_give_the_same_ids_and_frames(model, seed):
    """Property: any split of the text (str or UTF-8 bytes, even inside a character) feeds the whole-text
    ids, so the frames equal the non-streaming generation of the whole text."""
    g = golden("tts/tts_streaming.npz")
    text = "".join(str(d) for d in g["deltas"])
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
    parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    s = new_session(model)
    s.begin_turn()
    frames = []
    for part in parts:
        if seed % 2:
            raw = part.encode()
            k = rng.randint(0, len(raw))
            frames += s.push_text(raw[:k]) + s.push_text(raw[k:])
        else:
            frames += s.push_text(part)
    frames += s.end_text() + s.drain()
    np.testing.assert_array_equal(codes_of(frames[:-1]), g["nonstream_whole_codes"])


@exact_codes
def test_multiturn_reuses_the_kv_cache(model):
    g = golden("tts/tts_multiturn.npz")
    s = new_session(model, voice=g["voice_prompt_codes"].T)
    f1 = run_turn_ids(s, list(g["turn1_streamed_text_ids"]), [3] * 20, user_text=SPEC_PROMPTS["turn1_user"],
                      user_audio_codes=g["turn1_user_audio_codes"].T)
    np.testing.assert_array_equal(s.context[0][: len(g["turn1_input_ids"])], g["turn1_input_ids"])
    np.testing.assert_array_equal(codes_of(f1), g["turn1_frames"])
    rows_after_turn1 = s.context_rows
    f2 = run_turn_ids(s, list(g["turn2_streamed_text_ids"]), [12, 1, 1, 1], user_text=SPEC_PROMPTS["turn2_user"],
                      user_audio_codes=g["turn2_user_audio_codes"].T)
    turn2_prefill = s.context[len(s.context) - len(f2)]
    np.testing.assert_array_equal(turn2_prefill[: len(g["turn2_input_ids"])], g["turn2_input_ids"])
    np.testing.assert_array_equal(codes_of(f2), g["turn2_frames"])
    np.testing.assert_array_equal(s.context_ids(), g["context_ids"])
    assert s.context_rows == len(g["context_ids"]) > rows_after_turn1


@exact_codes
def test_app_text_only_user_turn(model):
    """app.py's path: text-only user turn, token chunks of 12: per-call frame counts, frames, context,
    audio, and the non-streaming loop on the same rows all as upstream."""
    g = golden("tts/tts_app_stream.npz")
    rows = g["turn_input_ids"]
    voice = g["prompt_codes"].T
    system = model.prompt.system_block(model.prompt.check_codes(voice))
    # the user text is whatever the golden grid holds between "user\n" and the closing <|im_end|>
    user_ids = rows[len(system) + 5: -5, 0]
    user_text = model.tokenizer.decode(list(user_ids))
    s = new_session(model, voice=voice)
    s.begin_turn(user_text=user_text)
    ids = list(g["text_ids"])
    pushes = [s.push_token_ids(ids[i:i + 12]) for i in range(0, len(ids), 12)]
    ended = s.end_text()
    drains = []
    while not s.turn_done:
        drains.append(s.step())
    assert [len(p) for p in pushes] == list(g["push_frames"])
    assert len(ended) == g["end_text_frames"][0]
    assert [len(d) for d in drains] == list(g["drain_frames"])
    frames = [f for chunk in pushes + [ended] + drains for f in chunk]
    np.testing.assert_array_equal(s.context[0][: len(rows)], rows)
    np.testing.assert_array_equal(codes_of(frames), g["frames"])
    np.testing.assert_array_equal(s.context_ids(), g["context_ids"])
    audio = np.concatenate([f.audio for f in frames if not f.eos])
    assert audio.shape == g["wav"].shape and np.abs(audio - g["wav"]).max() <= tolerance(g["wav"])
    # upstream's non-streaming loop on the same rows gives the same codes
    gen = new_session(model, voice=voice)
    np.testing.assert_array_equal(codes_of(run_turn_ids(gen, ids, [len(ids)], user_text=user_text))[:-1],
                                  g["nonstream_codes"])


@exact_codes
def test_turn_audio_matches_upstream_bridge_audio(model):
    """Upstream's bridge decodes 3-frame chunks inside codec.streaming (exact below 10 s); our frame-by-
    frame audio, one frame's 1920 samples with each frame, equals it."""
    g = golden("tts/tts_streaming.npz")
    frames = run_turn_ids(new_session(model), list(g["streamed_text_ids"]), [1] * 36)
    assert all(f.audio.shape == (1920,) for f in frames if not f.eos)
    audio = np.concatenate([f.audio for f in frames if not f.eos])
    ref = g["bridge_wav"]
    assert audio.shape == ref.shape and np.abs(audio - ref).max() <= tolerance(ref)


@exact_codes
def test_multiturn_audio_matches_upstream(model):
    g = golden("tts/tts_multiturn.npz")
    s = new_session(model, voice=g["voice_prompt_codes"].T)
    for n, key in ((1, "turn1"), (2, "turn2")):
        frames = run_turn_ids(s, list(g[f"{key}_streamed_text_ids"]), [5] * 10, user_text=SPEC_PROMPTS[f"{key}_user"],
                              user_audio_codes=g[f"{key}_user_audio_codes"].T)
        audio = np.concatenate([f.audio for f in frames if not f.eos])
        ref = g[f"{key}_wav"]
        assert audio.shape == ref.shape and np.abs(audio - ref).max() <= tolerance(ref)
        if n == 1:  # turn 2's prefill sees turn 1's whole context: its hidden states match upstream's
            turn2 = model.prompt.user_turn(SPEC_PROMPTS["turn2_user"], g["turn2_user_audio_codes"].T)
            rows = np.concatenate([turn2, model.prompt.prefill_text(g["turn2_streamed_text_ids"])])
            hidden = backbone_hidden(model, [s.context_ids(), rows])
            ref_h = g["turn2_prefill_hidden"]
            assert np.abs(hidden - ref_h).max() <= tts_tolerance(ref_h)


# ---------------------------------------------------------------------------------------------- pacing
@exact_codes
def test_pacing_prefill_at_12th_id_no_pad_before_end(model):
    g = golden("tts/tts_streaming.npz")
    ids = list(g["streamed_text_ids"])
    s = new_session(model)
    s.begin_turn()
    for i in range(11):
        assert s.push_token_ids([ids[i]]) == []
        assert s.context_rows == 0               # nothing computed before the 12th id
    assert len(s.push_token_ids([ids[11]])) == 1  # the 12th id: prefill -> frame 0
    prefill_rows = s.context_rows
    assert s.step() == [] and s.stats.stalls == 1  # waiting for text: no <|text_pad|> fed
    assert s.context_rows == prefill_rows
    for k, t in enumerate(ids[12:20], start=1):
        out = s.push_token_ids([t])
        assert len(out) == 1 and s.context_rows == prefill_rows + k
        assert s.context[-1][0, 0] == t            # one committed id per frame, never a pad
    assert all(r[0, 0] != model.layout.text_pad_id for r in s.context[1:])
    out = s.push_token_ids(ids[20:])
    assert len(out) == len(ids) - 20
    tail = s.end_text() + s.drain()
    assert all(r[0, 0] == model.layout.text_pad_id for r in s.context[len(ids) - 11:])
    assert len(tail) == len(g["frames"]) - (len(ids) - 11)


def test_short_text_prefills_at_end_of_text(model):
    s = new_session(model)
    s.begin_turn()
    assert s.push_text("Hi there.") == []
    out = s.end_text()
    assert len(out) == 1 and s.context[0][-1, 1] == model.layout.audio_bos
    assert s.context[0][-1, 0] == model.tokenizer.encode("Hi there.")[-1]


# ---------------------------------------------------------------------------------------------- cancel, limits
def test_cancel_then_next_turn_equals_session_with_fed_rows(model):
    g = golden("tts/tts_multiturn.npz")
    ids1, ids2 = list(g["turn1_streamed_text_ids"]), list(g["turn2_streamed_text_ids"])
    a = new_session(model)
    a.begin_turn(user_text="first")
    frames = a.push_token_ids(ids1[:16])    # prefill + 4 frames, then barge-in
    a.cancel()
    assert a.turn_done and a.stats.finish_reason == "cancelled"
    assert a.push_token_ids(ids1[16:20]) == []  # nothing more for a cancelled turn
    # exactly the prefill and one step row per frame but the last were fed: the last frame never is
    prompt = model.prompt.turn_prompt(True, None, "first")
    assert len(frames) == 5 and a.context_rows == len(prompt) + 12 + 4
    fed = a.context_ids()
    np.testing.assert_array_equal(fed[: len(prompt)], prompt)
    np.testing.assert_array_equal(fed[len(prompt) + 12:, 1:], codes_of(frames[:4]))
    frames_a = run_turn_ids(a, ids2, [12, 20], user_text="second")

    # reference: a fresh session primed with exactly those rows, then the same second turn
    b = new_session(model)
    b.prime(fed)
    assert b.context_rows == len(fed)
    frames_b = run_turn_ids(b, ids2, [32], user_text="second")
    np.testing.assert_array_equal(codes_of(frames_a), codes_of(frames_b))
    np.testing.assert_array_equal(a.context_ids(), b.context_ids())


def test_truncate_keeps_what_was_heard(model):
    """After a cancel, truncating to the audio heard leaves the context of a turn that ended there: the
    next turn equals a session primed with the prefill and the step rows carrying the heard frames."""
    g = golden("tts/tts_multiturn.npz")
    ids1, ids2 = list(g["turn1_streamed_text_ids"]), list(g["turn2_streamed_text_ids"])
    a = new_session(model)
    a.begin_turn(user_text="first")
    frames = a.push_token_ids(ids1[:20])            # 9 frames
    a.cancel()
    prefill = len(model.prompt.turn_prompt(True, None, "first")) + 12
    kept = a.truncate_turn(3)                        # the listener heard 3 frames (240 ms)
    assert kept == prefill + 3 == a.context_rows
    heard = a.context_ids()
    np.testing.assert_array_equal(heard[prefill:, 1:], codes_of(frames[:3]))
    frames_a = run_turn_ids(a, ids2, [32], user_text="second")
    b = new_session(model)
    b.prime(heard)
    frames_b = run_turn_ids(b, ids2, [32], user_text="second")
    np.testing.assert_array_equal(codes_of(frames_a), codes_of(frames_b))
    with pytest.raises(Exception, match="truncate after the turn has ended"):
        a.begin_turn(user_text="third")
        a.push_token_ids(ids2[:12])
        a.truncate_turn(1)


def test_context_limit(model):
    from engine.errors import InputError

    s = new_session(model, max_context_rows=90)
    with pytest.raises(InputError, match="context limit"):
        s.begin_turn(user_text="x" * 400, params=model.default_sampling(temperature=0.3))
    assert s.state.value == "idle" and s.context_rows == 0  # the failed turn changed nothing
    s.begin_turn()                          # still usable: 61 prompt rows fit
    assert s.stream.turn_params == greedy(model)
    frames = s.push_token_ids(list(golden("tts/tts_streaming.npz")["streamed_text_ids"]))
    frames += s.end_text() + s.drain()
    assert s.stats.finish_reason == "context_limit"
    assert s.context_rows <= 90
    with pytest.raises(InputError, match="context limit"):
        s.begin_turn(user_text="more")


def test_ids_then_text_is_refused_and_empty_turn_ends(model):
    from engine.errors import InputError

    s = new_session(model)
    s.begin_turn()
    s.push_token_ids([9707])
    with pytest.raises(InputError, match="do not mix"):
        s.push_text("more")
    s.cancel()
    s.begin_turn()
    assert s.end_text() == [] and s.turn_done and s.stats.finish_reason == "no_text"
    assert s.context_rows == 0   # nothing was fed


def test_frame_limit_per_turn(model):
    s = new_session(model)
    s.begin_turn(max_frames=5)
    frames = s.push_token_ids(list(golden("tts/tts_streaming.npz")["streamed_text_ids"])) + s.end_text() + s.drain()
    assert len(frames) == 5 and s.stats.finish_reason == "max_frames"


def test_bad_input_errors(model):
    from engine.errors import InputError

    s = new_session(model)
    with pytest.raises(InputError, match="begin_turn"):
        s.push_text("hi")
    s.begin_turn()
    with pytest.raises(InputError, match="in progress"):
        s.begin_turn()
    with pytest.raises(InputError, match="token ids must lie"):
        s.push_token_ids([model.vocab + 5])
    with pytest.raises(InputError, match="token ids must lie"):
        s.push_token_ids([-1])
    with pytest.raises(InputError, match="list of integers"):
        s.push_token_ids([1.5, 2.0])
    with pytest.raises(InputError, match="list of integers"):
        s.push_token_ids(["a"])
    s.push_text("Hello")
    with pytest.raises(InputError, match="do not mix"):
        s.push_token_ids([1, 2])
    with pytest.raises(InputError, match="UTF-8"):
        s.push_text(b"\xff\xfe")
    s.end_text()
    with pytest.raises(InputError, match="already ended"):
        s.push_text("more")
    s.drain()
    with pytest.raises(InputError, match="0..1023"):
        s.begin_turn(user_text="x", user_audio_codes=np.full((3, 16), 2000))
    s.begin_turn(user_text="still usable")   # errors left the session usable
    s.close()
    with pytest.raises(InputError, match="closed"):
        s.begin_turn()


def rss_bytes() -> int:
    """Resident memory of this process (onnxruntime's native allocations included)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_open_close_cycles_free_memory(model):
    ids = list(golden("tts/tts_streaming.npz")["streamed_text_ids"])

    def cycle():
        s = new_session(model)
        s.begin_turn(max_frames=3)
        s.push_token_ids(ids[:14])
        s.end_text()
        s.drain()
        s.close()

    for _ in range(10):
        cycle()
    base = rss_bytes()
    for _ in range(150):
        cycle()
    grown = rss_bytes() - base
    print(f"RSS after 10 cycles {base / 2**20:.1f} MiB, growth over 150 more {grown / 2**20:.2f} MiB")
    assert grown < 8 * 2**20, grown   # a leak of one session's codec rings (~0.75 MB) per cycle would show


# ---------------------------------------------------------------------------------------------- replay CLI
@exact_codes
def test_replay_cli_multiturn(tmp_path, full_bundle_dir):
    g = golden("tts/tts_multiturn.npz")
    np.save(tmp_path / "voice.npy", g["voice_prompt_codes"].T)
    np.save(tmp_path / "u1.npy", g["turn1_user_audio_codes"].T)
    np.save(tmp_path / "u2.npy", g["turn2_user_audio_codes"].T)
    script = {"voice_codes": "voice.npy", "voice_wav": None, "turns": [
        {"user_text": SPEC_PROMPTS["turn1_user"], "user_audio_codes": "u1.npy",
         "assistant_token_ids": [int(i) for i in g["turn1_streamed_text_ids"]]},
        {"user_text": SPEC_PROMPTS["turn2_user"], "user_audio_codes": "u2.npy",
         "assistant_token_ids": [int(i) for i in g["turn2_streamed_text_ids"]]},
    ]}
    (tmp_path / "s.json").write_text(json.dumps(script))
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "replay", "--bundle", str(full_bundle_dir),
                           str(tmp_path / "s.json"), "--out-dir", str(tmp_path / "out"), "--greedy",
                           "--device", TEST_DEVICE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for i, key in ((0, "turn1"), (1, "turn2")):
        codes = np.load(tmp_path / "out" / f"turn{i}_codes.npy")
        np.testing.assert_array_equal(codes, g[f"{key}_frames"][:-1])
        audio, sr = sf.read(tmp_path / "out" / f"turn{i}.wav", dtype="float32")
        ref = g[f"{key}_wav"]
        assert sr == 24000 and audio.shape == ref.shape and np.abs(audio - ref).max() <= tolerance(ref)


def test_replay_cli_deltas_and_errors(tmp_path, full_bundle_dir):
    g = golden("tts/tts_streaming.npz")
    ok = {"turns": [{"assistant_deltas": [str(d) for d in g["deltas"]]}]}
    bad = {"bad": {"turns": [{"assistant_deltas": ["a"], "assistant_token_ids": [1]}]},
           "bad_deltas": {"turns": [{"assistant_deltas": "Hello."}]},
           "bad_null": {"turns": [{"assistant_deltas": None}]},
           "bad_ids": {"turns": [{"assistant_token_ids": [1.5]}]},
           "bad_path": {"voice_codes": 5, "turns": [{"assistant_token_ids": [1]}]},
           "bad_user": {"turns": [{"user_audio_codes": ["x"], "assistant_token_ids": [1]}]},
           "no_turns": {"turns": []},
           "typo": {"voice_code": "v.npy", "turns": [{"assistant_token_ids": [1]}]}}
    for name, script in [("ok", ok)] + list(bad.items()):
        (tmp_path / f"{name}.json").write_text(json.dumps(script))
    (tmp_path / "not_utf8.json").write_bytes('{"turns": [{"assistant_deltas": ["caf\u00e9"]}]}'.encode("latin-1"))
    run = lambda name: subprocess.run([sys.executable, "-m", "mossrt.cli", "replay", "--bundle", str(full_bundle_dir),
                                       str(tmp_path / f"{name}.json"), "--out-dir", str(tmp_path / name), "--greedy",
                                       "--device", TEST_DEVICE], capture_output=True, text=True)
    proc = run("ok")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "ok" / "turn0_codes.npy"), g["nonstream_whole_codes"])
    for name, message in (("bad", "exactly one of"),
                          ("bad_deltas", "turns.0.assistant_deltas: Input should be a valid list"),
                          ("bad_null", "exactly one of"), ("bad_ids", "turns.0.assistant_token_ids.0"),
                          ("bad_path", "voice_codes"), ("bad_user", "turns.0.user_audio_codes"),
                          ("no_turns", "turns: List should have at least 1 item"),
                          ("typo", "voice_code: Extra inputs are not permitted"), ("not_utf8", "not UTF-8")):
        proc = run(name)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr)
