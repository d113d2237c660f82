"""What one stream decides: turns, text commit, pacing, limits, sampling draws, frame history.

Pure host logic with no graph calls. A runner asks :meth:`StreamState.want` for the rows to feed next
(a prefill block or one step row, with the frame's sampling inputs), tells it which rows went into the
KV cache (:meth:`on_fed`), and hands back the sampled codes (:meth:`accept`), which become a
:class:`Frame`. Whether a stream runs alone (``StreamingSession``) or batched with others (the
scheduler), it makes exactly the same decisions, so its output does not depend on the company it keeps.

Pacing (upstream semantics, model spec §5.3): nothing is fed until 12 ids are committed (or the text
ends with fewer); the prefill then yields frame 0; afterwards every committed id yields exactly one
frame. ``<|text_pad|>`` is never fed before the end of the text: a running stream without new ids
waits, and each time it runs dry counts a stall.

Cancel semantics: rows already fed to the backbone stay in the context (they were computed); ids
committed but not fed, and the last frame (never fed, exactly as after EOS), are dropped.

Thread-safe: every public method holds the stream's own lock, so a scheduler's loop thread and the
threads that feed the stream interleave safely (a cancel between ``want`` and ``accept`` makes
``accept`` discard the frame). The lock is never held during a graph call.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from engine.audio.voices import resolve_voice
from engine.errors import ContextLimitError, InputError, StreamClosedError
from engine.limits import Limits
from engine.model.sampling import FrameRandom, SamplingParams
from engine.model.textstream import TextCommitter, TokenizationDrift
from engine.model.tokenizer import check_unicode

if TYPE_CHECKING:
    from engine.model.tts import TTSModel

log = logging.getLogger("mossrt.stream")


class FinishReason(str, enum.Enum):
    EOS = "eos"                      # codebook 0 sampled audio EOS
    MAX_FRAMES = "max_frames"        # the turn's frame limit
    CONTEXT_LIMIT = "context_limit"  # the stream's context is full
    CANCELLED = "cancelled"          # barge-in
    NO_TEXT = "no_text"              # the turn ended without any text: nothing was fed
    ERROR = "error"                  # the runner failed this stream (see the error it delivered)


class TurnState(enum.Enum):
    IDLE = "idle"            # no turn open
    WAITING = "waiting"      # turn open, fewer than 12 ids committed and text not ended
    RUNNING = "running"      # prefilled; frames follow committed ids
    DONE = "done"            # finished (see FinishReason)


@dataclass
class Frame:
    """One generated frame. ``audio`` is its 1920 samples, or None for the EOS frame, for frames that are
    not :func:`playable` (dropped from the audio, which continues with the next frame) and when the
    stream does not decode audio."""

    index: int
    codes: np.ndarray
    audio: np.ndarray | None = None
    eos: bool = False
    turn: int = 0            # the stream's turn number (1, 2, ...)
    needs_audio: bool = False  # the codec decodes it: a playable frame of a stream that decodes audio
    # Characters of the turn's text (NFC, as tokenized) whose ids the model had read when it wrote this
    # frame (0 for token-id input): the exact basis for alignment. Reading runs 12 ids ahead of speech.
    text_chars: int = 0


@dataclass
class TurnStats:
    text_ids: int = 0
    frames: int = 0
    stalls: int = 0           # times the running stream ran out of text before its end
    dropped_frames: int = 0   # non-EOS frames with non-codec codes (no audio)
    finish_reason: FinishReason | None = None
    prefill_rows: int = 0
    unfed_text_ids: int = 0   # committed ids the turn ended without feeding (cancel, limits)
    tokenization_drift: bool = False


@dataclass(frozen=True)
class StepRequest:
    """Rows to feed, and the sampling inputs of the frame they complete."""

    rows: np.ndarray          # [T, 17]
    first_frame: bool         # a turn's first frame: no repetition penalty (upstream)
    params: SamplingParams
    uniform: np.ndarray       # [16] draws of this frame, from the stream's own generator
    history: np.ndarray       # [repetition_window, 16] earlier frames of the turn, history_pad where none
    turn: int                 # the turn it belongs to (results of an ended turn are discarded)
    # Ends of the cacheable leading rows: the system block, then (text-only first turn) the assistant header.
    # Each ends a prefill chunk, so their KV does not depend on what follows and may come from the prefix
    # cache (keyed by the system block's rows); empty when the request starts no stream.
    prefix_cuts: tuple[int, ...] = ()
    sample: bool = True       # False: context rows only (prime), no frame follows
    start_row: int = 0        # the stream's context rows when it was asked for: where the rows go in the KV


@dataclass(frozen=True)
class TurnInputs:
    """A turn's inputs as :meth:`StreamState.check_turn` checked them (user audio already encoded), with its
    prompt rows as laid out for the stream then (``first``: as its first turn)."""

    user_text: str
    user_audio: np.ndarray | None
    max_frames: int | None
    params: SamplingParams
    first: bool
    rows: np.ndarray


P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[Concatenate[StreamState, P], R]) -> Callable[Concatenate[StreamState, P], R]:
    """The method runs holding the stream's own lock."""
    @functools.wraps(method)
    def wrapper(self: StreamState, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def playable(codes: np.ndarray, codebook_size: int) -> bool:
    """Whether a frame can go to the codec: every code a codec code (the model can, rarely, sample the
    pad/BOS/EOS ids in some codebook; upstream drops such frames, and so do we, counting them)."""
    return bool((codes < codebook_size).all() and (codes >= 0).all())


@dataclass
class _Turn:
    serial: int
    prompt_rows: np.ndarray
    committer: TextCommitter
    params: SamplingParams
    max_frames: int | None
    pending: list[int] = field(default_factory=list)   # committed ids not yet fed
    frames: list[np.ndarray] = field(default_factory=list)
    # the last repetition_window frames, history_pad before the first: kept as frames arrive (rebuilding it
    # from ``frames`` each step cost ~50 us a stream a tick)
    history: np.ndarray | None = None
    text_ended: bool = False
    input_kind: str | None = None   # "text" or "ids": a turn takes one kind of assistant input
    starved: bool = False
    start_rows: int = 0             # context rows before the turn's prefill
    fed_text_ids: int = 0           # committed ids fed so far (prefill and step rows)
    prefix_cuts: tuple[int, ...] = ()   # cacheable chunk ends of the prefill (first turn only)
    stats: TurnStats = field(default_factory=TurnStats)


class StreamState:
    """One stream's host state across turns (its KV context lives in the runner's slot, or, parked, in a host
    copy the scheduler keeps: everything else its next turn needs is here)."""

    def __init__(self, model: TTSModel, voice_codes: np.ndarray | None = None, params: SamplingParams | None = None,
                 seed: int | None = None, limits: Limits | None = None, decode_audio: bool = True,
                 allow_special_tokens: bool = False) -> None:
        self.model = model
        self.limits = limits or Limits()
        self.voice_codes = resolve_voice(model, self.limits, codes=voice_codes)
        self.params = (params or model.default_sampling()).validated()
        self.rng = FrameRandom(seed, model.layout.codebooks)
        self.decode_audio = decode_audio
        self.allow_special_tokens = bool(allow_special_tokens)
        self.context: list[np.ndarray] = []    # every row block fed to the backbone, in order
        self.fed_rows = 0
        self.state = TurnState.IDLE
        self.closed = False
        # Pad frames the stream may still emit after its text ended (None: unlimited). A single-stream
        # session uses it to make step() emit exactly one; a scheduler leaves it unlimited.
        self.pad_credit: int | None = None
        self._turn: _Turn | None = None
        self._serial = 0
        self._in_flight: StepRequest | None = None
        self._prime: np.ndarray | None = None
        self._prime_prefix: tuple[int, ...] = ()
        self._last_fed: StepRequest | None = None
        self._lock = threading.RLock()
        # Single flag writes (atomic), by writers that hold their own locks (the handle's, admission's):
        # want() reads them under the stream's lock
        self._paused = False                    # a consumer that does not keep up holds the stream
        self._parked = False                    # between turns, its slot given away: it asks for nothing
        self._finished: list[tuple[int, TurnStats]] = []
        self.system_rows = len(model.prompt.system_block(self.voice_codes))
        self.tts_prompt_rows = self.system_rows + len(model.prompt.assistant_header)

    # ------------------------------------------------------------------ held by its scheduler
    @property
    def paused(self) -> bool:
        """Its consumer does not keep up: the stream asks for nothing until it catches up."""
        return self._paused

    @property
    def parked(self) -> bool:
        """Between turns, its slot given away: the stream asks for nothing until it is attached again."""
        return self._parked

    def mark_paused(self) -> None:
        """Its consumer's buffer is full: hold the stream (it asks for nothing)."""
        self._paused = True

    def mark_unpaused(self) -> None:
        """Its consumer caught up: the stream goes on."""
        self._paused = False

    def mark_parked(self) -> None:
        """Its slot is given away (its rows are copied out): it asks for nothing until attached again."""
        self._parked = True

    def mark_unparked(self) -> None:
        """It holds a slot again: it asks for rows as usual."""
        self._parked = False

    # ------------------------------------------------------------------ views
    @property
    def turn_done(self) -> bool:
        return self.state is TurnState.DONE

    @property
    def has_turn(self) -> bool:
        return self._turn is not None

    @property
    def stats(self) -> TurnStats:
        return self._require_turn().stats

    @property
    def turn_params(self) -> SamplingParams:
        return self._require_turn().params

    @property
    def pending_text_ids(self) -> int:
        """Committed ids not fed yet (0 without a turn)."""
        return len(self._turn.pending) if self._turn is not None else 0

    @property
    def pending_text_chars(self) -> int:
        """Characters received but not yet committed to ids (0 without a turn)."""
        return len(self._turn.committer.pending_text) if self._turn is not None else 0

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def turn_serial(self) -> int:
        """Counts the turns begun (the current one's number)."""
        return self._serial

    @_locked
    def context_ids(self) -> np.ndarray:
        if not self.context:
            return np.zeros((0, self.model.layout.columns), np.int64)
        return np.concatenate(self.context)

    # ------------------------------------------------------------------ turn lifecycle (caller input)
    def begin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                   params: SamplingParams | None = None) -> None:
        """Open a turn (see ``StreamingSession.begin_turn``): :meth:`check_turn`, then :meth:`open_turn`. A turn
        that cannot open raises and leaves the stream as it was."""
        self.open_turn(self.check_turn(user_text, user_audio_codes, user_audio_wav, max_frames, params))

    def check_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                   params: SamplingParams | None = None) -> TurnInputs:
        """A turn's inputs checked as far as they can be before it opens — the user text, the frame limit, the
        sampling settings, the user audio (encoded here: not under the lock), the stream open, no turn in
        progress, and its prompt rows within the context as the stream stands — changing nothing: a
        scheduled stream checks a turn before it asks for a slot, so a turn refused for its inputs never
        takes one. Raises what :meth:`begin_turn` would."""
        if not isinstance(user_text, str):
            raise InputError("user_text must be a string")
        if user_text:
            check_unicode(user_text)
            if len(user_text) > self.limits.max_text_chars:
                raise InputError(f"user text is {len(user_text)} characters; the limit is {self.limits.max_text_chars}")
        max_frames = self.limits.check_max_frames(max_frames)
        turn_params = params.validated() if params is not None else self.params
        user_audio = resolve_voice(self.model, self.limits, wav=user_audio_wav, codes=user_audio_codes,
                                   what="user audio", user_audio=True)   # may encode audio: not under the lock
        with self._lock:
            first = self.fed_rows == 0
            rows = self._turn_rows(first, user_text, user_audio)
        return TurnInputs(user_text, user_audio, max_frames, turn_params, first, rows)

    def open_turn(self, inputs: TurnInputs) -> None:
        """Open a turn of checked inputs (:meth:`check_turn`); the checks that depend on the stream's state run
        again (it may have changed since). Raises and leaves the stream as it was when the turn cannot open."""
        with self._lock:
            first = self.fed_rows == 0
            rows = self._turn_rows(first, inputs.user_text, inputs.user_audio,
                                   inputs.rows if first == inputs.first else None)
            self._open_turn(inputs, rows)

    def _turn_rows(self, first: bool, user_text: str, user_audio: np.ndarray | None,
                   rows: np.ndarray | None = None) -> np.ndarray:
        """A turn's prompt rows (``rows``: already laid out), checked against the stream's state and context."""
        self._require_open()
        if self.state in (TurnState.WAITING, TurnState.RUNNING):
            raise InputError("a turn is in progress: end it (end_text and let it finish) or cancel it first")
        if rows is None:
            rows = self.model.prompt.turn_prompt(first, self.voice_codes, user_text, user_audio,
                                                 allow_special=self.allow_special_tokens)
        lead = self.model.layout.text_lead
        if self.fed_rows + len(rows) + lead > self.limits.max_context_rows:
            raise ContextLimitError(f"context limit: the turn's {len(rows)} prompt rows do not fit "
                                    f"({self.fed_rows} of {self.limits.max_context_rows} rows used)")
        return rows

    def _open_turn(self, inputs: TurnInputs, rows: np.ndarray) -> None:
        user_text, user_audio, max_frames, turn_params = (inputs.user_text, inputs.user_audio, inputs.max_frames,
                                                          inputs.params)
        self._serial += 1
        # a text-only first turn opens with the system block + assistant header, both the same for every
        # stream with this voice: both are cacheable. With user context only the system block is.
        has_user = bool(user_text) or user_audio is not None
        cuts = () if self.fed_rows else (self.system_rows,) if has_user else (self.system_rows, self.tts_prompt_rows)
        self._turn = _Turn(serial=self._serial, prompt_rows=rows, params=turn_params, max_frames=max_frames,
                           committer=TextCommitter(self.model.tokenizer, self.allow_special_tokens),
                           prefix_cuts=cuts)
        self.state = TurnState.WAITING

    @_locked
    def push_text(self, delta: str | bytes) -> int:
        """Add assistant text (any split; bytes may cut UTF-8 characters); returns the ids it committed."""
        t = self._require_text_open()
        self._set_input_kind(t, "text")
        return self._queue(t, t.committer.push(delta))

    @_locked
    def push_token_ids(self, ids: Iterable[int]) -> int:
        """Add assistant token ids (fed exactly as given)."""
        t = self._require_text_open()
        arr = self.model.check_text_ids(ids)
        self._set_input_kind(t, "ids")
        return self._queue(t, [int(i) for i in arr])

    @_locked
    def end_text(self) -> int:
        """No more text this turn: commits the rest. The stream then drains to EOS or its limits."""
        t = self._require_turn()
        if t.text_ended:
            raise InputError("text already ended for this turn")
        tail = t.committer.finish()
        try:
            t.committer.check()
        except TokenizationDrift as e:   # a bug if ever seen: report it, keep speaking what was committed
            t.stats.tokenization_drift = True
            log.error("tokenization drift: %s", e)
        t.text_ended = True
        n = self._queue(t, tail)
        if self.state is TurnState.WAITING and not t.pending:
            self._finish(t, FinishReason.NO_TEXT)
        return n

    @_locked
    def cancel(self) -> None:
        """Barge-in: end the turn now. Fed rows stay in the context; nothing else is kept."""
        self._require_open()
        if self._turn is not None and self.state is not TurnState.DONE:
            self._finish(self._turn, FinishReason.CANCELLED)

    @_locked
    def close(self) -> None:
        """The stream ends: an open turn is cancelled, and it asks for nothing more."""
        self.closed = True
        if self._turn is not None and self.state is not TurnState.DONE:
            self._finish(self._turn, FinishReason.CANCELLED)

    @_locked
    def prime(self, rows: npt.ArrayLike, prefix: bool = False) -> None:
        """Feed context rows ``[n, 17]`` without generating (between turns): the stream then continues as
        if a conversation had produced exactly these rows (restoring a conversation; tests' references).
        ``prefix``: the rows are the stream's system block, or its text-only opening (system block + assistant
        header), fed in the cacheable chunks of a first turn."""
        self._require_open()
        if self.state in (TurnState.WAITING, TurnState.RUNNING) or self._prime is not None:
            raise InputError("prime context rows between turns")
        arr = np.asarray(rows)
        lay = self.model.layout
        if arr.ndim != 2 or arr.shape[1] != lay.columns or arr.shape[0] == 0 \
                or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"context rows must be integers [rows >= 1, {lay.columns}], got {arr.shape}")
        arr = arr.astype(np.int64)
        if arr[:, 0].min() < 0 or arr[:, 0].max() >= self.model.vocab or arr[:, 1:].min() < 0 \
                or arr[:, 1:].max() > max(lay.audio_pad, lay.audio_bos, lay.audio_eos):
            raise InputError("context rows hold ids outside the text vocabulary or the audio codes")
        if self.fed_rows + len(arr) > self.limits.max_context_rows:
            raise ContextLimitError(f"context limit: {len(arr)} more rows do not fit "
                                    f"({self.fed_rows} of {self.limits.max_context_rows} rows used)")
        self._prime = arr
        n = len(arr)
        self._prime_prefix = tuple(sorted({min(self.system_rows, n), n})) if prefix and self.fed_rows == 0 else ()

    @_locked
    def truncate_turn(self, audio_frames: int) -> int:
        """After the last turn ended (typically cancelled): keep in the context only what a listener who
        heard its first ``audio_frames`` frames of audio heard — the turn's prefill block and the step rows
        carrying those frames (as if the turn had ended there; more frames than the turn played keep all
        of it, see ``turn_audio_frames``). Returns the context rows kept; the
        runner drops the rest of the KV cache before the next step."""
        t = self._require_turn()
        if self.state is not TurnState.DONE or self._in_flight is not None:
            raise InputError("truncate after the turn has ended (cancel it first)")
        if isinstance(audio_frames, bool) or not isinstance(audio_frames, (int, np.integer)) or audio_frames < 0:
            raise InputError(f"audio frames heard must be an integer >= 0, got {audio_frames!r}")
        if t.stats.prefill_rows == 0:
            return self.fed_rows                          # nothing of the turn was fed
        played = self._played_frames(t)
        heard = min(int(audio_frames), len(played))     # a listener never heard more than was played
        carried = played[heard - 1] + 1 if heard else 0   # frames 0..j ride in step rows 1..j+1
        keep = min(self.fed_rows, t.start_rows + t.stats.prefill_rows + carried)
        drop = self.fed_rows - keep
        while drop > 0:
            block = self.context[-1]
            if len(block) <= drop:
                self.context.pop()
                drop -= len(block)
            else:
                self.context[-1] = block[: len(block) - drop]
                drop = 0
        self.fed_rows = keep
        return keep

    @property
    @_locked
    def waiting_for_text(self) -> bool:
        """The open turn's text has not ended and it has nothing left to feed: only more text (or its
        end) lets it go on. A transport bounds how long a turn may wait so (WebSocket text timeout)."""
        t = self._turn
        if t is None or t.text_ended or self.state not in (TurnState.WAITING, TurnState.RUNNING):
            return False
        if self.state is TurnState.WAITING:
            return len(t.pending) < self.model.layout.text_lead
        return not t.pending

    @property
    @_locked
    def turn_audio_frames(self) -> int:
        """Frames of audio the current (or last) turn played: what ``truncate_turn`` can keep at most."""
        return len(self._played_frames(self._turn)) if self._turn is not None else 0

    def _played_frames(self, t: _Turn) -> list[int]:
        lay = self.model.layout
        return [i for i, c in enumerate(t.frames) if c[0] != lay.audio_eos and playable(c, lay.codebook_size)]

    @_locked
    def fail(self) -> None:
        """The runner could not compute this stream: the turn ends with ERROR."""
        self._in_flight = None
        if self._turn is not None and self.state is not TurnState.DONE:
            self._finish(self._turn, FinishReason.ERROR)

    # ------------------------------------------------------------------ runner side
    @_locked
    def want(self) -> StepRequest | None:
        """The next rows to feed (with the sampling inputs of the frame they complete), or None."""
        if self._held_back():
            return None
        if self._prime is not None:
            return self._prime_request(self._prime)
        t = self._turn
        if t is None or self.state not in (TurnState.WAITING, TurnState.RUNNING):
            return None
        if self.state is TurnState.WAITING:
            return self._prefill_request(t) if self._prefill_ready(t) else None
        return self._step_request(t)

    def _held_back(self) -> bool:
        """Whether the stream asks for nothing whatever its turn holds: closed, a request already out, its
        consumer behind (paused) or its slot given away (parked)."""
        return self.closed or self._in_flight is not None or self._paused or self._parked

    def _prime_request(self, rows: np.ndarray) -> StepRequest:
        """The primed context rows, as one request that samples no frame (the prime is taken)."""
        self._prime = None
        self._in_flight = StepRequest(rows=rows, first_frame=False, params=self.params, uniform=np.zeros(0),
                                      history=np.zeros((0, 0), np.int64), turn=self._serial, sample=False,
                                      prefix_cuts=self._prime_prefix, start_row=self.fed_rows)
        return self._in_flight

    def _prefill_ready(self, t: _Turn) -> bool:
        """Whether a waiting turn may prefill: 12 ids committed, or its text ended with fewer."""
        return len(t.pending) >= self.model.layout.text_lead or t.text_ended

    def _prefill_request(self, t: _Turn) -> StepRequest:
        """The turn's prefill (its prompt rows and its first committed ids), which yields frame 0; the turn is
        running from now."""
        n = min(self.model.layout.text_lead, len(t.pending))
        t.fed_text_ids += n
        rows = np.concatenate([t.prompt_rows, self.model.prompt.prefill_text(t.pending[:n])])
        del t.pending[:n]
        t.stats.prefill_rows = len(rows)
        t.start_rows = self.fed_rows
        self.state = TurnState.RUNNING
        return self._request(t, rows, first=True, prefix_cuts=t.prefix_cuts)

    def _step_request(self, t: _Turn) -> StepRequest | None:
        """A running turn's next step row, or None: the turn ends at its frame limit (before a text id is
        taken) or when its context is full (after), and waits when it has no text id to feed."""
        if t.stats.frames >= self._frame_limit(t):
            self._finish(t, FinishReason.MAX_FRAMES)
            return None
        text_id = self._next_text_id(t)
        if text_id is None:
            return None
        if self.fed_rows + 1 > self.limits.max_context_rows:
            self._finish(t, FinishReason.CONTEXT_LIMIT)
            return None
        return self._request(t, self.model.prompt.step_row(text_id, t.frames[-1]), first=False)

    def _next_text_id(self, t: _Turn) -> int | None:
        """The text id the next step row carries: the next committed id, ``<|text_pad|>`` once the text ended
        (within ``pad_credit``), else None (the stream ran dry: counted once as a stall)."""
        if t.pending:
            text_id = t.pending.pop(0)
            t.fed_text_ids += 1
        elif t.text_ended:
            if self.pad_credit is not None:
                if self.pad_credit <= 0:
                    return None
                self.pad_credit -= 1
            text_id = self.model.layout.text_pad_id
        else:
            if not t.starved:
                t.stats.stalls += 1
                t.starved = True
            return None
        t.starved = False
        return text_id

    @_locked
    def on_fed(self, request: StepRequest, rows: np.ndarray) -> None:
        """Rows of ``request`` went into the KV cache (a prefill may be fed in several chunks; ``context``
        keeps one block per request)."""
        if self._last_fed is request and self.context:
            self.context[-1] = np.concatenate([self.context[-1], rows])
        else:
            self.context.append(rows)
        self._last_fed = request
        self.fed_rows += len(rows)

    @_locked
    def aborted(self, request: StepRequest) -> bool:
        """Whether the request's turn ended meanwhile (cancel, close): stop feeding its rows."""
        if self.closed:
            return True
        if not request.sample:
            return False
        return self._turn is None or request.turn != self._turn.serial or self.state is TurnState.DONE

    @_locked
    def release(self, request: StepRequest) -> None:
        """The runner gives up a request (its turn ended meanwhile, or the stream leaves)."""
        if self._in_flight is request:
            self._in_flight = None

    @_locked
    def accept(self, request: StepRequest, codes: np.ndarray) -> Frame | None:
        """The frame the request completed; None if its turn ended meanwhile (the frame is discarded)."""
        self._in_flight = None
        t, lay = self._turn, self.model.layout
        if self.aborted(request) or t is None:
            return None
        codes = np.asarray(codes, np.int64)
        if self._demo_turn_over(t):
            codes = codes.copy()
            codes[0] = lay.audio_eos             # the demo's random model ends here, as a model does at EOS
        t.frames.append(codes)
        if t.history is not None and len(t.history):
            t.history[:-1] = t.history[1:]          # numpy copies overlapping slices correctly
            t.history[-1] = codes
        t.stats.frames += 1
        frame = Frame(index=len(t.frames) - 1, codes=codes, turn=t.serial, text_chars=self._chars_read(t))
        if codes[0] == lay.audio_eos:
            frame.eos = True
            self._finish(t, FinishReason.EOS)
        elif not playable(codes, lay.codebook_size):
            t.stats.dropped_frames += 1
        else:
            frame.needs_audio = self.decode_audio
        if not frame.eos and t.text_ended and not t.pending and t.stats.frames >= self._frame_limit(t):
            self._finish(t, FinishReason.MAX_FRAMES)
        return frame

    # ------------------------------------------------------------------ internals
    def _request(self, t: _Turn, rows: np.ndarray, first: bool, prefix_cuts: tuple[int, ...] = ()) -> StepRequest:
        m = self.model
        if t.history is None:
            window = t.params.repetition_window
            t.history = np.full((window, m.layout.codebooks), m.history_pad, np.int64)
            recent = t.frames[-window:] if window else []
            if recent:
                t.history[window - len(recent):] = np.stack(recent)
        req = StepRequest(rows=rows, first_frame=first, params=t.params, uniform=self.rng.next_frame(),
                          history=t.history.copy(), turn=t.serial, prefix_cuts=prefix_cuts, start_row=self.fed_rows)
        self._in_flight = req
        return req

    @staticmethod
    def _chars_read(t: _Turn) -> int:
        ends = t.committer.char_ends
        return ends[t.fed_text_ids - 1] if t.input_kind == "text" and t.fed_text_ids else 0

    def _queue(self, t: _Turn, ids: list[int]) -> int:
        if self.state is TurnState.DONE:
            return 0   # text after the turn ended: nothing more is generated this turn (as upstream)
        t.pending += ids
        t.stats.text_ids += len(ids)
        return len(ids)

    def _demo_turn_over(self, t: _Turn) -> bool:
        """The demo bundle's end rule (its manifest's ``demo.end_frames_per_text_id``; a real bundle has
        none): a turn whose text is all fed is over at that many frames per text id."""
        rate = self.model.demo_end_frames_per_text_id
        return (rate is not None and t.text_ended and not t.pending
                and t.stats.frames >= max(1, math.ceil(rate * t.stats.text_ids)))

    def _frame_limit(self, t: _Turn) -> int:
        """The turn's frame cap: as asked, else generous for the text seen so far (final once it ended)."""
        return t.max_frames if t.max_frames is not None else self.limits.default_max_frames(t.stats.text_ids)

    @_locked
    def take_finished(self) -> list[tuple[int, TurnStats]]:
        """Turns that ended since the last call, in order: (turn number, stats)."""
        out, self._finished = self._finished, []
        return out

    def _finish(self, t: _Turn, reason: FinishReason) -> None:
        t.stats.finish_reason = reason
        t.stats.unfed_text_ids = len(t.pending)
        t.pending = []
        self.state = TurnState.DONE
        self._finished.append((t.serial, t.stats))

    def _set_input_kind(self, t: _Turn, kind: str) -> None:
        if t.input_kind not in (None, kind):
            raise InputError(f"this turn already takes {'text deltas' if t.input_kind == 'text' else 'token ids'}; "
                             "do not mix text deltas and token ids in one turn")
        t.input_kind = kind

    def _require_open(self) -> None:
        if self.closed:
            raise StreamClosedError("the stream is closed")

    def _require_turn(self) -> _Turn:
        """The current (or last) turn of the open stream; InputError when none was begun."""
        self._require_open()
        if self._turn is None:
            raise InputError("no turn is open: call begin_turn first")
        return self._turn

    def _require_text_open(self) -> _Turn:
        t = self._require_turn()
        if t.text_ended:
            raise InputError("text already ended for this turn")
        return t
