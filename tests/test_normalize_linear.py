"""The normalizer's cost is linear in its text, whatever the text (issue 43): adversarial runs at the largest
``--max-input-chars`` are bounded by a count of characters examined (``Work``), not by a clock; a request's
work has a budget; a normalization stops when its client leaves; whitespace-like text is refused before it."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from app.errors import ApiError
from app.normalize import BudgetExceeded, Cancelled, Switches, Work, normalize
from app.normalize.work import WORK_BASE, WORK_PER_CHAR
from app.settings import ServerSettings

LARGEST = ServerSettings.model_fields["max_input_chars"].metadata  # checked below: the 100,000
N = 100_000
K = 100            # characters examined a character of text: the measured worst is ~93 (docs/normalization.md)

# the runs of the issue (dotted, e-mail-like, grouped numbers, schemes) and a run of every pattern's trigger
RUNS = ["a.", "a@", "a.a@", "@a.", "x@y.", "ab.cd@", "a@b.c", "1,", "000,", "1,000", "1", "1 ", "1-", "1.", "1/", "1:",
        "1%", "$1", "+1 ", "(1) ", "&", "& ", "(s)", "a-", "a.com.", "a.co", "-", "'", "March ", "the 60s ", "2024年",
        "1st ", "5kg ", "1 1/2 ", "9:30 pm ", "你好1", " ", "a"]
MIXED = ["http://" + "a." * N, "www." + "a-" * N, "a." * 1000 + "@" + "b." * N, "1," * 1000 + "000" * N,
         "".join(RUNS) * 400]


def _at_largest(unit: str) -> str:
    return (unit * (N // len(unit) + 1))[:N]


def test_the_largest_input_allowed_is_the_one_tested():
    assert max(getattr(m, "le", 0) or 0 for m in LARGEST) == N


@pytest.mark.parametrize("text", [_at_largest(u) for u in RUNS] + [t[:N] for t in MIXED],
                         ids=[repr(u) for u in RUNS] + [f"mixed-{i}" for i in range(len(MIXED))])
def test_adversarial_runs_cost_a_bounded_count_a_character(text):
    work = Work()
    normalize(text, Switches(unit_normalization=True), work)
    assert work.examined <= K * len(text), (work.examined / len(text), work.per_rule)
    assert K <= WORK_PER_CHAR                 # the budget is never what refuses such a text


def test_the_count_is_linear_not_quadratic():
    """The same run at 10,000 and 100,000 characters: ten times the work (the old URL, e-mail and percent
    patterns did a hundred times)."""
    for unit in ("a.", "a.a@", "000,", "1-"):
        small, large = Work(), Work()
        normalize(_at_largest(unit)[:N // 10], Switches(), small)
        normalize(_at_largest(unit), Switches(), large)
        assert large.examined <= 11 * small.examined, unit


def test_outputs_are_those_of_the_patterns_before():
    assert normalize("Mail ann.lee@example.org or see www.example.co.uk/a.").spoken == \
        "Mail ann dot lee at example dot org or see www dot example dot co dot uk slash a."
    assert normalize("x.y.example.com-foo and a..b.com").spoken == \
        "x dot y dot example dot com-foo and a..b dot com"
    assert normalize("Up 10%,20% and 1,000,000%").spoken == \
        "Up ten percent,twenty percent and one million percent"


def test_a_text_over_its_budget_is_refused():
    text = "1 2 3 " * 100
    with pytest.raises(BudgetExceeded):
        normalize(text, Switches(), Work(limit=len(text)))
    assert Work.budget_for(text).limit == WORK_PER_CHAR * len(text) + WORK_BASE


def test_a_set_cancel_flag_stops_the_normalization():
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        normalize(_at_largest("1 "), Switches(), Work(cancel=cancel))


# ---------------------------------------------------------------------- through aprepare_utterance (public API)
class _Limits:
    def check_text_chars(self, text):
        from engine.errors import TextTooLongError
        if len(text) > N:
            raise TextTooLongError(f"text is {len(text)} characters; the limit is {N}")
        return text


def _service():
    return types.SimpleNamespace(require_ready=lambda: None, limits=_Limits(),
                                 settings=types.SimpleNamespace(normalize_text="on"))


@pytest.mark.parametrize("text", ["", " ", "\u00a0", "\u200b", "\ufeff \u2060"])
def test_whitespace_like_text_is_refused_before_normalizing(text):
    from app.session.utterance import aprepare_utterance, prepare_utterance

    with pytest.raises(ApiError) as e:
        prepare_utterance(_service(), text, None, None)
    assert e.value.code == "empty_input"
    with pytest.raises(ApiError):
        asyncio.run(aprepare_utterance(_service(), text, None, None))


def test_too_long_text_is_refused_on_the_loop_before_any_normalization(monkeypatch):
    import app.session.utterance as utterance

    monkeypatch.setattr(utterance, "normalize", lambda *a, **k: pytest.fail("normalized a text over the limit"))
    with pytest.raises(ApiError) as e:
        asyncio.run(utterance.aprepare_utterance(_service(), "a." * N, None, None))
    assert e.value.code == "input_too_long"


@pytest.mark.parametrize("how", ["task-cancelled", "client-disconnected"])
def test_normalization_stops_when_the_client_leaves(monkeypatch, how):
    """The worker thread is told to stop (its ``Work.cancel``) when the awaiting task is cancelled or the
    request's ``disconnected()`` says so; it stops at its next window, without finishing the text."""
    import app.session.utterance as utterance

    started, stopped = threading.Event(), threading.Event()
    seen: dict = {}
    real = utterance.normalize

    def normalize_slowly(text, switches, work):
        started.set()
        assert work.cancel is not None and work.cancel.wait(30), "never cancelled"
        try:
            real(text, switches, work)
        except Cancelled:
            seen["examined"] = work.examined
            stopped.set()
            raise
        seen["finished"] = True

    monkeypatch.setattr(utterance, "normalize", normalize_slowly)

    async def main():
        left = asyncio.Event()

        async def disconnected() -> bool:
            return left.is_set()

        task = asyncio.ensure_future(utterance.aprepare_utterance(
            _service(), _at_largest("1 "), None, None,
            disconnected=disconnected if how == "client-disconnected" else None))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        if how == "task-cancelled":
            task.cancel()
        else:
            left.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stopped.wait(30) and "finished" not in seen
    assert seen["examined"] <= 2 * N            # stopped at its first check (after the one scan for letters)


def test_normalizations_run_one_at_a_time(monkeypatch):
    """Normalizing holds the interpreter lock, so requests normalize one at a time (the others wait on the
    loop): each call here waits for a second one to be inside at once, which never comes."""
    import app.session.utterance as utterance

    inside, most, crowd = [0], [0], threading.Condition()

    class Done(Exception):
        pass

    def normalize_counting(text, switches, work):
        with crowd:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            crowd.notify_all()
            crowd.wait_for(lambda: inside[0] >= 2, timeout=1)   # a second one inside, if the gate let it in
            inside[0] -= 1
        raise Done

    monkeypatch.setattr(utterance, "normalize", normalize_counting)

    async def main():
        return await asyncio.gather(*(utterance.aprepare_utterance(_service(), "$1 a", None, None)
                                      for _ in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, Done) for r in results), results
    assert most[0] == 1, f"{most[0]} normalizations at once"
