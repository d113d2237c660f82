"""What each rule does, by language: the table of docs/normalization.md is generated from these (``table()``),
and tests/test_normalize.py checks each against :func:`app.normalize.normalize`, so neither can drift."""

from __future__ import annotations

from dataclasses import dataclass

from . import Switches
from .rules import RULES


@dataclass(frozen=True)
class Example:
    rule: str
    language: str             # "en" or "zh"
    sent: str
    spoken: str               # what the model is given
    switches: Switches = Switches()


_UNITS = Switches(unit_normalization=True)

EXAMPLES: tuple[Example, ...] = (
    Example("email", "en", "Write to ann.lee@example.org today.", "Write to ann dot lee at example dot org today."),
    Example("email", "zh", "请发邮件到 ann@example.cn 谢谢", "请发邮件到 ann 艾特 example 点 cn 谢谢"),
    Example("url", "en", "Read https://example.com/docs/start-here.",
            "Read example dot com slash docs slash start dash here."),
    Example("url", "zh", "网址是 www.example.cn/a", "网址是 www 点 example 点 cn 斜杠 a"),
    Example("phone", "en", "Call (415) 555-2671.", "Call four one five, five five five, two six seven one."),
    Example("phone", "en", "Or +1 415 555 2671", "Or plus one, four one five, five five five, two six seven one"),
    Example("phone", "zh", "请拨打13812345678。", "请拨打一三八一二三四五六七八。"),
    Example("date", "en", "It opens on 2024-03-09.", "It opens on March ninth, twenty twenty-four."),
    Example("date", "en", "Due 12/25/2023", "Due December twenty-fifth, twenty twenty-three"),
    Example("date", "en", "From March 5, 2024 to 9 May 2025", "From March fifth, twenty twenty-four to the ninth "
            "of May, twenty twenty-five"),
    Example("date", "en", "Since Sept 2010, not Dec. 1999", "Since September twenty ten, not December "
            "nineteen ninety-nine"),
    Example("date", "zh", "日期是2024-03-09。", "日期是二零二四年三月九日。"),
    Example("year", "zh", "2008年8月8日", "二零零八年八月八日"),
    Example("decade", "en", "Songs of the 1990s, the '80s and her 30s",
            "Songs of the nineteen nineties, the eighties and her thirties"),
    Example("fraction", "en", "Add 1/2 cup, then 2 3/4 cups", "Add one half cup, then two and three quarters cups"),
    Example("fraction", "zh", "加1/2杯水，再加1 1/4杯", "加二分之一杯水，再加一又四分之一杯"),
    Example("time", "en", "We meet at 9:05 pm.", "We meet at nine oh five p m."),
    Example("time", "en", "At 7 am, 15:00 or 3:00", "At seven a m, fifteen hundred or three o'clock"),
    Example("time", "zh", "会议在14:30开始", "会议在十四点三十分开始"),
    Example("currency", "en", "It costs $1,299.99 today.",
            "It costs one thousand two hundred and ninety-nine dollars and ninety-nine cents today."),
    Example("currency", "en", "That is $5 million, or £1.", "That is five million dollars, or one pound."),
    Example("currency", "zh", "票价€20，合¥150", "票价二十欧元，合一百五十元"),
    Example("percent", "en", "Up 12.5% on the year", "Up twelve point five percent on the year"),
    Example("percent", "zh", "增长了12.5%", "增长了百分之十二点五"),
    Example("unit", "en", "A 10KB file at 30 km/h", "A ten kilobytes file at thirty kilometers per hour", _UNITS),
    Example("unit", "en", "1 kg, 5 in a row", "one kilogram, five in a row", _UNITS),
    Example("unit", "zh", "速度是30 km/h，气温-5°C", "速度是三十公里每小时，气温负五摄氏度", _UNITS),
    Example("unit", "zh", "重2kg，内存16GB，500mL", "重两公斤，内存十六吉字节，五百毫升", _UNITS),
    Example("ordinal", "en", "She came 21st.", "She came twenty-first."),
    Example("number", "en", "There are 48,213 of them, -7 and 3.14",
            "There are forty-eight thousand two hundred and thirteen of them, minus seven and three point one four"),
    Example("number", "zh", "一共有48213个，-7和3.14", "一共有四万八千二百一十三个，负七和三点一四"),
    Example("number", "en", "Serial 12345678901234567", "Serial one two three four five six seven eight nine zero "
            "one two three four five six seven"),
    Example("plural", "en", "Pick the item(s) you like", "Pick the items you like"),
    Example("symbol", "en", "Tom & Jerry + 2 = 5", "Tom and Jerry plus two equals five"),
    Example("symbol", "zh", "汤姆&杰瑞", "汤姆和杰瑞"),
)

_LANGUAGE = {"en": "English", "zh": "Mandarin"}


def table() -> str:
    """The Markdown table of docs/normalization.md: every rule, in the order they claim text, by language."""
    what = {r.name: r for r in RULES}
    rows = ["| rule | switch | language | sent | the model is given |", "|---|---|---|---|---|"]
    for ex in EXAMPLES:
        rule = what[ex.rule]
        switch = f"`{rule.switch}`" if rule.switch else "`normalize`"
        rows.append(f"| {ex.rule}: {rule.what} | {switch} | {_LANGUAGE[ex.language]} | {_cell(ex.sent)} "
                    f"| {_cell(ex.spoken)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"
