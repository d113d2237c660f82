"""The speech clock against known word times: each word's estimated start against espeak-ng's, streamed (a
frame at a time, each piece sent with the frame the clock places it in) and whole (re-timed at the end, as
``/with-timestamps`` answers), and the read clock for comparison. What a barge-in would report is counted too:
at every half second of playback, the words whose estimated start has passed but whose sound has not begun
(claimed, not heard) and those heard but not yet claimed. A piece is always sent with the frame its estimate
falls in, so a client that has received a frame before playing it has every estimate by then."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from app.alignment.characters import Aligner
from app.alignment.words import WordTimestamps

from .espeak import TARGET_RATE, Speech

FRAME = TARGET_RATE * 80 // 1000
TEXT_LEAD = 12                    # ids the first frame reads (the model's text lead)


def read_chars(text: str):
    """Characters the model has read when it writes frame k: the first 12 ids, then one id a frame."""
    from tokenizers import Tokenizer

    from export.demo import TOKENIZER_JSON

    enc = Tokenizer.from_file(str(TOKENIZER_JSON)).encode(text, add_special_tokens=False)
    ends = [end for _, end in enc.offsets]
    return lambda k: ends[min(TEXT_LEAD + k, len(ends)) - 1] if ends else 0


@dataclass(frozen=True)
class Timed:
    starts_ms: list[float]        # per character of the text: its estimated start
    sent_ms: list[float]          # per character: when its message's audio ended (when a client had it)
    spans: list[dict]             # the alignments as the route sends them (HTTP shape, seconds), in order


def run(speech: Speech, clock: str = "speech", whole: bool = False) -> Timed:
    """Every character's estimated start, as the ElevenLabs routes compute it for this audio."""
    aligner = Aligner(clock)
    aligner.add(speech.text)
    read = read_chars(speech.text)
    starts, sent, spans = [], [], []
    frames = [speech.audio[i:i + FRAME] for i in range(0, len(speech.audio), FRAME)]
    for k, audio in enumerate(frames):
        span = aligner.frame(read(k), audio)
        if span is not None:
            starts += span.starts_ms
            sent += [(k + 1) * 80.0] * len(span.chars)
            spans.append(span.seconds())
    span = aligner.rest()
    if span is not None:
        starts += span.starts_ms
        sent += [len(frames) * 80.0] * len(span.chars)
        spans.append(span.seconds())
    if whole:
        final = aligner.final()
        starts = final.starts_ms if final is not None else starts
        sent = [len(frames) * 80.0] * len(starts)
        spans = [final.seconds()] if final is not None else spans
    assert len(starts) == len(speech.text), (len(starts), len(speech.text))
    return Timed(starts, sent, spans)


def captions(speech: Speech, timed: Timed) -> Timed:
    """What ``/dev/captioned_speech`` answers for the same alignments: its words (app.alignment.words), each
    character placed at the start of its word (as the route says it), so a word's error is its caption's."""
    words = WordTimestamps()
    got = [w for span in timed.spans for w in words.add(span)] + words.finish()
    starts: list[float] = []
    at = 0
    for w in got:
        begin = speech.text.index(w["word"], at)
        starts += [starts[-1] if starts else 0.0] * (begin - at) + [w["start_time"] * 1000] * len(w["word"])
        at = begin + len(w["word"])
    starts += [starts[-1] if starts else 0.0] * (len(speech.text) - at)
    return Timed(starts, timed.sent_ms, timed.spans)


@dataclass(frozen=True)
class Errors:
    word_errors_ms: list[float]   # estimated - true start, per word
    end_error_ms: float           # the last word's
    overclaimed: float            # per half-second cut: words claimed before their sound began (mean)
    underclaimed: float           # per cut: words begun but not yet claimed (mean)


def errors(speech: Speech, timed: Timed) -> Errors:
    est = [timed.starts_ms[w.start] for w in speech.words]
    true = [w.time_s * 1000 for w in speech.words]
    claimed = est       # a player that starts at the first audio reaches a word's estimate once it has it
    over, under = [], []
    for cut in np.arange(500.0, speech.seconds * 1000, 500.0):
        over.append(sum(c <= cut < t for c, t in zip(claimed, true)))
        under.append(sum(t <= cut < c for c, t in zip(claimed, true)))
    return Errors([e - t for e, t in zip(est, true)], est[-1] - true[-1] if est else 0.0,
                  statistics.fmean(over) if over else 0.0, statistics.fmean(under) if under else 0.0)


def summary(all_errors: list[Errors]) -> dict:
    """Median and p90 of |error| over every word, the median signed error, the worst end drift."""
    flat = [e for x in all_errors for e in x.word_errors_ms]
    absolute = sorted(abs(e) for e in flat)
    return {"words": len(flat), "median_abs_ms": statistics.median(absolute),
            "p90_abs_ms": absolute[int(0.9 * (len(absolute) - 1))], "median_signed_ms": statistics.median(flat),
            "worst_end_ms": max((abs(x.end_error_ms) for x in all_errors), default=0.0),
            "overclaimed_words": statistics.fmean(x.overclaimed for x in all_errors),
            "underclaimed_words": statistics.fmean(x.underclaimed for x in all_errors)}
