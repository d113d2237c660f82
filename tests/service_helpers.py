"""Real ``mossrt`` processes on loopback for the service tests (``mossrt serve``; ``test_localai`` builds
its gRPC backend on the same ``Process``), and what those tests share: the texts, the reference synthesis,
PCM helpers."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf
from conftest import TEST_DEVICE
from prometheus_client.parser import text_string_to_metric_families

TEXT = ("Welcome to the world of MOSS TTS Realtime. Experience how text transforms into smooth, "
        "human-like speech in real time, one small step after another.")
LONG_TEXT = " ".join(["The quick brown fox jumps over the lazy dog, and the model keeps on talking."] * 12)
PCM_TOLERANCE = 4      # int16 steps: float32 round-off between batched and solo decodes, then rounding


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def assert_same_audio(got: np.ndarray, ref: np.ndarray) -> None:
    """Two greedy renderings of one text: the same length, samples within PCM_TOLERANCE. Not bitwise: the
    codec's chunking follows the listener's playback clock, and chunkings agree only to float round-off."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.abs(got - ref).max() <= PCM_TOLERANCE, np.abs(got - ref).max()


def to_pcm16(wav: np.ndarray) -> np.ndarray:
    """A float waveform as int16 steps, converted as the service converts."""
    return np.rint(np.clip(wav, -1, 1) * 32767).astype(np.int32)


def synth_reference(tmp_path: Path, bundle: Path, text: str = TEXT, *flags: str) -> np.ndarray:
    """``mossrt synth --greedy`` of ``text`` as int16 steps (its float WAV converted as the service converts)."""
    out = tmp_path / "synth.wav"
    proc = subprocess.run([sys.executable, "-m", "mossrt.cli", "synth", "--bundle", str(bundle), "--text", text,
                           "--out", str(out), "--greedy", "--device", TEST_DEVICE, *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return to_pcm16(sf.read(out, dtype="float32")[0])


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM (a graceful shutdown), SIGKILL after ``timeout`` s; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Process:
    """A ``mossrt`` command in a subprocess, its output in ``log_path``; ``stop()`` sends SIGTERM and returns
    the exit status.

    As a context manager (``with Server(...) as s:``) it waits until the process is ready *inside* the
    managed block, so one that never gets ready is stopped too, always stops it on the way out, and asserts
    a clean exit (status 0, the log's tail as the message). When the block itself failed, that failure is
    what is raised; a non-zero exit status is added to it as a note."""

    stop_timeout: float = 60

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120) -> "Process":
        raise NotImplementedError

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 10) -> re.Match:
        """The first match of ``pattern`` in the log, waiting up to ``timeout`` s for it to appear."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in the log:\n{self.log()[-3000:]}")

    def stop(self, timeout: float | None = None) -> int:
        self._log.close()
        return stop_process(self.proc, self.stop_timeout if timeout is None else timeout)

    def __enter__(self):
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        status = self.stop()
        if exc is None:
            assert status == 0, f"exit status {status}:\n{self.log()[-3000:]}"
        elif status != 0 and isinstance(exc, Exception):
            exc.add_note(f"(and the process then exited with status {status}:\n{self.log()[-3000:]})")
        return False


class Server(Process):
    """``mossrt serve`` on a free loopback port."""

    def __init__(self, bundle: Path | None, voices_dir: Path, log_path: Path, *flags: str, env: dict | None = None,
                 wyoming: bool = False):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "mossrt.cli", "serve", "--port", str(self.port), "--voices-dir", str(voices_dir),
                "--device", TEST_DEVICE, *flags]
        self.wyoming_port = free_port() if wyoming else None        # --wyoming-uri on a port of its own
        if wyoming:
            args += ["--wyoming-uri", f"tcp://127.0.0.1:{self.wyoming_port}"]
        if bundle is not None:
            args += ["--bundle", str(bundle)]
        super().__init__(args, log_path, env)

    def wait_ready(self, timeout: float = 120) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")


async def native_ws_turns(server: "Server", turns: list[list[str]], **session: object) -> list[bytes]:
    """Our own WebSocket's audio for consecutive turns (text deltas) of one session, greedy unless
    ``session`` (session.update fields) says otherwise."""
    import asyncio
    import json

    import websockets

    out = []
    async with websockets.connect(server.base.replace("http", "ws") + "/v1/audio/speech/stream", max_size=None) as w:
        await w.recv()
        await w.send(json.dumps({"type": "session.update", "greedy": True, **session}))
        await w.recv()
        for deltas in turns:
            for d in deltas:
                await w.send(json.dumps({"type": "input.text", "text": d}))
            await w.send(json.dumps({"type": "input.done"}))
            audio = []
            while True:
                msg = await asyncio.wait_for(w.recv(), timeout=120)
                if isinstance(msg, bytes):
                    audio.append(msg)
                elif json.loads(msg)["type"] == "response.done":
                    break
            out.append(b"".join(audio))
    return out


class Backend(Process):
    """``mossrt localai`` on a free loopback port, with a channel and stub to it; ready once it listens."""

    stop_timeout = 30

    def __init__(self, log_path: Path, *flags: str, env: dict | None = None):
        import grpc

        from app.localai import backend_pb2_grpc as pb_grpc

        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "mossrt.cli", "localai", "--addr", self.addr,
                          "--device", TEST_DEVICE, *flags], log_path, env)
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = pb_grpc.BackendStub(self.channel)

    def wait_ready(self, timeout: float = 60) -> "Backend":
        import grpc

        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RuntimeError(f"backend not listening after {timeout} s (exit {self.proc.poll()}):\n{self.log()}")
        return self

    def stop(self, timeout: float | None = None) -> int:
        self.channel.close()
        return super().stop(timeout)


# ---------------------------------------------------------------------------------------------- metrics, sockets
def metric(server: "Server", name: str, **labels) -> float:
    """A sample of the server's /metrics (0 when absent)."""
    for fam in text_string_to_metric_families(httpx.get(server.base + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def requests_counted(server: "Server") -> dict:
    """Every ``mossrt_requests_total`` sample: (endpoint, status) → count."""
    for fam in text_string_to_metric_families(httpx.get(server.base + "/metrics", timeout=10).text):
        if fam.name == "mossrt_requests":
            return {(x.labels.get("endpoint"), x.labels.get("status")): x.value for x in fam.samples
                    if x.name == "mossrt_requests_total"}
    return {}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it is truthy (its value) or ``timeout`` passes (AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what}")


def raw_request(server: "Server", body: bytes, path: str = "/v1/audio/speech", rcvbuf: int | None = None,
                headers: dict | None = None) -> socket.socket:
    """A POST on a raw socket (optionally with a small receive buffer), headers and body sent, nothing read."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    head = {"Host": f"127.0.0.1:{server.port}", "Content-Type": "application/json",
            "Content-Length": str(len(body)), **(headers or {})}
    sock.sendall(f"POST {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
                 + b"\r\n" + body)
    return sock


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a RST, not a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_answer(sock: socket.socket) -> bytes:
    """A whole (non-streamed) HTTP response, or what came before the server closed."""
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(rest) >= length:
                return data
        try:
            piece = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return data
        if not piece:
            return data
        data += piece


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def body_of(answer: bytes) -> dict:
    import json

    return json.loads(answer.split(b"\r\n\r\n", 1)[1])
