"""An API process's side of the engine core: :class:`CoreProcess` starts the core process, :class:`EngineClient`
connects to it (one per API process: ``mossrt serve``, or each of its ``--api-workers``) and makes
:class:`engine.core.local.LocalEngine`'s calls over ZMQ; :class:`RemoteStream` has the methods of a
:class:`engine.serving.handles.StreamHandle` the service uses, its events put into the caller's own sink.

One I/O thread owns the socket: callers queue a message and wake it through a pipe, replies complete
futures, events go into sinks (thread-safe: ``QueueSink``, ``AsyncSink``). The core's death is seen by
its pidfd: every open stream gets ``EngineBrokenError``, every waiting call too, and ``on_death`` runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, cast

import numpy as np
import zmq

from engine.errors import EngineBrokenError, StreamClosedError
from engine.model.sampling import SamplingParams
from engine.serving.handles import AwaitableSink, BlockingSink, Event, EventSink, FrameEvent, StreamError, TurnEnd
from engine.serving.stream import TurnStats

from .config import CoreConfig
from .local import EngineSnapshot
from .wire import pack, unpack

log = logging.getLogger("mossrt.core")

CREDIT_EVERY = 8         # frames consumed before the credit goes back (the core pauses at max_buffered_frames)


@dataclass(frozen=True)
class CoreAddress:
    """Where a running engine core listens (``ipc://...``) and its process id (watched by pidfd)."""

    address: str
    pid: int


class CoreProcess:
    """``python -m engine.core`` for ``config``, started now as a child of this process (which it watches: it
    exits when this process does). Its socket lives in a folder of mode 0700: only this user reaches it."""

    def __init__(self, config: CoreConfig, log_level: str = "info") -> None:
        self._dir = tempfile.mkdtemp(prefix="mossrt-core-")
        address = f"ipc://{self._dir}/core.sock"
        self.popen = subprocess.Popen([sys.executable, "-m", "engine.core", "--address", address,
                                       "--config-json", config.to_json(), "--parent-pid", str(os.getpid()),
                                       "--log-level", log_level],
                                      start_new_session=True)     # a terminal's Ctrl-C reaches the API side only
        self.at = CoreAddress(address, self.popen.pid)

    def exit_status(self, timeout: float | None = None) -> int | None:
        """The core's exit status once it has exited (waiting up to ``timeout``), else None."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once it has exited."""
        self.popen.terminate()
        if self.exit_status(timeout) is None:
            self.popen.kill()
            self.popen.wait()


class EngineClient:
    """An API process's connection to the engine core at ``core`` (``CoreProcess`` started it, here or in the
    process that supervises the API workers). With ``process`` (the core is this process's child) ``stop``
    stops the core and its exit status is this process's to read; without (an API worker's client) ``stop``
    only disconnects: the supervisor stops the core once every worker has drained."""

    def __init__(self, core: CoreAddress, on_death: Callable[[str], None] | None = None,
                 process: CoreProcess | None = None) -> None:
        self.core = core
        self.process = process
        self._core_fd = os.pidfd_open(core.pid)
        self.on_death = on_death
        self.snapshot = EngineSnapshot(state="loading")
        self._known = False             # a state message has come (until then "loading" is a guess)
        self.dead: str | None = None
        self._stopping = False          # stop() was called: the exit that follows is not a death
        self._disconnect = False        # a joined client's stop: the I/O thread ends after sending what is queued
        self._state_changed = threading.Condition()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(core.address)
        self._out: deque[list[Any]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._calls: dict[int, Future[Any]] = {}
        self._streams: dict[int, RemoteStream] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mossrt-core-client", daemon=True)
        self._thread.start()
        self._post(["hello", 0, os.getpid()])

    @classmethod
    def start(cls, config: CoreConfig, on_death: Callable[[str], None] | None = None,
              log_level: str = "info") -> EngineClient:
        """A new core process for ``config`` (a child of this process) and this process's client of it."""
        process = CoreProcess(config, log_level)
        return cls(process.at, on_death, process)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        return "broken" if self.dead else self.snapshot.state

    @property
    def error(self) -> str | None:
        return self.snapshot.error

    @property
    def broken(self) -> str | None:
        return self.dead or self.snapshot.broken

    def wait_settled(self, timeout: float | None = None) -> str:
        """Wait until the core has loaded (ready), failed or died; returns the state."""
        with self._state_changed:
            self._state_changed.wait_for(lambda: self.dead or self.snapshot.state not in ("loading", "warming"),
                                         timeout)
        return self.state

    def wait_known(self, timeout: float | None = None) -> str:
        """Wait for the core's first word on its state (the answer to this client's hello); returns the state."""
        with self._state_changed:
            self._state_changed.wait_for(lambda: self.dead or self._known, timeout)
        return self.state

    # ------------------------------------------------------------------ calls
    def _post(self, message: list[Any]) -> None:
        self._out.append(message)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def call_future(self, op: str, *args: Any) -> Future[Any]:
        """``op`` in the core; the future holds its value or its error."""
        f: Future[Any] = Future()
        if self.dead:
            f.set_exception(EngineBrokenError(self.dead))
            return f
        call_id = next(self._ids)
        with self._lock:
            self._calls[call_id] = f
        self._post(["call", call_id, op, list(args)])
        return f

    def call(self, op: str, *args: Any) -> Any:
        return self.call_future(op, *args).result()

    async def acall(self, op: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self.call_future(op, *args))

    def send(self, op: str, *args: Any) -> None:
        """``op`` in the core, unanswered."""
        if not self.dead:
            self._post(["send", 0, op, list(args)])

    # ------------------------------------------------------------------ LocalEngine's calls
    def open_stream(self, voice_codes: np.ndarray | None, params: SamplingParams, seed: int | None,
                    sink: EventSink, allow_special_tokens: bool = False, *, one_shot: bool = False,
                    may_park_others: bool = True) -> RemoteStream:
        sid = next(self._ids)
        stream = RemoteStream(self, sid, sink, one_shot)
        with self._lock:
            self._streams[sid] = stream
        try:
            stream.max_buffered_frames = self.call("open_stream", sid, voice_codes, params, seed,
                                                   allow_special_tokens, one_shot, may_park_others)
        except BaseException:
            with self._lock:
                self._streams.pop(sid, None)
            raise
        return stream

    async def aclaim_session(self, limit: int) -> bool:
        return bool(await self.acall("claim_session", limit))

    def release_session(self) -> None:
        self.send("release_session")

    def voice_prefix(self, codes: np.ndarray) -> np.ndarray | None:
        return cast("np.ndarray | None", self.call("voice_prefix", codes))

    def has_voice_prefix(self, codes: np.ndarray) -> bool:
        return bool(self.call("has_voice_prefix", codes))

    def load_voice_prefix(self, codes: np.ndarray, kv: np.ndarray) -> bool:
        return bool(self.call("load_voice_prefix", codes, kv))

    def fresh_snapshot(self, timeout: float = 1.0) -> EngineSnapshot:
        """The core's counters now (the last one known when it does not answer within ``timeout``)."""
        try:
            snap = cast(EngineSnapshot, self.call_future("snapshot").result(timeout))
        except Exception:  # noqa: BLE001 - a busy or dead core: what was last known
            return self.snapshot
        return snap

    def take_resume_seconds(self) -> list[float]:
        try:
            return list(self.call_future("resume_seconds").result(1.0))
        except Exception:  # noqa: BLE001 - a busy or dead core: none this scrape
            return []

    def drain(self, timeout: float) -> bool:
        try:
            return bool(self.call("drain", timeout))
        except EngineBrokenError:
            return False

    def stop(self) -> None:
        """Stop the core (its streams end with an error) and wait for it to exit; a worker's client (the core
        not its own) closes only its own streams."""
        self._stopping = True
        if self.process is None:
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                s.close()
            self._disconnect = True
            self._post([])                      # wakes the I/O thread, which sends the closes and ends
        else:
            if not self.dead:
                try:
                    self.call_future("stop").result(30)
                except Exception:  # noqa: BLE001 - stopping anyway
                    pass
            self.process.stop()
        self._thread.join(10)

    # ------------------------------------------------------------------ the I/O thread
    def _deliver(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "batch":                 # the core's queued messages for this process, in order
            for m in message[2]:
                self._deliver(m)
            return
        if kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                f = self._calls.pop(call_id, None)
            if f is not None and not f.done():
                if ok:
                    f.set_result(value)
                else:
                    f.set_exception(value if isinstance(value, BaseException) else RuntimeError(str(value)))
        elif kind == "event":
            _, sid, what, value = message
            stream = self._streams.get(sid)
            if stream is None:
                return
            if what == "frame":
                stream.sink.put(FrameEvent(value))
            elif what == "end":
                stream.sink.put(TurnEnd(int(value[0]), value[1]))
            else:
                stream.sink.put(StreamError(value))
        elif kind == "state":
            with self._state_changed:
                self._known = True
                self.snapshot = message[2]
                self._state_changed.notify_all()

    def _core_died(self) -> None:
        rc = self.process.exit_status() if self.process is not None else None
        self.dead = f"the engine core process exited ({f'status {rc}' if rc is not None else f'pid {self.core.pid}'})"
        if not self._stopping:
            log.error("%s: every stream ends with engine_broken", self.dead)
        error = EngineBrokenError(self.dead)
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
            streams, self._streams = list(self._streams.values()), {}
        for f in calls:
            if not f.done():
                f.set_exception(error)
        for s in streams:
            s.sink.put(StreamError(error))
        with self._state_changed:
            self._state_changed.notify_all()
        if self.on_death is not None and not self._stopping:
            self.on_death(self.dead)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._core_fd, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._sock in ready:
                while True:
                    try:
                        data = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(unpack(data))
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 65536)
                except BlockingIOError:
                    pass
            while self._out:
                message = self._out.popleft()
                if message:
                    self._sock.send(pack(message))
            if self._core_fd in ready:
                self._core_died()
                break
            if self._disconnect:
                break
        # closed here, on the socket's own thread: a context left to the garbage collector blocks it in
        # zmq_ctx_term while libzmq still counts the socket as open
        self._sock.close(0)
        self._ctx.term()
        os.close(self._core_fd)         # (the wake pipe stays: a late caller may still write to it)


class StreamView:
    """What the service reads of a remote stream's host state (one call to the core each time)."""

    def __init__(self, stream: RemoteStream) -> None:
        self._stream = stream

    def _state(self) -> dict[str, Any]:
        return cast("dict[str, Any]", self._stream.client.call("stream_state", self._stream.sid))

    @property
    def has_turn(self) -> bool:
        return bool(self._state()["has_turn"])

    @property
    def turn_audio_frames(self) -> int:
        return int(self._state()["turn_audio_frames"])

    @property
    def waiting_for_text(self) -> bool:
        return bool(self._state()["waiting_for_text"])

    @property
    def turn_done(self) -> bool:
        return bool(self._state()["turn_done"])

    @property
    def pending_text_ids(self) -> int:
        return int(self._state()["pending_text_ids"])

    @property
    def pending_text_chars(self) -> int:
        return int(self._state()["pending_text_chars"])

    @property
    def stats(self) -> TurnStats:
        """The turn's stats as far as the service reads them between events (its finish reason)."""
        return TurnStats(finish_reason=self._state()["finish_reason"])


class RemoteStream:
    """A stream in the engine core (``EngineClient.open_stream``): ``StreamHandle``'s calls, each made in the
    core; events arrive in ``sink``."""

    def __init__(self, client: EngineClient, sid: int, sink: EventSink, one_shot: bool) -> None:
        self.client = client
        self.sid = sid
        self.sink = sink
        self.one_shot = one_shot
        self.max_buffered_frames = 0
        self.closed = False
        self.stream = StreamView(self)
        self._credit = 0

    def begin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                   params: SamplingParams | None = None, wait: float | None = None) -> None:
        self._require_open()
        self.client.call("begin_turn", self.sid, self._turn(user_text, user_audio_codes, user_audio_wav,
                                                            max_frames, params, wait))

    async def abegin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                          user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                          params: SamplingParams | None = None, wait: float | None = None) -> None:
        self._require_open()
        await self.client.acall("begin_turn", self.sid, self._turn(user_text, user_audio_codes, user_audio_wav,
                                                                   max_frames, params, wait))

    @staticmethod
    def _turn(user_text: str, user_audio_codes: np.ndarray | None, user_audio_wav: tuple[np.ndarray, int] | None,
              max_frames: int | None, params: SamplingParams | None, wait: float | None) -> dict[str, Any]:
        return {"user_text": user_text, "user_audio_codes": user_audio_codes,
                "user_audio_wav": list(user_audio_wav) if user_audio_wav is not None else None,
                "max_frames": max_frames, "params": params, "wait": wait}

    def push_text(self, delta: str | bytes) -> int:
        self._require_open()
        return int(self.client.call("push_text", self.sid, delta))

    def push_token_ids(self, ids: Iterable[int]) -> int:
        self._require_open()
        return int(self.client.call("push_token_ids", self.sid, [int(i) for i in ids]))

    def end_text(self) -> int:
        self._require_open()
        return int(self.client.call("end_text", self.sid))

    def cancel(self) -> None:
        self._require_open()
        self.client.call("cancel", self.sid)

    def truncate_turn(self, audio_frames: int) -> int:
        self._require_open()
        return int(self.client.call("truncate_turn", self.sid, audio_frames))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.client.send("close", self.sid)
        with self.client._lock:
            self.client._streams.pop(self.sid, None)

    @property
    def context_rows(self) -> int:
        return int(self.client.call("stream_state", self.sid)["context_rows"])

    def consumed(self, frames: int = 1) -> None:
        self._credit += frames
        if self._credit >= min(CREDIT_EVERY, max(1, self.max_buffered_frames // 4)):
            credit, self._credit = self._credit, 0
            self.client.send("consumed", self.sid, credit)

    def get(self, timeout: float | None = None) -> Event:
        event = cast(BlockingSink, self.sink).get(timeout=timeout)
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    async def aget(self) -> Event:
        event = await cast(AwaitableSink, self.sink).get()
        if isinstance(event, FrameEvent):
            self.consumed()
        return event

    def _require_open(self) -> None:
        if self.closed:
            raise StreamClosedError("the stream is closed")
        if self.client.dead:
            raise EngineBrokenError(self.client.dead)

