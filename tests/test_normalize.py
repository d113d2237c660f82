"""Text normalization (app/normalize): each rule in each language does what docs/normalization.md's table
(generated from app/normalize/examples.py) says; each switch turns its rule off; the alignment of a normalized
utterance covers the text as sent; and a real server normalizes when a request (Kokoro's
``normalization_options``, ElevenLabs' ``apply_text_normalization``) or its default says, and only then."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
from service_helpers import Server

from app.alignment.characters import Aligner
from app.alignment.spans import SentAligner
from app.normalize import OFF, Switches, language_at, normalize
from app.normalize.examples import EXAMPLES, table
from app.normalize.rules import RULES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: f"{e.rule}-{e.language}-{e.sent[:16]}")
def test_each_rule_says_its_example(ex):
    got = normalize(ex.sent, ex.switches)
    assert got.spoken == ex.spoken
    assert language_at(ex.sent, *_span_of(got, ex.rule)) == ex.language
    # outside the changes the two texts are the same, character for character
    at_sent = at_spoken = 0
    for seg in got.segments:
        assert ex.sent[at_sent:seg.sent_start] == got.spoken[at_spoken:seg.spoken_start]
        at_sent, at_spoken = seg.sent_end, seg.spoken_end
    assert ex.sent[at_sent:] == got.spoken[at_spoken:]


def _span_of(got, rule: str) -> tuple[int, int]:
    seg = next((s for s in got.segments if s.rule == rule), got.segments[0])
    return seg.sent_start, seg.sent_end


def test_every_rule_has_an_example_in_english_and_every_rule_but_the_english_ones_in_mandarin():
    english_only = {"ordinal", "plural", "decade"}   # Mandarin writes no ordinal, plural or 1990s (90年代 is numbers)
    by_language = {lang: {e.rule for e in EXAMPLES if e.language == lang} for lang in ("en", "zh")}
    rules = {r.name for r in RULES}
    assert by_language["en"] == rules - {"year"}
    assert by_language["zh"] == rules - english_only
    for ex in EXAMPLES:
        assert ex.rule in {s.rule for s in normalize(ex.sent, ex.switches).segments}, ex


@pytest.mark.parametrize("rule", [r for r in RULES if r.switch], ids=lambda r: r.name)
def test_each_switch_turns_its_rule_off(rule):
    off = Switches(**{**Switches().model_dump(), "unit_normalization": True, rule.switch: False})
    for ex in (e for e in EXAMPLES if e.rule == rule.name):
        assert rule.name not in {s.rule for s in normalize(ex.sent, off).segments}, ex


def test_normalization_off_gives_the_text_as_sent():
    for ex in EXAMPLES:
        got = normalize(ex.sent, OFF)
        assert (got.spoken, got.segments) == (ex.sent, ())


def test_the_docs_table_is_the_generated_one():
    text = (ROOT / "docs" / "normalization.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- normalization-table:begin -->\n(.*?)\n<!-- normalization-table:end -->", text, re.S)
    assert m and m.group(1) == table(), "docs/normalization.md's table differs: paste app.normalize.examples.table()"


@pytest.mark.parametrize("sent, spoken", [
    ("速度是30 km/h", "速度是三十公里每小时"),
    ("气温-5°C，体温98.6°F", "气温负五摄氏度，体温九十八点六华氏度"),
    ("重2kg，长3m，宽20cm", "重两公斤，长三米，宽二十厘米"),           # each unit Mandarin, not only the first
    ("下载了4.7GB，约1,500 MB", "下载了四点七吉字节，约一千五百兆字节"),
    ("容量500mL，用时45min，10s", "容量五百毫升，用时四十五分钟，十秒"),
    ("耗电3kWh，时速60mph", "耗电三千瓦时，时速六十英里每小时"),
    ("内存16KiB", "内存十六KiB"),                                   # no Mandarin name: the number alone
])
def test_mandarin_says_units_by_their_names(sent, spoken):
    got = normalize(sent, Switches(unit_normalization=True))
    assert got.spoken == spoken
    assert {s.rule for s in got.segments} == ({"number"} if "KiB" in sent else {"unit"})


@pytest.mark.parametrize("sent, spoken", [
    ("It was -5°C", "It was minus five degrees Celsius"),            # the minus is the unit's, not left as "-"
    ("1,500 km", "one thousand five hundred kilometers"),
    ("the 2nd and 3rd, 5th", "the second and third, fifth"),         # not two nanodays, three rods, five thous
])
def test_english_units_take_the_whole_number_and_leave_ordinals(sent, spoken):
    assert normalize(sent, Switches(unit_normalization=True)).spoken == spoken


@pytest.mark.parametrize("sent, spoken", [
    ("March 5, 2024", "March fifth, twenty twenty-four"),
    ("on March 5th 2024.", "on March fifth, twenty twenty-four."),
    ("5 March 2024", "the fifth of March, twenty twenty-four"),
    ("2nd Dec. 1999", "the second of December, nineteen ninety-nine"),
    ("In March 2024,", "In March twenty twenty-four,"),
    ("Sept 1900", "September nineteen hundred"),
    ("日期：March 5, 2024", "日期：二零二四年三月五日"),                 # in Mandarin, as the ISO form is
])
def test_dates_with_a_months_name_say_the_year_as_a_year(sent, spoken):
    got = normalize(sent, Switches(unit_normalization=True))
    assert got.spoken == spoken
    assert [seg.rule for seg in got.segments] == ["date"]


def test_a_months_name_date_reads_its_year_as_the_numeric_forms_do():
    from app.normalize.languages import LANGUAGES

    for year in ("1999", "2008", "2024", "1900"):
        said = LANGUAGES["en"].year(year)
        assert normalize(f"May 1, {year}").spoken == f"May first, {said}"
        assert normalize(f"{year}-05-01").spoken == f"May first, {said}"
        assert normalize(f"May {year}").spoken == f"May {said}"
    # not a date: "may" is a verb, a 32nd day has no reading, and a day without a year is not claimed
    assert normalize("you may 2024").spoken == "you may two thousand and twenty-four"
    assert normalize("March 32, 2024").spoken == "March thirty-two, two thousand and twenty-four"


@pytest.mark.parametrize("sent, spoken", [
    ("the 1990s", "the nineteen nineties"),
    ("the 1900s and 2000s", "the nineteen hundreds and two thousands"),
    ("in the 2010's", "in the twenty tens"),
    ("the early 60s", "the early sixties"),
    ("mid-70s", "mid-seventies"),
    ("a 30s clip", "a thirty seconds clip"),           # two digits without a word before them: seconds
    ("1 1/2 cups", "one and a half cups"),
    ("5/8 inch", "five eighths inch"),
    ("24/7 and 50/50", "twenty-four/seven and fifty/fifty"),      # not proper fractions: left to the numbers
    ("on 1/15/2024", "on January fifteenth, twenty twenty-four"),  # a date, not a fraction
])
def test_decades_and_fractions_with_units_on(sent, spoken):
    assert normalize(sent, Switches(unit_normalization=True)).spoken == spoken


def test_a_matched_phrase_without_a_reading_is_left_as_sent():
    assert normalize("13/45/2024 and 25:99").spoken == "thirteen/forty-five/two thousand and twenty-four and " \
                                                      "twenty-five:ninety-nine"
    assert normalize("Version 1.2.3").spoken == "Version 1.2.3"        # not a number, not a date


def test_any_text_is_normalized_without_an_error_and_maps_back():
    """Random texts of digits, symbols, Han, non-ASCII digits and huge numbers: no exception reaches the
    request, and outside its changes the model's text is the sent one."""
    import random

    pieces = list("0123456789.,:-/+$€£¥%@&=#~() abKMkmhAPM年月日你好\n") + [
        "(s)", "https://", "www.", ".com", "°C", "km/h", "e\u0301", "٣", "²", "½", "１２", "9" * 22, "-", "0000"]
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        got = normalize(text, Switches(unit_normalization=True))
        at_sent = at_spoken = 0
        for seg in got.segments:
            assert text[at_sent:seg.sent_start] == got.spoken[at_spoken:seg.spoken_start], text
            at_sent, at_spoken = seg.sent_end, seg.spoken_end
        assert text[at_sent:] == got.spoken[at_spoken:], text


def _play(aligner, text: str, reads: list[int]):
    """Spans of a turn whose frames read ``reads`` characters of ``text`` (cumulative), then its rest."""
    aligner.add(text)
    spans = [aligner.frame(n, np.full(1920, 0.1 if i % 3 else 0.0, np.float32)) for i, n in enumerate(reads)]
    return [s for s in spans + [aligner.rest()] if s is not None]


@pytest.mark.parametrize("clock", ["speech", "read"])
def test_alignment_of_a_normalized_utterance_covers_the_text_as_sent(clock):
    sent = "Pay $10.50 by 2024-01-15, or call 555-1234. Thanks!"
    got = normalize(sent)
    assert got.spoken != sent
    n = len(got.spoken)
    reads = [min(n, 4 * i) for i in range(1, 40)]
    spans = _play(SentAligner(Aligner(clock), got), got.spoken, reads)
    assert "".join(c for s in spans for c in s.chars) == sent
    previous_end = 0.0
    for s in spans:
        assert s.origin_ms == pytest.approx(previous_end)
        times = [t for pair in zip(s.starts_ms, s.ends_ms) for t in pair]
        assert all(b >= a - 1e-6 for a, b in zip(times, times[1:])) and times[0] >= s.origin_ms
        previous_end = s.ends_ms[-1]
    # the ends of the spans are those of the same frames unmapped: the audio's timeline is unchanged
    plain = _play(Aligner(clock), got.spoken, reads)
    assert spans[-1].ends_ms[-1] == plain[-1].ends_ms[-1]


def test_the_whole_alignment_of_a_normalized_utterance_is_the_text_as_sent():
    sent = "Meet me at 9:30 am, 21st floor; it's 48213 steps."
    got = normalize(sent)
    aligner = SentAligner(Aligner("speech"), got)
    _play(aligner, got.spoken, [min(len(got.spoken), 3 * i) for i in range(1, 60)])
    final = aligner.final()
    assert "".join(final.chars) == sent
    assert final.starts_ms == sorted(final.starts_ms)


def test_a_change_is_reported_once_it_has_all_been_read():
    got = normalize("I owe $10.50 now")
    aligner = SentAligner(Aligner("read"), got)
    aligner.add(got.spoken)
    change = got.segments[0]
    first = aligner.frame(change.spoken_end - 1)           # all but the last character of "ten dollars ..."
    assert "".join(first.chars) == "I owe "
    second = aligner.frame(change.spoken_end)
    assert "".join(second.chars) == "$10.50"


# ---------------------------------------------------------------------------------------- on a real server
SENT = "It costs $10.50, call 555-1234."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("normalize")
    with Server(None, tmp / "voices", tmp / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def normalizing_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("normalize-default")
    with Server(None, tmp / "voices", tmp / "server.log", "--normalize-text", "on") as s:
        yield s


def _input_tokens(server, **extra) -> int:
    body = {"model": "tts-1", "input": SENT, "stream_format": "sse", "max_frames": 80, "greedy": True, **extra}
    with httpx.stream("POST", server.base + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    return events[-1]["usage"]["input_tokens"]


def _tokens(text: str) -> int:
    """Tokens of ``text`` to the demo bundle's tokenizer (the MOSS-TTS-Realtime one): what ``usage`` counts."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(ROOT / "export" / "data" / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids)


def test_normalization_options_turn_it_on_per_request(server, normalizing_server):
    sent, spoken = _tokens(SENT), _tokens(normalize(SENT).spoken)
    no_phone = _tokens(normalize(SENT, Switches(phone_normalization=False)).spoken)
    assert len({sent, spoken, no_phone}) == 3
    assert _input_tokens(server) == sent                                        # the server's default: off
    assert _input_tokens(server, normalization_options={}) == spoken            # Kokoro's default: normalize on
    assert _input_tokens(server, normalization_options={"normalize": False}) == sent
    assert _input_tokens(server, normalization_options={"phone_normalization": False}) == no_phone
    assert _input_tokens(normalizing_server) == spoken                          # --normalize-text on
    assert _input_tokens(normalizing_server, normalization_options={"normalize": False}) == sent


def test_a_bad_switch_is_a_400(server):
    r = httpx.post(server.base + "/v1/audio/speech", timeout=60,
                   json={"model": "tts-1", "input": SENT, "normalization_options": {"normalize": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "normalization_options.normalize"


@pytest.mark.parametrize("apply", ["on", "auto-with-default"])
def test_elevenlabs_alignment_keeps_the_text_as_sent(server, normalizing_server, apply):
    target = server if apply == "on" else normalizing_server
    body = {"text": SENT, **({"apply_text_normalization": "on"} if apply == "on" else {})}
    r = httpx.post(target.base + "/v1/text-to-speech/default/with-timestamps?seed=1", json=body, timeout=180)
    assert r.status_code == 200, r.text
    alignment = r.json()["alignment"]
    assert "".join(alignment["characters"]) == SENT
    assert alignment["character_start_times_seconds"] == sorted(alignment["character_start_times_seconds"])
    assert base64.b64decode(r.json()["audio_base64"])


def test_elevenlabs_apply_text_normalization_off_reads_the_text_as_sent(normalizing_server):
    r = httpx.post(normalizing_server.base + "/v1/text-to-speech/default/with-timestamps?seed=1&alignment=read",
                   json={"text": SENT, "apply_text_normalization": "off"}, timeout=180)
    assert r.status_code == 200, r.text
    assert "".join(r.json()["alignment"]["characters"]) == SENT


@pytest.mark.parametrize("stream", [False, True])
def test_captions_and_sse_word_timestamps_keep_the_text_as_sent(server, stream):
    """Kokoro's captioned speech and our SSE timestamps of a normalized input: its words as sent."""
    body = {"input": SENT, "normalization_options": {}, "response_format": "pcm", "stream": stream}
    words = []
    with httpx.stream("POST", server.base + "/dev/captioned_speech", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.strip():
                words += [w["word"] for w in json.loads(line)["timestamps"]]
    assert words == SENT.split()
    sse = {"model": "tts-1", "input": SENT, "stream_format": "sse", "return_timestamps": True,
           "normalization_options": {}}
    with httpx.stream("POST", server.base + "/v1/audio/speech", json=sse, timeout=180) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [w["word"] for e in events if e["type"] == "speech.audio.timestamps" for w in e["timestamps"]] == \
        SENT.split()
