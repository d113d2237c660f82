"""One helper that drives a whole turn of a streaming session: begin → push → end → drain."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.model.sampling import SamplingParams
from engine.offline.session import StreamingSession
from engine.serving.stream import Frame, TurnStats


@dataclass
class TurnResult:
    """A whole turn's frames and its stats (set once the turn is drained)."""

    frames: list[Frame] = field(default_factory=list)   # every frame, the EOS frame included
    stats: TurnStats | None = None

    @property
    def audible(self) -> list[Frame]:
        """The frames that carry audio codes: every one but the EOS frame."""
        return [f for f in self.frames if not f.eos]

    def codes(self, codebooks: int = 16) -> npt.NDArray[np.int64]:
        """[frames, 16] int64 codes of the turn, EOS frame dropped."""
        audible = self.audible
        if not audible:
            return np.zeros((0, codebooks), np.int64)
        return np.stack([f.codes for f in audible]).astype(np.int64)

    def audio(self) -> np.ndarray:
        """The turn's waveform: the audio of every decoded frame, in order."""
        parts = [f.audio for f in self.frames if f.audio is not None]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def run_turn(session: StreamingSession, *, deltas: Iterable[str | bytes] | None = None,
             token_ids: Iterable[int] | None = None, user_text: str = "", user_audio_codes: np.ndarray | None = None,
             user_audio_wav: tuple[np.ndarray, int] | None = None, max_frames: int | None = None,
             params: SamplingParams | None = None) -> TurnResult:
    """Open a turn, feed its assistant input (text ``deltas`` — any iterable of str/bytes — or ``token_ids``),
    end the text and drain to EOS or the turn's limits."""
    if (deltas is None) == (token_ids is None):
        raise InputError("give the turn's assistant input as text deltas or as token ids (exactly one)")
    session.begin_turn(user_text=user_text, user_audio_codes=user_audio_codes, user_audio_wav=user_audio_wav,
                       max_frames=max_frames, params=params)
    result = TurnResult()
    if deltas is not None:
        for delta in deltas:
            result.frames += session.push_text(delta)
    else:
        assert token_ids is not None, "checked above: exactly one input is given"
        result.frames += session.push_token_ids(token_ids)
    result.frames += session.end_text()
    result.frames += session.drain()
    result.stats = session.stats
    return result
