"""Offline synthesis (upstream ``inferencer.py``): text (+ voice) in, codes and a waveform out.

It is a one-turn streaming session given all its ids at once: prefill the TTS prompt plus the first
``min(12, L)`` ids (audio BOS on the last) → frame 0; one row per step (the next id, or ``<|text_pad|>``
once the text is used up, beside the previous frame) → the next frame; stop when codebook 0 is EOS
(that frame is dropped) or at the frame limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine.audio.voices import resolve_voice
from engine.errors import InputError
from engine.limits import Limits
from engine.model.sampling import SamplingParams
from engine.model.spec import ModelSpec
from engine.model.tts import TTSModel
from engine.offline.session import StreamingSession
from engine.offline.turn import run_turn
from engine.serving.stream import FinishReason, playable


@dataclass
class Generation:
    """One utterance's codes, as :func:`generate` made them."""

    codes: np.ndarray                 # [frames, 16] int64, EOS frame dropped
    raw_frames: np.ndarray            # every frame produced, EOS frame included
    stopped_on_eos: bool
    seed: int
    finish_reason: FinishReason = FinishReason.EOS
    rows: list[np.ndarray] = field(default_factory=list)  # every grid row block fed, in order


def generate(model: TTSModel, text: str | None = None, text_ids: Iterable[int] | None = None,
             voice_codes: npt.ArrayLike | None = None,
             params: SamplingParams | None = None, seed: int | None = None, max_frames: int | None = None,
             limits: Limits | None = None, allow_special_tokens: bool = False) -> Generation:
    """Whole-utterance synthesis to codes. Give ``text`` or ``text_ids``. Text that cannot be spoken whole
    within the limits (context rows, frames) is refused before any work."""
    limits = limits or Limits()
    if (text is None) == (text_ids is None):
        raise InputError("give text or text_ids")
    max_frames = limits.check_max_frames(max_frames)
    voice = resolve_voice(model, limits, codes=voice_codes)
    ids = utterance_ids(model, limits, voice, max_frames, text=text, text_ids=text_ids,
                        allow_special_tokens=allow_special_tokens)
    frame_cap = max_frames or limits.default_max_frames(ids.size)
    session = StreamingSession(model, voice_codes=voice, params=params, seed=seed, decode_audio=False,
                               limits=limits, allow_special_tokens=allow_special_tokens)
    try:
        turn = run_turn(session, token_ids=ids, max_frames=frame_cap)
        raw = np.stack([f.codes for f in turn.frames]).astype(np.int64)
        stopped = bool(turn.frames[-1].eos)
        finish = turn.stats.finish_reason if turn.stats is not None else None
        assert finish is not None, "run_turn drains the turn to its end (EOS or the frame cap)"
        return Generation(codes=raw[:-1] if stopped else raw, raw_frames=raw, stopped_on_eos=stopped,
                          seed=session.seed, finish_reason=finish, rows=list(session.context))
    finally:
        session.close()


def utterance_ids(model: ModelSpec, limits: Limits, voice_codes: npt.NDArray[np.int64] | None,
                  max_frames: int | None, text: str | None = None, text_ids: Iterable[int] | None = None,
                  allow_special_tokens: bool = False) -> npt.NDArray[np.int64]:
    """The ids of a whole utterance (a first turn with this voice, no user context), refused before any
    work when it cannot be spoken whole: empty, over the character limit (TextTooLongError), or more ids
    than the context rows or the frame cap (``max_frames``, already checked, else the default) allow
    (ContextLimitError). Give ``text`` or ``text_ids``."""
    if text is not None:
        ids = model.check_text_ids(model.tokenizer.encode(limits.check_text_chars(text), allow_special_tokens))
    elif text_ids is None:
        raise InputError("give text or text_ids")
    else:
        ids = model.check_text_ids(text_ids)
    if ids.size == 0:
        raise InputError("no text to synthesize")
    limits.check_turn_fits(int(ids.size), len(model.prompt.tts_prompt(voice_codes)), 0, model.layout.text_lead,
                           max_frames or limits.default_max_frames(ids.size))
    return ids


def synthesize(model: TTSModel, generation: Generation) -> npt.NDArray[np.float32]:
    """Decode a generation's codes in as few codec calls as the codec allows (each call reads all of the
    codec's weights; the audio is the same for any chunking); frames that are not playable are dropped,
    as in a streaming session."""
    codes = [c for c in generation.codes if playable(c, model.layout.codebook_size)]
    if not codes:
        return np.zeros(0, np.float32)
    return model.codec.decode(np.stack(codes), model.layout.codebooks)
