"""Offline synthesis (upstream ``inferencer.py``): text (+ voice) in, codes and a waveform out.

It is a one-turn streaming session given all its ids at once: prefill the TTS prompt plus the first
``min(12, L)`` ids (audio BOS on the last) → frame 0; one row per step (the next id, or ``<|text_pad|>``
once the text is used up, beside the previous frame) → the next frame; stop when codebook 0 is EOS
(that frame is dropped) or at the frame limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import InputError
from .sampling import SamplingParams
from .session import StreamingSession, check_max_frames, default_max_frames, playable
from .tokenizer import check_unicode
from .tts import TTSModel

DEFAULT_MAX_TEXT_CHARS = 4000


@dataclass
class Generation:
    codes: np.ndarray                 # [frames, 16] int64, EOS frame dropped
    raw_frames: np.ndarray            # every frame produced, EOS frame included
    stopped_on_eos: bool
    seed: int
    rows: list[np.ndarray] = field(default_factory=list)  # every grid row block fed, in order


def resolve_voice(model: TTSModel, voice_wav: tuple[np.ndarray, int] | None = None,
                  voice_codes: np.ndarray | None = None) -> np.ndarray | None:
    """A voice reference as ``[frames, 16]`` codes, from a recording (encoded by the bundle's codec) or
    from codes ``[frames, K >= 16]`` (validated)."""
    if voice_wav is not None and voice_codes is not None:
        raise InputError("give a voice waveform or voice codes, not both")
    if voice_wav is not None:
        return model.voice_codes_from_wav(*voice_wav)
    if voice_codes is not None:
        return model.prompt.check_voice_codes(voice_codes)
    return None


def check_text(text: str, max_chars: int = DEFAULT_MAX_TEXT_CHARS) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InputError("text is empty")
    if len(text) > max_chars:
        raise InputError(f"text is {len(text)} characters; the limit is {max_chars}")
    return check_unicode(text)


def generate(model: TTSModel, text: str | None = None, text_ids=None, voice_codes: np.ndarray | None = None,
             params: SamplingParams | None = None, seed: int | None = None, max_frames: int | None = None,
             max_text_chars: int = DEFAULT_MAX_TEXT_CHARS) -> Generation:
    """Whole-utterance synthesis to codes. Give ``text`` or ``text_ids``."""
    if (text is None) == (text_ids is None):
        raise InputError("give text or text_ids")
    ids = model.check_text_ids(model.tokenizer.encode(check_text(text, max_text_chars)) if text is not None
                               else text_ids)
    if ids.size == 0:
        raise InputError("no text to synthesize")
    limit = check_max_frames(max_frames) or default_max_frames(ids.size)
    voice = model.prompt.check_voice_codes(voice_codes) if voice_codes is not None else None
    # room for the whole turn, so a long generation never runs into the context limit
    rows = len(model.prompt.tts_prompt(voice)) + model.ids.prefill_text_tokens + limit
    session = StreamingSession(model, voice_codes=voice, params=params, seed=seed, max_context_rows=rows,
                               decode_audio=False)
    try:
        session.begin_turn(max_frames=limit)
        frames = session.push_token_ids(ids) + session.end_text() + session.drain()
        raw = np.stack([f.codes for f in frames]).astype(np.int64)
        stopped = bool(frames[-1].eos)
        return Generation(codes=raw[:-1] if stopped else raw, raw_frames=raw, stopped_on_eos=stopped,
                          seed=session.rng.seed, rows=list(session.context))
    finally:
        session.close()


def synthesize(model: TTSModel, generation: Generation) -> np.ndarray:
    """Decode a generation's codes through the codec's streaming decoder, frame by frame (frames that
    are not playable are dropped, as in a streaming session)."""
    codes = [c for c in generation.codes if playable(c, model.codec.codebook_size)]
    if not codes:
        return np.zeros(0, np.float32)
    dec = model.codec.streaming_decoder(1, model.ids.rvq)
    return np.concatenate([dec.decode(c[None]) for c in codes])
