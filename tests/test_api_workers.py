"""``mossrt serve --engine-process on --api-workers 2``: two API processes on one listening socket share one
engine core, against a real server. Which worker takes a new connection is the kernel's choice, so each
property is asserted over many fresh connections (both workers are seen answering first): the WebSocket
session bound and the voices hold across workers, one scrape counts every worker's requests, a killed
worker's stream leaves its slot at once and the worker is replaced; SIGTERM stops every process (status 0),
the core's death ends them all (status 70)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from service_helpers import Server, metric, wait_for

CORE_MODULE = "engine.core"
WORKER_MODULE = "mossrt.api_worker"
TRIES = 40           # fresh connections per property: both workers take some (asserted)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def processes(server: Server, module: str) -> list[int]:
    found = []
    for c in children(server.proc.pid):
        try:
            if module in Path(f"/proc/{c}/cmdline").read_text():
                found.append(c)
        except FileNotFoundError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def health_pid(server: Server) -> int:
    with httpx.Client() as fresh:                  # a new connection: either worker may take it
        return int(fresh.get(server.base + "/health", timeout=30).json()["pid"])


def start(bundle: Path, tmp: Path, name: str, *flags: str, wyoming: bool = False) -> Server:
    return Server(bundle, tmp / "voices", tmp / f"{name}.log", "--engine-process", "on", "--api-workers", "2",
                  *flags, wyoming=wyoming)


@pytest.fixture(scope="module")
def server(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    with start(full_bundle_dir, tmp, "serve", "--ws-max-sessions", "1", "--max-streams", "2", wyoming=True) as s:
        yield s


def test_wyoming_is_served_by_one_worker_on_the_supervisors_socket(server):
    """The supervisor binds the Wyoming port (open as long as serve is), worker 0 serves it: a synthesis
    over Wyoming speaks, and only one worker holds the port."""
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    async def speak() -> list[str]:
        async with AsyncTcpClient("127.0.0.1", server.wyoming_port, connect_timeout=30) as c:
            await c.write_event(Synthesize(text="Over Wyoming.").event())
            kinds = []
            while not kinds or kinds[-1] != "audio-stop":
                event = await asyncio.wait_for(c.read_event(), 120)
                assert event is not None and event.type != "error", event
                kinds.append(event.type)
            return kinds

    kinds = asyncio.run(speak())
    assert kinds[0] == "audio-start" and "audio-chunk" in kinds
    assert sum("API worker 0" in line for line in server.log().splitlines()) >= 1


def test_two_workers_answer_on_one_port_and_share_one_core(server):
    workers = processes(server, WORKER_MODULE)
    assert len(workers) == 2 and len(processes(server, CORE_MODULE)) == 1
    seen = {health_pid(server) for _ in range(TRIES)}
    assert seen == set(workers), "both workers take connections on the one port"
    with httpx.Client() as c:                      # one connection: one worker
        assert c.get(server.base + "/ready").json()["status"] == "ready"
    body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "input": "Either worker, one voice.",
            "seed": 3}
    outs = {httpx.post(server.base + "/v1/audio/speech", json=body, timeout=120).content for _ in range(6)}
    assert len(outs) == 1 and len(next(iter(outs))) > 0, "every worker's audio is the core's, byte for byte"


def test_the_websocket_session_bound_holds_across_workers(server):
    import websockets

    async def session_refused() -> bool:
        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream") as w:
            msg = json.loads(await asyncio.wait_for(w.recv(), 60))
            return msg["type"] == "error" and msg["error"]["code"] == "too_many_sessions"

    async def run() -> list[bool]:
        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream") as held:
            assert json.loads(await held.recv())["type"] == "session.created"
            refusals = [await session_refused() for _ in range(TRIES // 4)]
        return refusals

    assert all(asyncio.run(run())), "--ws-max-sessions 1 over both workers: every other session is refused"
    wait_for(lambda: metric(server, "mossrt_websocket_sessions") == 0, 30, "the held session closed")

    async def again() -> str:
        async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream") as w:
            return str(json.loads(await w.recv())["type"])

    assert asyncio.run(again()) == "session.created", "its close made room, whichever worker held it"


def test_a_voice_added_through_one_worker_is_spoken_by_every_worker(server):
    t = np.arange(24000) / 24000
    wav = io.BytesIO()
    sf.write(wav, 0.3 * np.sin(2 * np.pi * 220 * t), 24000, format="WAV")
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": "shared"},
                   files={"audio_sample": ("ref.wav", wav.getvalue(), "audio/wav")}, timeout=120)
    assert r.status_code == 200, r.text
    voice = r.json()["id"]
    for _ in range(TRIES // 4):
        names = [v["name"] for v in httpx.get(server.base + "/v1/audio/voices", timeout=30).json()["voices"]]
        assert "shared" in names
    body = {"model": "tts-1", "voice": voice, "response_format": "pcm", "input": "A voice for all.", "seed": 1}
    outs = {httpx.post(server.base + "/v1/audio/speech", json=body, timeout=120).content for _ in range(4)}
    assert len(outs) == 1


def test_one_scrape_counts_every_workers_requests(server):
    def spoken() -> float:
        return metric(server, "mossrt_requests_total", endpoint="/v1/audio/speech", status="200")

    before = spoken()
    body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "input": "Count me.", "greedy": True}
    pids = set()
    for _ in range(8):
        with httpx.Client() as c:
            pids.add(int(c.get(server.base + "/health").json()["pid"]))
            assert c.post(server.base + "/v1/audio/speech", json=body, timeout=120).status_code == 200
    assert {spoken() for _ in range(TRIES // 4)} == {before + 8}, f"summed over workers {pids}"
    assert {metric(server, "mossrt_capacity_streams") for _ in range(4)} == {2.0}, "the core's gauge, not a sum"


def worker_holding(server: Server, client_port: int) -> int:
    """The worker whose socket is the server end of our connection from ``client_port`` (/proc/net/tcp's
    inode, found among each worker's file descriptors)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
            if local == server.port and remote == client_port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in processes(server, WORKER_MODULE):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except FileNotFoundError:
                pass
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def test_a_killed_worker_frees_its_stream_and_session_at_once_and_is_replaced(server):
    import websockets

    ws_url = server.base.replace("http", "ws") + "/v1/audio/speech/stream"

    async def hold_then_kill() -> int:
        async with websockets.connect(ws_url, max_size=None) as w:
            assert json.loads(await w.recv())["type"] == "session.created"
            await w.send(json.dumps({"type": "session.update", "greedy": True}))
            await w.recv()
            await w.send(json.dumps({"type": "input.text", "text": "A turn, then the slot held idle."}))
            await w.send(json.dumps({"type": "input.done"}))
            while not (isinstance(m := await asyncio.wait_for(w.recv(), 120), str)
                       and json.loads(m)["type"] == "response.done"):
                pass
            assert metric(server, "mossrt_active_streams") == 1, "the idle conversation holds its slot"
            victim = worker_holding(server, w.transport.get_extra_info("sockname")[1])
            os.kill(victim, signal.SIGKILL)
            try:
                await asyncio.wait_for(w.recv(), 60)
            except websockets.ConnectionClosed:
                pass
            return victim

    victim = asyncio.run(hold_then_kill())
    wait_for(lambda: metric(server, "mossrt_active_streams") == 0, 30, "the core closed the dead worker's stream")
    wait_for(lambda: len(processes(server, WORKER_MODULE)) == 2 and victim not in processes(server, WORKER_MODULE),
             60, "the supervisor started the worker again")
    wait_for(lambda: len({health_pid(server) for _ in range(TRIES)} - {victim}) == 2, 60,
             "the new worker answers")

    async def session_again() -> str:
        async with websockets.connect(ws_url) as w:
            return str(json.loads(await w.recv())["type"])

    assert asyncio.run(session_again()) == "session.created", "the dead worker's session was released"
    assert metric(server, "mossrt_websocket_sessions") == 0, "the dead worker's gauge left the sum"
    assert "starting it again" in server.log()


def test_sigterm_stops_every_process(full_bundle_dir, tmp_path):
    s = start(full_bundle_dir, tmp_path, "term")
    with s:
        pids = processes(s, WORKER_MODULE) + processes(s, CORE_MODULE)
        assert len(pids) == 3
    # the with block sent SIGTERM and asserted status 0
    assert not [p for p in pids if alive(p)], "no worker or core outlives serve"


def test_the_cores_death_ends_every_worker_and_serve_exits_70(full_bundle_dir, tmp_path):
    s = start(full_bundle_dir, tmp_path, "core")
    try:
        s.wait_ready()
        workers = processes(s, WORKER_MODULE)
        os.kill(processes(s, CORE_MODULE)[0], signal.SIGKILL)
        assert s.proc.wait(60) == 70
        deadline = time.monotonic() + 30
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if alive(p)]
        assert "engine core process exited" in s.log()
    finally:
        s.stop()


def test_workers_without_the_core_process_are_refused_at_start(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mossrt.cli", "serve", "--engine-process", "off", "--api-workers", "2",
                        "--voices-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engine-process on" in r.stderr and "api_workers" in r.stderr
