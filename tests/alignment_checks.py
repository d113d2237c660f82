"""What every ElevenLabs route's alignment must satisfy, read as a client reads it (tests/test_alignment.py,
tests/test_elevenlabs.py)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from app.alignment.clock import ALPHABETIC_CPS, RATE_BOUNDS

MS_PER_BYTE = 1 / 48          # 24 kHz s16 mono


@dataclass(frozen=True)
class Char:
    char: str
    start_ms: float
    end_ms: float
    audio_from_ms: float          # the audio of the message it came with
    audio_to_ms: float


def ws_chars(messages: list[dict]) -> tuple[list[Char], float]:
    """A context's characters on its audio timeline, as pipecat reads them (each message's times count from
    the end of the previous message's span), and the audio's length in ms."""
    out, origin, audio = [], 0.0, 0.0
    for m in messages:
        a = m.get("alignment")
        length = len(base64.b64decode(m.get("audio") or "")) * MS_PER_BYTE
        assert m.get("normalizedAlignment") == a
        if a:
            assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"]), a
            for ch, s, d in zip(a["chars"], a["charStartTimesMs"], a["charDurationsMs"]):
                out.append(Char(ch, origin + s, origin + s + d, audio, audio + length))
            origin += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
        audio += length
    return out, audio


def http_chunks_chars(chunks: list[dict]) -> tuple[list[Char], float]:
    """/stream/with-timestamps' characters (seconds from the start) and the audio's length in ms."""
    out, audio = [], 0.0
    for c in chunks:
        length = len(base64.b64decode(c["audio_base64"])) * MS_PER_BYTE
        a = c.get("alignment")
        if a:
            for ch, s, e in zip(a["characters"], a["character_start_times_seconds"],
                                a["character_end_times_seconds"], strict=True):
                out.append(Char(ch, s * 1000, e * 1000, audio, audio + length))
        audio += length
    return out, audio


def assert_follows_the_audio(chars: list[Char], audio_ms: float, text: str, whole: bool = False,
                             clock: str = "speech") -> None:
    """Every character of ``text`` once and in order (a prefix of it when cut), times that never go back,
    inside the audio of the message that carried it (``whole``: inside the audio), none after the audio.
    With the speech clock, before the turn's last message no faster than its fastest rate allows
    (English-like text here: the alphabetic prior times the rate's upper bound)."""
    assert text.startswith("".join(c.char for c in chars)), ("".join(c.char for c in chars), text)
    starts = [c.start_ms for c in chars]
    assert starts == sorted(starts)
    for i, c in enumerate(chars):
        assert c.start_ms <= c.end_ms <= audio_ms + 1, c
        if not whole:
            assert c.audio_from_ms - 1 <= c.start_ms and c.end_ms <= c.audio_to_ms + 1, c
        if clock == "speech" and not whole and c.audio_to_ms < audio_ms - 1:
            assert i + 1 <= c.audio_to_ms / 1000 * ALPHABETIC_CPS * RATE_BOUNDS[1] + 2, (i, c)
