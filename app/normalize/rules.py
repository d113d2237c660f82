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

from .languages import unit_name



@dataclass(frozen=True)
class Rule:
    name: str
    switch: str | None            # the option that enables it, besides ``normalize`` (None: ``normalize`` alone)
    what: str                     # for the documentation's table
    find: Callable[[str, str], Iterator[tuple[int, int, re.Match]]]   # (start, end, match) in the text
    say: Callable[[re.Match, object], str | None]                      # (match, language): what is read
    pad: bool = True              # a space between what is said and a letter it would run into


def _regex(pattern: str, flags: int = 0):
    compiled = re.compile(pattern, flags | re.ASCII)       # \b and \w: a digit next to a Han character is a boundary

    def find(text: str, lang: str):
        for m in compiled.finditer(text):
            yield m.start(), m.end(), m
    return find


_TRAILING = ".,;:!?)]}'\""


def _url_find(text: str, lang: str):
    for m in re.finditer(r"(?a)(?:https?://|www\.)[^\s<>\"]+|\b(?:[A-Za-z0-9-]+\.)+(?:com|org|net|io|dev|ai|edu|gov|app|"
                         r"co|uk|de|fr|cn|jp)\b(?:/[^\s<>\"]*)?", text):
        end = m.end()
        while end > m.start() and text[end - 1] in _TRAILING:
            end -= 1
        yield m.start(), end, m


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


def _phone_find(text: str, lang: str):
    region, leniency = ("CN", phonenumbers.Leniency.VALID) if lang == "zh" else ("US", phonenumbers.Leniency.POSSIBLE)
    for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=leniency):
        if not re.fullmatch(r"\+?[0-9 ().-]+", m.raw_string) or sum(c in "0123456789" for c in m.raw_string) < 7:
            continue                              # "13/45/2024" is possible as a US number, not as a phone one
        yield m.start, m.end, re.fullmatch(r"(?s).*", m.raw_string)


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
_NAMED_DATE = (rf"\b(?P<mon>{_MONTH})\b\.?\s+(?P<md>\d{{1,2}})(?:st|nd|rd|th)?,?\s+(?P<my>\d{{4}})\b"
               rf"|\b(?P<dd>\d{{1,2}})(?:st|nd|rd|th)?\s+(?P<mon2>{_MONTH})\b\.?,?\s+(?P<dy>\d{{4}})\b"
               rf"|\b(?P<mon3>{_MONTH})\b\.?,?\s+(?P<yy>\d{{4}})\b")

# a decade: a year ending in 0 with an s (1990s, 1990's); two digits (80s) only after an apostrophe ('80s) or a
# word that makes it an age or an era (the 80s, her 30s, early 60s), since "a 30s clip" is thirty seconds
_DECADE = (r"(?<![\w.,'’])['’]?(?P<y>[1-9]\d{2}0)['’]?s\b"
           r"|(?<![\w.,])['’](?P<t>[1-9]0)['’]?s\b"
           r"|\b(?P<lead>(?:[Tt]he|[Hh]is|[Hh]er|[Tt]heir|[Mm]y|[Yy]our|[Oo]ur|[Ee]arly|[Mm]id|[Ll]ate)[\s-]+)"
           r"(?P<t2>[1-9]0)['’]?s\b")

RULES: tuple[Rule, ...] = (
    Rule("email", "email_normalization", "e-mail addresses, symbol by symbol",
         _regex(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+"), lambda m, lang: _say_spelled(m.group(0), lang)),
    Rule("url", "url_normalization", "web addresses, without the scheme", _url_find, _say_url),
    Rule("phone", "phone_normalization", "phone numbers (phonenumbers' matcher), digit by digit",
         _phone_find, _say_phone),
    Rule("date", None, "dates: ISO (2024-01-15), US (1/15/2024) and with a month's name (March 5, 2024)",
         _regex(r"\b(?P<y>\d{4})-(?P<mo>\d{1,2})-(?P<d>\d{1,2})\b|\b(?P<mo2>\d{1,2})/(?P<d2>\d{1,2})/(?P<y2>\d{4})\b|"
                + _NAMED_DATE), _say_date_any),
    Rule("year", None, "Mandarin years (2024年)", _regex(r"(?P<y>\d{4})(?=年)"), _say_zh_year),
    # before the units: the s of 1990s is not seconds
    Rule("decade", None, "English decades (1990s, '80s, the 60s: two digits only after an apostrophe or a word "
         "such as the, her, early)", _regex(_DECADE), _say_decade),
    Rule("fraction", None, "proper fractions, with a whole number before them (3/4, 1 1/2)",
         _regex(r"(?<![\w/.,])(?:(?P<w>\d{1,3})\s)?(?P<a>\d{1,3})/(?P<b>\d{1,3})(?![\w/]|[.,]\d)"), _say_fraction),
    Rule("time", None, "clock times (3:30, 15:05:09, 3:30 pm, 7 am)",
         _regex(r"\b(?P<h>\d{1,2})(?::(?P<m>\d{2})(?::(?P<s>\d{2}))?(?:\s?(?P<ap>[AaPp])\.?[Mm]\b)?|"
                r"\s?(?P<ap2>[AaPp])\.?[Mm]\b)"), _say_time_any),
    Rule("currency", None, "amounts of $, €, £, ¥ (with thousand/million/billion)",
         _regex(r"(?P<sym>[$€£¥])\s?(?P<whole>" + _NUMBER + r")(?:\.(?P<cents>\d+))?"
                r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?", re.I), _say_currency),
    Rule("percent", None, "percentages", _regex(r"(?<![\w.])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)\s?%"),
         lambda m, lang: lang.percent(m.group("n"))),
    Rule("unit", "unit_normalization", "units after a number, by name (pint's units: 10KB, 5 km/h, -5°C)",
         _regex(r"(?<![\w.,])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)(?P<gap>\s?)"
                r"(?P<unit>°[CF]|[A-Za-zµ]+(?:/[A-Za-z]+)?)\b"), _say_unit),
    Rule("ordinal", None, "English ordinals (21st)", _regex(r"\b(?P<n>\d+)(?:st|nd|rd|th)\b"),
         lambda m, lang: lang.ordinal(m.group("n")) if lang.code == "en" else None),
    Rule("number", None, "numbers, with thousands separators, decimals and a minus sign (over 15 digits: digit by digit)",
         _regex(r"(?<![\w.,])(?P<n>-?" + _NUMBER + r"(?:\.\d+)?)(?![\d]|[.,]\d)"),
         lambda m, lang: lang.number(m.group("n"))),
    Rule("plural", "optional_pluralization_normalization", "an optional plural: word(s) -> words",
         _regex(r"(?<=\w)\(s\)"), lambda m, lang: "s", pad=False),
    Rule("symbol", "replace_remaining_symbols", "the symbols & + = @ # ~ by name",
         _regex(r"[&+=@#~]"), lambda m, lang: lang.symbols[m.group(0)]),
)
