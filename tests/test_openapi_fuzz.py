"""Schemathesis against a real ``mossrt serve`` process: every operation of ``/openapi.json`` fuzzed with
schema-valid and schema-invalid requests, bounded and seeded so CI sends the same requests every run.

For every response:
  * no 5xx, never FastAPI's default 422 or its ``{"detail": ...}`` body, and every non-2xx JSON body is exactly
    OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
  * schemathesis' own checks: server errors, status codes, content types, headers, ``Allow`` on 405, response
    bodies against the documented schemas, schema-invalid data rejected, unsupported methods refused.
    ``positive_data_acceptance`` is left out: the schema cannot say what the server must still refuse with a
    400 (a voice that does not exist, an ``input`` of blanks, an ``audio_sample`` that is not audio).

Two tests fuzz; a third reports:
  * ``test_openapi_fuzz``: every operation (schemathesis' examples, coverage and fuzzing phases, positive and
    negative data).
  * ``test_speech_and_voices_reach_the_engine``: random fuzzing seldom gets past the first 400 (an empty
    ``input``, an unknown voice, random bytes for ``audio_sample``), so this one fuzzes the same two
    operations with schema-valid data and then makes each request speakable (non-blank text, a built-in voice)
    or registrable (a real WAV): every sampling field, format and speed then runs through the engine, and each
    registered voice goes through get, speech, delete, get-after-delete.
  * ``test_openapi_fuzz_findings``: the distinct failures both collected (each with the exact request, as
    curl); failures are collected rather than raised so one finding never hides the rest of the run. Findings
    it did not report (it was deselected, or ran before a fuzz test that then found something) fail the
    module's ``server`` fixture at teardown, so a finding fails the run whichever tests are selected.

Audio responses are read for at most ``AUDIO_READ_BYTES`` / ``AUDIO_READ_SECONDS`` and then the connection is
closed (schemathesis itself stops SSE after ``max-stream-events``): a schema-valid request may ask for
``max_frames`` 3750 with greedy sampling, which the random-weight test bundle never ends early, i.e. minutes
of generation on a CPU. Closing early also exercises the server's cancellation on client disconnect.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests
import schemathesis
import soundfile as sf
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from service_helpers import Server

SEED = 20241130
MAX_EXAMPLES = 30           # fuzzing-phase examples per operation (the examples and coverage phases add their
                            # own deterministic cases: boundary values, wrong types, missing fields, methods)
DEEP_EXAMPLES = 15          # per operation in test_speech_and_voices_reach_the_engine
REQUEST_TIMEOUT_S = 30
MAX_STREAM_EVENTS = 8       # SSE events schemathesis reads before it closes the stream
AUDIO_READ_BYTES = 32 * 1024
NDJSON = "application/x-ndjson"       # /dev/captioned_speech's streamed lines: capped as audio is
AUDIO_READ_SECONDS = 3.0
LOG = os.environ.get("MOSSRT_FUZZ_LOG")   # a path: every request and its answer, one JSON line each
BUDGET_S = 120              # the whole run (both fuzz tests): 10-25 s on a shared 2-core machine
VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.\-]{0,63}$")   # app/voices.py's rule
SPEAKABLE = "Hello there, this is a fuzzed request. "


# --------------------------------------------------------------------------------------------- run record
@dataclass
class Run:
    started: float | None = None
    operations: set = field(default_factory=set)
    examples: collections.Counter = field(default_factory=collections.Counter)   # by test and operation
    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    truncated: int = 0
    findings: dict = field(default_factory=dict)   # (operation, kind, status) -> first occurrence, in words
    finding_counts: collections.Counter = field(default_factory=collections.Counter)
    reported: bool = False                          # the summary was printed by test_openapi_fuzz_findings
    reported_findings: set = field(default_factory=set)   # keys of RUN.findings some test has failed on

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started if self.started else 0.0
        per_test = collections.Counter()
        for (test, _), n in self.examples.items():
            per_test[test] += n
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        return (f"schemathesis {schemathesis.SCHEMATHESIS_VERSION}: {len(self.operations)} operations, "
                f"{sum(self.examples.values())} examples ({', '.join(f'{t} {n}' for t, n in per_test.items())}), "
                f"{self.requests} requests in {elapsed:.1f} s (seed {SEED}, max_examples {MAX_EXAMPLES}/"
                f"{DEEP_EXAMPLES}); statuses {{{statuses}}}; {self.truncated} audio responses cut after "
                f"{AUDIO_READ_BYTES // 1024} KiB or {AUDIO_READ_SECONDS:g} s; "
                f"{len(self.findings)} distinct findings")


RUN = Run()


class CappedSession(requests.Session):
    """Reads an audio body only up to AUDIO_READ_BYTES / AUDIO_READ_SECONDS, then drops the connection."""

    def request(self, *args, **kwargs):
        response = super().request(*args, **kwargs)
        ctype = response.headers.get("content-type", "")
        if kwargs.get("stream") and ctype.startswith(("audio/", NDJSON)):    # streamed as generated
            data, deadline, cut = bytearray(), time.monotonic() + AUDIO_READ_SECONDS, False
            while chunk := response.raw.read1(8192, decode_content=True):
                data += chunk
                if len(data) >= AUDIO_READ_BYTES or time.monotonic() >= deadline:
                    cut = True
                    break
            response._content = bytes(data)
            response._content_consumed = True
            if cut:
                RUN.truncated += 1
                response.raw.close()         # the server sees the client go away and cancels the stream
            response.close()
        return response


def _config(**project) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "seed": SEED,
        "generation": {"max-examples": MAX_EXAMPLES, "database": "none", "deterministic": True},
        "suppress-health-check": ["too_slow"],     # data generation on a loaded 2-core CI machine
        "request-timeout": REQUEST_TIMEOUT_S,
        "max-stream-events": MAX_STREAM_EVENTS,
        "checks": {"positive_data_acceptance": {"enabled": False}},
        **project,
    })


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory, request):
    """The server under fuzzing. On the way out (after the clean-exit check) it fails the run on a traceback in
    the server log, and on any finding ``test_openapi_fuzz_findings`` has not reported: that test may be
    deselected (``-k engine``) or run before a fuzz test that then finds something (another order)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2", "--queue-timeout", "5") as s:
        try:
            yield s
        finally:
            if RUN.started and not RUN.reported:
                _print(request, RUN.summary())
    problems = []
    # a crash inside a stream, after its 200 went out, never shows as a 5xx: the log is where it shows
    log = s.log()
    tracebacks = [m.start() for m in re.finditer("Traceback", log)]
    if tracebacks:
        problems.append(f"a traceback in the server log:\n{log[max(0, tracebacks[0] - 2000):tracebacks[0] + 4000]}")
    late = _take_unreported()
    if late:
        problems.append(f"schemathesis: {len(late)} distinct findings no test reported (test_openapi_fuzz_findings "
                        f"deselected, or run before they were found):\n\n{_format(late)}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def session():
    with CappedSession() as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    RUN.started = RUN.started or time.monotonic()
    return schemathesis.openapi.from_url(server.base + "/openapi.json", config=_config())


@pytest.fixture(scope="module")
def deep_schema(server):
    RUN.started = RUN.started or time.monotonic()
    config = _config(
        generation={"max-examples": DEEP_EXAMPLES, "database": "none", "deterministic": True, "mode": "positive"},
        phases={"examples": {"enabled": False}, "coverage": {"enabled": False}})
    return schemathesis.openapi.from_url(server.base + "/openapi.json", config=config)


@pytest.fixture(autouse=True)
def _schemathesis_pytest9_shim(request):
    """schemathesis 4.32's ``from_fixture`` reads and writes ``node._nodeid``, which pytest 9.2 no longer has
    (the id lives in ``node._id``): give it the attribute it expects (it only renames the subtests)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _print(request, line: str) -> None:
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print("\n" + line, flush=True)
    else:
        print("\n" + line)


# --------------------------------------------------------------------------------------------- checks
def _body_text(response, limit: int = 600) -> str:
    text = response.content[:limit].decode("utf-8", "replace")
    return text + ("…" if len(response.content) > limit else "")


def _invariants(response) -> list[tuple[str, str]]:
    """Our own rules: no 5xx, no FastAPI 422/``detail``, OpenAI's error shape on every non-2xx JSON."""
    problems = []
    status = response.status_code
    ctype = ",".join(response.headers.get("content-type", []))
    body = None
    if ctype.startswith(NDJSON):        # one JSON document a line (the last one may be cut off by the cap)
        lines = response.content.split(b"\n")[:-1]
        try:
            for line in lines:
                json.loads(line)
        except ValueError:
            problems.append(("invalid_json_body", "a line of the body is not JSON although its Content-Type "
                                                  "says NDJSON"))
    elif "json" in ctype:
        try:
            body = json.loads(response.content)
        except ValueError:
            problems.append(("invalid_json_body", "the body is not JSON although its Content-Type says so"))
    if status >= 500:
        problems.append(("server_error", f"{status}"))
    if status == 422:
        problems.append(("fastapi_422", "FastAPI's default validation status"))
    if isinstance(body, dict) and "detail" in body:
        problems.append(("fastapi_detail_body", "FastAPI's default {\"detail\": ...} error body"))
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        if "json" not in ctype:
            problems.append(("error_not_json", f"a {status} with Content-Type {ctype!r}"))
        elif not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)
                  and set(err) == {"message", "type", "param", "code"}
                  and isinstance(err["message"], str) and err["message"]
                  and isinstance(err["type"], str) and err["type"]
                  and (err["param"] is None or isinstance(err["param"], str))
                  and (err["code"] is None or isinstance(err["code"], str))):
            problems.append(("error_shape", "not exactly {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"))
    return problems


def _record(case, response, kind: str, detail: str) -> None:
    key = (f"{case.method} {case.operation.path}", kind, response.status_code)
    RUN.finding_counts[key] += 1
    if key not in RUN.findings:
        try:
            curl = case.as_curl_command(headers=dict(response.request.headers))
        except Exception:  # noqa: BLE001 - the report must not fail on a curl rendering
            curl = f"{case.method} {case.formatted_path} body={case.body!r}"
        RUN.findings[key] = (f"{detail.strip()}\nrequest: {curl}\nresponse: {response.status_code} "
                             f"{_body_text(response, 300)}")


def _call_and_check(case, base: str, session: requests.Session, test: str):
    RUN.operations.add(case.operation.label)
    RUN.examples[(test, case.operation.label)] += 1
    RUN.requests += 1
    response = case.call(base_url=base, session=session, timeout=REQUEST_TIMEOUT_S)
    RUN.statuses[response.status_code] += 1
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"test": test, "method": case.method, "path": case.formatted_path, "query": case.query,
                                "body": repr(case.body)[:2000], "status": response.status_code,
                                "response": _body_text(response, 300),
                                "ms": round(1000 * response.elapsed)}) + "\n")
    for kind, detail in _invariants(response):
        _record(case, response, kind, detail)
    try:
        case.validate_response(response)
    except FailureGroup as group:
        for failure in group.exceptions:
            _record(case, response, type(failure).__name__, f"{failure.title}: {failure.message}")
    return response


# --------------------------------------------------------------------------------------------- tests
fuzz = schemathesis.pytest.from_fixture("api_schema")
deep = schemathesis.pytest.from_fixture("deep_schema").include(
    operation_id=["create_speech_v1_audio_speech_post", "create_voice_v1_audio_voices_post"])


@fuzz.parametrize()
def test_openapi_fuzz(case, server, session):
    _call_and_check(case, server.base, session, "fuzz")


def _wav(seconds: float = 1.0, rate: int = 24000) -> bytes:
    rng = np.random.default_rng(SEED)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@deep.parametrize()
def test_speech_and_voices_reach_the_engine(case, server, session):
    body = case.body
    if case.operation.path == "/v1/audio/speech" and isinstance(body, dict):
        text = body.get("input")
        body["input"] = SPEAKABLE + (text[:200] if isinstance(text, str) else "")
        if not isinstance(body.get("voice"), str) or body["voice"] not in ("default", "alloy", "nova"):
            body["voice"] = ("default", "alloy", "nova")[RUN.requests % 3]
        _call_and_check(case, server.base, session, "deep")
        return
    if case.operation.path == "/v1/audio/voices" and isinstance(body, dict):
        name = body.get("name")
        if not (isinstance(name, str) and VOICE_NAME.match(name)) or name.lower() in ("default", "alloy", "nova"):
            body["name"] = f"fuzz voice {RUN.requests}"
        body["audio_sample"] = _wav()
        response = _call_and_check(case, server.base, session, "deep")
        if response.status_code == 200:
            _voice_round_trip(response.json(), server.base)


def _voice_round_trip(voice: dict, base: str) -> None:
    """A registered voice: get it, speak with it by name and by id, delete it, and it is gone."""
    def expect(what: str, r: requests.Response, status: int) -> None:
        RUN.requests += 1
        RUN.statuses[r.status_code] += 1
        if r.status_code != status:
            key = (f"voice round trip: {what}", "unexpected_status", r.status_code)
            RUN.finding_counts[key] += 1
            RUN.findings.setdefault(key, f"expected {status} for {what} of {voice}\nresponse: {r.status_code} "
                                         f"{r.text[:600]}")

    quoted = requests.utils.quote(voice["id"], safe="")
    expect("GET /v1/audio/voices/{id}", requests.get(f"{base}/v1/audio/voices/{quoted}", timeout=30), 200)
    for ref in (voice["name"], {"id": voice["id"]}):
        r = requests.post(f"{base}/v1/audio/speech", timeout=REQUEST_TIMEOUT_S, json={
            "model": "tts-1", "input": SPEAKABLE, "voice": ref, "response_format": "pcm", "max_frames": 8})
        expect(f"POST /v1/audio/speech with voice {ref!r}", r, 200)
    expect("DELETE /v1/audio/voices/{id}", requests.delete(f"{base}/v1/audio/voices/{quoted}", timeout=30), 200)
    expect("GET /v1/audio/voices/{id} after delete", requests.get(f"{base}/v1/audio/voices/{quoted}", timeout=30),
           404)


def _take_unreported() -> list:
    """The keys of the findings not reported yet, in a stable order; from now on they count as reported."""
    keys = sorted(set(RUN.findings) - RUN.reported_findings, key=str)
    RUN.reported_findings.update(keys)
    return keys


def _format(keys: list) -> str:
    return "\n\n".join(
        f"[{op}] {kind} -> {status} (x{RUN.finding_counts[(op, kind, status)]})\n    "
        + RUN.findings[(op, kind, status)].replace("\n", "\n    ")
        for op, kind, status in keys)


def test_openapi_fuzz_findings(server, request):
    """Every distinct finding of the two fuzz tests, each with its first request (as curl) and response.
    (Findings made after this test ran, or with it deselected, fail the ``server`` fixture's teardown.)"""
    if RUN.started is None:
        pytest.skip("the fuzz tests did not run (deselected?)")
    elapsed = time.monotonic() - RUN.started
    RUN.reported = True
    _print(request, RUN.summary())
    keys = _take_unreported()
    if keys:
        pytest.fail(f"schemathesis: {len(keys)} distinct findings:\n\n{_format(keys)}", pytrace=False)
    assert elapsed < BUDGET_S, f"the fuzz run took {elapsed:.0f} s; the budget is {BUDGET_S} s"
