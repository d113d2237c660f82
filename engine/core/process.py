"""The engine core process: one :class:`LocalEngine` behind a ZMQ ROUTER socket (``python -m engine.core``).

Messages (:mod:`engine.core.wire`), API process → core: ``["hello", 0, pid]`` (its process, watched by
pidfd), ``["call", call_id, op, args]`` (answered ``["reply", call_id, ok, value_or_error]``) and
``["send", 0, op, args]`` (no answer). Core → API process: replies, ``["event", stream_id, kind, value]``
(``frame``, ``end`` with ``[turn, stats]``, ``error``) and ``["state", 0, snapshot]`` whenever the
engine's state changes; what is queued for one API process when the I/O thread flushes goes as one
``["batch", 0, [messages]]``. The device loop only queues an event; this process's I/O thread packs and
sends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import zmq

from engine.errors import StreamClosedError
from engine.serving.handles import Event, FrameEvent, StreamError, StreamHandle, TurnEnd

from .local import LocalEngine
from .wire import WireError, pack, unpack

log = logging.getLogger("mossrt.core")

STATE_POLL_MS = 200          # how often the I/O loop looks whether the engine's state changed


def watch_pid(pid: int) -> int | None:
    """A file descriptor that turns readable when process ``pid`` exits (None: it is gone already)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


class CoreSink:
    """A stream's events, queued for its API process (called on the device loop's thread: never blocks)."""

    def __init__(self, server: CoreServer, peer: bytes, sid: int) -> None:
        self._server, self._peer, self._sid = server, peer, sid

    def put(self, event: Event) -> None:
        if isinstance(event, FrameEvent):
            self._server.post(self._peer, ["event", self._sid, "frame", event.frame])
        elif isinstance(event, TurnEnd):
            self._server.post(self._peer, ["event", self._sid, "end", [event.turn, event.stats]])
        elif isinstance(event, StreamError):
            self._server.post(self._peer, ["event", self._sid, "error", event.error])


class CoreServer:
    """Serves ``engine`` on ``address`` until stopped, its parent exits, or ``stop`` is called."""

    def __init__(self, engine: LocalEngine, address: str, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)        # bounded by each stream's max_buffered_frames instead
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._out: deque[tuple[bytes, list[Any]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False       # a wake-up byte is in the pipe: later posts need none (one per flush)
        self._streams: dict[tuple[bytes, int], StreamHandle] = {}
        self._waits: dict[tuple[bytes, int], Future[Any]] = {}
        self._peers: dict[int, bytes] = {}          # pidfd -> peer
        self._sessions: dict[bytes, int] = {}       # WebSocket sessions each API process holds
        self._parent = watch_pid(parent_pid) if parent_pid is not None else None
        self._stopping = False
        self._loop = asyncio.new_event_loop()       # admission waits (no thread per waiting stream)
        threading.Thread(target=self._loop.run_forever, name="mossrt-core-admission", daemon=True).start()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mossrt-core-blocking")
        self._last_state: tuple[str, str | None, str | None] | None = None
        self.ops: dict[str, Callable[..., Any]] = {
            "snapshot": lambda peer: self.engine.snapshot(),
            "resume_seconds": lambda peer: self.engine.take_resume_seconds(),
            "take_ticks": lambda peer: self.engine.take_ticks(),
            "claim_session": self._claim_session,
            "release_session": self._release_session,
            "has_voice_prefix": lambda peer, codes: self.engine.has_voice_prefix(codes),
            "load_voice_prefix": lambda peer, codes, kv: self.engine.load_voice_prefix(codes, kv),
            "open_stream": self._open_stream,
            "push_text": lambda peer, sid, delta: self._stream(peer, sid).push_text(delta),
            "push_token_ids": lambda peer, sid, ids: self._stream(peer, sid).push_token_ids(ids),
            "end_text": lambda peer, sid: self._stream(peer, sid).end_text(),
            "cancel": lambda peer, sid: self._stream(peer, sid).cancel(),
            "truncate_turn": lambda peer, sid, frames: self._stream(peer, sid).truncate_turn(frames),
            "stream_state": self._stream_state,
            "consumed": lambda peer, sid, frames: self._stream(peer, sid).consumed(frames),
            "close": self._close,
        }
        self.blocking: dict[str, Callable[..., Any]] = {
            "voice_prefix": lambda peer, codes: self.engine.voice_prefix(codes),
            "drain": lambda peer, timeout: self.engine.drain(timeout),
            "stop": lambda peer: self.engine.stop(),
        }

    # ------------------------------------------------------------------ from any thread
    def post(self, peer: bytes, message: list[Any]) -> None:
        """Queue ``message`` for ``peer`` and wake the I/O loop (thread-safe, never blocks): one write to the
        wake pipe per flush, not one per frame (the device loop posts a frame per stream per tick)."""
        self._out.append((peer, message))
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:      # the pipe is full of wake-ups already
            pass

    def stop(self) -> None:
        self._stopping = True
        self.post(b"", [])

    # ------------------------------------------------------------------ ops
    def _stream(self, peer: bytes, sid: int) -> StreamHandle:
        h = self._streams.get((peer, sid))
        if h is None:
            raise StreamClosedError("the stream is closed")
        return h

    def _open_stream(self, peer: bytes, sid: int, voice_codes: Any, params: Any, seed: Any,
                     allow_special_tokens: bool, one_shot: bool, may_park_others: bool) -> int:
        h = self.engine.open_stream(voice_codes, params, seed, CoreSink(self, peer, sid), allow_special_tokens,
                                    one_shot=one_shot, may_park_others=may_park_others)
        self._streams[(peer, sid)] = h
        return h.max_buffered_frames

    def _claim_session(self, peer: bytes, limit: int) -> bool:
        if not self.engine.claim_session(limit):
            return False
        self._sessions[peer] = self._sessions.get(peer, 0) + 1
        return True

    def _release_session(self, peer: bytes) -> None:
        if self._sessions.get(peer, 0) > 0:
            self._sessions[peer] -= 1
            self.engine.release_session()

    def _stream_state(self, peer: bytes, sid: int) -> dict[str, Any]:
        s = self._stream(peer, sid).stream
        return {"has_turn": s.has_turn, "turn_done": s.turn_done, "turn_audio_frames": s.turn_audio_frames,
                "waiting_for_text": s.waiting_for_text, "pending_text_ids": s.pending_text_ids,
                "pending_text_chars": s.pending_text_chars, "context_rows": s.fed_rows,
                "finish_reason": s.stats.finish_reason if s.has_turn else None}

    def _close(self, peer: bytes, sid: int) -> None:
        wait = self._waits.pop((peer, sid), None)
        if wait is not None:
            wait.cancel()                              # leaves the admission queue
        h = self._streams.pop((peer, sid), None)
        if h is not None:
            h.close()

    def _begin_turn(self, peer: bytes, call_id: int, sid: int, kwargs: dict[str, Any]) -> None:
        h = self._stream(peer, sid)
        if isinstance(kwargs.get("user_audio_wav"), list):
            kwargs["user_audio_wav"] = tuple(kwargs["user_audio_wav"])
        wait = asyncio.run_coroutine_threadsafe(h.abegin_turn(**kwargs), self._loop)
        self._waits[(peer, sid)] = wait

        def done(f: Future[Any]) -> None:
            if self._waits.get((peer, sid)) is f:
                del self._waits[(peer, sid)]
            if f.cancelled():
                self.post(peer, ["reply", call_id, False, StreamClosedError("the stream is closed")])
            elif f.exception() is not None:
                self.post(peer, ["reply", call_id, False, f.exception()])
            else:
                self.post(peer, ["reply", call_id, True, None])
        wait.add_done_callback(done)

    def _run_blocking(self, peer: bytes, call_id: int, op: str, args: list[Any]) -> None:
        def run() -> None:
            try:
                self.post(peer, ["reply", call_id, True, self.blocking[op](peer, *args)])
            except Exception as e:  # noqa: BLE001 - the caller's error
                self.post(peer, ["reply", call_id, False, e])
        self._pool.submit(run)

    # ------------------------------------------------------------------ the I/O loop
    def _handle(self, peer: bytes, message: list[Any]) -> None:
        kind = message[0]
        if kind == "hello":
            fd = watch_pid(int(message[2]))
            if fd is None:
                self._forget(peer)
            else:
                self._peers[fd] = peer
            self.post(peer, ["state", 0, self.engine.snapshot()])
            return
        if kind not in ("call", "send"):
            raise WireError(f"unknown message kind {kind!r}")
        call_id, op, args = message[1], message[2], list(message[3])
        try:
            if op == "begin_turn" and kind == "call":
                self._begin_turn(peer, call_id, args[0], dict(args[1]))
                return
            if op in self.blocking and kind == "call":
                self._run_blocking(peer, call_id, op, args)
                return
            value = self.ops[op](peer, *args)
            if kind == "call":
                self.post(peer, ["reply", call_id, True, value])
        except Exception as e:  # noqa: BLE001 - the caller's error, answered
            if kind == "call":
                self.post(peer, ["reply", call_id, False, e])

    def _forget(self, peer: bytes) -> None:
        """An API process exited: its streams close and free their slots."""
        keys = [k for k in self._streams if k[0] == peer]
        for key in keys:
            self._close(*key)
        sessions = self._sessions.pop(peer, 0)
        for _ in range(sessions):
            self.engine.release_session()
        log.info("an API process exited: its %d streams are closed, its %d WebSocket sessions released",
                 len(keys), sessions)

    def _flush(self) -> None:
        """Send what is queued: one message per API process, its events in order (a batch when several)."""
        self._wake_pending = False          # before the queue is read: a post from now on wakes the loop again
        by_peer: dict[bytes, list[list[Any]]] = {}
        while self._out:
            peer, message = self._out.popleft()
            if message:
                by_peer.setdefault(peer, []).append(message)
        for peer, messages in by_peer.items():
            self._sock.send_multipart([peer, pack(messages[0] if len(messages) == 1 else ["batch", 0, messages])])

    def _check_state(self) -> None:
        snap = self.engine.snapshot()
        state = (snap.state, snap.error, snap.broken)
        if state != self._last_state:
            self._last_state = state
            for peer in set(self._peers.values()):
                self.post(peer, ["state", 0, snap])

    def run(self) -> None:
        """Serve until stopped or the parent exits."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._parent is not None:
            poller.register(self._parent, zmq.POLLIN)
        watched: set[int] = set()
        while not self._stopping:
            for fd in set(self._peers) - watched:
                poller.register(fd, zmq.POLLIN)
                watched.add(fd)
            ready = dict(poller.poll(STATE_POLL_MS))
            if self._parent is not None and self._parent in ready:
                log.info("the parent process exited: the engine core stops")
                break
            if self._sock in ready:
                while True:
                    try:
                        peer, data = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(peer, unpack(data))
                    except (WireError, ValueError, TypeError, IndexError) as e:
                        log.warning("a message that is not ours was dropped: %s", e)
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 65536)
                except BlockingIOError:
                    pass
            for fd in [fd for fd in ready if fd in self._peers]:
                if select.select([fd], [], [], 0)[0]:
                    poller.unregister(fd)
                    watched.discard(fd)
                    self._forget(self._peers.pop(fd))
                    os.close(fd)
            self._check_state()
            self._flush()
        self.engine.stop()
        self._sock.close(0)
        self._ctx.term()
