"""``POST /v1/audio/speech``: OpenAI's speech endpoint, streamed as frames are generated."""

from __future__ import annotations

import base64
import json
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from engine.errors import ContextLimitError, EngineError, InputError, TextTooLongError
from engine.generate import utterance_ids
from engine.scheduler import AsyncSink

from ..audio_formats import CONTENT_TYPES, StreamEncoder
from ..auth import require_key
from ..errors import ApiError, from_engine
from ..metrics import StreamMeter
from ..streaming import StreamedResponse, StreamEnd, audio_events
from ..schemas import SpeechRequest
from ..service import SamplingFields, TTSService

log = logging.getLogger("mossrt.speech")
router = APIRouter()
ENDPOINT = "/v1/audio/speech"


@router.post(ENDPOINT, dependencies=[Depends(require_key)], response_class=Response,
             responses={200: {"content": {t: {"schema": {"type": "string", "format": "binary"}}
                                          for t in sorted(set(CONTENT_TYPES.values()))}
                              | {"text/event-stream": {}},
                              "description": "audio, streamed as it is generated"}})
async def create_speech(body: SpeechRequest, request: Request):
    service: TTSService = request.app.state.service
    metrics = request.app.state.metrics
    service.require_ready()
    if not body.input.strip():
        raise ApiError(400, "input is empty", param="input", code="empty_input")
    voice = await run_in_threadpool(service.resolve_voice,     # a registered voice's codes come from disk
                                    body.voice.model_dump() if hasattr(body.voice, "model_dump") else body.voice)
    params = service.sampling(SamplingFields(seed=body.seed, temperature=body.temperature, top_p=body.top_p,
                                             top_k=body.top_k, repetition_penalty=body.repetition_penalty,
                                             repetition_window=body.repetition_window, greedy=body.greedy))
    model = service.model
    try:
        ids = utterance_ids(model, service.limits, voice, body.max_frames, text=body.input,
                            allow_special_tokens=body.allow_special_tokens)
    except (TextTooLongError, ContextLimitError) as e:
        raise ApiError(400, str(e), param="input", code="input_too_long") from None
    except InputError as e:
        raise ApiError(400, str(e), param="input", code="invalid_value") from None
    try:
        encoder = StreamEncoder(body.response_format, model.codec.sample_rate, body.speed, out_rate=body.sample_rate)
    except ValueError as e:
        raise ApiError(400, str(e), param="sample_rate" if body.sample_rate else "speed", code="invalid_value") from None

    try:
        # a slot may take up to --queue-timeout seconds to free: the wait awaits, holding no thread
        handle = await service.astart_utterance(ids, voice, params, body.seed, AsyncSink(), body.max_frames,
                                                body.allow_special_tokens, arrived=request.state.started)
    except BaseException as e:
        encoder.close()
        if not isinstance(e, Exception):
            raise
        raise from_engine(e) from None          # counted by the request middleware with its status

    meter = StreamMeter(metrics, "sse" if body.stream_format == "sse" else "http", request.state.started)
    end = StreamEnd(handle, encoder, meter, metrics, ENDPOINT)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    stall = service.settings.stall_timeout
    if body.stream_format == "sse":
        return StreamedResponse(_sse(len(ids), end), end, stall, media_type="text/event-stream",
                               headers=headers)
    return StreamedResponse(_audio(end), end, stall, media_type=encoder.content_type, headers=headers)


async def _audio(end: StreamEnd):
    try:
        async for data, _, _ in audio_events(end):
            if data:
                yield data
    except EngineError:
        pass                                 # logged and counted by audio_events; the body just ends


async def _sse(input_tokens: int, end: StreamEnd):
    meter = end.meter
    try:
        async for data, _, stats in audio_events(end):
            if data:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            if stats is not None:
                timing = meter.finish()
                yield _event({"type": "speech.audio.done",
                              "usage": {"input_tokens": input_tokens, "output_tokens": stats.frames,
                                        "total_tokens": input_tokens + stats.frames},
                              "finish_reason": stats.finish_reason.value,
                              "metrics": {**timing, "frames": stats.frames, "audio_seconds": round(meter.audio_s, 3),
                                          "elapsed_ms": timing["total_ms"]}})
    except EngineError as e:
        yield _event({"type": "speech.audio.error", **from_engine(e).body()})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
