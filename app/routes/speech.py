"""``POST /v1/audio/speech``: OpenAI's speech endpoint, streamed as frames are generated (audio or SSE).
Parses the body and renders the audio; the utterance, its stream and every bound are :mod:`app.session`'s."""

from __future__ import annotations

import base64
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from engine.handles import AsyncSink

from ..audio_formats import CONTENT_TYPES, StreamEncoder
from ..errors import ApiError
from ..metrics import StreamMeter
from ..schemas import SpeechRequest
from ..service import SamplingFields, TTSService
from ..session.http import StreamedResponse, StreamEnd, outs
from ..session.policy import require_key
from ..session.pump import Audio, Ended, Failed, TurnAudio
from ..session.utterance import prepare_utterance

router = APIRouter()
ENDPOINT = "/v1/audio/speech"


@router.post(ENDPOINT, dependencies=[Depends(require_key)], response_class=Response,
             responses={200: {"content": {t: {"schema": {"type": "string", "format": "binary"}}
                                          for t in sorted(set(CONTENT_TYPES.values()))}
                              | {"text/event-stream": {}},
                              "description": "audio, streamed as it is generated"}})
async def create_speech(body: SpeechRequest, request: Request):
    service: TTSService = request.app.state.service
    service.require_ready()
    voice = await run_in_threadpool(service.resolve_voice,     # a registered voice's codes come from disk
                                    body.voice.model_dump() if hasattr(body.voice, "model_dump") else body.voice)
    utterance = prepare_utterance(service, body.input, voice, SamplingFields(
        seed=body.seed, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, repetition_window=body.repetition_window, greedy=body.greedy),
        body.max_frames, body.allow_special_tokens)
    try:
        encoder = StreamEncoder(body.response_format, service.model.codec.sample_rate, body.speed,
                                out_rate=body.sample_rate)
    except ValueError as e:
        raise ApiError("invalid_value", str(e), "sample_rate" if body.sample_rate else "speed") from None
    try:
        handle = await utterance.start(service, AsyncSink(), arrived=request.state.started)
    except BaseException:
        encoder.close()
        raise                                        # counted by the request guard with its status
    metrics = request.app.state.metrics
    meter = StreamMeter(metrics, "sse" if body.stream_format == "sse" else "http", request.state.started)
    end = StreamEnd(handle, TurnAudio(meter, encoder=encoder), metrics, ENDPOINT)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    stall = service.policy.stall_timeout
    if body.stream_format == "sse":
        return StreamedResponse(_sse(len(utterance.ids), end), end, stall, media_type="text/event-stream",
                                headers=headers)
    return StreamedResponse(_audio(end), end, stall, media_type=encoder.content_type, headers=headers)


async def _audio(end: StreamEnd):
    async for out in outs(end):
        if isinstance(out, Failed):
            return                               # logged and counted by outs; the body just ends
        data = out.data if isinstance(out, Audio) else out.tail
        if data:
            yield data


async def _sse(input_tokens: int, end: StreamEnd):
    meter = end.turn.meter
    async for out in outs(end):
        if isinstance(out, Audio) and out.data:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(out.data).decode()})
        elif isinstance(out, Failed):             # instead of done
            yield _event({"type": "speech.audio.error", **out.error.body()})
            return
        elif isinstance(out, Ended):
            if out.tail:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(out.tail).decode()})
            timing = meter.finish()
            stats = out.stats
            yield _event({"type": "speech.audio.done",
                          "usage": {"input_tokens": input_tokens, "output_tokens": stats.frames,
                                    "total_tokens": input_tokens + stats.frames},
                          "finish_reason": stats.finish_reason.value,
                          "metrics": {**timing, "frames": stats.frames, "audio_seconds": round(meter.audio_s, 3),
                                      "elapsed_ms": timing["total_ms"]}})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
