"""When each character of an utterance is *spoken*, estimated on the audio's own timeline.

The model reads its text one token per 80 ms frame after a 12-token lead, far faster than it speaks
(12.5 tokens/s against 3-4 in English), so what it has read says only what it *may* have spoken. This clock
places every character on the audio's timeline instead, from three things:

- **The text's own length, by script.** Each character has a nominal duration from a prior speaking rate
  (below): its nominal start is the sum of the durations before it.
- **The audio's speech time.** Only frames with speech move the text on: a frame 30 dB under the
  utterance's loudest so far (or under -60 dBFS) is silence, so pauses, and the silence before the voice
  starts, hold the estimate where it is.
- **The audio's syllables and pauses, to learn the rate.** Syllable nuclei (rises of 3 dB or more in the
  10 ms energy envelope, within 25 dB of the loudest) are counted as the audio comes, and the text's
  syllables are counted the same way for it (vowel groups of alphabetic words, one per Han character, kana
  or Hangul block); the rate is refitted to the two counts, weighted by how much speech has been heard. A
  pause of two or more silent frames is matched to the punctuation whose predicted position lies nearest,
  which anchors the text after it to the end of the pause.

Bounds: a character is never placed before an earlier one, nor (in the aligner) before the model has read
it or later than the audio; at the end of an utterance everything left goes out with its last audio.

Priors (read speech): 14 characters/s of speech time for alphabetic scripts (conversational English runs
at 150-160 words/min, about 5.5-6 characters a word with its space: 14-16 characters/s), 5 for Han
characters (Mandarin read speech 5.2 syllables/s, one a character: Pellegrino, Coupé & Marsico, *Language*
87(3), 2011), 7.5 for kana (Japanese 7.8 morae/s, the same study; a kana is about a mora), 6 for Hangul
syllable blocks (one syllable each), 0.2 s a digit (read as a word). The fitted rate stays within 0.6-1.7
times the prior. Figures against speech with known word times: docs/api-elevenlabs.md
(``scripts/alignment-eval``).
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field

import numpy as np

FRAME_S = 0.08
ALPHABETIC_CPS, HAN_CPS, KANA_CPS, HANGUL_CPS = 14.0, 5.0, 7.5, 6.0
DIGIT_S = 0.2
PAUSE_MARKS = set(",;:.!?\n\u2013\u2014\u2026\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f")
VOWELS = set("aeiouyàáâãäåæèéêëìíîïòóôõöøùúûüýÿœаеёиоуыэюяαεηιουω")
SILENCE_DB, FLOOR_DB = 30.0, -60.0     # a frame this far under the loudest so far (or under this) is silent
PAUSE_FRAMES = 2                       # a pause is at least this many silent frames (160 ms)
HOP_S, SMOOTH, RISE_DB, NUCLEUS_RANGE_DB = 0.01, 5, 3.0, 25.0
RATE_BOUNDS = (0.6, 1.7)               # the fitted rate, as a multiple of the prior
TRUST_S = 1.0                          # speech heard before the syllable count weighs as much as the prior
ALPHABETIC_SHARE = 0.8                 # syllables fit the rate only in text at least this alphabetic (by time)
MAX_WINDOW_S = 1.5                     # a pause matches punctuation at most this far (nominal s) from the estimate


def char_seconds(ch: str) -> float:
    """Seconds of speech the character takes at the prior rate (0 for punctuation, marks and symbols)."""
    cat = unicodedata.category(ch)
    if cat == "Nd":
        return DIGIT_S
    if cat.startswith("L"):
        name = unicodedata.name(ch, "")
        if name.startswith(("CJK UNIFIED", "CJK COMPATIBILITY IDEOGRAPH")):
            return 1.0 / HAN_CPS
        if name.startswith(("HIRAGANA", "KATAKANA")):
            return 1.0 / KANA_CPS
        if name.startswith("HANGUL SYLLABLE"):
            return 1.0 / HANGUL_CPS
        return 1.0 / ALPHABETIC_CPS
    if cat == "Zs":
        return 1.0 / ALPHABETIC_CPS            # a space is part of alphabetic speech's rate
    return 0.0


def _syllable_class(ch: str) -> str:
    """'v' a vowel letter, 'c' another alphabetic letter, 's' a character that is a syllable, '' none."""
    if ch.lower() in VOWELS:
        return "v"
    if unicodedata.category(ch) == "Nd":
        return "s"
    if unicodedata.category(ch).startswith("L"):
        name = unicodedata.name(ch, "")
        if name.startswith(("CJK UNIFIED", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA", "HANGUL SYLLABLE")):
            return "s"
        return "c"
    return ""


@dataclass
class _Anchor:
    nominal: float               # nominal seconds of the text at this point
    speech: float                # seconds of speech heard at this point
    time: float                  # its time on the audio timeline


@dataclass
class SpeechClock:
    """One utterance's estimate. Feed it the text's units (:meth:`add`), then each frame's audio in order
    (:meth:`frame`); :meth:`time_of` says when a unit starts, :meth:`spoken_by` how many have started."""

    starts: list[float] = field(default_factory=list)      # nominal start of each unit
    syllables_before: list[float] = field(default_factory=list)
    pause_after: list[int] = field(default_factory=list)   # units that follow pause-making punctuation
    _nominal: float = 0.0
    _syllables: float = 0.0
    _alphabetic: float = 0.0                              # nominal seconds of alphabetic letters and spaces
    _prev_class: str = ""
    _pause_pending: bool = False
    _frames: int = 0
    _speech_s: float = 0.0
    _peak_db: float = -math.inf
    _silent_run: int = 0
    _anchors: list[_Anchor] = field(default_factory=list)
    _silences: list[list[float]] = field(default_factory=list)   # [speech time a silence began at, its length]
    _matched: int = -1
    _envelope: list[float] = field(default_factory=list)   # 10 ms energy (dB) of the current frame's tail
    _nuclei: int = 0
    _rise_min: float = math.inf
    _rising: bool = False
    _rise_max: float = -math.inf

    # ------------------------------------------------------------------ text
    def add(self, unit: str) -> None:
        """The next unit of text (a character, or a character with the marks NFC joins to it)."""
        if self._pause_pending and any(not c.isspace() for c in unit):
            self._pause_pending = False
            self.pause_after.append(len(self.starts))
        self.starts.append(self._nominal)
        self.syllables_before.append(self._syllables)
        for ch in unit:
            self.extend(ch)

    def extend(self, ch: str) -> None:
        """A character of the last unit (also one joined to it later: a combining mark, a jamo)."""
        self._nominal += char_seconds(ch)
        cls = _syllable_class(ch)
        if cls in ("v", "c") or unicodedata.category(ch) == "Zs":
            self._alphabetic += char_seconds(ch)
        if cls == "s" or (cls == "v" and self._prev_class != "v"):
            self._syllables += 1
        self._prev_class = cls
        if ch in PAUSE_MARKS:
            self._pause_pending = True

    @property
    def units(self) -> int:
        return len(self.starts)

    @property
    def audio_s(self) -> float:
        return self._frames * FRAME_S

    # ------------------------------------------------------------------ the estimate
    def _nominal_at_syllables(self, n: float) -> float:
        """The nominal position where the text's ``n``-th syllable begins (interpolated)."""
        before = self.syllables_before
        if not before or n <= 0:
            return 0.0
        lo, hi = 0, len(before)
        while lo < hi:                               # the first unit with more than n syllables before it
            mid = (lo + hi) // 2
            if before[mid] <= n:
                lo = mid + 1
            else:
                hi = mid
        return self.starts[lo - 1] if lo - 1 < len(self.starts) else self._nominal

    def rate(self) -> float:
        """Nominal seconds of text per second of speech (1: the prior), from the syllables heard and the
        pause anchors, each weighted by the speech heard since the voice began."""
        onset = self._anchors[0].speech if self._anchors else 0.0
        heard = self._speech_s - onset
        if heard <= 0:
            return 1.0
        observed = []
        if self._syllables > 0 and self._nuclei > 1 and self._alphabetic >= ALPHABETIC_SHARE * self._nominal:
            observed.append(self._nominal_at_syllables(self._nuclei) / heard)
        last = self._anchors[-1] if len(self._anchors) > 1 else None
        if last is not None and last.speech - onset > 0.5:
            observed.append(last.nominal / (last.speech - onset))
        if not observed:
            return 1.0
        weight = heard / (heard + TRUST_S)
        rate = (1 - weight) + weight * sum(observed) / len(observed)
        return min(max(rate, RATE_BOUNDS[0]), RATE_BOUNDS[1])

    def position(self) -> float:
        """Where in the text (nominal seconds) the speech is now: the latest anchor, then the fitted rate."""
        last = self._anchors[-1] if self._anchors else _Anchor(0.0, 0.0, 0.0)
        return last.nominal + (self._speech_s - last.speech) * self.rate()

    def _base(self, nominal: float) -> _Anchor:
        base = self._anchors[0] if self._anchors else _Anchor(0.0, 0.0, 0.0)
        for a in self._anchors:
            if a.nominal <= nominal:
                base = a
        return base

    def time_of(self, unit: int) -> float:
        """When unit ``unit`` starts: from the latest anchor before it, its nominal distance at the fitted
        rate in speech time, placed on the audio timeline (silence heard since counts; silence ahead does not)."""
        nominal = self.starts[unit]
        if not self._anchors:                        # no voice yet: everything is still ahead
            return self.audio_s + nominal / self.rate()
        base = self._base(nominal)
        speech_at = base.speech + (nominal - base.nominal) / self.rate()
        if speech_at <= self._speech_s:              # already spoken: map speech time back to audio time
            return base.time + (speech_at - base.speech) + self._silence_between(base.speech, speech_at)
        return self.audio_s + (speech_at - self._speech_s)

    def _silence_between(self, a: float, b: float) -> float:
        """Audio seconds of silence heard between speech times ``a`` and ``b`` (pauses inside a span)."""
        total = 0.0
        for s, length in self._silences:
            if a < s < b:
                total += length
        return total

    def spoken_by(self, t: float, limit: int, start: int = 0) -> int:
        """How many of the first ``limit`` units have started by time ``t`` (``start`` of them known to)."""
        n = start
        while n < limit and self.time_of(n) < t:
            n += 1
        return n

    # ------------------------------------------------------------------ audio
    def frame(self, audio: np.ndarray | None) -> None:
        """One frame of audio (80 ms, any sample rate; None for a frame without audio) has been sent."""
        start = self.audio_s
        self._frames += 1
        if audio is None or not len(audio):
            return
        samples = np.asarray(audio, dtype=np.float64)
        power = float(np.mean(np.square(samples)))
        db = 10 * math.log10(power) if power > 0 else -200.0
        self._peak_db = max(self._peak_db, db)
        silent = db < self._peak_db - SILENCE_DB or db < FLOOR_DB
        self._count_nuclei(samples)
        if silent:
            if self._anchors:
                if self._silent_run == 0:
                    self._silences.append([self._speech_s, 0.0])
                self._silences[-1][1] += FRAME_S
            self._silent_run += 1
            return
        if not self._anchors:
            self._anchors.append(_Anchor(0.0, self._speech_s, start))      # the voice begins
        elif self._silent_run >= PAUSE_FRAMES:
            self._pause_ended(start)
        self._silent_run = 0
        self._speech_s += FRAME_S

    def _count_nuclei(self, samples: np.ndarray) -> None:
        hop = max(1, int(round(len(samples) * HOP_S / FRAME_S)))
        for i in range(0, len(samples) - hop + 1, hop):
            p = float(np.mean(np.square(samples[i:i + hop])))
            self._envelope.append(10 * math.log10(p) if p > 0 else -200.0)
            if len(self._envelope) < SMOOTH:
                continue
            x = sum(self._envelope[-SMOOTH:]) / SMOOTH
            del self._envelope[:-SMOOTH]
            if not self._rising:
                self._rise_min = min(self._rise_min, x)
                if x > self._rise_min + RISE_DB and x > self._peak_db - NUCLEUS_RANGE_DB:
                    self._rising, self._rise_max = True, x
                    self._nuclei += 1
            else:
                self._rise_max = max(self._rise_max, x)
                if x < self._rise_max - RISE_DB:
                    self._rising, self._rise_min = False, x

    def _pause_ended(self, at: float) -> None:
        """Speech resumed at ``at`` after a pause: anchor the pause-following unit predicted nearest."""
        candidates = [u for u in self.pause_after if u > self._matched]
        if not candidates:
            return
        position = self.position()
        best = min(candidates, key=lambda u: abs(self.starts[u] - position))
        if abs(self.starts[best] - position) > min(MAX_WINDOW_S, max(0.6, 0.1 * position)):
            return
        self._matched = best
        self._anchors.append(_Anchor(self.starts[best], self._speech_s, at))

    # ------------------------------------------------------------------ the whole
    def final_times(self, units: int) -> list[float]:
        """Every unit's time once the whole audio is known: after the last anchor the rate is the one that
        ends the text with the speech."""
        if not units:
            return []
        times = [self.time_of(u) for u in range(units)]
        last = max(self._anchors, key=lambda a: a.nominal, default=None)
        if last is not None and self._speech_s > last.speech and self._nominal > last.nominal:
            scale = (self._speech_s - last.speech) / (self._nominal - last.nominal)
            for u in range(units):
                if self.starts[u] >= last.nominal:
                    speech_at = last.speech + (self.starts[u] - last.nominal) * scale
                    times[u] = last.time + (speech_at - last.speech) + self._silence_between(last.speech, speech_at)
        end = self.audio_s - self._silent_run * FRAME_S
        out, floor = [], 0.0
        for t in times:
            floor = min(max(floor, t), max(end, 0.0))
            out.append(floor)
        return out
