"""``mossrt serve --engine-process on``: the engine core in a process of its own (engine.core), against a real
server. The audio is byte-identical to the in-process engine's on every route tried (greedy, and seeded
sampling); when the core dies, /ready says so, requests get engine_broken, and serve exits non-zero; no
process is left behind by either side's death or by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from service_helpers import Server, native_ws_turns

CORE_MODULE = "engine.core"


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (any of its threads), from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def core_pid(server: Server) -> int:
    cores = [c for c in children(server.proc.pid) if CORE_MODULE in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(cores) == 1, f"one engine core process, found {cores}"
    return cores[0]


def gone(pid: int, timeout: float = 30) -> bool:
    """Whether ``pid`` has exited (or is a zombie nobody waits for) within ``timeout``: a bound for a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def speech(server: Server, **body) -> bytes:
    r = httpx.post(server.base + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy",
                                                           "response_format": "pcm", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture(scope="module")
def servers(full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("core")
    with Server(full_bundle_dir, tmp / "v1", tmp / "inline.log", "--engine-process", "off") as inline, \
            Server(full_bundle_dir, tmp / "v2", tmp / "core.log", "--engine-process", "on") as core:
        yield inline, core


def test_the_core_process_speaks_exactly_as_the_engine_in_process(servers):
    inline, core = servers
    assert not [c for c in children(inline.proc.pid) if CORE_MODULE in Path(f"/proc/{c}/cmdline").read_text()]
    core_pid(core)
    text = "The core process speaks every frame exactly as before."
    assert speech(core, input=text, seed=7) == speech(inline, input=text, seed=7)
    assert speech(core, input=text, greedy=True) == speech(inline, input=text, greedy=True)
    turns = [["Hello ", "there, "], ["and a second ", "turn."]]
    got, want = (asyncio.run(native_ws_turns(s, turns)) for s in (core, inline))
    assert got == want and all(got)
    ready = httpx.get(core.base + "/ready").json()
    assert ready["status"] == "ready" and ready["streams"]["active"] == 0


def test_when_the_core_dies_ready_says_why_and_serve_exits_non_zero(full_bundle_dir, tmp_path):
    server = Server(full_bundle_dir, tmp_path / "v", tmp_path / "s.log", "--engine-process", "on")
    try:
        server.wait_ready()
        pid = core_pid(server)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = httpx.get(server.base + "/ready", timeout=5)
            if r.status_code == 503:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "broken"
        assert "engine core process exited" in r.json()["error"]
        refused = httpx.post(server.base + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.",
                                                                     "voice": "alloy"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_broken"
        assert server.proc.wait(60) == 70
    finally:
        server.stop()


def test_neither_side_leaves_a_process_behind(full_bundle_dir, tmp_path):
    server = Server(full_bundle_dir, tmp_path / "v", tmp_path / "a.log", "--engine-process", "on")
    with server:
        pid = core_pid(server)
    assert gone(pid), "SIGTERM to serve stops its engine core"      # the with block asserted status 0
    killed = Server(full_bundle_dir, tmp_path / "v", tmp_path / "b.log", "--engine-process", "on")
    try:
        killed.wait_ready()
        pid = core_pid(killed)
        killed.proc.kill()
        killed.proc.wait(30)
        assert gone(pid), "an engine core whose API process died exits (it watches its parent)"
    finally:
        killed.stop()
