"""How each language says what the rules find: English on ``inflect`` (cardinals, ordinals, plurals) and
``pint`` (unit names), Mandarin on ``cn2an`` (numbers) and ``pint`` (which unit a symbol is, split into its
prefix and unit). Only what no library holds is written here: a few symbol, currency and Mandarin unit names,
and how English reads a year."""

from __future__ import annotations

import calendar
import functools
import re

import cn2an

# the currency and its hundredth, singular and plural
_EN_CURRENCY = {"$": (("dollar", "dollars"), ("cent", "cents")), "€": (("euro", "euros"), ("cent", "cents")),
                "£": (("pound", "pounds"), ("penny", "pence")), "¥": (("yen", "yen"), ("sen", "sen"))}
_ZH_CURRENCY = {"$": "美元", "€": "欧元", "£": "英镑", "¥": "元"}
# Mandarin names of pint's units and prefixes (GB/T 3100's): a prefix's and a unit's (毫 + 升), or a whole name
# where speech has its own (公里 and 公斤: 两千克 could be 2 kg or 2000 g)
_ZH_UNITS = {"meter": "米", "gram": "克", "metric_ton": "吨", "pound": "磅", "ounce": "盎司", "mile": "英里",
             "foot": "英尺", "inch": "英寸", "yard": "码", "liter": "升", "gallon": "加仑", "hectare": "公顷",
             "degree_Celsius": "摄氏度", "degree_Fahrenheit": "华氏度", "kelvin": "开尔文", "byte": "字节",
             "bit": "比特", "second": "秒", "minute": "分钟", "hour": "小时", "day": "天", "week": "周", "year": "年",
             "watt": "瓦", "watt_hour": "瓦时", "ampere": "安", "ampere_hour": "安时", "volt": "伏", "hertz": "赫兹",
             "joule": "焦耳", "calorie": "卡", "pascal": "帕", "kilometer": "公里", "kilogram": "公斤"}
_ZH_PREFIXES = {"": "", "tera": "太", "giga": "吉", "mega": "兆", "kilo": "千", "hecto": "百", "centi": "厘",
                "milli": "毫", "micro": "微", "nano": "纳"}
LONGEST_NUMBER = 15             # digits of a whole number said as a number; a longer one is read digit by digit


def _too_long(digits: str) -> bool:
    whole, _, decimals = digits.replace(",", "").lstrip("-").partition(".")
    return len(whole) > LONGEST_NUMBER or len(decimals) > LONGEST_NUMBER


@functools.lru_cache(maxsize=4096)          # inflect is slow: a digit said 10^5 times is worked out once
def _en_words(digits: str) -> str:
    return _inflect().number_to_words(digits).replace(",", "")


@functools.lru_cache(maxsize=4096)
def _zh_words(digits: str, mode: str) -> str:
    return cn2an.an2cn(digits, mode)


def _digit_by_digit(lang, digits: str) -> str:
    """A number too long to say as one: its digits, the point and a minus sign by name."""
    words = [lang.minus if ch == "-" else lang.point if ch == "." else lang.digits(ch)
             for ch in digits.replace(",", "")]
    return lang.space.join(words)


@functools.lru_cache(maxsize=1)
def _units():
    import pint  # its registry takes ~0.3 s to load: only when a unit is read

    return pint.UnitRegistry()


@functools.lru_cache(maxsize=1)
def _inflect():
    import inflect

    return inflect.engine()


@functools.lru_cache(maxsize=1024)          # a text of 100,000 characters may name the same unit 25,000 times
def unit_name(symbol: str) -> str | None:
    """pint's name of a unit symbol (``km`` -> ``kilometer``, ``km/h`` -> ``kilometer / hour``), or None."""
    import pint

    for candidate in (symbol, symbol[0].lower() + symbol[1:]):          # KB is pint's kB
        try:
            units = _units().parse_units(candidate)
        except (pint.errors.PintError, ValueError, TypeError, AttributeError, KeyError):
            continue
        if str(units):
            return str(units)
    return None


@functools.lru_cache(maxsize=1024)
def _zh_unit_name(name: str) -> str | None:
    """The Mandarin name of one of pint's unit names (``kilobyte`` -> 千字节), or None where it has none."""
    if name in _ZH_UNITS:
        return _ZH_UNITS[name]
    for prefix, unit, suffix in _units().parse_unit_name(name):
        if prefix in _ZH_PREFIXES and unit in _ZH_UNITS and not suffix:
            return _ZH_PREFIXES[prefix] + _ZH_UNITS[unit]
    return None


class English:
    code = "en"
    space = " "
    minus, point = "minus", "point"
    symbols = {".": "dot", "@": "at", "/": "slash", "-": "dash", "_": "underscore", ":": "colon", "?": "question mark",
               "=": "equals", "&": "and", "+": "plus", "#": "hash", "~": "tilde", "%": "percent"}

    def number(self, digits: str) -> str:
        """A plain number (``-1,234.5``): inflect's words, its decimals digit by digit."""
        if _too_long(digits):
            return _digit_by_digit(self, digits)
        return _en_words(digits.replace(",", ""))

    def digits(self, digits: str) -> str:
        return " ".join(self.number(d) for d in digits)

    def ordinal(self, digits: str) -> str:
        return _inflect().ordinal(self.number(digits))

    def year(self, digits: str) -> str:
        """As a year is read: 1999 nineteen ninety-nine, 2008 two thousand eight, 1900 nineteen hundred."""
        year = int(digits)
        high, low = divmod(year, 100)
        if year < 1000 or 2000 <= year < 2010 or high % 10 == 0 and low == 0:
            return self.number(digits)
        if low == 0:
            return f"{self.number(str(high))} hundred"
        return f"{self.number(str(high))} {'oh ' if low < 10 else ''}{self.number(str(low))}"

    def percent(self, digits: str) -> str:
        return f"{self.number(digits)} percent"

    def decade(self, digits: str) -> str:
        """1990 -> nineteen nineties, 1900 -> nineteen hundreds, 2000 -> two thousands, 80 -> eighties: the
        decade said as its year (or number), its last word in the plural."""
        said = self.year(digits) if len(digits) == 4 else self.number(digits)
        head, _, last = said.rpartition(" ")
        return f"{head} {_inflect().plural_noun(last)}".strip()

    def fraction(self, whole: str | None, numerator: str, denominator: str) -> str:
        """1/2 one half, 3/4 three quarters, 5/8 five eighths; 1 1/2 one and a half, 2 3/4 two and three quarters."""
        top, bottom = int(numerator), int(denominator)
        part = {2: "half", 4: "quarter"}.get(bottom) or _inflect().ordinal(self.number(denominator))
        if top != 1:
            part = _inflect().plural_noun(part)
        if whole is None:
            return f"{self.number(numerator)} {part}"
        return f"{self.number(whole)} and {'a' if top == 1 else self.number(numerator)} {part}"

    def currency(self, symbol: str, whole: str, cents: str | None, scale: str | None) -> str:
        (one, many), (cent_one, cent_many) = _EN_CURRENCY[symbol]
        if scale or (cents and len(cents) != 2):           # $5.5 million, $1.234: the amount, then the currency
            amount = whole + (f".{cents}" if cents else "")
            return f"{self.number(amount)}{' ' + scale if scale else ''} {many}"
        value = int(whole.replace(",", ""))
        said = f"{self.number(whole)} {one if value == 1 else many}"
        if cents and int(cents):
            said += f" and {self.number(str(int(cents)))} {cent_one if int(cents) == 1 else cent_many}"
        return said

    def time(self, hour: int, minute: int, second: int | None, meridiem: str | None) -> str:
        said = self.number(str(hour))
        if minute == 0 and second is None:
            said += " o'clock" if meridiem is None and hour <= 12 else ("" if meridiem else " hundred")
        elif minute < 10:
            said += f" oh {self.number(str(minute))}"
        else:
            said += f" {self.number(str(minute))}"
        if second is not None:
            said += f" and {self.number(str(second))} second{'s' if second != 1 else ''}"
        return said + (f" {meridiem[0].lower()} m" if meridiem else "")

    def date(self, year: int, month: int, day: int | None, day_first: bool = False) -> str:
        """March ninth, twenty twenty-four; written day first, the ninth of March, ...; without a day, March ...."""
        month_name, year_said = calendar.month_name[month], self.year(str(year))
        if day is None:
            return f"{month_name} {year_said}"
        if day_first:
            return f"the {self.ordinal(str(day))} of {month_name}, {year_said}"
        return f"{month_name} {self.ordinal(str(day))}, {year_said}"

    def unit(self, amount: str, name: str) -> str:
        """``5`` ``kilometer / hour`` -> five kilometers per hour (the word before "per" takes the plural)."""
        words = name.replace(" / ", " per ").replace("_", " ").replace(" * ", " ").split()
        if amount not in ("1", "1.0"):
            at = words.index("per") - 1 if "per" in words else (0 if words[0] == "degree" else len(words) - 1)
            words[at] = _inflect().plural(words[at])
        return f"{self.number(amount)} {' '.join(words)}"


class Mandarin:
    code = "zh"
    space = ""
    minus, point = "负", "点"
    symbols = {".": "点", "@": "艾特", "/": "斜杠", "-": "杠", "_": "下划线", ":": "冒号", "?": "问号", "=": "等于",
               "&": "和", "+": "加", "#": "井号", "~": "波浪号", "%": "百分号"}

    def number(self, digits: str) -> str:
        if _too_long(digits):
            return _digit_by_digit(self, digits)
        return _zh_words(digits.replace(",", ""), "low")

    def digits(self, digits: str) -> str:
        return _zh_words(digits, "direct")

    def ordinal(self, digits: str) -> str:
        return "第" + self.number(digits)

    def year(self, digits: str) -> str:
        return self.digits(digits)

    def percent(self, digits: str) -> str:
        return "百分之" + self.number(digits)

    def fraction(self, whole: str | None, numerator: str, denominator: str) -> str:
        """3/4 四分之三; 1 1/2 一又二分之一."""
        said = f"{self.number(denominator)}分之{self.number(numerator)}"
        return said if whole is None else f"{self.number(whole)}又{said}"

    def currency(self, symbol: str, whole: str, cents: str | None, scale: str | None) -> str:
        amount = self.number(whole + (f".{cents}" if cents else ""))
        scale_zh = {"thousand": "千", "million": "百万", "billion": "十亿", "trillion": "万亿"}.get(scale or "", "")
        return f"{amount}{scale_zh}{_ZH_CURRENCY[symbol]}"

    def time(self, hour: int, minute: int, second: int | None, meridiem: str | None) -> str:
        prefix = {"a": "上午", "p": "下午"}.get((meridiem or " ")[0].lower(), "")
        said = f"{prefix}{self.number(str(hour))}点"
        if minute:
            said += f"{'零' if minute < 10 else ''}{self.number(str(minute))}分"
        if second is not None:
            said += f"{self.number(str(second))}秒"
        return said

    def date(self, year: int, month: int, day: int | None, day_first: bool = False) -> str:
        """Year, month, day, however it was written (二零二四年三月九日); no day: 二零二四年三月."""
        said = f"{self.year(str(year))}年{self.number(str(month))}月"
        return said + (f"{self.number(str(day))}日" if day is not None else "")

    def unit(self, amount: str, name: str) -> str | None:
        """``5`` ``kilometer / hour`` -> 五公里每小时; None (the unit left as sent) for a unit without a name here."""
        named = [_zh_unit_name(part) for part in re.split(r" / |_per_", name)]
        names = [n for n in named if n is not None]
        if len(names) < len(named):
            return None
        # a lone 2 before a measure is 两 (两公里), as cn2an does not say
        return ("两" if amount == "2" else self.number(amount)) + "每".join(names)


# what a rule says a match in: one of LANGUAGES' values
Language = English | Mandarin

LANGUAGES: dict[str, Language] = {"en": English(), "zh": Mandarin()}
