"""The 17-column prompt grid: column 0 a text id, columns 1..16 the 16 audio codebooks of a frame.

Layouts follow upstream exactly (model spec §3): the system block with an optional voice-clone
context, the assistant header, the assistant prefill rows with audio BOS, step rows, and the streaming
processor's user segment with its 12-token text/audio delay. Caller text inside the templates is text
(never control tokens) unless the caller allows special tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.model.tokenizer import TextTokenizer, Trusted

# text ids as a list or a flat int64 array
TextIds = Sequence[int] | npt.NDArray[np.int64]

SYSTEM_PROMPT = (
    "<|im_start|>system\nYou are a highly expressive text-to-speech (TTS) engine developed by Mosi Intelligence. \n"
    "You possess natural language understanding, emotional modeling, and multi-style speech generation "
    "capabilities, allowing you to generate the corresponding speech based on the text given in the assistant."
    "<|im_end|>\n"
)
VOICE_CONTEXT_HEADER = ("<|im_start|>context\nThe assistant section should be synthesized using the following "
                        "voice timbre:")
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_SEPARATOR = "<|im_end|>\n"
USER_HEADER = "<|im_end|>\n<|im_start|>user\n"
USER_END_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class GridLayout:
    """What the grid's columns hold and the special values they use; all from the bundle manifest."""

    codebooks: int          # audio columns 1..codebooks (16 RVQ levels)
    codebook_size: int      # valid codec codes are 0..codebook_size-1
    audio_pad: int          # audio column value of rows without audio
    audio_bos: int
    audio_eos: int
    text_pad_id: int        # <|text_pad|>: fed once the text has run out
    audio_pad_text_id: int  # <|audio_pad|>: text id of voice-reference rows
    text_lead: int          # text leads audio by this many ids (the prefill's text rows)

    @property
    def columns(self) -> int:
        return 1 + self.codebooks


class PromptBuilder:
    """The grid rows of every prompt part (system block, headers, user turns, steps) for one layout."""

    def __init__(self, tokenizer: TextTokenizer, layout: GridLayout) -> None:
        self.tok = tokenizer
        self.layout = layout

    # ------------------------------------------------------------------ rows
    def text_rows(self, ids: TextIds) -> npt.NDArray[np.int64]:
        """Rows with the given text ids and every audio column at the audio pad."""
        rows = np.full((len(ids), self.layout.columns), self.layout.audio_pad, np.int64)
        rows[:, 0] = ids
        return rows

    def step_row(self, text_id: int, frame: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """One decode-step row: the next text id (or text pad) beside the previous frame's 16 codes."""
        row = np.empty((1, self.layout.columns), np.int64)
        row[0, 0] = text_id
        row[0, 1:] = frame
        return row

    def check_codes(self, codes: npt.ArrayLike, what: str = "voice codes") -> npt.NDArray[np.int64]:
        """Reference codes ``[frames, K >= 16]`` → ``[frames, 16]`` int64 (first 16 levels), range-checked.

        The layout is always explicit ``[frames, levels]``: unlike upstream we never guess a transpose.
        """
        raw = np.asarray(codes)
        n = self.layout.codebooks
        if raw.ndim != 2 or raw.shape[1] < n or raw.shape[0] == 0:
            raise InputError(f"{what} must be [frames >= 1, levels >= {n}], got shape {raw.shape}")
        if not np.issubdtype(raw.dtype, np.integer):
            raise InputError(f"{what} must be integers, got {raw.dtype}")
        arr = raw[:, :n].astype(np.int64)
        if arr.min() < 0 or arr.max() >= self.layout.codebook_size:
            raise InputError(f"{what} must lie in 0..{self.layout.codebook_size - 1}")
        return arr

    def system_block(self, voice_codes: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
        """``make_ensemble``: the system prompt, plus the voice-clone context with one
        ``<|audio_pad|>`` row per reference frame carrying that frame's codes."""
        text = SYSTEM_PROMPT
        if voice_codes is not None:
            text += VOICE_CONTEXT_HEADER + "<|audio_pad|>" * len(voice_codes) + TURN_SEPARATOR
        rows = self.text_rows(self.tok.encode_parts([Trusted(text)]))
        if voice_codes is not None:
            slots = np.flatnonzero(rows[:, 0] == self.layout.audio_pad_text_id)
            if len(slots) != len(voice_codes):
                raise AssertionError("tokenizer did not keep <|audio_pad|> as one token per frame")
            rows[slots, 1:] = voice_codes
        return rows

    @functools.cached_property
    def assistant_header(self) -> npt.NDArray[np.int64]:
        """The rows of the assistant header that follows a text-only system block."""
        return self.text_rows(self.tok.encode_parts([Trusted(ASSISTANT_HEADER)]))

    def tts_prompt(self, voice_codes: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
        """Non-streaming TTS prompt (upstream ``inferencer.py``): system block + assistant header."""
        return np.concatenate([self.system_block(voice_codes), self.assistant_header])

    def turn_prompt(self, first_turn: bool, voice_codes: npt.NDArray[np.int64] | None, user_text: str = "",
                    user_audio: npt.NDArray[np.int64] | None = None,
                    allow_special: bool = False) -> npt.NDArray[np.int64]:
        """The rows that open an assistant turn. A stream's first turn holds the system block (and voice);
        with user context it continues with upstream's user segment, else with the assistant header.
        Later turns hold only the user segment, or the bare turn separator + assistant header."""
        has_user = bool(user_text) or user_audio is not None
        if first_turn:
            if not has_user:
                return self.tts_prompt(voice_codes)
            return np.concatenate([self.system_block(voice_codes),
                                   self.user_turn(user_text, user_audio, allow_special=allow_special)])
        if has_user:
            return self.user_turn(user_text, user_audio, allow_special=allow_special)
        return self.text_rows(self.tok.encode_parts([Trusted(USER_END_ASSISTANT)]))

    def prefill_text(self, text_ids: TextIds) -> npt.NDArray[np.int64]:
        """The first ``min(12, L)`` assistant text rows, audio BOS in codebook 0 of the last one."""
        n = min(self.layout.text_lead, len(text_ids))
        if n == 0:
            raise InputError("no text to synthesize")
        rows = self.text_rows(list(text_ids[:n]))
        rows[-1, 1] = self.layout.audio_bos
        return rows

    def user_turn(self, user_text: str = "", user_audio: npt.NDArray[np.int64] | None = None,
                  leading: str = USER_HEADER, allow_special: bool = False) -> npt.NDArray[np.int64]:
        """``make_user_prompt``: user text (+ text pads) with the user's audio placed after a
        ``min(L, 12)``-token delay between BOS and EOS, then the assistant header.

        Text-only turns (no audio) have no pads and no BOS/EOS (upstream app's layout).
        """
        # Strings are tokenized whole, as upstream does (so a text starting with "\n" merges with the
        # header's newline); row positions come from the separately measured header and text lengths.
        def enc(*parts: str | Trusted) -> list[int]:
            return self.tok.encode_parts(list(parts), allow_special=allow_special)

        if user_audio is None or len(user_audio) == 0:
            return self.text_rows(enc(Trusted(leading), user_text, Trusted(USER_END_ASSISTANT)))
        audio = self.check_codes(user_audio, "user audio codes")
        lay = self.layout
        tail = self.text_rows(enc(Trusted(USER_END_ASSISTANT)))
        s = len(enc(Trusted(leading)))
        A, L, delay = len(audio), len(enc(user_text)) if user_text else 0, lay.text_lead
        pads = A + delay - L + 1 if L >= delay else A + 1
        pad_text = self.tok.decode([lay.text_pad_id])
        body = self.text_rows(enc(Trusted(leading), user_text, Trusted(pad_text * max(pads, 0))))
        first = s + (delay if L >= delay else L)          # row of audio frame 0
        body[first - 1, 1] = lay.audio_bos
        end = min(first + A, len(body))
        body[first:end, 1:] = audio[: end - first]
        if first + A < len(body):
            body[first + A, 1] = lay.audio_eos
        return np.concatenate([body, tail])
