"""A real ``mossrt serve`` process on loopback for the service tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mossrt serve`` in a subprocess; ``stop()`` sends SIGTERM and returns the exit status."""

    def __init__(self, bundle: Path | None, voices_dir: Path, log_path: Path, *flags: str, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", "mossrt.cli", "serve", "--port", str(self.port), "--voices-dir", str(voices_dir),
                "--device", os.environ.get("MOSSRT_TEST_DEVICE", "cpu"), *flags]
        if bundle is not None:
            args += ["--bundle", str(bundle)]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

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

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        self._log.close()
        return stop_process(self.proc, timeout)


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
