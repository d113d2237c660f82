"""What the session core needs of the service it is handed, as protocols: :class:`app.service.TTSService`
satisfies each structurally, and a test may hand in any object that does."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.limits import Limits
from engine.model.sampling import SamplingParams
from engine.model.spec import ModelSpec
from engine.serving.handles import EventSink, StreamHandle

from ..settings import ServerSettings
from .policy import SessionPolicy
from .sampling import SamplingFields


class UtteranceService(Protocol):
    """What checking one whole utterance and opening its stream needs (:mod:`app.session.utterance`)."""

    @property
    def settings(self) -> ServerSettings: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def model(self) -> ModelSpec | None: ...

    def require_ready(self) -> None: ...

    def sampling(self, fields: SamplingFields) -> SamplingParams: ...

    def start_utterance(self, ids: np.ndarray, voice_codes: np.ndarray | None, params: SamplingParams,
                        seed: int | None, sink: EventSink, max_frames: int | None = None,
                        allow_special_tokens: bool = False, wait: float | None = None, text: str | None = None,
                        may_park_others: bool = True) -> StreamHandle: ...

    async def astart_utterance(self, ids: np.ndarray, voice_codes: np.ndarray | None, params: SamplingParams,
                               seed: int | None, sink: EventSink, max_frames: int | None = None,
                               allow_special_tokens: bool = False, arrived: float | None = None,
                               text: str | None = None, may_park_others: bool = True) -> StreamHandle: ...


class SpeechService(UtteranceService, Protocol):
    """What starting an HTTP speech reply needs besides (:mod:`app.session.speech`): the request's voice
    resolved to prompt codes, and the bounds of a session."""

    @property
    def policy(self) -> SessionPolicy: ...

    def resolve_voice(self, voice: str | dict[str, object] | None, param: str = "voice") -> np.ndarray | None: ...


class ConversationService(Protocol):
    """What a conversation's stream needs (:mod:`app.session.conversation`): one stream, many turns."""

    def open_stream(self, voice_codes: np.ndarray | None, params: SamplingParams, seed: int | None,
                    sink: EventSink, allow_special_tokens: bool = False, *, one_shot: bool = False,
                    may_park_others: bool = True) -> StreamHandle: ...


class WireService(Protocol):
    """What a WebSocket session's life needs (:mod:`app.session.wire`): its bounds and a count of open
    sessions."""

    @property
    def settings(self) -> ServerSettings: ...

    @property
    def policy(self) -> SessionPolicy: ...

    def claim_session(self) -> bool: ...

    def release_session(self) -> None: ...
