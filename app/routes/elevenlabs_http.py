"""ElevenLabs-compatible HTTP: ``POST /v1/text-to-speech/{voice_id}`` (+ ``/stream``, ``/with-timestamps``,
``/stream/with-timestamps``) and ``GET /v1/voices``.

Each request is one whole utterance (:func:`app.session.utterance.prepare_utterance`, as
``/v1/audio/speech``), streamed as it is generated; ``/with-timestamps`` answers one JSON object when the
utterance is whole, and is cancelled like the streamed routes when its client leaves first. Errors are the
catalogue's in ElevenLabs' shape, ``{"detail": {"status", "message"}}``, which its SDK and pipecat's
``ElevenLabsHttpTTSService`` surface as they are. See docs/api-elevenlabs.md.
"""

from __future__ import annotations

import base64
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool

from engine.errors import EngineError
from engine.handles import AsyncSink

from ..elevenlabs.alignment import CLOCKS, Aligner
from ..elevenlabs.formats import parse_output_format
from ..errors import ApiError, from_engine, json_error
from ..metrics import StreamMeter
from ..service import DEFAULT_VOICE, SamplingFields, TTSService
from ..session.http import StreamedResponse, StreamEnd, outs, whole
from ..session.pump import Audio, Failed, TurnAudio
from ..session.utterance import prepare_utterance

router = APIRouter()
TTS_PATH = "/v1/text-to-speech/{voice_id}"
# routes whose successful requests count themselves when their stream ends (the status is known only then)
STREAMED_PATHS = tuple(TTS_PATH + suffix for suffix in ("", "/stream", "/with-timestamps", "/stream/with-timestamps"))
ROUTE_PREFIXES = ("/v1/text-to-speech/", "/v1/voices")     # answered in ElevenLabs' error shape


class TextToSpeechRequest(BaseModel):
    """The body. ``model_id``, ``voice_settings``, ``language_code``, ``previous_text`` / ``next_text``,
    pronunciation dictionaries and text-normalisation switches are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    text: StrictStr = Field(min_length=1)
    model_id: StrictStr | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**32)


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
    service: TTSService = request.app.state.service
    voices = [{"voice_id": DEFAULT_VOICE, "name": "Default", "category": "premade", "labels": {},
               "description": "the model's own voice (no reference)"}]
    voices += [{"voice_id": r.id, "name": r.name, "category": "cloned", "labels": {}, "description": None}
               for r in service.voices.list()]
    return {"voices": voices, "has_more": False, "total_count": len(voices), "next_page_token": None}


async def _body(request: Request) -> TextToSpeechRequest:
    try:
        data = json.loads(await request.body() or b"null")
    except Exception as e:  # noqa: BLE001 - json_error says which failures are bad JSON
        err = json_error(e)
        if err is None:
            raise
        raise err from None
    try:
        return TextToSpeechRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError("invalid_request", f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}") from None


async def _speak(voice_id: str, request: Request, timestamps: str | None):
    endpoint = request.scope["route"].path          # the route's template: one label per route, not per voice
    service: TTSService = request.app.state.service
    metrics = request.app.state.metrics
    try:
        service.require_ready()
        fmt = parse_output_format(request.query_params.get("output_format"))
        clock = request.query_params.get("alignment", "speech")
        if clock not in CLOCKS:
            raise ApiError("invalid_value", f"alignment {clock!r}: one of {', '.join(CLOCKS)}", "alignment")
        body = await _body(request)
        voice = await run_in_threadpool(service.resolve_voice, voice_id, "voice_id")   # reads its codes
        seed = body.seed if body.seed is not None else service.settings.elevenlabs_seed
        utterance = prepare_utterance(service, body.text, voice, SamplingFields(
            seed=seed, greedy=service.settings.elevenlabs_greedy or None), param="text")
        encoder = fmt.encoder(service.model.codec.sample_rate)
        try:
            handle = await utterance.start(service, AsyncSink(), arrived=request.state.started)
        except BaseException:
            encoder.close()
            raise
    except (ApiError, EngineError) as e:      # counted by the request guard with its status
        return from_engine(e).elevenlabs_response()
    meter = StreamMeter(metrics, "elevenlabs_http", request.state.started)
    end = StreamEnd(handle, TurnAudio(meter, encoder=encoder), metrics, endpoint)
    aligner = Aligner(clock) if timestamps else None
    chunks = _chunks(end, aligner, body.text)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    if timestamps == "whole":
        reply = await whole(request, end, _whole(chunks, aligner))
        return JSONResponse(reply if reply is not None else {}, headers=headers)
    stall = service.policy.stall_timeout
    if timestamps:
        return StreamedResponse(_ndjson(chunks), end, stall, media_type="application/json", headers=headers)
    return StreamedResponse((data async for data, _ in chunks if data), end, stall, media_type=encoder.content_type,
                            headers=headers)


async def _chunks(end: StreamEnd, aligner: Aligner | None, text: str):
    """(encoded bytes, alignment in seconds from the start or None) per frame, then the tail."""
    if aligner is not None:
        aligner.add(text)
    async for out in outs(end):
        if isinstance(out, Failed):
            return                               # logged and counted by outs; the body just ends
        if isinstance(out, Audio):
            span = aligner.frame(out.frame.text_chars, out.frame.audio) if aligner else None
            yield out.data, span.seconds() if span is not None else None
        else:
            span = aligner.rest() if aligner else None
            yield out.tail, span.seconds() if span is not None else None


async def _whole(chunks, aligner: Aligner) -> dict:
    """The whole reply: its audio once, and its alignment re-timed knowing where the speech ended (the
    speech clock; the read clock's spans as they came)."""
    audio: list[bytes] = []
    merged = {"characters": [], "character_start_times_seconds": [], "character_end_times_seconds": []}
    async for data, alignment in chunks:
        audio.append(data)
        for key in merged if alignment else ():
            merged[key] += alignment[key]
    final = aligner.final()
    if final is not None:
        merged = final.seconds()
    return {"audio_base64": base64.b64encode(b"".join(audio)).decode(), "alignment": merged,
            "normalized_alignment": merged}


async def _ndjson(chunks):
    """One JSON object per line, as ElevenLabs streams with-timestamps."""
    async for data, alignment in chunks:
        if data or alignment:
            line = {"audio_base64": base64.b64encode(data).decode(), "alignment": alignment,
                    "normalized_alignment": alignment}
            yield (json.dumps(line, separators=(",", ":")) + "\n").encode()
