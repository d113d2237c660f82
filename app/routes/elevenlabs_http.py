"""ElevenLabs-compatible HTTP: ``POST /v1/text-to-speech/{voice_id}`` (+ ``/stream``, ``/with-timestamps``,
``/stream/with-timestamps``) and ``GET /v1/voices``.

Each request is one whole utterance on a scheduler stream (as ``/v1/audio/speech``), streamed as it is
generated. Errors use ElevenLabs' shape, ``{"detail": {"status", "message"}}``, which its SDK and
pipecat's ``ElevenLabsHttpTTSService`` surface as they are.
"""

from __future__ import annotations

import base64
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from engine.errors import ContextLimitError, EngineError, InputError, TextTooLongError
from engine.generate import utterance_ids
from engine.scheduler import AsyncSink

from ..auth import http_key_error
from ..elevenlabs.alignment import FRAME_MS, Aligner
from ..elevenlabs.formats import parse_output_format
from ..errors import ApiError, from_engine
from ..metrics import StreamMeter
from ..streaming import StreamedResponse, StreamEnd, audio_events
from ..service import DEFAULT_VOICE, SamplingFields, TTSService

log = logging.getLogger("mossrt.elevenlabs")
router = APIRouter()
TTS_PATH = "/v1/text-to-speech/{voice_id}"
# routes whose successful requests count themselves when their stream ends (the status is known only then)
STREAMED_PATHS = tuple(TTS_PATH + suffix for suffix in ("", "/stream", "/with-timestamps", "/stream/with-timestamps"))


class TextToSpeechRequest(BaseModel):
    """The body. ``model_id``, ``voice_settings``, ``language_code``, ``previous_text`` / ``next_text``,
    pronunciation dictionaries and text-normalisation switches are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    text: StrictStr = Field(min_length=1)
    model_id: StrictStr | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**32)


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": {"status": code, "message": message}}, status_code=status, headers=headers)


def _check_key(request: Request) -> None:
    err = http_key_error(request.headers, request.app.state.service.settings.api_keys)
    if err is not None:
        raise err


@router.post(TTS_PATH, response_class=Response, include_in_schema=False)
@router.post(TTS_PATH + "/stream", response_class=Response, include_in_schema=False)
async def text_to_speech(voice_id: str, request: Request):
    return await _speak(voice_id, request, timestamps=None)


@router.post(TTS_PATH + "/stream/with-timestamps", include_in_schema=False)
async def text_to_speech_stream_with_timestamps(voice_id: str, request: Request):
    return await _speak(voice_id, request, timestamps="stream")


@router.post(TTS_PATH + "/with-timestamps", include_in_schema=False)
async def text_to_speech_with_timestamps(voice_id: str, request: Request):
    return await _speak(voice_id, request, timestamps="whole")


@router.get("/v1/voices", include_in_schema=False)
async def list_voices(request: Request):
    """ElevenLabs' voice list as clients read it: ``default`` (the model's own timbre), then registered voices."""
    try:
        _check_key(request)
    except ApiError as e:
        return _error(e.status, e.code or "error", e.message)
    service: TTSService = request.app.state.service
    voices = [{"voice_id": DEFAULT_VOICE, "name": "Default", "category": "premade", "labels": {},
               "description": "the model's own voice (no reference)"}]
    voices += [{"voice_id": r.id, "name": r.name, "category": "cloned", "labels": {}, "description": None}
               for r in service.voices.list()]
    return {"voices": voices, "has_more": False, "total_count": len(voices), "next_page_token": None}


async def _speak(voice_id: str, request: Request, timestamps: str | None):
    endpoint = request.scope["route"].path          # the route's template: one label per route, not per voice
    service: TTSService = request.app.state.service
    metrics = request.app.state.metrics
    try:
        _check_key(request)
        service.require_ready()
        fmt = parse_output_format(request.query_params.get("output_format"))
        try:
            body = TextToSpeechRequest.model_validate(json.loads(await request.body() or b"null"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        except ValidationError as e:
            err = e.errors()[0]
            raise ApiError(422, f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}",
                           code="invalid_request") from None
        if not body.text.strip():
            raise ApiError(400, "text is empty", code="empty_text")
        voice = await run_in_threadpool(service.resolve_voice, voice_id, param="voice_id")   # reads its codes
        params = service.sampling(SamplingFields(greedy=service.settings.elevenlabs_greedy or None))
        seed = body.seed if body.seed is not None else service.settings.elevenlabs_seed
        try:
            ids = utterance_ids(service.model, service.limits, voice, None, text=body.text)
        except (TextTooLongError, ContextLimitError) as e:
            raise ApiError(400, str(e), code="text_too_long") from None
        except InputError as e:
            raise ApiError(400, str(e), code="invalid_text") from None
        encoder = fmt.encoder(service.model.codec.sample_rate)
        try:
            # waiting for a slot awaits (no thread held); the queue timeout counts from the request's arrival
            handle = await service.astart_utterance(ids, voice, params, seed, AsyncSink(),
                                                    arrived=request.state.started, text=body.text)
        except BaseException:
            encoder.close()
            raise
    except (ApiError, EngineError) as e:      # counted by the request guard with its status
        err = e if isinstance(e, ApiError) else from_engine(e)
        return _error(err.status, err.code or "error", err.message, err.headers)
    meter = StreamMeter(metrics, "elevenlabs_http", request.state.started)
    end = StreamEnd(handle, encoder, meter, metrics, endpoint)
    chunks = _chunks(end, Aligner() if timestamps else None, body.text)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    if timestamps == "whole":
        try:
            return JSONResponse(await _whole(chunks), headers=headers)
        finally:
            end()
    stall = service.settings.stall_timeout
    if timestamps:
        return StreamedResponse(_ndjson(chunks), end, stall, media_type="application/json", headers=headers)
    return StreamedResponse((data async for data, _ in chunks if data), end, stall, media_type=encoder.content_type,
                             headers=headers)


async def _chunks(end: StreamEnd, aligner: Aligner | None, text: str):
    """(encoded bytes, alignment with absolute times in seconds or None) per frame (``audio_events``)."""
    offset_ms = 0.0
    if aligner is not None:
        aligner.add(text)
    try:
        async for data, frame, stats in audio_events(end):
            if stats is not None:
                yield data, _absolute(aligner.rest() if aligner else None, offset_ms)
                return
            yield data, _absolute(aligner.frame(frame.text_chars) if aligner else None, offset_ms)
            offset_ms += FRAME_MS
    except EngineError:
        pass                                 # logged and counted by audio_events; the body just ends


def _absolute(span: dict | None, offset_ms: float) -> dict | None:
    if span is None:
        return None
    starts = [(offset_ms + s) / 1000 for s in span["charStartTimesMs"]]
    return {"characters": span["chars"], "character_start_times_seconds": starts,
            "character_end_times_seconds": [s + d / 1000 for s, d in zip(starts, span["charDurationsMs"])]}


async def _whole(chunks) -> dict:
    audio, merged = b"", {"characters": [], "character_start_times_seconds": [], "character_end_times_seconds": []}
    async for data, alignment in chunks:
        audio += data
        for key in merged if alignment else ():
            merged[key] += alignment[key]
    return {"audio_base64": base64.b64encode(audio).decode(), "alignment": merged, "normalized_alignment": merged}


async def _ndjson(chunks):
    """One JSON object per line, as ElevenLabs streams with-timestamps."""
    async for data, alignment in chunks:
        if data or alignment:
            line = {"audio_base64": base64.b64encode(data).decode(), "alignment": alignment,
                    "normalized_alignment": alignment}
            yield (json.dumps(line, separators=(",", ":")) + "\n").encode()
