"""Every bound of a client session, over every transport (``transports.TRANSPORTS``): a client that stops
reading loses its stream, a turn that gets no more text gives its slot back, a reset frees the slot at once
and generation stops, a browser origin that is not allowed cannot open a socket, the key is checked before any
other work, what one client sends is bounded, malformed JSON gets the route's own error, and SIGTERM drains
every transport with one log line at most for a forced end. A transport added later joins the list and gets
every bound here. Each test runs a real ``mossrt serve`` (or ``mossrt localai``) on the demo bundle, whose
random weights never end a turn early, so a long text is a long stream; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import grpc
import httpx
import pytest

from service_helpers import (Backend, Server, body_of, metric, raw_request, read_answer, requests_counted, reset,
                             status_of, wait_for)
from transports import (BY_NAME, HTTP_TRANSPORTS, KEY, LONG, WS_TRANSPORTS, small_buffer_socket, ws_messages)

SLOT_BOUND_S = 10        # a freed slot shows in /metrics within this (generous: the machine is shared)
STALL_S, TEXT_S, IDLE_S = 2, 2, 6
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAMED_HTTP = [t.name for t in HTTP_TRANSPORTS if t.streamed]
WS_NAMES = [t.name for t in WS_TRANSPORTS]
BAD_JSON = {"a 5,000-digit integer": b'{"text": "hi", "seed": ' + b"9" * 5000 + b"}",
            "100,000-deep arrays": b"[" * 100_000 + b"]" * 100_000,
            "50,000-deep objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000}
# within the bounded server's 64 KiB WebSocket messages
BAD_JSON_WS = {"a 5,000-digit integer": BAD_JSON["a 5,000-digit integer"], "30,000-deep arrays": b"[" * 30_000 + b"]" * 30_000,
               "10,000-deep objects": b'{"a":' * 10_000 + b"1" + b"}" * 10_000}


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    env = {"MOSSRT_WS_IDLE_TIMEOUT": str(IDLE_S), "MOSSRT_WS_MAX_MESSAGE_BYTES": "65536",
           "MOSSRT_WS_MAX_BUFFERED_CHARS": "2000"}
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--max-streams", "3", "--queue-timeout", "0",
                "--stall-timeout", str(STALL_S), "--ws-text-timeout", str(TEXT_S), "--api-key", KEY,
                "--cors-origin", "https://app.example", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def localai(demo_bundle_dir, tmp_path_factory):
    """``mossrt localai`` with the demo bundle loaded and the suite's stall timeout."""
    from app.localai import backend_pb2 as pb

    with Backend(tmp_path_factory.mktemp("localai") / "b.log") as b:
        assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir), Options=[f"stall_timeout:{STALL_S}"]),
                                timeout=120).success
        yield b


def localai_generating(b) -> bool:
    """Whether the backend has a stream generating (Status BUSY), as LocalAI itself asks."""
    from app.localai import backend_pb2 as pb

    return b.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.BUSY


@pytest.fixture(autouse=True)
def no_stream_left(request):
    """Every test leaves the server as it found it: no stream holds a slot."""
    yield
    if "server" in request.fixturenames:
        s = request.getfixturevalue("server")
        wait_for(lambda: metric(s, "mossrt_active_streams") == 0, 30, "every slot free after the test")
    if "localai" in request.fixturenames:
        b = request.getfixturevalue("localai")
        wait_for(lambda: not localai_generating(b), 30, "no LocalAI stream after the test")


def ws_connect(server, t, *, sock=None, headers=AUTH, query="", **kw):
    import websockets

    headers = dict(headers)
    if not t.ours and "Authorization" in headers:          # ElevenLabs' clients send xi-api-key
        headers = {"xi-api-key": headers.pop("Authorization").split()[-1], **headers}
    return websockets.connect(t.url(server.base, query), sock=sock, additional_headers=headers, max_size=None,
                              open_timeout=30, **kw)


async def next_error(w, t) -> str:
    """The code of the next error message on ``w`` (other messages skipped)."""
    got = await ws_messages(w, lambda m: isinstance(m, dict) and t.error_code(m) is not None)
    assert got and isinstance(got[-1], dict) and t.error_code(got[-1]), got[-3:]
    return t.error_code(got[-1])


def _drain(sock, stop: threading.Event) -> None:
    """Read a socket until ``stop`` (then it can be reset: a close while another thread reads sends nothing)."""
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            if not sock.recv(65536):
                return
        except TimeoutError:
            continue
        except OSError:
            return


def frames_stopped(server, settle: float = 1.0) -> bool:
    """Generation has stopped: the frame counter does not move for ``settle`` s."""
    before = metric(server, "mossrt_frames_generated_total")
    time.sleep(settle)
    return metric(server, "mossrt_frames_generated_total") == before


# ---------------------------------------------------------------------------------------------- stalls
@pytest.mark.parametrize("name", STREAMED_HTTP + WS_NAMES + ["localai"])
def test_a_client_that_stops_reading_loses_its_stream(request, name):
    """A client with a 4 KiB receive buffer that reads nothing: once the socket buffers are full the server's
    send blocks; after the stall timeout the stream ends, its slot is free and the stall is counted. LocalAI:
    a caller that takes the first replies and then no more (HTTP/2's flow-control window fills, gRPC's send
    waits) has its call cancelled after the stall timeout, and the backend is idle again."""
    if name == "localai":
        _localai_caller_that_stops_reading(request.getfixturevalue("localai"))
        return
    server = request.getfixturevalue("server")
    t = BY_NAME[name]
    before = metric(server, "mossrt_stalled_streams_total", transport=t.label)
    if name in STREAMED_HTTP:
        sock = raw_request(server, json.dumps(t.body()).encode(), path=t.path, rcvbuf=4096, headers=AUTH)
        try:
            wait_for(lambda: metric(server, "mossrt_stalled_streams_total", transport=t.label) > before,
                     60 + STALL_S, "the stalled stream counted")
            wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "its slot freed")
        finally:
            sock.close()
        return

    async def reader_that_stops():
        async with ws_connect(server, t, sock=small_buffer_socket(server.port), max_queue=1) as w:
            for m in t.opening(LONG):
                await w.send(m)
            await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_stalled_streams_total",
                                                             transport=t.label) > before,
                                    60 + STALL_S, "the stalled session counted")
            await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S,
                                    "its slot freed")

    asyncio.run(asyncio.wait_for(reader_that_stops(), 120))


def _localai_caller_that_stops_reading(b) -> None:
    from app.localai import backend_pb2 as pb
    from app.localai import backend_pb2_grpc as pb_grpc

    # without BDP probing the window stays at its initial 64 KiB: about 0.7 s of audio left unread fills it
    with grpc.insecure_channel(b.addr, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = pb_grpc.BackendStub(channel).TTSStream(pb.TTSRequest(text=LONG), timeout=120)
        replies = iter(call)
        assert json.loads(next(replies).message) == {"sample_rate": 24000}
        assert next(replies).audio
        wait_for(lambda: b.log().count("took no audio") > 0, 60 + STALL_S, "the stalled call cancelled")
        wait_for(lambda: not localai_generating(b), SLOT_BOUND_S, "the backend idle again")
        with pytest.raises(grpc.RpcError) as ended:
            for _ in replies:
                pass
        assert ended.value.code() == grpc.StatusCode.CANCELLED


# ---------------------------------------------------------------------------------------------- the text clock
@pytest.mark.parametrize("name", WS_NAMES + ["ws-empty-deltas"])
def test_a_turn_that_gets_no_more_text_gives_its_slot_back(server, name):
    """A turn opened with a little text and never ended (no input.done, no flush), by a client that keeps
    reading: after the text timeout its text is ended for it, it speaks what it has, and once the socket
    idles (ElevenLabs: its inactivity_timeout) it closes; the slot is free. Empty deltas every half second
    (ws-empty-deltas) are no text: they do not hold the turn open."""
    t = BY_NAME["ws" if name == "ws-empty-deltas" else name]

    async def silent_turn():
        started = time.monotonic()
        async with ws_connect(server, t, query="" if t.ours else "inactivity_timeout=2") as w:
            for m in t.opening("Hello there, this turn never ends.", end=False):
                await w.send(m)
            ticker = None
            if name == "ws-empty-deltas":
                async def tick():
                    while True:
                        await asyncio.sleep(0.5)
                        await w.send(json.dumps({"type": "input.text", "text": ""}))
                ticker = asyncio.create_task(tick())
            done = (lambda m: isinstance(m, dict) and m.get("type") == "response.done") if t.ours else \
                (lambda m: False)
            messages = await ws_messages(w, done, timeout=TEXT_S + IDLE_S + 30)
            if ticker is not None:
                ticker.cancel()
            return messages, time.monotonic() - started

    messages, took = asyncio.run(asyncio.wait_for(silent_turn(), 90))
    if t.ours:
        codes = [t.error_code(m) for m in messages if isinstance(m, dict)]
        assert "text_timeout" in codes, messages[-3:]
        assert messages[-1]["type"] == "response.done", messages[-1]
    else:
        assert any(isinstance(m, dict) and m.get("audio") for m in messages), "the turn spoke what it had"
        assert took < TEXT_S + 2 + 20, took                  # closed by its inactivity, not held
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "the slot freed")


# ---------------------------------------------------------------------------------------------- resets
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + ["localai", "localai-tts"])
def test_a_client_that_resets_frees_the_slot_and_stops_generation(request, name):
    """A client that resets (RST) one second into a long utterance: its slot is free within SLOT_BOUND_S and
    no more frames are generated for it — a whole-body reply (/with-timestamps) as much as a streamed one.
    LocalAI: a call cancelled (HTTP/2 RST_STREAM) one second in, TTSStream and the whole-file TTS alike."""
    if name.startswith("localai"):
        _localai_call_cancelled_after_a_second(request.getfixturevalue("localai"), name == "localai-tts",
                                               request.getfixturevalue("tmp_path"))
        return
    server = request.getfixturevalue("server")
    t = BY_NAME[name]
    # still generating long after the reset (within the input limit, and the WebSockets' 2,000-character buffer)
    text = " ".join([LONG] * 5)[:3900 if name in [h.name for h in HTTP_TRANSPORTS] else 1900]
    alive = lambda: not frames_stopped(server, settle=0.5)
    if name in [h.name for h in HTTP_TRANSPORTS]:
        sock = raw_request(server, json.dumps(t.body(text)).encode(), path=t.path, headers=AUTH)
        stop = threading.Event()
        reading = threading.Thread(target=_drain, args=(sock, stop), daemon=True)     # a client that listens
        reading.start()
        wait_for(lambda: metric(server, "mossrt_active_streams") == 1, 30, "the stream took its slot")
        time.sleep(1)
        assert alive(), "the stream was not generating before the reset"
        stop.set()
        reading.join(5)
        reset(sock)
    else:
        async def reset_after_a_second():
            sock = socket.create_connection(("127.0.0.1", server.port))
            async with ws_connect(server, t, sock=sock) as w:
                for m in t.opening(text):
                    await w.send(m)
                listening = asyncio.create_task(ws_messages(w, lambda m: False, timeout=120))
                await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_active_streams") == 1, 30,
                                        "the stream took its slot")
                await asyncio.sleep(1)
                assert await asyncio.to_thread(alive), "the stream was not generating before the reset"
                reset(sock)
                listening.cancel()

        try:
            asyncio.run(asyncio.wait_for(reset_after_a_second(), 60))
        except AssertionError:
            raise
        except Exception:  # noqa: BLE001 - the client library finds its own socket gone
            pass
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "the reset stream's slot freed")
    assert frames_stopped(server), "frames still generated after the reset"


def _localai_call_cancelled_after_a_second(b, whole: bool, tmp) -> None:
    from app.localai import backend_pb2 as pb

    text = " ".join([LONG] * 5)[:3900]
    if whole:
        call = b.stub.TTS.future(pb.TTSRequest(text=text, dst=str(tmp / "cancelled.wav")), timeout=120)
    else:
        call = b.stub.TTSStream(pb.TTSRequest(text=text), timeout=120)
        def listen():                       # a caller that takes every reply
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass

        threading.Thread(target=listen, daemon=True).start()
    wait_for(lambda: localai_generating(b), 30, "the stream took its slot")
    time.sleep(1)
    assert localai_generating(b), "the stream was not generating before the cancel"
    call.cancel()
    wait_for(lambda: not localai_generating(b), SLOT_BOUND_S, "the cancelled stream's slot freed")
    time.sleep(1)
    assert not localai_generating(b), "generating again after the cancel"
    assert not (tmp / "cancelled.wav").exists(), "a cancelled TTS wrote its file"


# ---------------------------------------------------------------------------------------------- origin
@pytest.mark.parametrize("name", WS_NAMES)
def test_a_browser_origin_not_allowed_cannot_open_a_socket(server, name):
    import websockets

    t = BY_NAME[name]

    async def first(origin):
        async with ws_connect(server, t, origin=origin) as w:
            if t.ours:
                return json.loads(await asyncio.wait_for(w.recv(), 30))["type"]
            for m in t.opening("Hi.", end=True):
                await w.send(m)
            return "accepted" if (await asyncio.wait_for(w.recv(), 60)) else None

    with pytest.raises(websockets.InvalidStatus) as refused:
        asyncio.run(first("https://evil.example"))
    assert refused.value.response.status_code == 403
    assert asyncio.run(first("https://app.example")) in ("session.created", "accepted")


# ---------------------------------------------------------------------------------------------- keys
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES)
def test_the_key_is_checked_before_any_other_work(server, name):
    """Without a key nothing else happens: no voice is looked up (an unknown voice is not told apart), no
    body or format is read, no slot is taken, and the refusal is in the transport's own shape."""
    t = BY_NAME[name]
    if name in [h.name for h in HTTP_TRANSPORTS]:
        path = t.path.replace("/default/", "/no-such-voice/").replace("pcm_24000", "bogus")
        r = httpx.post(server.base + path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401 and t.error_code(r.json()) == "invalid_api_key", r.text
        return
    import websockets

    async def keyless(messages, query="inactivity_timeout=3600", path_voice="no-such-voice"):
        url = t.url(server.base, query).replace("/default/", f"/{path_voice}/").replace("pcm_24000", "bogus")
        got = []
        started = time.monotonic()
        try:
            async with websockets.connect(url, open_timeout=30) as w:
                for m in messages:
                    await w.send(m)
                while True:
                    got.append(await asyncio.wait_for(w.recv(), 40))
        except websockets.ConnectionClosed as e:
            return got, e.rcvd.code if e.rcvd else None, time.monotonic() - started

    if t.ours:
        got, code, _ = asyncio.run(keyless([]))
        assert code == 4001 and json.loads(got[0])["error"]["code"] == "invalid_api_key", got
        return
    # nothing sent: the socket is closed by the auth timeout (10 s), not kept for its inactivity_timeout
    got, code, took = asyncio.run(keyless([]))
    assert code == 1008 and took < 15, (code, took)
    assert [json.loads(g)["error"] for g in got] == ["auth_timeout"], got
    # a message without the key is the end, not a recoverable error; the voice and format are never looked at
    got, code, _ = asyncio.run(keyless([json.dumps({"text": " ", "bogus": 1})]))
    assert code == 1008 and [json.loads(g)["error"] for g in got] == ["invalid_api_key"], got
    # the key in the first message, with or without "Bearer ": accepted (the default voice, a valid format)
    for value in (f"Bearer {KEY}", KEY):
        async def keyed():
            async with websockets.connect(t.url(server.base), open_timeout=30) as w:
                first = {"text": " ", "authorization": value, **({"context_id": "c1"} if t.multi else {})}
                await w.send(json.dumps(first))
                for m in t.opening("Hello.", end=True)[1:]:
                    await w.send(m)
                return json.loads(await asyncio.wait_for(w.recv(), 60))

        assert "audio" in asyncio.run(keyed()), value


def test_localai_takes_its_token_before_any_other_work(demo_bundle_dir, tmp_path):
    from app.localai import backend_pb2 as pb

    token = "localai-token-0123456789"
    with Backend(tmp_path / "b.log", env={"LOCALAI_GRPC_AUTH_TOKEN": token}) as b:
        meta = [("authorization", f"Bearer {token}")]
        assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir)), metadata=meta, timeout=120).success
        with pytest.raises(grpc.RpcError) as e:
            list(b.stub.TTSStream(pb.TTSRequest(text="Hi.", voice="no-such-voice"), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + ["localai"])
def test_what_one_client_sends_is_bounded(server, name, demo_bundle_dir, tmp_path):
    """HTTP: a body over --max-body-bytes is a 413 before it is parsed. WebSocket: a message over the message
    limit, text beyond the socket's text buffer and (ElevenLabs multi-context) a sixth open context are
    recoverable errors. LocalAI: text over the limit is INVALID_ARGUMENT."""
    if name == "localai":
        from app.localai import backend_pb2 as pb

        with Backend(tmp_path / "b.log") as b:
            assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir), Options=["max_input_chars:100"]),
                                    timeout=120).success
            with pytest.raises(grpc.RpcError) as e:
                list(b.stub.TTSStream(pb.TTSRequest(text="x" * 200), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "100" in e.value.details()
        return
    t = BY_NAME[name]
    if name in [h.name for h in HTTP_TRANSPORTS]:
        big = json.dumps(t.body("x " * (1 << 20))).encode()            # 2 MiB over the 1 MiB limit
        sock = raw_request(server, big, path=t.path, headers=AUTH)
        answer = read_answer(sock)
        sock.close()
        assert status_of(answer) == 413 and t.error_code(body_of(answer)) == "request_too_large", answer[:300]
        return

    async def oversize():
        async with ws_connect(server, t) as w:
            codes = []
            opening = t.opening("Hi.", end=False)
            for m in opening[:-1]:
                await w.send(m)
            huge = json.dumps({"type": "input.text", "text": "x" * 66_000} if t.ours else {"text": "x" * 66_000})
            await w.send(huge)       # over the 64 KiB message limit (+4 KiB: closed by the protocol layer)
            codes.append(await next_error(w, t))
            over = "word " * 500                                          # 2,500 characters: over the 2,000 buffer
            msg = {"type": "input.text", "text": over} if t.ours else {"text": over, **({"context_id": "c1"}
                                                                                       if t.multi else {})}
            await w.send(json.dumps(msg))
            codes.append(await next_error(w, t))
            if t.multi:
                for i in range(2, 7):
                    await w.send(json.dumps({"text": " ", "context_id": f"c{i}"}))
                    await w.send(json.dumps({"text": "Hi.", "context_id": f"c{i}"}))
                codes.append(await next_error(w, t))
            return codes

    codes = asyncio.run(asyncio.wait_for(oversize(), 60))
    assert codes[:2] == ["message_too_large", "text_buffer_full"], codes
    if t.multi:
        assert codes[2] == "too_many_contexts", codes


# ---------------------------------------------------------------------------------------------- malformed JSON
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES)
def test_malformed_json_gets_the_routes_own_error(server, name):
    """A 5,000-digit integer, 100,000-deep arrays, 50,000-deep objects (and, over HTTP, invalid UTF-8): 400
    ``invalid_json`` in the route's shape, never a 500; on a WebSocket a recoverable error, the socket goes on."""
    t = BY_NAME[name]
    if name in [h.name for h in HTTP_TRANSPORTS]:
        for what, raw in {**BAD_JSON, "invalid UTF-8": b'{"text": "\xff\xfe"}'}.items():
            r = httpx.post(server.base + t.path, content=raw, headers={"content-type": "application/json", **AUTH},
                           timeout=30)
            assert r.status_code == 400 and t.error_code(r.json()) == "invalid_json", (what, r.status_code, r.text[:300])
        return

    async def malformed():
        async with ws_connect(server, t) as w:
            codes = []
            for raw in BAD_JSON_WS.values():
                await w.send(raw.decode())
                codes.append(await next_error(w, t))
            for m in t.opening("Hello.", end=True):
                await w.send(m)
            spoken = await ws_messages(w, lambda m: isinstance(m, bytes) or (isinstance(m, dict) and m.get("audio")))
            return codes, spoken

    codes, spoken = asyncio.run(asyncio.wait_for(malformed(), 60))
    assert codes == ["invalid_json"] * 3, codes
    assert spoken, "the socket went on"


# ---------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_drains_every_transport(demo_bundle_dir, tmp_path):
    """SIGTERM while an utterance streams on each transport: every one finishes, a new request is refused
    (503 ``draining``), the process exits 0 within the drain timeout and the flush, with no traceback."""
    s = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--max-streams", "8", "--drain-timeout", "60",
               "--shutdown-delay", "1")
    text = "Hello there, this is the last thing I say before the server goes away."
    with s:
        ended: dict = {}
        first = threading.Barrier(len(HTTP_TRANSPORTS) + len(WS_TRANSPORTS) + 1, timeout=60)

        def http(t):
            with httpx.stream("POST", s.base + t.path, json=t.body(text), timeout=120) as r:
                it = r.iter_bytes()
                got = next(it, b"") if t.streamed else b""
                first.wait()
                ended[t.name] = (r.status_code, len(got + b"".join(it)))

        def ws(t):
            async def run():
                async with ws_connect(s, t, headers={}) as w:
                    for m in t.opening(text):
                        await w.send(m)
                    final = (lambda m: isinstance(m, dict) and m.get("type") == "response.done") if t.ours else \
                        (lambda m: isinstance(m, dict) and m.get("isFinal"))
                    got = await ws_messages(w, lambda m: isinstance(m, bytes) or (isinstance(m, dict) and m.get("audio")))
                    await asyncio.to_thread(first.wait)
                    got += await ws_messages(w, final, timeout=120)
                    return got[-1]
            ended[t.name] = asyncio.run(run())

        threads = [threading.Thread(target=http, args=(t,)) for t in HTTP_TRANSPORTS]
        threads += [threading.Thread(target=ws, args=(t,)) for t in WS_TRANSPORTS]
        for th in threads:
            th.start()
        first.wait()
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        refused = httpx.post(s.base + "/v1/audio/speech", json={"model": "x", "input": "Hi."}, timeout=10)
        for th in threads:
            th.join(120)
        status = s.proc.wait(timeout=60 + 10)
        took = time.monotonic() - signalled
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    for t in HTTP_TRANSPORTS:
        assert ended[t.name][0] == 200 and ended[t.name][1] > 0, (t.name, ended[t.name])
    assert ended["ws"]["type"] == "response.done" and ended["ws"]["finish_reason"] in ("eos", "max_frames")
    assert ended["el-stream-input"]["isFinal"] and ended["el-multi-stream-input"]["isFinal"]
    assert status == 0 and took < 60, (status, took)
    assert "Traceback" not in s.log(), s.log()[-3000:]


def test_sigterm_drains_localai(demo_bundle_dir, tmp_path):
    """SIGTERM while a TTSStream streams: the call finishes with all its audio, a new call is refused
    (UNAVAILABLE), the process exits 0 within the grace, with no traceback."""
    from app.localai import backend_pb2 as pb

    text = "Hello there, this is the last thing I say before the server goes away."
    b = Backend(tmp_path / "b.log", "--grace", "60")
    with b:
        assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir)), timeout=120).success
        whole = b"".join(r.audio for r in b.stub.TTSStream(pb.TTSRequest(text=text, params={"seed": "1"}),
                                                           timeout=120))
        replies = iter(b.stub.TTSStream(pb.TTSRequest(text=text, params={"seed": "1"}), timeout=120))
        first = [next(replies), next(replies)]
        signalled = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        b.wait_log("stopping: running calls get", 30)
        with pytest.raises(grpc.RpcError) as refused:
            list(b.stub.TTSStream(pb.TTSRequest(text="Hi."), timeout=10))
        drained = b"".join(r.audio for r in first + list(replies))
        status = b.proc.wait(timeout=70)
        took = time.monotonic() - signalled
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert drained == whole, (len(drained), len(whole))
    assert status == 0 and took < 60, (status, took)
    assert "Traceback" not in b.log(), b.log()[-3000:]


def test_a_forced_end_of_the_drain_is_one_log_line(demo_bundle_dir, tmp_path):
    """SIGTERM with a short drain timeout while a slow reader still takes a long stream: when the time is up
    the response is cut off with one warning line, not uvicorn's 'Exception in ASGI application' traceback;
    the process exits 0."""
    s = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--drain-timeout", "2", "--stall-timeout", "600")
    with s:
        body = {"model": "x", "input": LONG * 2, "response_format": "pcm", "speed": 0.25, "max_frames": 3750}
        sock = raw_request(s, json.dumps(body).encode(), rcvbuf=2048)
        wait_for(lambda: metric(s, "mossrt_active_streams") == 1, 30, "the stream took its slot")
        stop = threading.Event()

        def slow_reader():                    # about 20 KB/s
            while not stop.is_set():
                try:
                    if not sock.recv(2048):
                        return
                except OSError:
                    return
                time.sleep(0.1)

        reader = threading.Thread(target=slow_reader)
        reader.start()
        time.sleep(1)
        s.proc.send_signal(signal.SIGTERM)
        status = s.proc.wait(timeout=60)
        stop.set()
        reader.join(10)
        sock.close()
    log = s.log()
    assert status == 0, log[-2000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_the_counts_say_how_each_request_ended(server):
    """(A guard on the suite itself: the requests above were counted under their route templates.)"""
    counted = requests_counted(server)
    assert any(endpoint == "/v1/text-to-speech/{voice_id}/stream" and n for (endpoint, _), n in counted.items()), counted
