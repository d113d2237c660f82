"""Every size a caller controls, bounded in one place: text, voices, context, frames.

The CLI, the streaming session, the scheduler, the HTTP/WebSocket service and the LocalAI backend all
check through these, so a limit means the same everywhere and is checked before any work is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ContextLimitError, InputError, TextTooLongError

HARD_MAX_FRAMES = 3750              # 5 minutes of audio per turn
MAX_CONTEXT_ROWS = 1 << 17          # no model context is longer (Qwen3: 32K; rows hold one id each)
DEFAULT_MAX_TEXT_CHARS = 4096       # one text (a synth text, an HTTP input): the CLI's and the server's default
# the offline tools' stream context (synth, replay, bench); the server's slots default to 4096 rows
# (app.settings.SERVER_MAX_CONTEXT_ROWS): a served stream holds its KV slot for as long as it is open
DEFAULT_MAX_CONTEXT_ROWS = 8192


@dataclass(frozen=True)
class Limits:
    """Bounds on caller input (validated on construction)."""

    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS   # characters of one text
    max_voice_seconds: float = 30.0     # a voice-clone reference (its rows sit in every turn's context)
    max_user_audio_seconds: float = 60.0  # user audio given as turn context
    min_audio_seconds: float = 0.5      # shorter references carry no usable timbre
    min_sample_rate: int = 8000         # reference audio below this is not speech audio
    max_sample_rate: int = 384000
    max_context_rows: int = DEFAULT_MAX_CONTEXT_ROWS   # rows of one stream's KV context (its slot size)
    max_frames: int = HARD_MAX_FRAMES   # frames of one turn

    def __post_init__(self) -> None:
        def whole(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InputError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")

        def real(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise InputError(f"{name} must be a number in {lo}..{hi}, got {v!r}")

        whole("max_text_chars", 1, 1_000_000)
        real("max_voice_seconds", 1.0, 600.0)
        real("max_user_audio_seconds", 1.0, 600.0)
        real("min_audio_seconds", 0.0, 10.0)
        whole("min_sample_rate", 1000, 48000)
        whole("max_sample_rate", 8000, 1_000_000)
        whole("max_context_rows", 16, MAX_CONTEXT_ROWS)
        whole("max_frames", 1, HARD_MAX_FRAMES)

    # ------------------------------------------------------------------ checks
    def check_text_chars(self, text: str) -> str:
        if not isinstance(text, str) or not text.strip():
            raise InputError("text is empty")
        if len(text) > self.max_text_chars:
            raise TextTooLongError(f"text is {len(text)} characters; the limit is {self.max_text_chars}")
        return text

    def check_audio_seconds(self, seconds: float, what: str = "voice reference", user_audio: bool = False) -> None:
        limit = self.max_user_audio_seconds if user_audio else self.max_voice_seconds
        if not math.isfinite(seconds) or seconds > limit:
            raise InputError(f"{what} is {seconds:.1f} s long; the limit is {limit:g} s")
        if seconds < self.min_audio_seconds:
            raise InputError(f"{what} is {seconds:.2f} s long; at least {self.min_audio_seconds:g} s is needed")

    def max_decoded_samples(self, user_audio: bool = False) -> int:
        """Samples (channels x frames) an audio file may decode to: those of the longest mono file at the
        highest rate allowed, so a file of many channels (a decompression bomb) is refused from its header."""
        seconds = self.max_user_audio_seconds if user_audio else self.max_voice_seconds
        return int(seconds * self.max_sample_rate)

    def check_decoded_samples(self, channels: int, frames: int, what: str = "voice reference",
                              user_audio: bool = False) -> None:
        limit = self.max_decoded_samples(user_audio)
        if channels < 1 or channels * frames > limit:
            raise InputError(f"{what} has {channels} channels of {frames} frames: {channels * frames} samples to "
                             f"decode; the limit is {limit} (mix it down to mono or stereo)")

    def check_sample_rate(self, sample_rate: int, what: str = "voice reference") -> None:
        if not isinstance(sample_rate, int) or not self.min_sample_rate <= sample_rate <= self.max_sample_rate:
            raise InputError(f"{what} has sample rate {sample_rate!r} Hz; supported: {self.min_sample_rate}.."
                             f"{self.max_sample_rate} Hz")

    def check_max_frames(self, max_frames: object) -> int | None:
        """``max_frames`` as given (None: the default applies), or an InputError when it is not an integer
        in 1..``self.max_frames``."""
        if max_frames is None:
            return None
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or not 1 <= max_frames <= self.max_frames:
            raise InputError(f"max_frames must be an integer in 1..{self.max_frames}, got {max_frames!r}")
        return max_frames

    def default_max_frames(self, text_ids: int) -> int:
        """Upstream has no cap; ours: generous for speech (~3-4 frames per id), clamped to the hard limit."""
        return min(self.max_frames, 60 + 10 * text_ids)

    def check_turn_fits(self, text_ids: int, prompt_rows: int, context_rows: int, text_lead: int,
                        max_frames: int | None = None) -> None:
        """Refuse, before any work, a turn whose text cannot be fed whole: every id takes a context row
        and (after the first ``text_lead``) one frame, and at least one frame must follow the text."""
        frames_needed = max(text_ids - text_lead + 1, 1) + 1
        rows_needed = context_rows + prompt_rows + text_ids + 1
        frame_cap = max_frames if max_frames is not None else self.max_frames
        if rows_needed > self.max_context_rows:
            room = self.max_context_rows - context_rows - prompt_rows - 1
            raise ContextLimitError(
                f"context limit: the turn needs {rows_needed} rows ({context_rows} in context, {prompt_rows} of "
                f"prompt, {text_ids} text tokens) but max_context_rows is {self.max_context_rows}; at most "
                f"{max(room, 0)} text tokens fit")
        if frames_needed > frame_cap:
            raise InputError(f"the text has {text_ids} tokens; a turn of at most {frame_cap} frames can speak at "
                             f"most {frame_cap + text_lead - 2} (max_frames)")
