"""Every bound of a client session, over every transport (``transports.TRANSPORTS``): a client that stops
reading loses its stream, a turn that gets no more text gives its slot back, a reset frees the slot at once
and generation stops, a browser origin that is not allowed cannot open a socket, the key is checked before any
other work, what one client sends is bounded (request heads, ping floods and oversized frames, below the
application, included), malformed JSON gets the route's own error, and SIGTERM drains every transport with one
log line at most for a forced end, within its documented bound. A transport added later joins the list and gets
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
from service_helpers import (
    Backend,
    Server,
    assert_same_audio,
    body_of,
    metric,
    pcm16,
    raw_request,
    read_answer,
    requests_counted,
    reset,
    status_of,
    wait_for,
)
from transports import (
    BY_NAME,
    ENHANCE_YOUR_CALM,
    H2_ACK,
    H2_CONTINUATION,
    H2_DATA,
    H2_END_HEADERS,
    H2_END_STREAM,
    H2_GOAWAY,
    H2_HEADERS,
    H2_PING,
    H2_PREFACE,
    H2_SETTINGS,
    HTTP_TRANSPORTS,
    KEY,
    LONG,
    WS_TRANSPORTS,
    WYOMING,
    grpc_request_head,
    h2_frame,
    h2_frames,
    hpack_int,
    raw_upgrade,
    server_frames,
    small_buffer_socket,
    ws_messages,
    wyoming_connect,
    wyoming_error,
    wyoming_events,
    wyoming_opening,
    wyoming_send,
)

SLOT_BOUND_S = 10        # a freed slot shows in /metrics within this (generous: the machine is shared)
STALL_S, TEXT_S, IDLE_S = 2, 2, 6
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAMED_HTTP = [t.name for t in HTTP_TRANSPORTS if t.streamed]
WS_NAMES = [t.name for t in WS_TRANSPORTS]
BAD_JSON = {"a 5,000-digit integer": b'{"text": "hi", "seed": ' + b"9" * 5000 + b"}",
            "100,000-deep arrays": b"[" * 100_000 + b"]" * 100_000,
            "50,000-deep objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000}
# within the bounded server's 64 KiB WebSocket messages
BAD_JSON_WS = {"a 5,000-digit integer": BAD_JSON["a 5,000-digit integer"],
               "30,000-deep arrays": b"[" * 30_000 + b"]" * 30_000,
               "10,000-deep objects": b'{"a":' * 10_000 + b"1" + b"}" * 10_000}


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    env = {"MOSSRT_WS_IDLE_TIMEOUT": str(IDLE_S), "MOSSRT_WS_MAX_MESSAGE_BYTES": "65536",
           "MOSSRT_WS_MAX_BUFFERED_CHARS": "2000"}
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--max-streams", "3", "--queue-timeout", "0",
                "--stall-timeout", str(STALL_S), "--ws-text-timeout", str(TEXT_S), "--api-key", KEY,
                "--cors-origin", "https://app.example", env=env, wyoming=True) as s:
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
@pytest.mark.parametrize("name", STREAMED_HTTP + WS_NAMES + ["localai", WYOMING])
def test_a_client_that_stops_reading_loses_its_stream(request, name):
    """A client with a 4 KiB receive buffer that reads nothing: once the socket buffers are full the server's
    send blocks; after the stall timeout the stream ends, its slot is free and the stall is counted. LocalAI:
    a caller that takes the first replies and then no more (HTTP/2's flow-control window fills, gRPC's send
    waits) has its call cancelled after the stall timeout, and the backend is idle again."""
    if name == "localai":
        _localai_caller_that_stops_reading(request.getfixturevalue("localai"))
        return
    if name == WYOMING:
        _wyoming_reader_that_stops(request.getfixturevalue("server"))
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
@pytest.mark.parametrize("name", WS_NAMES + ["ws-empty-deltas", WYOMING])
def test_a_turn_that_gets_no_more_text_gives_its_slot_back(server, name):
    """A turn opened with a little text and never ended (no input.done, no flush), by a client that keeps
    reading: after the text timeout its text is ended for it, it speaks what it has, and once the socket
    idles (ElevenLabs: its inactivity_timeout) it closes; the slot is free. Empty deltas every half second
    (ws-empty-deltas) are no text: they do not hold the turn open."""
    if name == WYOMING:
        _wyoming_turn_without_more_text(server)
        return
    t = BY_NAME["ws" if name == "ws-empty-deltas" else name]

    async def silent_turn():
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
            return messages

    messages = asyncio.run(asyncio.wait_for(silent_turn(), 90))
    if t.ours:
        codes = [t.error_code(m) for m in messages if isinstance(m, dict)]
        assert "text_timeout" in codes, messages[-3:]
        assert messages[-1]["type"] == "response.done", messages[-1]
    else:
        assert any(isinstance(m, dict) and m.get("audio") for m in messages), "the turn spoke what it had"
        # closed by its inactivity (the server says so), not held until some other timer
        assert t.error_code(messages[-1]) == "input_timeout_exceeded", messages[-3:]
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "the slot freed")


# ---------------------------------------------------------------------------------------------- resets
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + ["localai", "localai-tts", WYOMING])
def test_a_client_that_resets_frees_the_slot_and_stops_generation(request, name):
    """A client that resets (RST) one second into a long utterance: its slot is free within SLOT_BOUND_S and
    no more frames are generated for it — a whole-body reply (/with-timestamps) as much as a streamed one.
    LocalAI: a call cancelled (HTTP/2 RST_STREAM) one second in, TTSStream and the whole-file TTS alike."""
    if name.startswith("localai"):
        _localai_call_cancelled_after_a_second(request.getfixturevalue("localai"), name == "localai-tts",
                                               request.getfixturevalue("tmp_path"))
        return
    server = request.getfixturevalue("server")
    if name == WYOMING:
        _wyoming_reset_after_a_second(server)
        return
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


@pytest.mark.parametrize("name", WS_NAMES)
def test_odd_forms_of_an_origin_compare_as_browsers_serialise_them(server, name):
    """Origins compare in RFC 6454's serialisation (scheme and host lower-case, the default port elided):
    other forms of an allowed origin open the socket; ``null``, a trailing dot, another port or scheme,
    userinfo, a path, a lookalike host and a non-http(s) page of this host get 403; two ``Origin`` headers are
    refused too (the policy refuses them; uvicorn's WebSocket layer already answers them 400)."""
    import websockets

    t, port = BY_NAME[name], server.port
    allowed = ["HTTPS://APP.EXAMPLE", "https://App.Example:443", f"http://127.0.0.1:{port}", f"HTTP://127.0.0.1:{port}"]
    refused = ["null", "https://app.example.", "https://app.example:8443", "http://app.example",
               "https://user@app.example", "https://app.example/", "https://app.example.evil.example",
               f"ftp://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}", f"http://x@127.0.0.1:{port}",
               ("https://app.example", "https://evil.example")]
    key = [("Authorization", AUTH["Authorization"])] if t.ours else [("xi-api-key", KEY)]

    async def handshake(origin) -> int:
        origins = [origin] if isinstance(origin, str) else list(origin)
        try:
            async with websockets.connect(t.url(server.base), additional_headers=key + [("Origin", o) for o in origins],
                                          open_timeout=30):
                return 101
        except websockets.InvalidStatus as e:
            return e.response.status_code

    async def every():
        return {o: await handshake(o) for o in allowed + refused}

    got = asyncio.run(every())
    two = ("https://app.example", "https://evil.example")
    assert got.pop(two) in (400, 403), "two Origin headers: refused (uvicorn's websockets layer answers 400)"
    assert got == {**{o: 101 for o in allowed}, **{o: 403 for o in refused if o != two}}, got


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
    # nothing sent: the socket is closed by the auth timeout (10 s; the 40 s recv would fail first if it were
    # kept for its inactivity_timeout), and the server says that is why
    got, code, _ = asyncio.run(keyless([]))
    assert code == 1008, (code, got)
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
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + ["localai", WYOMING])
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
    if name == WYOMING:
        _wyoming_what_one_client_sends_is_bounded(server)
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


# ---------------------------------------------------------------------------------------------- heads
HEAD_BYTES = 8 << 20          # each hostile head: 8 MiB on the wire (the bound is 64 KiB)
HEAD_RSS_MIB = 32             # the server's growth over all of one transport's hostile heads (unbounded: > 100)


def server_rss_mib(server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _hostile_head(server, first_line: bytes, pieces) -> tuple[bytes, bool]:
    """Send a head piece by piece on a raw socket while another thread reads: the answer, and whether the
    server then closed the connection (EOF or reset) on its own."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    got: dict = {}

    def reader():
        data = b""
        try:
            while piece := sock.recv(65536):
                data += piece
            got["closed"] = True
        except ConnectionResetError:
            got["closed"] = True
        except OSError:
            got["closed"] = False
        got["answer"] = data

    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    try:
        sock.sendall(first_line)
        for piece in pieces:
            sock.sendall(piece)
    except OSError:
        pass                                        # the server cut the connection: the reader has its answer
    reading.join(40)
    sock.close()
    return got.get("answer", b""), got.get("closed", False)


@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + ["localai", WYOMING])
def test_a_request_head_is_bounded(request, name):
    """1,000,000 header fields, one 8 MiB header value, an 8 MiB URL — no key sent: each is answered 431
    ``header_fields_too_large`` or 414 ``uri_too_long`` in the route's error shape (the key is never looked
    at), the server closes the connection on its own, and its memory does not grow with the head (the
    unbounded parser took +122 MiB for the 1,000,000 fields and held them; a WebSocket upgrade got no
    answer at all). LocalAI's head is a call's metadata, Wyoming's an event's header line."""
    if name == "localai":
        _localai_metadata_is_bounded(request.getfixturevalue("localai"))
        return
    server = request.getfixturevalue("server")
    if name == WYOMING:
        _wyoming_header_line_is_bounded(server)
        return
    t = BY_NAME[name]
    ws = name in WS_NAMES
    method = b"GET" if ws else b"POST"
    head = (b"Host: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n") if ws else \
        b"Host: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    line = method + b" " + t.path.encode() + b" HTTP/1.1\r\n" + head
    fields = (b"".join(b"X-%07d: v\r\n" % (i * 1000 + j) for j in range(1000)) for i in range(1000))
    mib = 1 << 20
    attacks = {"1,000,000 header fields": (line, fields, 431, "header_fields_too_large"),
               "an 8 MiB header value": (line + b"X-Big: ", (b"v" * mib for _ in range(HEAD_BYTES // mib)), 431,
                                         "header_fields_too_large"),
               "an 8 MiB URL": (method + b" " + t.path.encode() + (b"&" if b"?" in t.path.encode() else b"?")
                                + b"pad=", (b"a" * mib for _ in range(HEAD_BYTES // mib)), 414, "uri_too_long")}
    before = server_rss_mib(server)
    for what, (first, pieces, status, code) in attacks.items():
        answer, closed = _hostile_head(server, first, pieces)
        assert status_of(answer) == status, (what, answer[:300])
        body = body_of(answer)
        got = body["detail"]["status"] if t.path.startswith("/v1/text-to-speech/") else body["error"]["code"]
        assert got == code, (what, body)
        assert closed, f"{what}: the connection was not closed after the refusal"
    grown = server_rss_mib(server) - before
    assert grown < HEAD_RSS_MIB, f"the server grew by {grown:.0f} MiB over the hostile heads"
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def _stream_1_ended(frames) -> bool:
    return any(stream == 1 and flags & H2_END_STREAM for _, flags, stream, _ in frames)


def _grpc_raw_connection(b, pieces, until=_stream_1_ended, timeout: float = 30) -> list[tuple[int, int, int, bytes]]:
    """Send ``pieces`` (HTTP/2 frames after the preface) while another thread reads: the frames the backend
    sent until ``until(frames)`` (stream 1 ended), the connection ended or ``timeout`` passed."""
    sock = socket.create_connection(("127.0.0.1", b.port))
    sock.settimeout(timeout)
    got: list[bytes] = []
    ended = threading.Event()

    def reader():
        try:
            while piece := sock.recv(65536):
                got.append(piece)
                if until(h2_frames(b"".join(got))):
                    break
        except OSError:
            pass
        ended.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        sock.sendall(H2_PREFACE + h2_frame(H2_SETTINGS, 0, 0))
        for piece in pieces:
            sock.sendall(piece)
    except OSError:
        pass                                        # the backend cut the connection: the reader has its answer
    ended.wait(timeout)
    sock.close()
    return h2_frames(b"".join(got))


GRPC_VALUE_BYTES = 128 << 20      # one metadata value of a raw HTTP/2 client (the hard limit is 16 KiB)
GRPC_HEAD_RSS_MIB = 64            # half of it: buffered whole, it would cost at least its size (skipped: +1-40)


def _localai_metadata_is_bounded(b) -> None:
    """gRPC's request head is the call's metadata (an HTTP/2 header block): one 8 MiB value from a gRPC
    client, and one declared 128 MiB value sent in 16 KiB CONTINUATION frames by a raw HTTP/2 client, are
    each RESOURCE_EXHAUSTED at grpc core's hard metadata limit (16 KiB, app/localai/server.py pins it), before
    the token or the servicer is looked at; the value is skipped as it arrives, not buffered (the backend's
    memory does not grow with it), and the next call is served."""
    from app.localai import backend_pb2 as pb

    before = server_rss_mib(b)
    with pytest.raises(grpc.RpcError) as e:
        b.stub.Health(pb.HealthMessage(), metadata=[("x-big", "v" * HEAD_BYTES)], timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    declared = grpc_request_head("/backend.Backend/Health") + b"\x00" + hpack_int(5, 7) + b"x-big" + \
        hpack_int(GRPC_VALUE_BYTES, 7)
    value = (h2_frame(H2_CONTINUATION, 0, 1, b"v" * 16384) for _ in range(GRPC_VALUE_BYTES // 16384))
    frames = _grpc_raw_connection(b, [h2_frame(H2_HEADERS, H2_END_STREAM, 1, declared), *value,
                                      h2_frame(H2_CONTINUATION, H2_END_HEADERS, 1)])
    answer = [(kind, flags) for kind, flags, stream, _ in frames if stream == 1]
    assert answer and answer[0][0] == H2_HEADERS and answer[0][1] & H2_END_STREAM, \
        f"the call was not ended at once with its status (trailers only): {answer}"
    assert not any(kind == H2_DATA for kind, _ in answer), "the call got a reply"
    grown = server_rss_mib(b) - before
    assert grown < GRPC_HEAD_RSS_MIB, f"the backend grew by {grown:.0f} MiB over the hostile metadata"
    assert b.stub.Health(pb.HealthMessage(), timeout=10).message == b"OK"


WYOMING_LINE_BYTES = 32 << 20     # a header line of 32 MiB (the bound is the reader's 64 KiB line)


def _wyoming_header_line_is_bounded(server) -> None:
    """Wyoming's request head is an event's JSON header line: a 32 MiB line is refused at the reader's 64 KiB
    line limit, events declaring a 2^40-byte payload or data before a byte of it is read — each
    ``message_too_large``, then the end of the connection —, the server's memory does not grow with them,
    and the next connection is served."""
    from wyoming.tts import Synthesize

    before = server_rss_mib(server)
    line = b'{"type": "synthesize", "data": {"text": "' + b"x" * WYOMING_LINE_BYTES + b'"}}\n'
    assert _wyoming_codes(server, [], raw=line) == ["message_too_large"]
    for length in (b"payload_length", b"data_length"):
        declared = b'{"type": "audio-chunk", "%s": %d}\n' % (length, 1 << 40)
        assert _wyoming_codes(server, [], raw=declared) == ["message_too_large"], length
    grown = server_rss_mib(server) - before
    assert grown < HEAD_RSS_MIB, f"the server grew by {grown:.0f} MiB over the hostile Wyoming heads"
    assert _wyoming_codes(server, [Synthesize(text="Hello.").event()]) == [], "the server goes on"


# ---------------------------------------------------------------------------------------------- pings
PINGS = 400_000                  # 125-byte pings (50 MB) from a client that reads nothing
PING_RSS_MIB = 24                # the server's growth (unbounded: +46 MiB for 400,000, linear)


def _serves(target) -> bool:
    """Whether the server (or the LocalAI backend) answers its health check."""
    if isinstance(target, Backend):
        from app.localai import backend_pb2 as pb

        return target.stub.Health(pb.HealthMessage(), timeout=10).message == b"OK"
    return httpx.get(target.base + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("name", WS_NAMES + ["localai", WYOMING])
def test_a_ping_flood_from_a_client_that_never_reads_is_bounded(request, name):
    """A client with a 4 KiB receive buffer sends 400,000 pings and reads nothing: the pongs it does not take
    stop at the send buffer (the server's memory does not grow with the flood), and the socket is cut (a
    reset) once its unsent bytes stayed over the bound for the stall timeout and the close's grace, as a
    client that stops reading is on every other path (unbounded, the pongs piled up in the server and
    the socket stayed open). Other clients are served meanwhile. LocalAI: HTTP/2 pings without a call, cut
    by grpc core's ping policy (GOAWAY ``too_many_pings`` past 2 strikes); Wyoming: ``ping`` events, whose
    pongs the session writes under the stall timeout."""
    from websockets.frames import Frame, Opcode

    if name == "localai":
        server = request.getfixturevalue("localai")
        sock = small_buffer_socket(server.port)
        # its settings acknowledged unread (else the settings timeout, not the ping policy, would cut it)
        sock.sendall(H2_PREFACE + h2_frame(H2_SETTINGS, 0, 0) + h2_frame(H2_SETTINGS, H2_ACK, 0))
        batch = h2_frame(H2_PING, 0, 0, b"p" * 8) * 1000
    elif name == WYOMING:
        server = request.getfixturevalue("server")
        sock = small_buffer_socket(server.wyoming_port)
        batch = b'{"type": "ping", "data": {"text": "p"}}\n' * 1000
    else:
        server = request.getfixturevalue("server")
        sock, answer = raw_upgrade(server.port, BY_NAME[name])
        assert answer.startswith(b"HTTP/1.1 101"), answer[:300]
        batch = Frame(Opcode.PING, b"p" * 125).serialize(mask=True) * 1000
    sock.settimeout(5)
    before = server_rss_mib(server)
    cut = None
    try:
        for _ in range(PINGS // 1000):
            sock.sendall(batch)
    except (ConnectionResetError, BrokenPipeError) as e:
        cut = e
    except TimeoutError:
        pass                                     # the server stopped reading: not a cut yet
    grown = server_rss_mib(server) - before
    assert _serves(server)
    deadline = time.monotonic() + STALL_S + 5 + 30
    while cut is None and time.monotonic() < deadline:
        try:
            sock.sendall(batch[:1000])
            time.sleep(0.2)
        except (ConnectionResetError, BrokenPipeError) as e:
            cut = e
        except TimeoutError:
            pass
    sock.close()
    assert grown < PING_RSS_MIB, f"the server grew by {grown:.0f} MiB over the ping flood"
    assert cut is not None, "the socket of a client that reads nothing was not cut"
    if name == "localai":       # and, read, the flood is answered with grpc core's ping policy
        frames = _grpc_raw_connection(server, [h2_frame(H2_SETTINGS, H2_ACK, 0), *[batch] * 100],
                                      until=lambda frames: any(kind == H2_GOAWAY for kind, *_ in frames))
        away = [payload for kind, _, _, payload in frames if kind == H2_GOAWAY]
        assert away and away[0][4:8] == ENHANCE_YOUR_CALM and b"too_many_pings" in away[0][8:], \
            f"no GOAWAY too_many_pings after {sum(kind == H2_PING for kind, *_ in frames)} pings answered"


# ---------------------------------------------------------------------------------------------- frames
@pytest.mark.parametrize("name", WS_NAMES)
def test_an_oversized_frame_right_after_the_handshake_ends_the_session_quietly(server, name):
    """A frame header declaring 2^40 bytes as the first thing after the handshake (30 times: the close races
    the session's first message): the protocol layer closes 1009, and the session ends without an error in
    the log (it logged 'ws session failed' with a RuntimeError about a send after the close)."""
    t = BY_NAME[name]
    offset = len(server.log())
    for _ in range(30):
        sock, answer = raw_upgrade(server.port, t, rcvbuf=1 << 16)
        assert answer.startswith(b"HTTP/1.1 101"), answer[:300]
        sock.sendall(bytes([0x81, 0xFF]) + (1 << 40).to_bytes(8, "big") + b"mask" + b"x" * 64)
        data = answer.split(b"\r\n\r\n", 1)[1]
        try:
            while piece := sock.recv(65536):
                data += piece
        except ConnectionResetError:
            pass
        sock.close()
        closes = [payload for opcode, payload in server_frames(data) if opcode == 0x8]
        assert closes and int.from_bytes(closes[0][:2], "big") == 1009, server_frames(data)
    wait_for(lambda: metric(server, "mossrt_websocket_sessions") == 0, 30, "every session ended")
    log = server.log()[offset:]
    assert "session failed" not in log and "Unexpected ASGI message" not in log, log[-3000:]


# ---------------------------------------------------------------------------------------------- malformed JSON
@pytest.mark.parametrize("name", [t.name for t in HTTP_TRANSPORTS] + WS_NAMES + [WYOMING])
def test_malformed_json_gets_the_routes_own_error(server, name):
    """A 5,000-digit integer, 100,000-deep arrays, 50,000-deep objects (and, over HTTP, invalid UTF-8): 400
    ``invalid_json`` in the route's shape, never a 500; on a WebSocket a recoverable error, the socket goes on."""
    if name == WYOMING:
        _wyoming_malformed_json(server)
        return
    t = BY_NAME[name]
    if name in [h.name for h in HTTP_TRANSPORTS]:
        for what, raw in {**BAD_JSON, "invalid UTF-8": b'{"text": "\xff\xfe"}'}.items():
            r = httpx.post(server.base + t.path, content=raw, headers={"content-type": "application/json", **AUTH},
                           timeout=30)
            assert r.status_code == 400 and t.error_code(r.json()) == "invalid_json", \
                (what, r.status_code, r.text[:300])
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


@pytest.mark.parametrize("name", WS_NAMES)
def test_refused_messages_move_no_clock(server, name):
    """``"not json"`` every IDLE_S / 3 s: each is refused (a recoverable ``invalid_json``), and none moves the
    idle clock, so the idle timeout closes the socket all the same (ours 4008, ElevenLabs 1008, code
    ``idle_timeout``) instead of the client holding it for as long as it keeps sending."""
    import websockets

    t = BY_NAME[name]

    async def refused_every_few_seconds():
        async with ws_connect(server, t) as w:
            async def tick():
                while True:
                    await w.send("not json")
                    await asyncio.sleep(IDLE_S / 3)
            ticker = asyncio.create_task(tick())
            try:
                idle = (lambda m: isinstance(m, dict) and t.error_code(m) not in (None, "invalid_json"))
                messages = await ws_messages(w, idle, timeout=4 * IDLE_S + 30)
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        await asyncio.wait_for(w.recv(), 30)
            finally:
                ticker.cancel()
            return messages, closed.value.rcvd.code

    messages, code = asyncio.run(asyncio.wait_for(refused_every_few_seconds(), 6 * IDLE_S + 60))
    codes = [c for c in (t.error_code(m) for m in messages if isinstance(m, dict)) if c is not None]
    assert codes[-1] == "idle_timeout" and code == (4008 if t.ours else 1008), (codes, code)
    assert codes[:-1].count("invalid_json") >= 2 and set(codes[:-1]) == {"invalid_json"}, codes   # refused


# ---------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_drains_every_transport(demo_bundle_dir, tmp_path):
    """SIGTERM while an utterance streams on each transport: every one finishes, a new request is refused
    (503 ``draining``), the drain ends because every turn finished (the server's own log line, not the drain
    timeout firing) and the process exits 0, with no traceback. No wall-clock bound: a slower machine takes
    longer, but what is promised is that nothing is cut off."""
    s = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--max-streams", "12", "--drain-timeout", "300",
               "--shutdown-delay", "1", wyoming=True)
    text = "Hello there, this is the last thing I say before the server goes away."
    with s:
        ended: dict = {}
        first = threading.Barrier(len(HTTP_TRANSPORTS) + len(WS_TRANSPORTS) + 2, timeout=60)

        def http(t):
            body = t.body(text)
            if "max_frames" in body:        # streaming at the signal, but 32 s of audio rather than 300 s: the
                body["max_frames"] = 400    # drain is to end because every turn finished, on a slow machine too
            with httpx.stream("POST", s.base + t.path, json=body, timeout=360) as r:
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
                    got = await ws_messages(w, lambda m: isinstance(m, bytes)
                                            or (isinstance(m, dict) and m.get("audio")))
                    await asyncio.to_thread(first.wait)
                    got += await ws_messages(w, final, timeout=360)
                    return got[-1]
            ended[t.name] = asyncio.run(run())

        threads = [threading.Thread(target=http, args=(t,)) for t in HTTP_TRANSPORTS]
        threads += [threading.Thread(target=ws, args=(t,)) for t in WS_TRANSPORTS]
        threads.append(threading.Thread(target=lambda: ended.update(wyoming=_wyoming_streaming_across(s, text, first))))
        for th in threads:
            th.start()
        first.wait()
        s.proc.send_signal(signal.SIGTERM)
        refused = httpx.post(s.base + "/v1/audio/speech", json={"model": "x", "input": "Hi."}, timeout=10)
        refused_wyoming = _wyoming_codes(s, wyoming_opening("Hi."))
        for th in threads:
            th.join(360)
        status = s.proc.wait(timeout=360)
    assert all(not th.is_alive() for th in threads), ended
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    for t in HTTP_TRANSPORTS:
        assert ended[t.name][0] == 200 and ended[t.name][1] > 0, (t.name, ended[t.name])
    assert ended["ws"]["type"] == "response.done" and ended["ws"]["finish_reason"] in ("eos", "max_frames")
    assert ended["el-stream-input"]["isFinal"] and ended["el-multi-stream-input"]["isFinal"]
    assert ended["wyoming"][-2:] == ["audio-stop", "synthesize-stopped"], ended["wyoming"]
    assert refused_wyoming == ["draining"], refused_wyoming
    assert status == 0, s.log()[-3000:]
    assert "drained (all turns finished)" in s.log(), s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()[-3000:]


def test_sigterm_drains_localai(demo_bundle_dir, tmp_path):
    """SIGTERM while a TTSStream streams: the call finishes with all its audio, a new call is refused
    (UNAVAILABLE), the process exits 0, with no traceback."""
    from app.localai import backend_pb2 as pb

    text = "Hello there, this is the last thing I say before the server goes away."
    b = Backend(tmp_path / "b.log", "--grace", "60")
    with b:
        assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir)), timeout=120).success
        whole = b"".join(r.audio for r in b.stub.TTSStream(pb.TTSRequest(text=text, params={"seed": "1"}),
                                                           timeout=120))
        replies = iter(b.stub.TTSStream(pb.TTSRequest(text=text, params={"seed": "1"}), timeout=120))
        first = [next(replies), next(replies)]
        b.proc.send_signal(signal.SIGTERM)
        b.wait_log("stopping: running calls get", 30)
        with pytest.raises(grpc.RpcError) as refused:
            list(b.stub.TTSStream(pb.TTSRequest(text="Hi."), timeout=10))
        drained = b"".join(r.audio for r in first + list(replies))
        status = b.proc.wait(timeout=120)
    # refused by the backend's drain gate, not lost in a race with grpc's own stop (that came back CANCELLED)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert "the backend is stopping" in refused.value.details(), refused.value
    # all of it (the grace did not cut the call off), to the codec's chunking round-off: not bitwise, since the
    # chunking follows the caller's playback clock, which load moves
    assert_same_audio(pcm16(drained), pcm16(whole))
    assert status == 0, b.log()[-3000:]
    assert "Traceback" not in b.log(), b.log()[-3000:]


def test_sigterm_grace_ends_a_localai_call_that_outlasts_it(demo_bundle_dir, tmp_path):
    """SIGTERM with ``--grace 1`` while a TTSStream's caller takes nothing: when the grace is spent the call is
    ended (an error status for the caller, not a hang) and the process exits 0 with no traceback."""
    from app.localai import backend_pb2 as pb

    b = Backend(tmp_path / "b.log", "--grace", "1")
    with b:
        # a stall timeout longer than the wait below, so only the grace can end the call
        assert b.stub.LoadModel(pb.ModelOptions(Model=str(demo_bundle_dir), Options=["stall_timeout:600"]),
                                timeout=120).success
        replies = iter(b.stub.TTSStream(pb.TTSRequest(text=LONG * 2, params={"seed": "1", "speed": "0.25"}),
                                        timeout=300))
        next(replies), next(replies)
        b.proc.send_signal(signal.SIGTERM)
        status = b.proc.wait(timeout=120)        # the grace, not the call (minutes of audio), ends the process
        with pytest.raises(grpc.RpcError):
            for _ in replies:
                pass
    assert status == 0, b.log()[-3000:]
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


def test_the_shutdown_ends_within_its_bound(demo_bundle_dir, tmp_path):
    """SIGTERM with ``--drain-timeout 2`` while a client that reads nothing holds a stream, a header
    slow-loris and a body that never completes hold connections, our WebSocket is mid-turn and ElevenLabs
    contexts are open: the process exits 0 within the documented max(shutdown delay, drain timeout) + 3 s
    (it took 11.4 s against 8 s with a drain timeout of 5: uvicorn's 3 s wait for the request still
    reading its body, after the drain, then the interpreter's teardown), and the end logs no uvicorn error
    (its 'Cancel N running task(s)')."""
    drain = 2
    s = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--drain-timeout", str(drain),
               "--stall-timeout", "600")
    with s:
        body = {"model": "x", "input": LONG, "response_format": "pcm", "max_frames": 3750}
        stalled = raw_request(s, json.dumps(body).encode(), rcvbuf=4096)
        loris = socket.create_connection(("127.0.0.1", s.port))
        loris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        half = socket.create_connection(("127.0.0.1", s.port))
        half.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        opened = threading.Barrier(len(WS_TRANSPORTS) + 1, timeout=60)

        def ws(t):
            async def run():
                async with ws_connect(s, t, headers={}) as w:
                    for m in t.opening(LONG, end=False):
                        await w.send(m)
                    await ws_messages(w, lambda m: isinstance(m, bytes) or (isinstance(m, dict) and m.get("audio")))
                    await asyncio.to_thread(opened.wait)
                    await ws_messages(w, lambda m: False, timeout=60)
            try:
                asyncio.run(run())
            except Exception:  # noqa: BLE001 - the socket ends with the server
                pass

        threads = [threading.Thread(target=ws, args=(t,), daemon=True) for t in WS_TRANSPORTS]
        for th in threads:
            th.start()
        opened.wait()
        wait_for(lambda: metric(s, "mossrt_active_streams") == 1 + len(WS_TRANSPORTS), 30, "every stream open")
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        status = s.proc.wait(timeout=60)
        took = time.monotonic() - signalled
        for sock in (stalled, loris, half):
            sock.close()
    log = s.log()
    assert status == 0, log[-2000:]
    assert took <= drain + 3, (took, log[-3000:])
    assert "ERROR:" not in log and "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------------------------------------- Wyoming
# A Wyoming connection (Home Assistant's TCP protocol) has no key, origin or WebSocket framing; every other
# bound applies. Each refusal is an error event, then the end of the connection (as Wyoming's servers do).
def _wyoming(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _wyoming_codes(server, events, raw: bytes | None = None) -> list:
    """The error codes a fresh connection gets for ``events`` (or ``raw`` bytes), to the connection's end."""
    async def run():
        reader, writer = await wyoming_connect(server)
        if raw is not None:
            writer.write(raw)
        try:
            await wyoming_send(writer, events)
        except ConnectionError:             # refused at an earlier event: the server closed the connection
            pass
        got = await wyoming_events(reader, lambda e: e.type == "audio-stop")
        writer.close()
        return [wyoming_error(e) for e in got if wyoming_error(e)]

    return _wyoming(run())


def _wyoming_reader_that_stops(server) -> None:
    """A long synthesis asked for on a socket with a 4 KiB receive buffer that is never read."""
    from wyoming.tts import Synthesize

    before = metric(server, "mossrt_stalled_streams_total", transport=WYOMING)

    async def run():
        reader, writer = await wyoming_connect(server, small_buffer_socket(server.wyoming_port))
        await wyoming_send(writer, [Synthesize(text=LONG).event()])
        await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_stalled_streams_total",
                                                         transport=WYOMING) > before,
                                60 + STALL_S, "the stalled connection counted")
        await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S,
                                "its slot freed")
        writer.close()

    _wyoming(run())


def _wyoming_turn_without_more_text(server) -> None:
    """synthesize-start and one chunk, never a stop, read throughout: after the text timeout the text is
    ended for it and it speaks what it has (audio-stop; no synthesize-stopped, the client never stopped);
    then the idle connection is closed with ``idle_timeout``; the slot is free."""
    async def run():
        reader, writer = await wyoming_connect(server)
        await wyoming_send(writer, wyoming_opening("Hello there, this turn never ends.", end=False))
        events = await wyoming_events(reader, lambda e: False, timeout=TEXT_S + IDLE_S + 60)
        writer.close()
        return events

    events = _wyoming(run())
    types = [e.type for e in events]
    assert types[0] == "audio-start" and "audio-stop" in types and "synthesize-stopped" not in types, types[-3:]
    assert wyoming_error(events[-1]) == "idle_timeout", events[-1]
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "the slot freed")


def _wyoming_reset_after_a_second(server) -> None:
    from wyoming.tts import Synthesize

    text = " ".join([LONG] * 5)[:3900]
    sock = socket.create_connection(("127.0.0.1", server.wyoming_port))

    async def run():
        reader, writer = await wyoming_connect(server, sock)
        await wyoming_send(writer, [Synthesize(text=text).event()])
        listening = asyncio.create_task(wyoming_events(reader, lambda e: False, timeout=120))
        await asyncio.to_thread(wait_for, lambda: metric(server, "mossrt_active_streams") == 1, 30,
                                "the stream took its slot")
        await asyncio.sleep(1)
        assert await asyncio.to_thread(lambda: not frames_stopped(server, settle=0.5)), "not generating before"
        reset(sock)
        listening.cancel()

    try:
        _wyoming(run(), 60)
    except AssertionError:
        raise
    except Exception:  # noqa: BLE001 - the client's transport finds its own socket gone
        pass
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, SLOT_BOUND_S, "the reset stream's slot freed")
    assert frames_stopped(server), "frames still generated after the reset"


def _wyoming_what_one_client_sends_is_bounded(server) -> None:
    """An event over the message limit, text beyond the text buffer, a whole text over the input limit, an
    event announcing more data than the limit (refused before its bytes are read)."""
    from wyoming.tts import Synthesize

    assert _wyoming_codes(server, wyoming_opening("x" * 66_000, end=False)) == ["message_too_large"]
    assert _wyoming_codes(server, wyoming_opening("word " * 500, end=False)) == ["text_buffer_full"]
    assert _wyoming_codes(server, [Synthesize(text="word " * 1000).event()]) == ["input_too_long"]
    assert _wyoming_codes(server, [], raw=b'{"type": "synthesize", "data_length": 100000000}\n') == \
        ["message_too_large"]


def _wyoming_malformed_json(server) -> None:
    """Each malformed header line, and a data section with a 5,000-digit integer: ``invalid_json``; then a
    new connection is served."""
    from wyoming.tts import Synthesize

    for what, raw in BAD_JSON_WS.items():
        assert _wyoming_codes(server, [], raw=raw + b"\n") == ["invalid_json"], what
    data = b'{"text": "hi", "seed": ' + b"9" * 5000 + b"}"
    assert _wyoming_codes(server, [], raw=b'{"type": "synthesize", "data_length": %d}\n' % len(data) + data) == \
        ["invalid_json"]
    assert _wyoming_codes(server, [Synthesize(text="Hello.").event()]) == [], "the server goes on"


def _wyoming_streaming_across(server, text: str, first: threading.Barrier) -> list:
    """A streaming synthesis (Home Assistant's events) speaking when ``first`` is passed: the types of the
    events after it, to synthesize-stopped."""
    async def run():
        reader, writer = await wyoming_connect(server)
        await wyoming_send(writer, wyoming_opening(text))
        await wyoming_events(reader, lambda e: e.type == "audio-chunk")
        await asyncio.to_thread(first.wait)
        rest = await wyoming_events(reader, lambda e: e.type == "synthesize-stopped", timeout=120)
        writer.close()
        return [e.type for e in rest]

    return _wyoming(run(), 180)

def test_the_counts_say_how_each_request_ended(server):
    """(A guard on the suite itself: the requests above were counted under their route templates.)"""
    counted = requests_counted(server)
    assert any(endpoint == "/v1/text-to-speech/{voice_id}/stream" and n
               for (endpoint, _), n in counted.items()), counted
