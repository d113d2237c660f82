"""Text normalization: what the model is given for a text as sent ("$10.50" -> "ten dollars and fifty cents"),
with the map back from the model's text to the sent one, so that alignment and captions keep the text as sent.

Opt-in: a request's ``normalization_options`` (Kokoro-FastAPI's field and switches), else the server's default
(``MOSSRT_NORMALIZE_TEXT``). Each rule (:mod:`.rules`) claims the matches no earlier rule claimed, and says each
in the language around it (Mandarin where the nearest letter is a Han character, English otherwise).
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, StrictBool

from .languages import LANGUAGES
from .rules import RULES, Rule
from .work import SAY_COST, BudgetExceeded, Cancelled, NormalizationError, Work

__all__ = ["OFF", "BudgetExceeded", "Cancelled", "Normalized", "NormalizationError", "Segment", "Switches", "Work",
           "language_at", "normalize", "warm"]

log = logging.getLogger("mossrt.app")


class Switches(BaseModel):
    """Kokoro-FastAPI's ``NormalizationOptions`` (a request's ``normalization_options``), with its defaults:
    ``normalize`` turns every rule on or off, the others one rule each. Unknown keys are ignored, as Kokoro's."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    normalize: StrictBool = True
    unit_normalization: StrictBool = False
    url_normalization: StrictBool = True
    email_normalization: StrictBool = True
    optional_pluralization_normalization: StrictBool = True
    phone_normalization: StrictBool = True
    replace_remaining_symbols: StrictBool = True

    def enabled(self, rule: Rule) -> bool:
        return self.normalize and (rule.switch is None or getattr(self, rule.switch))


OFF = Switches(normalize=False)


@dataclass(frozen=True)
class Segment:
    """``sent[sent_start:sent_end]`` is read as ``spoken[spoken_start:spoken_end]``."""

    sent_start: int
    sent_end: int
    spoken_start: int
    spoken_end: int
    rule: str


@dataclass(frozen=True)
class Normalized:
    """A text as sent and as the model reads it; outside ``segments`` the two are the same, character for
    character."""

    sent: str
    spoken: str
    segments: tuple[Segment, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.segments)


def _is_han(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf" or "\uf900" <= ch <= "\ufaff"


LANGUAGE_WINDOW = 64               # characters looked at on each side of a match for its language


# a unit symbol written after a number (2kg, 30 km/h, 5°C) is Latin in either language: it does not tell which
_UNIT_SYMBOL = re.compile(r"(?a)(?<=\d)\s?°?[A-Za-zµ]{1,4}(?:/[A-Za-z]{1,4})?\b")


_LETTER = re.compile(r"[^\W\d_]")


class _Languages:
    """The language of any span of one text in O(log n): its letters (but those of a unit symbol after a number)
    found once, in one pass, and looked up by bisection."""

    def __init__(self, text: str, work: Work | None = None):
        if work is not None:
            work.charge(2 * len(text))                   # the two scans below
        units = [(m.start(), m.end()) for m in _UNIT_SYMBOL.finditer(text)]
        self._at: list[int] = []
        self._zh: list[bool] = []
        k = 0
        for m in _LETTER.finditer(text):
            i = m.start()
            while k < len(units) and units[k][1] <= i:
                k += 1
            if (k < len(units) and units[k][0] <= i) or not text[i].isalpha():
                continue
            self._at.append(i)
            self._zh.append(_is_han(text[i]))

    def at(self, start: int, end: int) -> str:
        """As :func:`language_at`."""
        i = bisect.bisect_left(self._at, start) - 1
        if i >= 0 and self._at[i] >= start - LANGUAGE_WINDOW:
            return "zh" if self._zh[i] else "en"
        j = bisect.bisect_left(self._at, end)
        if j < len(self._at) and self._at[j] < end + LANGUAGE_WINDOW:
            return "zh" if self._zh[j] else "en"
        return "en"


def language_at(text: str, start: int, end: int) -> str:
    """The language a match is said in: that of the nearest letter before it, else after it, within
    LANGUAGE_WINDOW characters (Mandarin for a Han character), else English. The letters of a unit symbol after a
    number are skipped, so that in 重2kg，500mL the 500mL is Mandarin."""
    return _Languages(text).at(start, end)


def normalize(text: str, switches: Switches = Switches(), work: Work | None = None) -> Normalized:
    """``text`` as the model should read it, and where each change came from. Each enabled rule scans the text
    once, each match said in its own language; the cost is linear in the text and counted in ``work`` (a
    :class:`Work`; its cap raises :class:`BudgetExceeded`, its ``cancel`` event :class:`Cancelled`)."""
    if not switches.normalize:
        return Normalized(text, text)
    work = work if work is not None else Work()
    langs = _Languages(text, work)
    claimed: list[tuple[int, int, str, str]] = []          # (start, end, spoken, rule) in the sent text
    taken = bytearray(len(text))
    for rule in RULES:
        if not switches.enabled(rule):
            continue
        before = work.examined
        for start, end, match in rule.find(text, work, langs):
            if start >= end or any(taken[start:end]):
                continue
            lang_code = langs.at(start, end)
            try:
                said = rule.say(match, LANGUAGES[lang_code])
            except Exception:  # noqa: BLE001 - a library that cannot say a match: it is read as sent
                log.warning("normalization rule %s failed on %r; left as sent", rule.name, text[start:end],
                            exc_info=True)
                continue
            if not said or said == text[start:end]:
                continue
            work.said += 1
            work.charge(SAY_COST + len(said) + end - start)
            claimed.append((start, end, _padded(text, start, end, said) if rule.pad else said, rule.name))
            taken[start:end] = b"\x01" * (end - start)
        work.per_rule[rule.name] = work.per_rule.get(rule.name, 0) + work.examined - before
    claimed.sort()
    parts, segments, at, spoken_len = [], [], 0, 0
    for start, end, said, rule_name in claimed:
        parts.append(text[at:start])
        spoken_len += start - at
        segments.append(Segment(start, end, spoken_len, spoken_len + len(said), rule_name))
        parts.append(said)
        spoken_len += len(said)
        at = end
    parts.append(text[at:])
    return Normalized(text, "".join(parts), tuple(segments))


def warm() -> None:
    """Load what the rules use (pint's registry, phonenumbers' metadata, ...) now rather than in a request."""
    from .examples import EXAMPLES

    for ex in EXAMPLES:
        normalize(ex.sent, Switches(unit_normalization=True))


def _padded(text: str, start: int, end: int, said: str) -> str:
    """A space between what is said and a letter or digit of the text it would run into ("5km" is one match,
    but "A&B" -> "A and B")."""
    before = text[start - 1] if start > 0 else ""
    if before.isascii() and before.isalnum() and said[0].isascii() and said[0].isalnum():
        said = " " + said
    if end < len(text) and text[end].isascii() and text[end].isalnum() and said[-1].isascii() and said[-1].isalnum():
        said += " "
    return said
