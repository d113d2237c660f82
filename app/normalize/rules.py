"""The rules, in the order they claim text (an e-mail address before the URL inside it, a date before its
numbers, ...): each finds its matches with a regular expression (phone numbers with ``phonenumbers``) and says
them in the language around the match (:mod:`.languages`). A rule that cannot say a match (a 13th month) leaves
it to the rules after it. ``switch`` is the field of the request's ``normalization_options`` that turns it on
(besides ``normalize``)."""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import phonenumbers

from .languages import Language, unit_name
from .work import Work


@dataclass(frozen=True)
class Rule:
    name: str
    switch: str | None            # the option that enables it, besides ``normalize`` (None: ``normalize`` alone)
    what: str                     # for the documentation's table
    find: Callable[[str, Work, object], Iterator[tuple[int, int, re.Match]]]  # (text, work, languages) -> matches
    say: Callable[[re.Match, Language], str | None]                    # (match, language): what is read
    pad: bool = True              # a space between what is said and a letter it would run into


# Every finder is linear in its text: a scan that costs O(1) a position finds where a match may start, and the
# rule's pattern is matched there within a window the code bounds (``endpos``: the engine reads no further), each
# window counted in ``Work``. A window is a constant (patterns whose quantifiers are all bounded) or a possessive
# run of one character class from the start plus a constant (the digits of a number), and the starts of one rule
# are at most one a run, so the windows of a rule add up to a few times the text.

def _anchored(starts: str, pattern: str, reach: int, run: str | None = None, flags: int = 0):
    """Matches of ``pattern`` at the (zero-width) ``starts``, read within the ``run`` from the start (a
    possessive pattern: its end, or the start) plus ``reach`` characters, the most the pattern may read past it."""
    starts_re = re.compile(starts, flags | re.ASCII)       # \b and \w: a digit next to a Han character is a boundary
    compiled = re.compile(pattern, flags | re.ASCII)
    run_re = re.compile(run, flags | re.ASCII) if run else None

    def find(text: str, work: Work, langs) -> Iterator[tuple[int, int, re.Match]]:
        n, last = len(text), 0
        work.charge(n)                                     # the scan for starts
        for s in starts_re.finditer(text):
            at = s.start()
            if at < last:
                continue
            stop = min(n, (_run_end(run_re, text, at) if run_re else at) + reach)
            work.charge(stop - at + 1)
            m = compiled.match(text, at, stop)
            if m and m.end() > at:
                last = m.end()
                yield at, m.end(), m
    return find


def _run_end(run: re.Pattern[str], text: str, at: int) -> int:
    """Where the possessive ``run`` read from ``at`` ends. A run matches at each of its starts: it may be empty,
    or it begins with the character its rule's start looks ahead for (a currency symbol)."""
    m = run.match(text, at)
    assert m is not None, f"the run {run.pattern!r} does not match at its start"
    return m.end()


_TRAILING = ".,;:!?)]}'\""
_TLDS = "com|org|net|io|dev|ai|edu|gov|app|co|uk|de|fr|cn|jp"
# as before: a scheme (or www.) and what follows it, or dotted labels ending in a known top-level domain; the
# runs are possessive (nothing after them can give a character back), the labels' backtracking stays in one run
_URL = re.compile(r"(?:https?://|www\.)[^\s<>\"]++|\b(?:[A-Za-z0-9-]+\.)+(?:" + _TLDS + r")\b(?:/[^\s<>\"]*+)?",
                  re.ASCII)
_SCHEME = re.compile(r"https?://|www\.", re.ASCII)
_TLD = re.compile(r"(?<=[A-Za-z0-9-])\.(?:" + _TLDS + r")\b", re.ASCII)
_DOTTED = re.compile(r"[A-Za-z0-9.-]*+", re.ASCII)
_LABEL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")


def _url_find(text: str, work: Work, langs):
    """Web addresses: where a scheme is, and from the first label of the dotted run before each known
    top-level domain (found by walking left, never past the previous domain: each character once)."""
    work.charge(2 * len(text))                             # the two scans for anchors
    candidates = [(m.start(), m.start()) for m in _SCHEME.finditer(text)]
    floor = 0
    for m in _TLD.finditer(text):
        j = i = m.start()
        while j > floor:
            ch = text[j - 1]
            if ch in _LABEL or (ch == "." and text[j] in _LABEL and j - 1 > floor and text[j - 2] in _LABEL):
                j -= 1
            else:
                break
        work.charge(i - j + 1)
        candidates.append((j, i))
        floor = i + 1
    candidates.sort()
    last = 0
    for start, anchor in candidates:
        if anchor < last:
            continue
        url = None
        for at in range(max(start, last), anchor + 1):     # a leading "-" is no word boundary: the next one is
            url = _URL.match(text, at)
            work.charge(max(url.end() if url else at, _run_end(_DOTTED, text, at)) - at + 1)
            if url:
                break
        if url is None:
            continue
        end = url.end()
        while end > url.start() and text[end - 1] in _TRAILING:
            end -= 1
        work.charge(url.end() - end)
        last = url.end()
        yield url.start(), end, url


_EMAIL = re.compile(r"[A-Za-z0-9._%+-]++@[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)+", re.ASCII)
_EMAIL_LOCAL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._%+-")
_DOMAIN_RUN = re.compile(r"[A-Za-z0-9.-]*+", re.ASCII)


def _email_find(text: str, work: Work, langs):
    """E-mail addresses, from each "@": its local part walked left (never past the previous "@" or match, so each
    character once), its domain matched right."""
    work.charge(len(text))
    last = 0
    at = text.find("@")
    while at >= 0:
        if at >= last:
            j = at
            while j > last and text[j - 1] in _EMAIL_LOCAL:
                j -= 1
            m = _EMAIL.match(text, j) if j < at else None
            work.charge(at - j + _run_end(_DOMAIN_RUN, text, at + 1) - at)
            if m:
                last = m.end()
                yield j, m.end(), m
            else:
                last = at + 1                              # "@" is no part of a local part: none starts before it
        at = text.find("@", at + 1)


# a phone number's characters: digits (any script's), the punctuation phonenumbers reads in one, and spaces
_PHONE_RUN = re.compile(r"[+(\[\uff08\uff3b\d][\d\s().+\-/\[\]~\u2010-\u2015\u2212\u30fc\uff0d-\uff0f\u00ad"
                        r"\u200b\u2060\u3000\uff08\uff09\uff3b\uff3d\u2053\u223c\uff5e]*+")


def _phone_find(text: str, work: Work, langs):
    """Phone numbers: phonenumbers' matcher over each run of a number's characters with seven digits or more
    (and the character each side, which its matcher looks at), in the region of the run's language."""
    work.charge(len(text))
    for run in _PHONE_RUN.finditer(text):
        raw = run.group(0)
        if sum(c in "0123456789" for c in raw) < 7:
            continue
        lang = langs.at(run.start(), run.start() + len(raw.rstrip()))
        base = max(0, run.start() - 1)
        window = text[base:run.end() + 1]
        work.charge(len(window))
        region, leniency = ("CN", phonenumbers.Leniency.VALID) if lang == "zh" else \
            ("US", phonenumbers.Leniency.POSSIBLE)
        for m in phonenumbers.PhoneNumberMatcher(window, region, leniency=leniency):
            if not re.fullmatch(r"\+?[0-9 ().-]+", m.raw_string) or sum(c in "0123456789" for c in m.raw_string) < 7:
                continue                          # "13/45/2024" is possible as a US number, not as a phone one
            start, end = base + m.start, base + m.end
            if langs.at(start, end) == lang:
                yield start, end, re.fullmatch(r"(?s).*", m.raw_string)


def _say_spelled(text: str, lang) -> str:
    """An address said piece by piece: words as written, each symbol by its name."""
    out = []
    for piece in re.findall(r"[A-Za-z]+|[0-9]+|.", text):
        if piece.isascii() and piece.isdigit():
            out.append(lang.digits(piece) if len(piece) > 4 else lang.number(piece))
        elif piece in lang.symbols:
            out.append(lang.symbols[piece])
        elif piece.strip():
            out.append(piece)
    return lang.space.join(out) if lang.space else "".join(f" {p} " if p.isascii() else p for p in out).strip()


def _say_url(m, lang):
    url = m.group(0).rstrip(_TRAILING)
    url = re.sub(r"^https?://", "", url)
    return _say_spelled(url.rstrip("/"), lang)


def _say_phone(m, lang) -> str:
    raw = m.group(0)
    groups = [lang.digits(g) for g in re.findall(r"[0-9]+", raw)]
    if raw.lstrip().startswith("+"):
        groups[0] = lang.symbols["+"] + lang.space + groups[0]
    return ("，" if lang.code == "zh" else ", ").join(groups)


def _say_time(m, lang):
    hour, minute = int(m.group("h")), int(m.group("m") or 0)
    second = int(m.group("s")) if m.group("s") else None
    meridiem = m.group("ap")
    if hour > (12 if meridiem else 24) or minute > 59 or (second or 0) > 59 or (meridiem and hour == 0):
        return None
    return lang.time(hour, minute, second, meridiem)


def _say_date(m, lang):
    year, month, day = (int(m.group(k)) for k in ("y", "mo", "d"))
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    return lang.date(year, month, day)


def _say_zh_year(m, lang):
    return lang.year(m.group("y")) if lang.code == "zh" else None


def _say_decade(m, lang):
    if lang.code != "en":
        return None
    return (m.group("lead") or "") + lang.decade(m.group("y") or m.group("t") or m.group("t2"))


def _say_fraction(m, lang):
    numerator, denominator = int(m.group("a")), int(m.group("b"))
    if not 0 < numerator < denominator:
        return None                                # 24/7, 50/50, 3/0: not a fraction to say as one
    return lang.fraction(m.group("w"), m.group("a"), m.group("b"))


def _say_currency(m, lang):
    return lang.currency(m.group("sym"), m.group("whole"), m.group("cents"), (m.group("scale") or "").lower() or None)


def _say_unit(m, lang):
    symbol = m.group("unit")
    if symbol in _ORDINAL_SUFFIXES:
        return None                                # 5th is not five thous, 2nd not two nanodays
    if m.group("gap") and (symbol in _WORDS_NOT_UNITS or (symbol.isalpha() and symbol.islower() and len(symbol) > 3)):
        return None                                # a word ("5 in a row"), or a unit already written out
    name = unit_name(symbol)
    if name is None:
        return None
    return lang.unit(m.group("n"), name)


def _say_date_any(m, lang):
    if m.group("y") is not None:                   # ISO
        return _say_date(m, lang)
    if m.group("y2") is not None:                  # US: 1/15/2024
        year, month, day = int(m.group("y2")), int(m.group("mo2")), int(m.group("d2"))
        return lang.date(year, month, day) if 1 <= month <= 12 and 1 <= day <= 31 else None
    return _say_named_month(m, lang)


def _say_named_month(m, lang):
    """March 5, 2024 / 5 March 2024 / March 2024: the year said as a year, as in the numeric forms."""
    day = m.group("md") or m.group("dd")
    if day is not None and not 1 <= int(day) <= 31:
        return None
    month = _MONTHS[m.group("mon") or m.group("mon2") or m.group("mon3")]
    year = m.group("my") or m.group("dy") or m.group("yy")
    return lang.date(int(year), month, int(day) if day else None, day_first=m.group("dd") is not None)


def _say_time_any(m, lang):
    if m.group("ap2"):
        hour = int(m.group("h"))
        return lang.time(hour, 0, None, m.group("ap2")) if 1 <= hour <= 12 else None
    if m.group("m") is None:
        return None
    return _say_time(m, lang)


# short words pint also reads as units ("5 in a row", "at 3 am", "10 s"): a unit only when written onto its number
_WORDS_NOT_UNITS = {"in", "at", "am", "pm", "a", "an", "as", "s", "m", "h", "g", "t", "B", "to", "min", "are", "ha"}

_ORDINAL_SUFFIXES = {"st", "nd", "rd", "th"}

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)"

# English month names and their abbreviations (Mar, Mar.), capitalized: "may" is a verb
_MONTHS = {name: i for i in range(1, 13) for name in (calendar.month_name[i], calendar.month_abbr[i])} | {"Sept": 9}
_MONTH = "|".join(sorted(_MONTHS, key=len, reverse=True))       # March before Mar
_SP = r"\s{1,8}"                   # the spaces between a date's parts: at most 8, so that its window is bounded
_NAMED_DATE = (rf"\b(?P<mon>{_MONTH})\b\.?{_SP}(?P<md>\d{{1,2}})(?:st|nd|rd|th)?,?{_SP}(?P<my>\d{{4}})\b"
               rf"|\b(?P<dd>\d{{1,2}})(?:st|nd|rd|th)?{_SP}(?P<mon2>{_MONTH})\b\.?,?{_SP}(?P<dy>\d{{4}})\b"
               rf"|\b(?P<mon3>{_MONTH})\b\.?,?{_SP}(?P<yy>\d{{4}})\b")
_MONTH_START = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"        # every name and abbreviation begins so

# a decade: a year ending in 0 with an s (1990s, 1990's); two digits (80s) only after an apostrophe ('80s) or a
# word that makes it an age or an era (the 80s, her 30s, early 60s), since "a 30s clip" is thirty seconds
_DECADE = (r"(?<![\w.,'’])['’]?(?P<y>[1-9]\d{2}0)['’]?s\b"
           r"|(?<![\w.,])['’](?P<t>[1-9]0)['’]?s\b"
           r"|\b(?P<lead>(?:[Tt]he|[Hh]is|[Hh]er|[Tt]heir|[Mm]y|[Yy]our|[Oo]ur|[Ee]arly|[Mm]id|[Ll]ate)[\s-]{1,4})"
           r"(?P<t2>[1-9]0)['’]?s\b")

# a number's characters from its start (a sign, digits, separators): the run its window covers
_NUMBER_RUN = r"-?[0-9.,]*+"

RULES: tuple[Rule, ...] = (
    Rule("email", "email_normalization", "e-mail addresses, symbol by symbol",
         _email_find, lambda m, lang: _say_spelled(m.group(0), lang)),
    Rule("url", "url_normalization", "web addresses, without the scheme", _url_find, _say_url),
    Rule("phone", "phone_normalization", "phone numbers (phonenumbers' matcher), digit by digit",
         _phone_find, _say_phone),
    Rule("date", None, "dates: ISO (2024-01-15), US (1/15/2024) and with a month's name (March 5, 2024)",
         _anchored(rf"\b(?=\d|{_MONTH_START})",
                   r"\b(?P<y>\d{4})-(?P<mo>\d{1,2})-(?P<d>\d{1,2})\b|"
                   r"\b(?P<mo2>\d{1,2})/(?P<d2>\d{1,2})/(?P<y2>\d{4})\b|" + _NAMED_DATE, 40), _say_date_any),
    Rule("year", None, "Mandarin years (2024年)", _anchored(r"(?=\d{4}年)", r"(?P<y>\d{4})(?=年)", 5), _say_zh_year),
    # before the units: the s of 1990s is not seconds
    Rule("decade", None, "English decades (1990s, '80s, the 60s: two digits only after an apostrophe or a word "
         "such as the, her, early)", _anchored(r"(?=['’1-9])|\b(?=[TtHhMmYyOoEeLl])", _DECADE, 16), _say_decade),
    Rule("fraction", None, "proper fractions, with a whole number before them (3/4, 1 1/2)",
         _anchored(r"(?<![\w/.,])(?=\d)",
                   r"(?<![\w/.,])(?:(?P<w>\d{1,3})\s)?(?P<a>\d{1,3})/(?P<b>\d{1,3})(?![\w/]|[.,]\d)", 14),
         _say_fraction),
    Rule("time", None, "clock times (3:30, 15:05:09, 3:30 pm, 7 am)",
         _anchored(r"\b(?=\d)", r"\b(?P<h>\d{1,2})(?::(?P<m>\d{2})(?::(?P<s>\d{2}))?(?:\s?(?P<ap>[AaPp])\.?[Mm]\b)?|"
                   r"\s?(?P<ap2>[AaPp])\.?[Mm]\b)", 15), _say_time_any),
    Rule("currency", None, "amounts of $, €, £, ¥ (with thousand/million/billion)",
         _anchored(r"(?=[$€£¥])", r"(?P<sym>[$€£¥])\s?(?P<whole>" + _NUMBER + r")(?:\.(?P<cents>\d+))?"
                   r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?", 11, r"[$€£¥]\s?[0-9.,]*+", re.I),
         _say_currency),
    # a percentage starts where a number does, or after a comma that follows no digit (10%,20%): not inside a
    # grouped number, whose every group would otherwise be a start reading to the number's end
    Rule("percent", None, "percentages",
         _anchored(r"(?<![\w.])(?<!\d,)(?=-?\d)", r"(?<![\w.])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)\s?%", 3, _NUMBER_RUN),
         lambda m, lang: lang.percent(m.group("n"))),
    Rule("unit", "unit_normalization", "units after a number, by name (pint's units: 10KB, 5 km/h, -5°C)",
         _anchored(r"(?<![\w.,])(?=-?\d)", r"(?<![\w.,])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)(?P<gap>\s?)"
                   r"(?P<unit>°[CF]|[A-Za-zµ]+(?:/[A-Za-z]+)?)\b", 2,
                   _NUMBER_RUN + r"\s?(?:°[CF]?|[A-Za-zµ]*+(?:/[A-Za-z]*+)?)"), _say_unit),
    Rule("ordinal", None, "English ordinals (21st)",
         _anchored(r"\b(?=\d)", r"\b(?P<n>\d+)(?:st|nd|rd|th)\b", 3, r"\d*+"),
         lambda m, lang: lang.ordinal(m.group("n")) if lang.code == "en" else None),
    Rule("number", None,
         "numbers, with thousands separators, decimals and a minus sign (over 15 digits: digit by digit)",
         _anchored(r"(?<![\w.,])(?=-?\d)", r"(?<![\w.,])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)(?![\d]|[.,]\d)", 3,
                   _NUMBER_RUN), lambda m, lang: lang.number(m.group("n"))),
    Rule("plural", "optional_pluralization_normalization", "an optional plural: word(s) -> words",
         _anchored(r"(?<=\w)(?=\(s\))", r"\(s\)", 3), lambda m, lang: "s", pad=False),
    Rule("symbol", "replace_remaining_symbols", "the symbols & + = @ # ~ by name",
         _anchored(r"(?=[&+=@#~])", r"[&+=@#~]", 1), lambda m, lang: lang.symbols[m.group(0)]),
)
