"""An HTTP reply to OpenAI's speech body (``/v1/audio/speech``, ``/dev/captioned_speech``): its utterance
checked and its stream opened, and the reply's headers."""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from engine.serving.handles import AsyncSink

from ..audio_formats import StreamEncoder
from ..errors import ApiError
from ..metrics import StreamMeter
from ..schemas import SpeechRequest, VoiceRef
from .contracts import SpeechService
from .http import StreamEnd
from .policy import require_speakable
from .pump import TurnAudio
from .sampling import SamplingFields
from .utterance import Utterance, aprepare_utterance

IGNORED_HEADER = "X-Mossrt-Ignored"        # request fields this model cannot use, named in the reply


async def start_speech(body: SpeechRequest, request: Request, transport: str,
                       endpoint: str) -> tuple[Utterance, StreamEnd]:
    """The request's utterance checked and its stream opened (every route with OpenAI's speech body)."""
    service: SpeechService = request.app.state.service
    service.require_ready()
    if isinstance(body.input, str):
        require_speakable(body.input, "input")       # whitespace or zero-width text: empty_input, as every transport
    voice = await run_in_threadpool(service.resolve_voice,     # a registered voice's codes come from disk
                                    body.voice.model_dump() if isinstance(body.voice, VoiceRef) else body.voice)
    utterance = await aprepare_utterance(service, body.input, voice, SamplingFields(
        seed=body.seed, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, repetition_window=body.repetition_window, greedy=body.greedy),
        body.max_frames, body.allow_special_tokens, normalization_options=body.normalization_options,
        disconnected=request.is_disconnected)
    model = service.model
    assert model is not None, "require_ready() passed: the model is loaded"
    try:
        encoder = StreamEncoder(body.response_format, model.codec.sample_rate, body.speed, out_rate=body.sample_rate)
    except ValueError as e:
        raise ApiError("invalid_value", str(e), "sample_rate" if body.sample_rate else "speed") from None
    try:
        handle = await utterance.start(service, AsyncSink(), arrived=request.state.started)
    except BaseException:
        encoder.close()
        raise                                        # counted by the request guard with its status
    metrics = request.app.state.metrics
    meter = StreamMeter(metrics, transport, request.state.started)
    return utterance, StreamEnd(handle, TurnAudio(meter, encoder=encoder), metrics, endpoint)


def reply_headers(body: SpeechRequest, request: Request) -> dict[str, str]:
    """A speech reply's headers; ``instructions`` is answered, not silently dropped: MOSS-TTS-Realtime conditions
    on its fixed system prompt, the text and a voice only (docs/api-openai.md)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    if body.instructions:
        headers[IGNORED_HEADER] = "instructions"
    return headers
