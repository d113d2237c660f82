"""Offline synthesis (upstream ``inferencer.py``): text (+ voice) in, codes and a waveform out.

The loop, as upstream: prefill the prompt plus the first ``min(12, L)`` text ids (audio BOS on the last)
→ frame 0; then each step feeds one row (the next text id, or ``<|text_pad|>`` once the text is used
up, beside the previous frame) → the next frame; stop when codebook 0 is EOS (that frame is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .errors import InputError
from .sampling import FrameRandom, SamplingParams
from .tts import TTSModel

DEFAULT_MAX_TEXT_CHARS = 4000
HARD_MAX_FRAMES = 3750  # 5 minutes of audio


@dataclass
class Generation:
    codes: np.ndarray                 # [frames, 16] int64, EOS frame dropped
    raw_frames: np.ndarray            # every frame produced, EOS frame included
    stopped_on_eos: bool
    seed: int
    rows: list[np.ndarray] = field(default_factory=list)  # every grid row fed, for inspection


def default_max_frames(text_tokens: int) -> int:
    """Upstream has no cap; ours: generous for speech (~3-4 frames per token), clamped to 5 minutes."""
    return min(HARD_MAX_FRAMES, 60 + 10 * text_tokens)


def resolve_voice(model: TTSModel, voice_wav: tuple[np.ndarray, int] | None = None,
                  voice_codes: np.ndarray | None = None) -> np.ndarray | None:
    """A voice reference as ``[frames, 16]`` codes: a waveform is encoded with the bundle's codec (all
    ``ceil(N/1920)`` frames, first 16 levels, as upstream); codes are validated."""
    if voice_wav is not None and voice_codes is not None:
        raise InputError("give a voice waveform or voice codes, not both")
    if voice_wav is not None:
        wav, sr = voice_wav
        return model.codec.encode(wav, sr)[:, : model.ids.rvq]
    if voice_codes is not None:
        return model.prompt.check_voice_codes(voice_codes)
    return None


def check_text(text: str, max_chars: int = DEFAULT_MAX_TEXT_CHARS) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InputError("text is empty")
    if len(text) > max_chars:
        raise InputError(f"text is {len(text)} characters; the limit is {max_chars}")
    return text


def generate_frames(model: TTSModel, text_ids, voice_codes: np.ndarray | None = None,
                    params: SamplingParams | None = None, seed: int | None = None,
                    max_frames: int | None = None, prompt: np.ndarray | None = None,
                    record: Callable[[np.ndarray], None] | None = None) -> Iterator[np.ndarray]:
    """Yield frames ``[16]`` as they are produced (the EOS frame last, if one comes).

    ``prompt`` overrides the default TTS prompt rows (system block [+ voice] + assistant header).
    ``record`` receives every grid row block fed to the backbone.
    """
    params = params or model.default_sampling()
    ids = model.check_text_ids(text_ids)
    if ids.size == 0:
        raise InputError("no text to synthesize")
    max_frames = default_max_frames(ids.size) if max_frames is None else max_frames
    if not isinstance(max_frames, (int, np.integer)) or max_frames < 1:
        raise InputError(f"max_frames must be an integer >= 1, got {max_frames!r}")
    rng = FrameRandom(seed, model.ids.rvq)
    eos, pad = model.ids.audio_eos, model.ids.text_pad
    cache = model.new_cache()
    rows = np.concatenate([model.prompt.tts_prompt(voice_codes) if prompt is None else prompt,
                           model.prompt.prefill_text(ids)])
    window = params.repetition_window
    history = np.full((1, window, model.ids.rvq), model.history_pad, np.int64)
    next_text, produced = min(model.ids.prefill_text_tokens, ids.size), 0
    while True:
        if record:
            record(rows)
        hidden = model.backbone(rows[None], cache)[:, -1]
        frame = model.depth(hidden, history, [params], rng.next_frame()[None], first_frame=produced == 0).codes[0]
        produced += 1
        yield frame
        if frame[0] == eos or produced >= max_frames:
            return
        history = np.roll(history, -1, axis=1)
        history[0, -1] = frame
        text_id = int(ids[next_text]) if next_text < ids.size else pad
        next_text += 1
        rows = model.prompt.step_row(text_id, frame)


def generate(model: TTSModel, text: str | None = None, text_ids=None, voice_codes: np.ndarray | None = None,
             params: SamplingParams | None = None, seed: int | None = None, max_frames: int | None = None,
             max_text_chars: int = DEFAULT_MAX_TEXT_CHARS) -> Generation:
    """Whole-utterance synthesis to codes. Give ``text`` or ``text_ids``."""
    if (text is None) == (text_ids is None):
        raise InputError("give text or text_ids")
    ids = model.tokenizer.encode(check_text(text, max_text_chars)) if text is not None else text_ids
    fed: list[np.ndarray] = []
    rng_seed = FrameRandom(seed, model.ids.rvq).seed  # resolve a random seed once, to report it
    frames = list(generate_frames(model, ids, voice_codes, params, rng_seed, max_frames, record=fed.append))
    raw = np.stack(frames).astype(np.int64)
    stopped = bool(raw[-1, 0] == model.ids.audio_eos)
    codes = raw[:-1] if stopped else raw
    return Generation(codes=codes, raw_frames=raw, stopped_on_eos=stopped, seed=rng_seed, rows=fed)


def synthesize(model: TTSModel, generation: Generation) -> np.ndarray:
    """Decode a generation's codes through the codec's streaming decoder, frame by frame.

    As upstream's frame decoder, a frame holding a non-codec code (pad/BOS/EOS >= 1024 in any
    codebook; the model can sample them, rarely) ends the audio there.
    """
    codes = playable_prefix(generation.codes, model.codec.codebook_size)
    if codes.shape[0] == 0:
        return np.zeros(0, np.float32)
    dec = model.codec.streaming_decoder(1, model.ids.rvq)
    return np.concatenate([dec.decode(codes[f:f + 1]) for f in range(codes.shape[0])])


def playable_prefix(codes: np.ndarray, codebook_size: int) -> np.ndarray:
    """Frames before the first one with a code outside the codec's range."""
    bad = np.flatnonzero((codes >= codebook_size).any(axis=1) | (codes < 0).any(axis=1))
    return codes[: bad[0]] if bad.size else codes
