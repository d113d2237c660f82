"""One whole utterance (a text and its settings), checked once for every route that speaks one: OpenAI's
``/v1/audio/speech``, the ElevenLabs HTTP routes and LocalAI's ``TTS``/``TTSStream``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import ContextLimitError, InputError, TextTooLongError
from engine.generate import utterance_ids
from engine.handles import EventSink, StreamHandle
from engine.sampling import SamplingParams

from ..errors import ApiError


@dataclass(frozen=True)
class Utterance:
    text: str
    ids: list[int]
    voice: np.ndarray | None
    params: SamplingParams
    seed: int | None
    max_frames: int | None
    allow_special_tokens: bool

    async def start(self, service, sink: EventSink, arrived: float | None = None) -> StreamHandle:
        """Its stream on the event loop: waiting for a slot awaits; the queue timeout counts from ``arrived``
        (the request's arrival), so it is the time to the 429. Fed as text: frames say which characters they
        read."""
        return await service.astart_utterance(self.ids, self.voice, self.params, self.seed, sink, self.max_frames,
                                              self.allow_special_tokens, arrived=arrived, text=self.text)

    def start_blocking(self, service, sink: EventSink, wait: float | None = None) -> StreamHandle:
        """Its stream from a thread (gRPC), waiting at most ``wait`` s for a slot."""
        return service.start_utterance(self.ids, self.voice, self.params, self.seed, sink, self.max_frames,
                                       self.allow_special_tokens, wait=wait, text=self.text)


def prepare_utterance(service, text: str, voice: np.ndarray | None, sampling, max_frames: int | None = None,
                      allow_special_tokens: bool = False, param: str = "input") -> Utterance:
    """The checked utterance, or the catalogue's error naming ``param``: ``empty_input``, ``input_too_long``
    (it cannot be spoken whole within a stream's context and frame limit), ``invalid_value``. ``voice`` is
    already resolved (its codes); ``sampling`` a :class:`~app.service.SamplingFields`."""
    service.require_ready()
    if not isinstance(text, str) or not text.strip():
        raise ApiError("empty_input", f"{param} is empty", param)
    params = service.sampling(sampling)
    try:
        max_frames = service.limits.check_max_frames(max_frames)
    except InputError as e:
        raise ApiError("invalid_value", str(e), "max_frames") from None
    try:
        ids = utterance_ids(service.model, service.limits, voice, max_frames, text=text,
                            allow_special_tokens=allow_special_tokens)
    except (TextTooLongError, ContextLimitError) as e:
        raise ApiError("input_too_long", str(e), param) from None
    except InputError as e:
        raise ApiError("invalid_value", str(e), param) from None
    return Utterance(text, ids, voice, params, sampling.seed, max_frames, allow_special_tokens)
