"""``mossrt serve --api-workers N``: this process supervises; it opens the listening socket, starts the engine
core process (:class:`engine.core.client.CoreProcess`) and N API worker processes (``python -m
mossrt.api_worker``) that inherit the socket and join the core. Admission, the WebSocket session bound,
parking and the voices' prefix KV live in the core, the voices on disk: every worker sees the same. Their
Prometheus metrics go to one folder (prometheus-client's multiprocess mode) that any worker's ``/metrics``
reads whole.

- A worker that exits while the server runs is started again (the core has closed its streams and released
  its sessions as soon as it saw the process go, by pidfd).
- The core's death: each worker ends its streams with ``engine_broken``, answers ``/ready`` 503 and exits 70;
  this process then exits 70 too, so that the orchestrator replaces the pod.
- SIGTERM/SIGINT: forwarded to every worker, which drains as a single ``mossrt serve`` does; once they have
  exited (bounded: the drain window and a margin, then SIGKILL) the core is stopped. A second signal is
  forwarded too (the workers stop at once). This process's own death ends the core (it watches its parent),
  and with it the workers.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from .serve import ENGINE_DEATH_GRACE_S, ENGINE_DIED_STATUS, FLUSH_SECONDS

log = logging.getLogger("mossrt.app")

RESTART_BACKOFF_S = 1.0      # a worker that dies within this many seconds of its start waits as long to restart
EXIT_MARGIN_S = 10.0         # past the drain window (or the core's death grace), workers still alive are killed


def wyoming_socket(uri: str | None) -> socket.socket | None:
    """The Wyoming listener's TCP socket, bound and listening here so that it is open as long as this
    process is and a connection waits in the backlog while worker 0 (which serves Wyoming) starts or
    restarts; None without a ``tcp://`` URI (a ``unix://`` one is bound by worker 0 itself)."""
    if not uri or urlsplit(uri).scheme != "tcp":
        return None
    parts = urlsplit(uri)
    sock = socket.create_server((parts.hostname or "", parts.port or 0), family=socket.AF_INET6
                                if parts.hostname and ":" in parts.hostname else socket.AF_INET)
    sock.set_inheritable(True)
    return sock


@dataclass
class Worker:
    index: int
    popen: subprocess.Popen
    pidfd: int
    started: float


class Supervisor:
    """The engine core and ``count`` API workers for ``settings`` on ``bundle``, until SIGTERM or the core's death."""

    def __init__(self, settings, bundle, count: int) -> None:
        self.settings, self.bundle, self.count = settings, bundle, count
        self.workers: dict[int, Worker] = {}           # pidfd -> worker
        self._signals: list[int] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # ------------------------------------------------------------------ processes
    def _spawn(self, index: int) -> None:
        settings = self.settings
        if index > 0 and settings.wyoming_uri:
            settings = settings.model_copy(update={"wyoming_uri": None})     # one Wyoming listener: worker 0's
        orders = {"index": index, "fd": self.listener.fileno(), "core_address": self.core.at.address,
                  "core_pid": self.core.at.pid, "settings": settings.model_dump(mode="json")}
        fds = [self.listener.fileno()]
        if index == 0 and self.wyoming is not None:
            orders["wyoming_fd"] = self.wyoming.fileno()
            fds.append(self.wyoming.fileno())
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        popen = subprocess.Popen([sys.executable, "-m", "mossrt.api_worker"], stdin=subprocess.PIPE, env=env,
                                 pass_fds=fds, start_new_session=True)   # signals: ours
        assert popen.stdin is not None
        popen.stdin.write(json.dumps(orders).encode())      # on stdin: the API keys stay out of its environment
        popen.stdin.close()
        worker = Worker(index, popen, os.pidfd_open(popen.pid), time.monotonic())
        self.workers[worker.pidfd] = worker
        log.info("API worker %d started (pid %d)", index, popen.pid)

    def _reap(self, worker: Worker) -> int:
        from prometheus_client import multiprocess

        status = worker.popen.wait()
        del self.workers[worker.pidfd]
        os.close(worker.pidfd)
        multiprocess.mark_process_dead(worker.popen.pid, self.metrics_dir)     # its live gauges leave the sums
        return status

    def _signal_workers(self, sig: int) -> None:
        for worker in list(self.workers.values()):
            try:
                worker.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def _wait_workers(self, bound: float) -> None:
        """Until every worker has exited, at most ``bound`` seconds (a signal meanwhile is forwarded: they stop
        at once); then the rest are killed."""
        deadline = time.monotonic() + bound
        while self.workers and time.monotonic() < deadline:
            ready, _, _ = select.select([self._wake_r, *self.workers], [], [], max(0.0, deadline - time.monotonic()))
            while self._signals:
                self._signal_workers(self._signals.pop(0))
            self._drain_wake(ready)
            for fd in [fd for fd in ready if fd in self.workers]:
                self._reap(self.workers[fd])
        for worker in list(self.workers.values()):
            log.warning("API worker %d (pid %d) did not exit in time: killed", worker.index, worker.popen.pid)
            worker.popen.kill()
            self._reap(worker)

    def _drain_wake(self, ready: list[int]) -> None:
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 512)
            except BlockingIOError:
                pass

    def _on_signal(self, sig: int, frame) -> None:
        self._signals.append(sig)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Serve until SIGTERM's drain ends (0) or the engine core dies (``ENGINE_DIED_STATUS``)."""
        import uvicorn

        from app.service import core_config
        from engine.core.client import CoreProcess

        s = self.settings
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # uvicorn's own bind (IPv4 or IPv6, SO_REUSEADDR), inheritable: the workers accept on it (the app unused)
        self.listener = uvicorn.Config(app="app.server:create_app", host=s.host, port=s.port).bind_socket()
        self.wyoming = wyoming_socket(s.wyoming_uri)
        self.metrics_dir = tempfile.mkdtemp(prefix="mossrt-metrics-")
        self.core = CoreProcess(core_config(s, self.bundle), s.log_level)
        core_fd = os.pidfd_open(self.core.at.pid)
        log.info("engine core process started (pid %d); %d API workers", self.core.at.pid, self.count)
        try:
            for i in range(self.count):
                self._spawn(i)
            return self._supervise(core_fd)
        finally:
            self.listener.close()
            if self.wyoming is not None:
                self.wyoming.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _supervise(self, core_fd: int) -> int:
        pending: dict[int, float] = {}          # index -> when to start it again
        while True:
            timeout = max(0.0, min(pending.values()) - time.monotonic()) if pending else None
            ready, _, _ = select.select([core_fd, self._wake_r, *self.workers], [], [], timeout)
            if self._signals:
                sig = self._signals.pop(0)
                log.info("signal %d: the API workers drain, then the engine core stops", sig)
                self._signal_workers(sig)
                s = self.settings           # each worker drains as one serve does, within this window
                self._wait_workers(max(s.drain_timeout, s.shutdown_delay) + FLUSH_SECONDS + EXIT_MARGIN_S)
                return self._status_after_stop(core_fd)
            if core_fd in ready:
                status = self.core.exit_status()
                log.error("the engine core process exited (status %s): the API workers end their streams "
                          "with engine_broken and exit; exiting with status %d", status, ENGINE_DIED_STATUS)
                self._wait_workers(ENGINE_DEATH_GRACE_S + EXIT_MARGIN_S)
                return ENGINE_DIED_STATUS
            for fd in [fd for fd in ready if fd in self.workers]:
                worker = self.workers[fd]
                lived = time.monotonic() - worker.started
                status = self._reap(worker)
                log.error("API worker %d (pid %d) exited with status %d: the engine core closed its streams; "
                          "starting it again", worker.index, worker.popen.pid, status)
                pending[worker.index] = time.monotonic() + (RESTART_BACKOFF_S if lived < RESTART_BACKOFF_S else 0)
            for index, when in list(pending.items()):
                if when <= time.monotonic():
                    del pending[index]
                    self._spawn(index)
            self._drain_wake(ready)

    def _status_after_stop(self, core_fd: int) -> int:
        died = bool(select.select([core_fd], [], [], 0)[0])
        if not died:
            self.core.stop()
        log.info("stopped: %d API workers and the engine core", self.count)
        return ENGINE_DIED_STATUS if died else 0
