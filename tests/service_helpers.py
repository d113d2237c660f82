"""Real ``mossrt`` processes on loopback for the service tests (``mossrt serve``; ``test_localai`` builds
its gRPC backend on the same ``Process``), and what those tests share: the texts, the reference synthesis,
PCM helpers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from conftest import TEST_DEVICE

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

    def __init__(self, bundle: Path | None, voices_dir: Path, log_path: Path, *flags: str, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "mossrt.cli", "serve", "--port", str(self.port), "--voices-dir", str(voices_dir),
                "--device", TEST_DEVICE, *flags]
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
