"""One whole utterance (a text and its settings), checked once for every route that speaks one: OpenAI's
``/v1/audio/speech``, the ElevenLabs HTTP routes and LocalAI's ``TTS``/``TTSStream``."""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio.to_thread
import numpy as np

from engine.errors import ContextLimitError, InputError, TextTooLongError
from engine.model.sampling import SamplingParams
from engine.offline.generate import utterance_ids
from engine.serving.handles import EventSink, StreamHandle

from ..alignment.characters import Aligner
from ..alignment.spans import SentAligner
from ..errors import ApiError
from ..normalize import OFF, BudgetExceeded, Normalized, Switches, Work, normalize
from .contracts import UtteranceService
from .policy import speakable
from .sampling import SamplingFields

DISCONNECT_POLL_S = 0.1             # how often a normalizing request looks whether its client is still there
# Normalizing is Python that holds the interpreter lock: one worker at a time already uses all the CPU a process
# can give it, and each more only makes the event loop wait longer for the lock (its /health and every stream's
# frames). Requests past it wait on the loop, holding no thread (docs/normalization.md has the figures).
NORMALIZERS_AT_ONCE = 1
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _normalizer_gate() -> asyncio.Semaphore:
    """The running loop's limit of normalizations at once (a loop's own: asyncio primitives are bound to one)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = asyncio.Semaphore(NORMALIZERS_AT_ONCE)
    return gate


@dataclass(frozen=True)
class Utterance:
    text: str                      # what the model reads: the sent text, normalized if that was asked for
    ids: np.ndarray                # the text's token ids (int64)
    voice: np.ndarray | None
    params: SamplingParams
    seed: int | None
    max_frames: int | None
    allow_special_tokens: bool
    normalized: Normalized         # the text as sent, and where ``text`` differs from it

    def aligner(self, clock: str = "speech") -> Aligner | SentAligner:
        """An aligner for this utterance's frames (fed ``text``) whose spans are in the text as sent."""
        aligner = Aligner(clock)
        return SentAligner(aligner, self.normalized) if self.normalized.changed else aligner

    async def start(self, service: UtteranceService, sink: EventSink, arrived: float | None = None,
                    may_park_others: bool = True) -> StreamHandle:
        """Its stream on the event loop: waiting for a slot awaits; the queue timeout counts from ``arrived``
        (the request's arrival), so it is the time to the 429. Fed as text: frames say which characters they
        read. ``may_park_others`` False: it takes only a free slot (``astart_utterance``)."""
        return await service.astart_utterance(self.ids, self.voice, self.params, self.seed, sink, self.max_frames,
                                              self.allow_special_tokens, arrived=arrived, text=self.text,
                                              may_park_others=may_park_others)

    def start_blocking(self, service: UtteranceService, sink: EventSink, wait: float | None = None) -> StreamHandle:
        """Its stream from a thread (gRPC), waiting at most ``wait`` s for a slot."""
        return service.start_utterance(self.ids, self.voice, self.params, self.seed, sink, self.max_frames,
                                       self.allow_special_tokens, wait=wait, text=self.text)


def normalization(service: UtteranceService, switches: Switches | None) -> Switches:
    """A request's normalization switches, or the server's default (``MOSSRT_NORMALIZE_TEXT``)."""
    if switches is not None:
        return switches
    return Switches() if service.settings.normalize_text == "on" else OFF


async def aprepare_utterance(service: UtteranceService, text: str, voice: np.ndarray | None,
                             sampling: SamplingFields, max_frames: int | None = None,
                             allow_special_tokens: bool = False, param: str = "input", *,
                             normalization_options: Switches | None = None,
                             disconnected: Callable[[], Awaitable[bool]] | None = None) -> Utterance:
    """:func:`prepare_utterance` on the event loop: when the text is to be normalized, in a worker thread (a
    text of 100,000 characters of numbers takes a second or two to say in words, and must not hold the loop),
    after the checks that cost nothing (empty, over ``--max-input-chars``) have refused it on the loop. The
    worker stops (``normalize``'s ``Work.cancel``) when this task is cancelled or ``disconnected()`` says the
    client left (then this raises ``asyncio.CancelledError``)."""
    if not normalization(service, normalization_options).normalize:
        return prepare_utterance(service, text, voice, sampling, max_frames, allow_special_tokens, param,
                                 normalization_options)
    _check_text(service, text, param)
    cancel = threading.Event()

    async def normalized() -> Utterance:
        async with _normalizer_gate():
            return await anyio.to_thread.run_sync(
                lambda: prepare_utterance(service, text, voice, sampling, max_frames, allow_special_tokens, param,
                                          normalization_options, cancel), abandon_on_cancel=True)
    job = asyncio.ensure_future(normalized())
    try:
        while True:
            done, _ = await asyncio.wait({job}, timeout=DISCONNECT_POLL_S if disconnected else None)
            if done:
                return job.result()
            if disconnected is not None and await disconnected():
                raise asyncio.CancelledError("the client left while its text was normalized")
    finally:
        cancel.set()                 # the worker stops at its next window; a finished one is not affected
        if not job.done():
            job.cancel()


def _check_text(service: UtteranceService, text: object, param: str) -> None:
    """What is refused before any other work: not ready, nothing to speak (whitespace, NBSP, zero-width
    characters alone, as on every transport), over ``--max-input-chars`` (before normalizing: bounds its work)."""
    service.require_ready()
    if not isinstance(text, str) or not speakable(text):
        raise ApiError("empty_input", f"{param} is empty", param)
    try:
        service.limits.check_text_chars(text)
    except TextTooLongError as e:
        raise ApiError("input_too_long", str(e), param) from None


def prepare_utterance(service: UtteranceService, text: str, voice: np.ndarray | None, sampling: SamplingFields,
                      max_frames: int | None = None, allow_special_tokens: bool = False, param: str = "input",
                      normalization_options: Switches | None = None,
                      cancel: threading.Event | None = None) -> Utterance:
    """The checked utterance, or the catalogue's error naming ``param``: ``empty_input``, ``input_too_long``
    (it cannot be spoken whole within a stream's context and frame limit), ``invalid_value``. ``voice`` is
    already resolved (its codes); ``sampling`` a :class:`~app.service.SamplingFields`; the text is normalized
    (:mod:`app.normalize`) as ``normalization_options`` say, else as the server's default, within its work
    budget (``Work.budget_for``: over it, ``input_too_long``); ``cancel`` set stops it (``Cancelled``)."""
    _check_text(service, text, param)
    try:
        normalized = normalize(text, normalization(service, normalization_options), Work.budget_for(text, cancel))
    except BudgetExceeded as e:
        raise ApiError("input_too_long", f"{e}; send less text or turn normalization off", param) from None
    params = service.sampling(sampling)
    try:
        max_frames = service.limits.check_max_frames(max_frames)
    except InputError as e:
        raise ApiError("invalid_value", str(e), "max_frames") from None
    model = service.model
    assert model is not None, "_check_text's require_ready() passed: the model is loaded"
    try:
        ids = utterance_ids(model, service.limits, voice, max_frames, text=normalized.spoken,
                            allow_special_tokens=allow_special_tokens)
    except (TextTooLongError, ContextLimitError) as e:
        said = " (normalized)" if normalized.changed else ""
        raise ApiError("input_too_long", f"{e}{said}", param) from None
    except InputError as e:
        raise ApiError("invalid_value", str(e), param) from None
    return Utterance(normalized.spoken, ids, voice, params, sampling.seed, max_frames, allow_special_tokens,
                     normalized)
