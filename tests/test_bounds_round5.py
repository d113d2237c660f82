"""Hardening round 5 (issue 43), the session core's part: the ElevenLabs multi-context start that waits for a
slot while its context is closed, the text buffer counted in characters, whitespace-only text alike on every
transport, the draining close code, ``/v2/voices``' parameters, one error shape per protocol on a shared
route, and ``normalized_alignment`` over the normalized text. Each test runs a real server (``mossrt serve``
on the demo bundle, or the app under uvicorn in this process where the test must hold one interleaving);
every wait is on a message, a counter or an event, bounded only against a hang."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import threading

import httpx
import pytest
from service_helpers import Server, free_port, metric, wait_for
from transports import BY_NAME, KEY, WS_TRANSPORTS, ws_messages

BUFFER = 2000                    # the server's --ws-max-buffered-chars
PIECE = "word " * 100            # 500 characters, about 100 tokens: the old bound let ~20 of them wait
AUTH = {"Authorization": f"Bearer {KEY}"}
XI = {"xi-api-key": KEY}
WS_NAMES = [t.name for t in WS_TRANSPORTS]
UNSPOKEN = [" ", "\u00a0", "\u200b", "\u2060\ufeff", "\u3000\t\n"]   # space, NBSP, ZWSP, joiner+BOM, ideographic


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("round5")
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--max-streams", "2", "--queue-timeout", "0",
                "--api-key", KEY, env={"MOSSRT_WS_MAX_BUFFERED_CHARS": str(BUFFER)}) as s:
        yield s


def connect(server, t, headers=None):
    import websockets

    headers = headers if headers is not None else (AUTH if t.ours else XI)
    return websockets.connect(t.url(server.base), additional_headers=headers, max_size=None, open_timeout=30)


def text_message(t, text: str, context: str = "c1") -> str:
    if t.ours:
        return json.dumps({"type": "input.text", "text": text})
    return json.dumps({"text": text, **({"context_id": context} if t.multi else {})})


def marker(t) -> str:
    """A message every protocol answers with an error of its own: what was sent before it has been handled."""
    return json.dumps({"type": "no.such.type"} if t.ours else {"text": 5})


def error_code(t, message) -> str | None:
    return t.error_code(message) if isinstance(message, dict) else None


# ---------------------------------------------------------------------------------------------- B: characters
@pytest.mark.parametrize("name", WS_NAMES)
def test_the_text_buffer_counts_characters_not_tokens(server, name):
    """500-character messages of short words (about 5 characters a token) into one turn, sent without reading:
    the buffer refuses once the characters received and not yet read by the model would pass 2,000. The
    model reads at most one id a frame (12 before its first frame): what it read is bounded by the frames
    generated meanwhile, a counter, never by a clock. The old bound counted tokens and took ~10,000
    characters."""
    t = BY_NAME[name]

    async def run() -> tuple[int, list]:
        async with connect(server, t) as w:
            opening = [json.dumps({"type": "session.update", "response_format": "pcm"})] if t.ours else \
                [text_message(t, " ")]
            for m in opening:
                await w.send(m)
            for _ in range(30):
                await w.send(text_message(t, PIECE))
            await w.send(marker(t))
            got = await ws_messages(w, lambda m: error_code(t, m) in ("unknown_type", "invalid_message"), 120)
            return 30, [error_code(t, m) for m in got if error_code(t, m)]

    before = metric(server, "mossrt_frames_generated_total")
    sent, codes = asyncio.run(asyncio.wait_for(run(), 180))
    frames = metric(server, "mossrt_frames_generated_total") - before
    assert codes[-1] in ("unknown_type", "invalid_message") and set(codes[:-1]) == {"text_buffer_full"}, codes
    accepted = (sent - len(codes[:-1])) * len(PIECE)
    read = 5 * (frames + 13)                 # characters the model can have read: at most 5 a token here
    assert BUFFER - len(PIECE) < accepted <= BUFFER + read, (accepted, frames)


# ---------------------------------------------------------------------------------------------- C: whitespace
def test_whitespace_only_text_opens_no_turn_on_our_websocket(server):
    """Space, NBSP, a zero-width space, a word joiner with a BOM: a keep-alive (no turn, no slot); the
    ``input.done`` after them finds no turn. Within a turn, whitespace is text."""
    t = BY_NAME["ws"]

    async def run() -> list:
        async with connect(server, t) as w:
            for text in UNSPOKEN:
                await w.send(text_message(t, text))
            await w.send(json.dumps({"type": "input.done"}))
            return await ws_messages(w, lambda m: error_code(t, m) is not None, 60)

    got = asyncio.run(asyncio.wait_for(run(), 90))
    types = [m.get("type") for m in got if isinstance(m, dict)]
    assert "response.created" not in types and error_code(t, got[-1]) == "no_turn", got


def test_whitespace_only_text_opens_no_turn_on_multi_stream_input(server):
    """A zero-width space (or NBSP) naming a context opens the context but no turn: its close is an isFinal
    with no audio, and no turn ended (the route's request counter is where a turn's end is counted)."""
    t = BY_NAME["el-multi-stream-input"]
    counted = "mossrt_requests_total"

    def turns() -> float:
        return metric(server, counted, endpoint=t.endpoint, status="200")

    async def run() -> list:
        async with connect(server, t) as w:
            for i, text in enumerate(UNSPOKEN):
                await w.send(json.dumps({"text": text, "context_id": f"z{i}"}))
                await w.send(json.dumps({"text": text, "context_id": f"z{i}"}))
            await w.send(json.dumps({"text": "\u200b"}))                       # no context: a keep-alive
            for i in range(len(UNSPOKEN)):
                await w.send(json.dumps({"context_id": f"z{i}", "close_context": True}))
            finals: set = set()

            def done(m) -> bool:
                if isinstance(m, dict) and m.get("isFinal"):
                    finals.add(m.get("contextId"))
                return len(finals) == len(UNSPOKEN) or error_code(t, m) is not None
            return await ws_messages(w, done, 60)

    before = turns()
    got = asyncio.run(asyncio.wait_for(run(), 90))
    assert not [m for m in got if isinstance(m, dict) and (m.get("audio") or m.get("error"))], got
    assert sorted(m["contextId"] for m in got if m.get("isFinal")) == [f"z{i}" for i in range(len(UNSPOKEN))]
    assert turns() == before


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/audio/speech", lambda text: {"model": "x", "input": text}, "openai"),
    ("/v1/text-to-speech/default", lambda text: {"text": text}, "elevenlabs"),
])
@pytest.mark.parametrize("text", UNSPOKEN[1:])
def test_whitespace_only_text_is_a_400_over_http(server, path, body, shape, text):
    r = httpx.post(server.base + path, json=body(text), headers=AUTH, timeout=60)
    code = r.json()["error"]["code"] if shape == "openai" else r.json()["detail"]["status"]
    assert (r.status_code, code) == (400, "empty_input"), r.text


def test_speakable_is_one_rule():
    from app.session.policy import speakable

    assert not any(speakable(t) for t in UNSPOKEN + ["", "\u200c\u200d", "\u2028\u2029", "\x00\x1f"])
    assert all(speakable(t) for t in ["a", " a ", "\u200ba", "3", "。", "\U0001f600", "\u00e9"])


# ---------------------------------------------------------------------------------------------- E, F
@pytest.mark.parametrize("query, param", [
    ("sort=__class__", "sort"), ("sort=name&sort_direction=sideways", "sort_direction"),
    ("page_size=0", "page_size"), ("page_size=101", "page_size"), ("page_size=abc", "page_size"),
    ("page_size=%C2%B2", "page_size"), ("page_size=" + "9" * 5000, "page_size"),
    ("next_page_token=-1", "next_page_token"), ("voice_type=robot", "voice_type"), ("category=x", "category"),
])
def test_v2_voices_refuses_parameters_elevenlabs_does_not_document(server, query, param):
    r = httpx.get(f"{server.base}/v2/voices?{query}", headers=XI, timeout=30)
    assert r.status_code == 400 and r.json()["detail"]["status"] == "invalid_value", r.text
    assert param in r.json()["detail"]["message"], r.text


def test_v2_voices_takes_the_documented_parameters(server):
    for query in ("sort=name&sort_direction=desc", "sort=created_at_unix&sort_direction=asc", "page_size=100",
                  "voice_type=default&category=premade", "page_size=1&next_page_token=0", "sort="):
        r = httpx.get(f"{server.base}/v2/voices?{query}", headers=XI, timeout=30)
        assert r.status_code == 200 and "voices" in r.json(), (query, r.text)


def test_a_shared_route_answers_in_the_shape_of_its_client(server):
    """``/v1/models``: a wrong ``xi-api-key`` (or ElevenLabs' SDK header) gets ElevenLabs' shape, as the ElevenLabs
    routes do; a wrong bearer key OpenAI's."""
    eleven = httpx.get(server.base + "/v1/models", headers={"xi-api-key": "wrong"}, timeout=30)
    sdk = httpx.get(server.base + "/v1/models", headers={"X-Fern-SDK-Name": "elevenlabs"}, timeout=30)
    openai = httpx.get(server.base + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
    for r in (eleven, sdk):
        assert r.status_code == 401 and r.json() == {"detail": {"status": "invalid_api_key",
                                                                "message": r.json()["detail"]["message"]}}, r.text
    assert openai.status_code == 401 and openai.json()["error"]["code"] == "invalid_api_key", openai.text
    assert httpx.get(server.base + "/v1/models", headers=XI, timeout=30).json()[0]["model_id"]


# ---------------------------------------------------------------------------------------------- G
@pytest.mark.parametrize("route", ["with-timestamps", "stream/with-timestamps"])
def test_normalized_alignment_is_over_the_normalized_text(server, route):
    from app.normalize import Switches, normalize

    text = "I have 3 cats"
    spoken = normalize(text, Switches()).spoken
    assert spoken != text
    r = httpx.post(f"{server.base}/v1/text-to-speech/default/{route}?output_format=pcm_24000", headers=XI,
                   json={"text": text, "apply_text_normalization": "on"}, timeout=120)
    assert r.status_code == 200, r.text
    bodies = [r.json()] if route == "with-timestamps" else [json.loads(x) for x in r.text.splitlines() if x]
    sent = "".join(c for b in bodies if b["alignment"] for c in b["alignment"]["characters"])
    read = "".join(c for b in bodies if b["normalized_alignment"] for c in b["normalized_alignment"]["characters"])
    assert (sent, read) == (text, spoken)
    for b in bodies:
        n = b["normalized_alignment"]
        if n:
            assert len(n["characters"]) == len(n["character_start_times_seconds"]) == \
                len(n["character_end_times_seconds"])
            assert n["character_start_times_seconds"] == sorted(n["character_start_times_seconds"])
    assert sum(len(base64.b64decode(b["audio_base64"])) for b in bodies) > 0


# ---------------------------------------------------------------------------------------------- D: SIGTERM
def test_sigterm_closes_open_sockets_with_the_documented_code(demo_bundle_dir, tmp_path):
    """Sockets still open when the drain ends get ``draining`` in their protocol's shape and its close code:
    4503 on ours, 1008 on ElevenLabs' (docs/errors.md), not uvicorn's 1012 without a reason."""
    import websockets

    s = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--drain-timeout", "5", "--shutdown-delay", "0")
    ours, multi = BY_NAME["ws"], BY_NAME["el-multi-stream-input"]
    opened = threading.Barrier(3, timeout=60)
    ended: dict = {}

    def hold(t, first: str | None):
        async def run():
            async with connect(s, t, headers={}) as w:
                if first is not None:
                    await w.send(first)                     # opens a context, no turn
                else:
                    await ws_messages(w, lambda m: isinstance(m, dict) and m.get("type") == "session.created")
                await asyncio.to_thread(opened.wait)
                got = await ws_messages(w, lambda m: False, 120)
                await w.wait_closed()
                return got, w.close_code
        try:
            ended[t.name] = asyncio.run(run())
        except (websockets.WebSocketException, OSError) as e:
            ended[t.name] = e

    with s:
        threads = [threading.Thread(target=hold, args=(ours, None)),
                   threading.Thread(target=hold, args=(multi, json.dumps({"text": " ", "context_id": "c1"})))]
        for th in threads:
            th.start()
        opened.wait()
        wait_for(lambda: metric(s, "mossrt_websocket_sessions") == 2, 30, "both sockets open")
        s.proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(120)
        status = s.proc.wait(timeout=120)
    got, code = ended["ws"]
    assert code == 4503 and got and got[-1]["error"]["code"] == "draining" and got[-1]["fatal"], ended
    got, code = ended[multi.name]
    assert code == 1008 and got and got[-1]["error"] == "draining", ended
    assert status == 0 and "Traceback" not in s.log(), s.log()[-3000:]


# ---------------------------------------------------------------------------------------------- A: the start race
@pytest.fixture
def inprocess(demo_bundle_dir, tmp_path):
    """The app under uvicorn in this process (one slot, a 2 s text timeout): the test holds its interleavings."""
    import uvicorn

    from app.server import create_app
    from app.settings import ServerSettings
    from engine.runtime.bundle import Bundle

    settings = ServerSettings(bundle=demo_bundle_dir, voices_dir=tmp_path / "v", max_streams=1, device="cpu",
                              queue_timeout=60, ws_text_timeout=2,
                              engine_process="off")        # in this process: the test holds its scheduler
    app = create_app(settings, Bundle(demo_bundle_dir, device="cpu"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           ws="websockets-sansio"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 60, "uvicorn started")
        assert app.state.service.wait_ready(120)
        yield app, f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def test_a_context_closed_while_its_start_waits_for_a_slot_never_starts(inprocess, monkeypatch):
    """multi-stream-input, one slot: c1 speaks while c2's text waits behind it and another stream queues for
    the slot. c1's end lets the other stream park this socket's stream and take the slot (held here until
    it is admitted), so c2's start, from c1's end, waits for a slot; c2 is closed (barge-in) then. c2 gets
    exactly one isFinal, its wait leaves the queue at once (no slot is taken for it), the slot's release
    then opens no turn for it, and c3 is served next without waiting for a text timeout."""
    import websockets

    from app.routes import elevenlabs_ws

    app, base = inprocess
    sch = app.state.service.scheduler
    model = app.state.service.model
    admitted = threading.Event()
    original = elevenlabs_ws.ElevenLabsSession.on_ended

    async def on_ended(self, out, turn):
        if self.active is not None and self.active.id == "c1":
            assert await asyncio.to_thread(admitted.wait, 60), "the other stream was never admitted"
        await original(self, out, turn)

    monkeypatch.setattr(elevenlabs_ws.ElevenLabsSession, "on_ended", on_ended)
    blocker: dict = {}

    def take_the_slot():
        h = sch.open_stream(params=model.default_sampling(greedy=True), seed=0)
        blocker["h"] = h
        h.begin_turn(wait=60)                       # queues behind c1's turn; admitted by parking the socket's stream
        admitted.set()

    def queued(n: int) -> bool:
        return sch.stats().queued == n

    async def run() -> tuple[list, int, list]:
        send = lambda w, **m: w.send(json.dumps(m))  # noqa: E731
        url = base + "/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
        async with websockets.connect(url, max_size=None, open_timeout=30) as w:
            await send(w, text=" ", context_id="c1")
            await send(w, text="Hello there, my friend.", context_id="c1")
            await send(w, text="More words for later.", context_id="c2")       # waits behind c1, no flush
            await asyncio.to_thread(wait_for, lambda: sch.stats().active == 1, 30, "c1's turn holds the slot")
            threading.Thread(target=take_the_slot, daemon=True).start()
            await asyncio.to_thread(wait_for, lambda: queued(1), 30, "the other stream queued")
            await send(w, context_id="c1", flush=True)
            await send(w, context_id="c1", close_context=True)
            first = await ws_messages(w, lambda m: m.get("isFinal") and m.get("contextId") == "c1", 120)
            await asyncio.to_thread(wait_for, lambda: admitted.is_set() and queued(1), 30, "c2's start waits")
            await send(w, context_id="c2", close_context=True)                 # barge-in while it waits
            closed = await ws_messages(w, lambda m: m.get("isFinal") and m.get("contextId") == "c2", 60)
            waiting = sch.stats().queued                                       # its wait left the queue
            blocker["h"].close()                                               # the slot is free again
            await send(w, text=" ", context_id="c3")
            await send(w, text="Last one.", context_id="c3")
            await send(w, context_id="c3", flush=True)
            await send(w, context_id="c3", close_context=True)
            rest = await ws_messages(w, lambda m: m.get("isFinal") and m.get("contextId") == "c3", 120)
            return first + closed, waiting, rest

    head, waiting, rest = asyncio.run(asyncio.wait_for(run(), 300))
    c2 = [m for m in head + rest if m.get("contextId") == "c2"]
    assert c2 == [{"isFinal": True, "contextId": "c2"}], c2
    assert waiting == 0, "the closed context's start still waited for a slot"
    assert any(m.get("audio") for m in rest) and not [m for m in rest if m.get("error")], rest
    wait_for(lambda: sch.stats().queued == 0, 30, "nothing queued")
