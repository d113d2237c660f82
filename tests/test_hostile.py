"""A hostile client against a real ``mossrt serve`` (the demo bundle): one voice name uploaded, deleted and used
at once; a server killed while it writes voices, restarted; a request body sent a byte at a time; more idle
sockets than the process has descriptors; origins allow-listed in their odd forms (an IDN host, ``null``).
Every wait is bounded by an event or a counter, never by a wall-clock margin."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import os
import resource
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from service_helpers import Backend, Server, wait_for
from transports import LONG

BODY_TIMEOUT_S = 3
NAME = "race"
SHORT = {"model": "x", "input": "Hi.", "response_format": "pcm", "max_frames": 2}    # a speech request, its voice aside


def wav_bytes(seed: int = 0, seconds: float = 1.0) -> bytes:
    buf = io.BytesIO()
    noise = np.random.default_rng(seed).standard_normal(int(24000 * seconds)).astype(np.float32) * 0.1
    sf.write(buf, noise, 24000, format="WAV")
    return buf.getvalue()


def server_sockets(server: Server) -> int:
    """The server process's open sockets (its listener included)."""
    fds = Path(f"/proc/{server.proc.pid}/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return count


@pytest.fixture(scope="module")
def server(demo_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    # the header timeout far above every wait here: a connection that closes was closed by what is tested
    with Server(demo_bundle_dir, tmp / "v", tmp / "s.log", "--max-streams", "3", "--queue-timeout", "60",
                "--body-timeout", str(BODY_TIMEOUT_S), "--header-timeout", "600",
                "--cors-origin", "https://bücher.example", "--cors-origin", "null") as s:
        s.voices_dir = tmp / "v"
        yield s


# ---------------------------------------------------------------------------------------------- voice races
def test_one_voice_name_uploaded_deleted_and_used_at_once(server):
    """Concurrent deletes of one voice: exactly one is a 200, the others 404 (the window is narrow in one
    process; the next test opens it wide with two). Then uploads, deletes and speech requests of one name at
    once: each answer is a 200 or the clean refusal of its race (409
    ``voice_exists``, 404 ``not_found``, 400 ``voice_not_found``), never a 5xx or a ``voice_unusable`` (a
    half-read voice); the 200s add up to what is left; the folder holds whole voices only."""
    sample = wav_bytes()

    async def upload(c):
        return await c.post("/v1/audio/voices", data={"name": NAME},
                            files={"audio_sample": ("a.wav", sample, "audio/wav")})

    async def speak(c):
        return await c.post("/v1/audio/speech", json={**SHORT, "voice": NAME})

    def outcome(kind, r):
        return kind, r.status_code, (r.json()["error"]["code"] if r.status_code >= 400 else None)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as c:
            for _ in range(4):                            # one voice, 16 deletes of it at once
                vid = (await upload(c)).json()["id"]
                got = Counter(r.status_code for r in await asyncio.gather(*(c.delete(f"/v1/audio/voices/{vid}")
                                                                            for _ in range(16))))
                assert got == {200: 1, 404: 15}, got
            seen = Counter()
            for _ in range(6):                            # uploads, deletes and uses of one name at once
                jobs = [("up", upload(c)) for _ in range(3)] + [("del", c.delete(f"/v1/audio/voices/{NAME}"))
                                                                for _ in range(6)]
                jobs += [("speak", speak(c)) for _ in range(3)]
                answers = await asyncio.gather(*(j for _, j in jobs))
                seen.update(outcome(kind, r) for (kind, _), r in zip(jobs, answers))
            left = [v for v in (await c.get("/v1/audio/voices")).json()["data"] if v["name"] == NAME]
            return seen, left

    seen, left = asyncio.run(scenario())
    allowed = {("up", 200, None), ("up", 409, "voice_exists"), ("del", 200, None), ("del", 404, "not_found"),
               ("speak", 200, None), ("speak", 400, "voice_not_found")}
    assert set(seen) <= allowed, seen
    assert seen[("up", 200, None)] - seen[("del", 200, None)] == len(left) <= 1, (seen, left)
    on_disk = sorted(p.name for p in server.voices_dir.iterdir())
    assert on_disk == [v["id"] for v in left], on_disk            # no temp or trash folder, no orphan
    for v in left:
        assert {p.name for p in (server.voices_dir / v["id"]).iterdir()} >= {"codes.npy", "meta.json"}


def test_a_voice_deleted_by_another_process_is_gone_not_damaged(server, demo_bundle_dir, tmp_path):
    """Two servers sharing one voices folder (a replica, a LocalAI backend): a voice deleted by one is, to the
    other (whose index still holds it, as a request that looked it up just before the delete does), a 400
    ``voice_not_found`` to speak with and a 404 to delete again: not ``voice_unusable`` ("damaged on disk"),
    and not a second 200 for one deletion."""
    with Server(demo_bundle_dir, server.voices_dir, tmp_path / "b.log", "--max-streams", "2") as other:
        vid = httpx.post(server.base + "/v1/audio/voices", data={"name": "shared"}, timeout=120,
                         files={"audio_sample": ("a.wav", wav_bytes(7), "audio/wav")}).json()["id"]
        assert httpx.get(other.base + f"/v1/audio/voices/{vid}", timeout=30).status_code == 200   # indexed there
        assert httpx.delete(server.base + f"/v1/audio/voices/{vid}", timeout=30).status_code == 200
        r = httpx.post(other.base + "/v1/audio/speech", json={**SHORT, "voice": vid}, timeout=120)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "voice_not_found"), r.text
        r = httpx.delete(other.base + f"/v1/audio/voices/{vid}", timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), r.text


# ---------------------------------------------------------------------------------------------- killed mid-write
def test_a_server_killed_while_writing_voices_restarts_with_whole_voices(demo_bundle_dir, tmp_path):
    """SIGKILL while uploads are being written, and what a kill at each step of a write or a delete leaves
    (an empty temp folder, half a codes file, half a meta file, a delete's folder, a prefix's temp file, a
    damaged meta.json): the restarted server starts, lists only whole voices (each acknowledged upload among
    them, each one usable), and has removed the leftovers, except a temp folder another process still holds
    locked (a write in progress there)."""
    voices = tmp_path / "v"
    first = Server(demo_bundle_dir, voices, tmp_path / "a.log", "--max-streams", "2").wait_ready()
    acknowledged, stop = [], threading.Event()

    def uploader(k: int) -> None:
        with httpx.Client(base_url=first.base, timeout=60) as c:
            for i in range(1000):
                if stop.is_set():
                    return
                try:
                    r = c.post("/v1/audio/voices", data={"name": f"v{k}-{i}"},
                               files={"audio_sample": ("a.wav", wav_bytes(k * 1000 + i), "audio/wav")})
                except httpx.HTTPError:
                    return                                    # the server is gone
                if r.status_code == 200:
                    acknowledged.append(r.json()["id"])

    threads = [threading.Thread(target=uploader, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(acknowledged) >= 6, 120, "uploads acknowledged")
        first.proc.kill()                                     # SIGKILL: mid-way through whatever it was doing
        first.proc.wait(30)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        first.stop()
    real = sorted(voices.glob("voice_*/codes.npy"))[0]
    codes = real.read_bytes()
    old = time.time() - 3600                                 # long abandoned (ABANDONED_AFTER_S)
    leftovers = {".voice_00000000000000aa.tmp": {},
                 ".voice_00000000000000bb.tmp": {"codes.npy": codes[: len(codes) // 2]},
                 ".voice_00000000000000cc.tmp": {"codes.npy": codes, "meta.json": b'{"id": "voice_0000000000'},
                 ".voice_00000000000000dd.deleted": {"codes.npy": codes}}
    for folder, files in leftovers.items():
        (voices / folder).mkdir()
        for name, data in files.items():
            (voices / folder / name).write_bytes(data)
    prefix_tmp = real.parent / "prefix-kv-x.tmp.npy"
    prefix_tmp.write_bytes(b"\x93NUMPY half")
    (voices / "voice_00000000000000ee").mkdir()
    (voices / "voice_00000000000000ee" / "meta.json").write_text('{"id": "voice_00000000000000ee", "na')
    for path in [*(voices / f for f in leftovers), prefix_tmp]:
        os.utime(path, (old, old))
    busy = voices / ".voice_00000000000000ff.tmp"              # another process is writing this one
    busy.mkdir()
    os.utime(busy, (old, old))
    held = os.open(busy, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with Server(demo_bundle_dir, voices, tmp_path / "b.log", "--max-streams", "2") as s:
            listed = httpx.get(s.base + "/v1/audio/voices", timeout=30).json()["data"]
            ids = {v["id"] for v in listed}
            assert set(acknowledged) <= ids, (set(acknowledged) - ids)
            assert ids == {p.parent.name for p in voices.glob("voice_*/meta.json")} - {"voice_00000000000000ee"}
            for v in listed:
                assert httpx.get(s.base + f"/v1/audio/voices/{v['id']}", timeout=30).status_code == 200
                r = httpx.post(s.base + "/v1/audio/speech", json={**SHORT, "voice": v["id"]}, timeout=120)
                assert r.status_code == 200 and r.content, (v, r.status_code, r.text[:300])
            assert not any((voices / f).exists() for f in leftovers), sorted(p.name for p in voices.iterdir())
            assert not prefix_tmp.exists()
            assert busy.is_dir(), "a temp folder locked by a writer was removed"
    finally:
        os.close(held)


# ---------------------------------------------------------------------------------------------- slow bodies
MULTIPART_HEAD = (b'--XX\r\nContent-Disposition: form-data; name="name"\r\n\r\nslow\r\n--XX\r\n'
                  b'Content-Disposition: form-data; name="audio_sample"; filename="a.wav"\r\n'
                  b"Content-Type: audio/wav\r\n\r\nRIFF")
SLOW_BODIES = {"/v1/audio/speech": ("application/json", b'{"model": "x", "input": "'),
               "/v1/text-to-speech/default/stream": ("application/json", b'{"text": "'),
               "/v1/text-to-speech/default/with-timestamps": ("application/json", b'{"text": "'),
               "/v1/text-to-speech/default": ("application/json", b'{"text": "'),
               "/v1/audio/voices": ("multipart/form-data; boundary=XX", MULTIPART_HEAD)}


@pytest.mark.parametrize("path", list(SLOW_BODIES))
def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_body_timeout_and_its_connection_closed(server, path):
    """Headers, then a body one byte every 0.3 s: the route answers 408 ``request_timeout`` (in its own error
    shape) when ``--body-timeout`` passes, with ``Connection: close``, and closes the connection at once (before, the
    connection stayed open, its body trickling in and ignored, until the header timeout, here 600 s)."""
    ctype, start = SLOW_BODIES[path]
    before = server_sockets(server)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: 100000\r\n\r\n".encode()
                 + start)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.3):
            try:
                sock.sendall(b"a")
            except OSError:
                return

    sender = threading.Thread(target=trickle)
    sender.start()
    answer = b""
    try:
        sock.settimeout(30)                           # far below the header timeout: an EOF here is the 408's
        while True:
            try:
                piece = sock.recv(65536)
            except ConnectionResetError:          # closed, and a trickled byte then met the closed socket
                break
            if not piece:
                break
            answer += piece
    finally:
        stop.set()
        sender.join()
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)      # in the route's own shape: ElevenLabs' on its routes
    assert (error["detail"]["status"] if "text-to-speech" in path
            else error["error"]["code"]) == "request_timeout", error
    wait_for(lambda: server_sockets(server) <= before, 30, "the connection's socket freed in the server")


# ---------------------------------------------------------------------------------------------- descriptors
def test_more_idle_sockets_than_descriptors(demo_bundle_dir, tmp_path):
    """The server's descriptor limit lowered to 256, a stream running, then 400 idle connections: the stream
    keeps going, the server logs nothing (no traceback, no error line) while it has no descriptor
    left (new connections, ``/health`` too, are closed unanswered: docs/operations.md states that limit), and
    it answers again as soon as the idle sockets close."""
    with Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--max-streams", "2",
                "--header-timeout", "600", "--stall-timeout", "600") as s:
        resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
        received, stop = [0], threading.Event()

        def stream() -> None:
            with httpx.stream("POST", s.base + "/v1/audio/speech", timeout=120, json={
                    "model": "x", "input": LONG, "response_format": "pcm", "max_frames": 3750}) as r:
                for chunk in r.iter_bytes():
                    received[0] += len(chunk)
                    if stop.wait(0.02):            # read at a pace: the stream lasts the whole test
                        return

        reader = threading.Thread(target=stream)
        reader.start()
        idle, log_before = [], s.log()
        try:
            wait_for(lambda: received[0] > 0, 60, "the stream's first audio")
            for _ in range(400):                       # the listen backlog takes what accept() cannot
                idle.append(socket.create_connection(("127.0.0.1", s.port), timeout=30))
            fds = Path(f"/proc/{s.proc.pid}/fd")
            wait_for(lambda: len(list(fds.iterdir())) >= 250, 60, "the server out of descriptors")
            at_saturation = received[0]
            wait_for(lambda: received[0] > at_saturation, 60, "the running stream goes on without descriptors")
            assert s.proc.poll() is None
        finally:
            for sock in idle:
                sock.close()
            stop.set()
            reader.join(120)
        wait_for(lambda: _answers(s.base + "/health"), 60, "/health answers once the idle sockets closed")
        added = s.log()[len(log_before):]
        assert "Traceback" not in added and " ERROR " not in added, added[-3000:]


def _open_files_limit(pid: int) -> tuple[int, int]:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


@pytest.mark.parametrize("command", ["serve", "localai"])
def test_a_server_starts_with_its_soft_descriptor_limit_raised(command, demo_bundle_dir, tmp_path):
    """Started with a soft descriptor limit of 256 under a higher hard one (a common shell default is 1,024
    of 524,288), ``mossrt serve`` and ``mossrt localai`` raise the soft limit to the hard one and say so,
    so the limit of docs/operations.md is the hard one, not the shell's."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard descriptor limit here is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))      # inherited by the child, restored at once
    try:
        if command == "serve":
            proc = Server(demo_bundle_dir, tmp_path / "v", tmp_path / "s.log")
        else:
            proc = Backend(tmp_path / "s.log", "--bundle", str(demo_bundle_dir))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with proc:
        want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        assert _open_files_limit(proc.proc.pid)[0] == want
        proc.wait_log(rf"open-file limit \(RLIMIT_NOFILE\) raised from 256 to {want}", 30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------------------------- origins
def test_an_allow_listed_idn_origin_and_null_when_listed(server):
    """``--cors-origin https://bücher.example`` allows the origin a browser sends for it (punycode, with or
    without its default port) and no lookalike; ``null`` opens a socket only because it is listed."""
    import websockets

    async def handshake(origin: str) -> int:
        try:
            async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream",
                                          additional_headers={"Origin": origin}, open_timeout=30):
                return 101
        except websockets.InvalidStatus as e:
            return e.response.status_code

    async def every(origins):
        return {o: await handshake(o) for o in origins}

    got = asyncio.run(every(["https://xn--bcher-kva.example", "https://XN--BCHER-KVA.example:443", "null",
                             "https://bucher.example", "https://xn--bcher-kva.example.evil.example"]))
    assert got == {"https://xn--bcher-kva.example": 101, "https://XN--BCHER-KVA.example:443": 101, "null": 101,
                   "https://bucher.example": 403, "https://xn--bcher-kva.example.evil.example": 403}, got
