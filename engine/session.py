"""Streaming sessions: text (deltas or token ids) in, frames with their audio out, turns sharing one
KV cache.

Lifecycle::

    s = StreamingSession(model, voice_codes=..., params=..., seed=...)
    s.begin_turn(user_text=..., user_audio_codes=...)    # optional user context, laid out as upstream
    s.push_text("Hel") / s.push_token_ids([...])        # frames come back as soon as they exist
    s.end_text()                                         # remaining ids, one frame each
    while not s.turn_done: s.step()                      # <|text_pad|> frames until EOS or the frame limit
    s.begin_turn(...)                                    # next turn: positions continue in the same cache
    s.cancel()                                           # barge-in at any time; the session stays usable
    s.close()

Pacing (upstream semantics, model spec §5.3): nothing is computed until 12 ids are committed (or the
text ends with fewer); the prefill then yields frame 0; afterwards every committed id yields exactly
one frame. ``<|text_pad|>`` is never fed before end of text: without new ids the session waits and
counts the stall, so a service can report underruns.

Cancel semantics: rows already fed to the backbone stay in the context (they were computed); ids
committed but not fed, and the last frame (never fed, exactly as after EOS), are dropped. The next
turn's output therefore equals that of a session whose context holds the cancelled turn's fed rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .errors import InputError
from .prompt import USER_END_ASSISTANT
from .sampling import FrameRandom, SamplingParams
from .textstream import TextCommitter
from .tts import BackboneCache, ContextLimitError, TTSModel

DEFAULT_MAX_CONTEXT_ROWS = 8192
HARD_MAX_FRAMES = 3750  # 5 minutes of audio per turn


def default_max_frames(text_tokens: int) -> int:
    """Upstream has no cap; ours: generous for speech (~3-4 frames per token), clamped to 5 minutes."""
    return min(HARD_MAX_FRAMES, 60 + 10 * text_tokens)


def check_max_frames(max_frames) -> int | None:
    if max_frames is None:
        return None
    if isinstance(max_frames, bool) or not isinstance(max_frames, (int, np.integer)) \
            or not 1 <= max_frames <= HARD_MAX_FRAMES:
        raise InputError(f"max_frames must be an integer in 1..{HARD_MAX_FRAMES}, got {max_frames!r}")
    return int(max_frames)


def playable(codes: np.ndarray, codebook_size: int) -> bool:
    """Whether a frame can go to the codec: every code a codec code (the model can, rarely, sample the
    pad/BOS/EOS ids in some codebook; upstream drops such frames, and so do we, counting them)."""
    return bool((codes < codebook_size).all() and (codes >= 0).all())


class TurnState(enum.Enum):
    IDLE = "idle"            # no turn open
    WAITING = "waiting"      # turn open, fewer than 12 ids committed and text not ended
    RUNNING = "running"      # prefilled; frames follow committed ids
    DONE = "done"            # EOS, frame limit, context limit or cancel


@dataclass
class Frame:
    """One generated frame. ``audio`` is its 1920 samples, or None for the EOS frame, for frames that are
    not :func:`playable` (dropped from the audio, which continues with the next frame) and when the
    session does not decode audio."""

    index: int
    codes: np.ndarray
    audio: np.ndarray | None
    eos: bool = False


@dataclass
class TurnStats:
    text_ids: int = 0
    frames: int = 0
    stalls: int = 0          # step() calls that found no committed id while text could still come
    dropped_frames: int = 0  # non-EOS frames with non-codec codes (no audio)
    finish_reason: str | None = None  # "eos", "max_frames", "context_limit", "cancelled", "no_text"
    prefill_rows: int = 0


@dataclass
class _Turn:
    prompt_rows: np.ndarray
    committer: TextCommitter
    params: SamplingParams
    pending: list[int] = field(default_factory=list)   # committed ids not yet fed
    frames: list[np.ndarray] = field(default_factory=list)
    text_ended: bool = False
    input_kind: str | None = None   # "text" or "ids": a turn takes one kind of assistant input
    max_frames: int | None = None
    stats: TurnStats = field(default_factory=TurnStats)


class StreamingSession:
    def __init__(self, model: TTSModel, voice_codes: np.ndarray | None = None,
                 params: SamplingParams | None = None, seed: int | None = None,
                 max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS, decode_audio: bool = True):
        self.model = model
        self.voice_codes = model.prompt.check_voice_codes(voice_codes) if voice_codes is not None else None
        self.params = (params or model.default_sampling()).validated()
        self.rng = FrameRandom(seed, model.ids.rvq)
        self.cache: BackboneCache | None = model.new_cache(max_rows=max_context_rows)
        self.decode_audio = decode_audio
        self.context: list[np.ndarray] = []   # every row block fed, in order
        self.turns = 0
        self.state = TurnState.IDLE
        self._turn: _Turn | None = None
        self._decoder = model.codec.streaming_decoder(1, model.ids.rvq) if decode_audio else None
        self._special_strings = model.tokenizer.added_tokens()

    # ------------------------------------------------------------------ properties
    @property
    def context_rows(self) -> int:
        return int(self.cache.lengths[0]) if self.cache is not None else 0

    @property
    def turn_done(self) -> bool:
        return self.state is TurnState.DONE

    @property
    def stats(self) -> TurnStats:
        self._require_turn()
        return self._turn.stats

    @property
    def closed(self) -> bool:
        return self.cache is None

    def context_ids(self) -> np.ndarray:
        return np.concatenate(self.context) if self.context else np.zeros((0, 1 + self.model.ids.rvq), np.int64)

    # ------------------------------------------------------------------ turn lifecycle
    def begin_turn(self, user_text: str = "", user_audio_codes: np.ndarray | None = None,
                   user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
                   params: SamplingParams | None = None) -> None:
        """Open a turn. The first turn's rows hold the system block (and voice); with user context they
        continue with upstream's user segment (text, then the user's audio after the 12-token delay), then
        the assistant header. Later turns add only the user segment (or the bare turn separator) on top of
        the cache, positions continuing. ``params`` apply to this turn only (default: the session's).
        A turn that cannot open raises and leaves the session as it was."""
        self._require_open()
        if self.state in (TurnState.WAITING, TurnState.RUNNING):
            raise InputError("a turn is in progress: end it (end_text and step until done) or cancel it first")
        if user_audio_codes is not None and user_audio_wav is not None:
            raise InputError("give user audio as codes or as a waveform, not both")
        max_frames = check_max_frames(max_frames)
        turn_params = params.validated() if params is not None else self.params
        if user_audio_wav is not None:
            user_audio_codes = self.model.voice_codes_from_wav(*user_audio_wav)
        p = self.model.prompt
        has_user = bool(user_text) or user_audio_codes is not None
        if self.turns == 0:
            rows = np.concatenate([p.system_block(self.voice_codes), p.user_turn(user_text, user_audio_codes)]) \
                if has_user else p.tts_prompt(self.voice_codes)
        else:
            rows = p.user_turn(user_text, user_audio_codes) if has_user else p.text_rows(
                self.model.tokenizer.encode(USER_END_ASSISTANT))
        if self.context_rows + len(rows) + self.model.ids.prefill_text_tokens > self.cache.max_rows:
            raise ContextLimitError(f"context limit: the turn's {len(rows)} prompt rows do not fit "
                                    f"({self.context_rows} of {self.cache.max_rows} rows used)")
        self._turn = _Turn(prompt_rows=rows, max_frames=max_frames, params=turn_params,
                           committer=TextCommitter(self.model.tokenizer.backend, self._special_strings))
        self.state = TurnState.WAITING
        if self._decoder is not None:
            self._decoder.reset()  # each turn's audio is its own stream (as upstream)

    def push_text(self, delta: str | bytes) -> list[Frame]:
        """Add assistant text (any split, bytes may cut UTF-8 characters); returns the frames it yields."""
        self._require_text_open()
        self._set_input_kind("text")
        return self._feed(self._turn.committer.push(delta))

    def push_token_ids(self, ids) -> list[Frame]:
        """Add assistant token ids (fed exactly as given)."""
        self._require_text_open()
        arr = self.model.check_text_ids(ids)
        self._set_input_kind("ids")
        return self._feed([int(i) for i in arr])

    def end_text(self) -> list[Frame]:
        """No more text this turn: commits the rest, prefills if needed, and steps through pending ids."""
        self._require_turn()
        if self._turn.text_ended:
            raise InputError("text already ended for this turn")
        tail = self._turn.committer.finish()
        self._turn.text_ended = True
        return self._feed(tail)

    def step(self) -> list[Frame]:
        """After end of text: one ``<|text_pad|>`` frame (or nothing once the turn is done). Before it:
        nothing is fed; the call counts a stall."""
        self._require_turn()
        t = self._turn
        if self.state is TurnState.DONE:
            return []
        if not t.text_ended:
            t.stats.stalls += 1
            return []
        return self._advance(self.model.ids.text_pad)

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
        self._require_open()
        if self._turn is not None and self.state is not TurnState.DONE:
            self._finish("cancelled")

    def close(self) -> None:
        """Free the session's memory (KV cache, codec state). Further calls raise."""
        self.cache = None
        self._decoder = None
        self._turn = None
        self.context = []
        self.state = TurnState.IDLE

    # ------------------------------------------------------------------ internals
    def _feed(self, ids: list[int]) -> list[Frame]:
        t = self._turn
        if self.state is TurnState.DONE:
            return []  # text after EOS: nothing more is generated this turn (as upstream)
        t.pending += ids
        t.stats.text_ids += len(ids)
        out: list[Frame] = []
        if self.state is TurnState.WAITING:
            n = self.model.ids.prefill_text_tokens
            if len(t.pending) < n and not t.text_ended:
                return out
            if not t.pending:
                if t.text_ended:
                    self._finish("no_text")
                return out
            out += self._prefill()
        while t.pending and self.state is TurnState.RUNNING:
            out += self._advance(t.pending.pop(0))
        return out

    def _prefill(self) -> list[Frame]:
        t = self._turn
        n = min(self.model.ids.prefill_text_tokens, len(t.pending))
        text, t.pending = t.pending[:n], t.pending[n:]
        rows = np.concatenate([t.prompt_rows, self.model.prompt.prefill_text(text)])
        t.stats.prefill_rows = len(rows)
        self.state = TurnState.RUNNING
        self.turns += 1
        return self._run(rows, first=True)

    def _frame_limit(self) -> int:
        """The turn's frame cap: as asked, else generous for the text seen so far (it grows with it)."""
        t = self._turn
        return t.max_frames if t.max_frames is not None else default_max_frames(t.stats.text_ids)

    def _advance(self, text_id: int) -> list[Frame]:
        t = self._turn
        if t.stats.frames >= self._frame_limit():
            self._finish("max_frames")
            return []
        return self._run(self.model.prompt.step_row(text_id, t.frames[-1]), first=False)

    def _run(self, rows: np.ndarray, first: bool) -> list[Frame]:
        t, m = self._turn, self.model
        try:
            hidden = m.backbone(rows[None], self.cache)[:, -1]
        except ContextLimitError:
            self._finish("context_limit")
            return []
        self.context.append(rows)
        window = t.params.repetition_window
        history = np.full((1, window, m.ids.rvq), m.history_pad, np.int64)
        recent = t.frames[-window:]
        if recent:
            history[0, window - len(recent):] = np.stack(recent)
        codes = m.depth(hidden, history, [t.params], self.rng.next_frame()[None], first_frame=first).codes[0]
        t.frames.append(codes)
        t.stats.frames += 1
        frame = Frame(index=len(t.frames) - 1, codes=codes, audio=None)
        if codes[0] == m.ids.audio_eos:
            frame.eos = True
            self._finish("eos")
        elif not playable(codes, m.codec.codebook_size):
            t.stats.dropped_frames += 1
        elif self._decoder is not None:
            frame.audio = self._decoder.decode(codes[None])
        if not frame.eos and t.text_ended and not t.pending and t.stats.frames >= self._frame_limit():
            self._finish("max_frames")
        return [frame]

    def _finish(self, reason: str) -> None:
        self._turn.stats.finish_reason = reason
        self._turn.pending = []
        self.state = TurnState.DONE

    def _set_input_kind(self, kind: str) -> None:
        t = self._turn
        if t.input_kind not in (None, kind):
            raise InputError(f"this turn already takes {'text deltas' if t.input_kind == 'text' else 'token ids'}; "
                             "do not mix text deltas and token ids in one turn")
        t.input_kind = kind

    def _require_open(self) -> None:
        if self.cache is None:
            raise InputError("the session is closed")

    def _require_turn(self) -> None:
        self._require_open()
        if self._turn is None:
            raise InputError("no turn is open: call begin_turn first")

    def _require_text_open(self) -> None:
        self._require_turn()
        if self._turn.text_ended:
            raise InputError("text already ended for this turn")
