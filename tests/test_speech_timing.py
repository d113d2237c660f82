"""The speech clock (app/alignment/clock.py) and the aligner on it (app/alignment/characters.py): priors by script,
silence that holds the text, a rate learned from the syllables heard, pauses anchored to punctuation, a cancelled
turn's unspoken text never aligned; and, end to end, ``scripts/alignment-eval`` against espeak-ng's speech with
its known word times (Debian's espeak-ng: ``bash .ci/install-debian.sh``)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.alignment.characters import Aligner
from app.alignment.clock import ALPHABETIC_CPS, FRAME_S, HAN_CPS, SpeechClock, char_seconds

REPO = Path(__file__).resolve().parents[1]
RATE = 24000
FRAME = int(RATE * FRAME_S)


def syllables(n: int, every_s: float, seed: int = 0) -> np.ndarray:
    """``n`` noise bursts, one every ``every_s`` seconds (a syllable nucleus each), no silence between."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(n * every_s * RATE)) / RATE
    envelope = 0.15 + 0.85 * np.clip(np.sin(np.pi * (t % every_s) / every_s), 0, None) ** 2
    return (0.2 * envelope * rng.standard_normal(len(t))).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def feed(clock: SpeechClock, audio: np.ndarray) -> None:
    for i in range(0, len(audio), FRAME):
        clock.frame(audio[i:i + FRAME])


def clock_for(text: str) -> SpeechClock:
    clock = SpeechClock()
    for ch in text:
        clock.add(ch)
    return clock


def test_priors_by_script():
    assert char_seconds("a") == char_seconds(" ") == pytest.approx(1 / ALPHABETIC_CPS)
    assert char_seconds("你") == pytest.approx(1 / HAN_CPS)
    assert char_seconds("か") > char_seconds("a") and char_seconds("한") > char_seconds("か")
    assert char_seconds("7") == pytest.approx(0.2)
    assert char_seconds(",") == char_seconds("\u0301") == 0.0


def test_silence_holds_the_text_and_the_voice_onset_starts_it():
    clock = clock_for("Hello there, my friend.")
    feed(clock, silence(0.8))
    assert clock.spoken_by(clock.audio_s, clock.units) == 0          # nothing before the voice
    feed(clock, syllables(3, 0.2))
    assert clock.time_of(0) == pytest.approx(0.8, abs=FRAME_S)        # the first character at the onset
    spoken = clock.spoken_by(clock.audio_s, clock.units)
    feed(clock, np.full(int(0.16 * RATE), 1e-4, np.float32))          # a quiet stretch: -80 dBFS
    assert clock.spoken_by(clock.audio_s, clock.units) == spoken      # quiet frames move nothing


def test_the_rate_follows_the_syllables_heard():
    """English-like text of 40 syllables spoken at 1.5 times the prior's syllable rate: the fitted rate
    rises above the prior and the last syllable is placed well before its nominal time."""
    text = "ba " * 40
    clock = clock_for(text)
    nominal_each = 3 / ALPHABETIC_CPS
    feed(clock, syllables(40, nominal_each / 1.5))
    assert clock.rate() > 1.25
    last = clock.final_times(clock.units)[len(text) - 3]
    assert last < 39 * nominal_each * 0.8
    slow = clock_for(text)
    feed(slow, syllables(40, nominal_each * 1.4))
    assert slow.rate() < 0.85


def test_a_pause_anchors_the_next_sentence():
    """Speech slower than the prior, then a pause: the sentence after the full stop starts where speech
    resumes, not where the prior rate had put it."""
    text = "One two three four five. Six seven eight."
    clock = clock_for(text)
    first = text.index("Six")
    nominal_first = first / ALPHABETIC_CPS
    feed(clock, syllables(8, nominal_first * 1.3 / 8))                 # 30 % slower than the prior
    resume = clock.audio_s + 0.4
    feed(clock, silence(0.4))
    feed(clock, syllables(4, 0.2))
    assert clock.time_of(first) == pytest.approx(resume, abs=FRAME_S)


def test_the_aligner_sends_nothing_early_and_skips_a_cancelled_turn():
    aligner = Aligner()
    aligner.add("First turn, spoken only in part.")
    sent = ""
    for k in range(6):                                                   # 480 ms of speech
        span = aligner.frame(40, syllables(1, FRAME_S, seed=k))
        sent += "".join(span.chars) if span else ""
    assert 0 < len(sent) <= 0.48 * ALPHABETIC_CPS * 1.7 + 2              # never faster than its fastest rate
    aligner.add("Second.", current=False)                                # text for the next turn
    aligner.new_turn()                                                   # the first was cancelled: its rest is skipped
    later = ""
    for k in range(20):
        span = aligner.frame(7, syllables(1, FRAME_S, seed=k))
        later += "".join(span.chars) if span else ""
    span = aligner.rest()
    later += "".join(span.chars) if span else ""
    assert later == "Second." and "part" not in sent


def test_read_clock_sends_what_was_read():
    aligner = Aligner("read")
    aligner.add("Read ahead of the audio.")
    span = aligner.frame(10, syllables(1, FRAME_S))
    assert "".join(span.chars) == "Read ahead" and span.starts_ms[0] == 0 and span.ends_ms[-1] == 80
    with pytest.raises(ValueError):
        Aligner("later")


@pytest.fixture(scope="module")
def espeak():
    if not ctypes.util.find_library("espeak-ng"):
        pytest.skip("espeak-ng not installed: run `bash .ci/install-debian.sh` (apt-get install espeak-ng)")


def run_eval(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "alignment-eval"), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| en |" in proc.stdout or "| cmn |" in proc.stdout
    return {(f["voice"], f["wpm"], f["mode"]): f for rows in json.loads(out.read_text()).values() for f in rows}


def test_against_espeak_speech_with_known_word_times(espeak, tmp_path):
    """English at espeak-ng's 175 words a minute (18 characters/s, faster than the prior) and Mandarin at
    5.5 characters/s: word starts within a few hundred ms, errors that lean late, barely a word claimed before
    it is heard at any cut; the read clock, on the same audio, seconds early and over a dozen words claimed."""
    figures = (run_eval(tmp_path, "--voices", "en", "--wpm", "175")
               | run_eval(tmp_path, "--voices", "cmn", "--wpm", "350"))
    en, cmn = figures["en", 175, "streamed"], figures["cmn", 350, "streamed"]
    for f in (en, cmn):
        assert f["median_abs_ms"] < 300 and f["p90_abs_ms"] < 900, f
        assert f["median_signed_ms"] > -100 and f["overclaimed_words"] < 1.0, f
    assert figures["en", 175, "whole"]["p90_abs_ms"] < 600 and figures["en", 175, "whole"]["worst_end_ms"] < 400
    read = figures["en", 175, "read clock"]
    assert read["median_signed_ms"] < -2000 and read["overclaimed_words"] > 10
    for voice, wpm in (("en", 175), ("cmn", 350)):     # /dev/captioned_speech's words: the same clock's starts
        for mode in ("streamed", "whole"):
            words, chars = figures[voice, wpm, "captions " + mode], figures[voice, wpm, mode]
            assert words["words"] == chars["words"], (voice, mode)
            for key in ("median_abs_ms", "p90_abs_ms", "median_signed_ms", "worst_end_ms"):
                assert abs(words[key] - chars[key]) <= 1.0, (voice, mode, key)   # rounded to the ms


def test_eval_refuses_a_bad_rate(espeak):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "alignment-eval"), "--wpm", "5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--wpm" in proc.stderr
