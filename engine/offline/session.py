"""Streaming sessions on the caller's thread: a stream's state plus a runner of its own (a batch of one).

Lifecycle::

    s = StreamingSession(model, voice_codes=..., params=..., seed=...)
    s.begin_turn(user_text=..., user_audio_codes=...)    # optional user context, laid out as upstream
    s.push_text("Hel") / s.push_token_ids([...])        # frames come back as soon as they exist
    s.end_text()                                         # remaining ids, one frame each
    while not s.turn_done: s.step()                      # <|text_pad|> frames until EOS or the frame limit
    s.begin_turn(...)                                    # next turn: positions continue in the same cache
    s.cancel()                                           # barge-in at any time; the session stays usable
    s.close()

It runs exactly the code the scheduler runs for many streams (``StreamState`` + ``StepRunner``), so
what it produces is what a stream produces in any batch. Not thread-safe: a second thread entering a
call while another is inside it gets :class:`ConcurrentUseError` (use the scheduler's handles to share
streams between threads).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

from engine.errors import ConcurrentUseError, GraphError, InputError
from engine.limits import Limits
from engine.model.sampling import SamplingParams
from engine.model.tts import TTSModel
from engine.serving.runner import DEFAULT_PREFILL_CHUNK_ROWS, StepRunner
from engine.serving.stream import Frame, StreamState, TurnState, TurnStats


class StreamingSession:
    """One stream and a runner of its own, driven on the caller's thread (see the module doc)."""

    def __init__(self, model: TTSModel, voice_codes: np.ndarray | None = None, params: SamplingParams | None = None,
                 seed: int | None = None, max_context_rows: int | None = None, decode_audio: bool = True,
                 limits: Limits | None = None, allow_special_tokens: bool = False,
                 prefill_chunk_rows: int = DEFAULT_PREFILL_CHUNK_ROWS) -> None:
        limits = limits or Limits()
        if max_context_rows is not None:
            limits = dataclasses.replace(limits, max_context_rows=max_context_rows)
        self.model = model
        self.stream = StreamState(model, voice_codes=voice_codes, params=params, seed=seed, limits=limits,
                                  decode_audio=decode_audio, allow_special_tokens=allow_special_tokens)
        self.stream.pad_credit = 0
        runner = StepRunner(model, 1, limits.max_context_rows, prefill_chunk_rows=prefill_chunk_rows,
                            prefill_rows_per_tick=limits.max_context_rows)
        runner.attach(self.stream)
        self._runner: StepRunner | None = runner          # None once closed
        self._busy = threading.Lock()

    # ------------------------------------------------------------------ views
    @property
    def state(self) -> TurnState:
        return self.stream.state

    @property
    def turn_done(self) -> bool:
        return self.stream.turn_done

    @property
    def stats(self) -> TurnStats:
        return self.stream.stats

    @property
    def closed(self) -> bool:
        return self._runner is None

    @property
    def context_rows(self) -> int:
        """Rows in the KV context (every row fed, all turns)."""
        return self.stream.fed_rows

    @property
    def context(self) -> list[np.ndarray]:
        return self.stream.context

    @property
    def seed(self) -> int:
        return self.stream.rng.seed

    @property
    def runner(self) -> StepRunner:
        return self._require_open()

    def context_ids(self) -> np.ndarray:
        return self.stream.context_ids()

    # ------------------------------------------------------------------ calls
    def begin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                   params: SamplingParams | None = None) -> None:
        """Open a turn. The first turn's rows hold the system block (and voice); with user context they
        continue with upstream's user segment (text, then the user's audio after the 12-token delay), then
        the assistant header. Later turns add only the user segment (or the bare turn separator) on top of
        the cache, positions continuing. ``params`` apply to this turn only (default: the session's).
        A turn that cannot open raises and leaves the session as it was."""
        with self._call():
            self.stream.begin_turn(user_text, user_audio_codes, user_audio_wav, max_frames, params)

    def push_text(self, delta: str | bytes) -> list[Frame]:
        """Add assistant text (any split, bytes may cut UTF-8 characters); returns the frames it yields."""
        with self._call():
            self.stream.push_text(delta)
            return self._pump(pads=0)

    def push_token_ids(self, ids: Iterable[int]) -> list[Frame]:
        """Add assistant token ids (fed exactly as given); returns the frames they yield."""
        with self._call():
            self.stream.push_token_ids(ids)
            return self._pump(pads=0)

    def end_text(self) -> list[Frame]:
        """No more text this turn: commits the rest, prefills if needed, and steps through pending ids."""
        with self._call():
            self.stream.end_text()
            return self._pump(pads=0)

    def step(self) -> list[Frame]:
        """After the end of the text: one ``<|text_pad|>`` frame (or nothing once the turn is done).
        Before it: nothing is fed (a running stream that is out of text counts a stall)."""
        with self._call():
            if not self.stream.has_turn:
                raise InputError("no turn is open: call begin_turn first")
            return self._pump(pads=1)

    def drain(self, max_frames: int | None = None) -> list[Frame]:
        """Step until the turn is done (or ``max_frames`` frames)."""
        out: list[Frame] = []
        while not self.turn_done and (max_frames is None or len(out) < max_frames):
            new = self.step()
            if not new and not self.turn_done:
                break
            out += new
        return out

    def cancel(self) -> None:
        """Barge-in: end the turn now. Fed rows stay in the context; nothing else is kept."""
        with self._call():
            self.stream.cancel()

    def prime(self, rows: npt.ArrayLike) -> None:
        """Feed context rows ``[n, 17]`` between turns without generating (see ``StreamState.prime``)."""
        with self._call():
            self.stream.prime(rows)
            self._pump(pads=0)

    def truncate_turn(self, audio_frames: int) -> int:
        """After a turn ended: keep in the context only what its first ``audio_frames`` frames of audio
        carried (see ``StreamState.truncate_turn``). Returns the context rows kept."""
        with self._call():
            kept = self.stream.truncate_turn(audio_frames)
            self._pump(pads=0)
            return kept

    def close(self) -> None:
        """Free the session's memory (KV slot, codec state). Further calls raise."""
        with self._call(require_open=False):
            if self._runner is not None:
                self.stream.close()
                self._runner.detach(self.stream)
                self._runner = None

    # ------------------------------------------------------------------ internals
    def _pump(self, pads: int) -> list[Frame]:
        """Run ticks until the stream has nothing more to feed now (at most ``pads`` pad frames)."""
        runner = self._require_open()
        self.stream.pad_credit = pads
        frames: list[Frame] = []
        while True:
            result = runner.tick()
            frames += [f for _, f in result.frames]
            if result.failed:
                raise GraphError(str(result.failed[0][1])) from result.failed[0][1]
            if not runner.has_work() and not result.worked:
                break
        self.stream.pad_credit = 0
        self.stream.take_finished()   # a session reports turn ends through stats, not events
        return frames

    @contextmanager
    def _call(self, require_open: bool = True) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError("this StreamingSession is in use by another thread; a session is not "
                                     "thread-safe (share streams between threads through a Scheduler)")
        try:
            if require_open:
                self._require_open()
            yield
        finally:
            self._busy.release()

    def _require_open(self) -> StepRunner:
        """The session's runner; an InputError once the session is closed."""
        if self._runner is None:
            raise InputError("the session is closed")
        return self._runner
