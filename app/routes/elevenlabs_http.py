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
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine.errors import EngineError
from engine.serving.handles import AsyncSink

from ..alignment.characters import CLOCKS
from ..alignment.paired import Alignments
from ..elevenlabs.formats import parse_output_format
from ..elevenlabs.protocol import QuerySeed, Seed
from ..errors import ELEVENLABS_PREFIXES, HTTP_CODES, ApiError, from_engine, json_error
from ..metrics import StreamMeter
from ..normalize import OFF, Switches
from ..service import TTSService
from ..session.aligned import AlignedAudio, aligned_audio, whole_aligned
from ..session.http import StreamedResponse, StreamEnd, whole
from ..session.policy import require_speakable
from ..session.pump import TurnAudio
from ..session.sampling import SamplingFields
from ..session.utterance import aprepare_utterance

router = APIRouter()
TTS_PATH = "/v1/text-to-speech/{voice_id}"
# routes whose successful requests count themselves when their stream ends (the status is known only then)
STREAMED_PATHS = tuple(TTS_PATH + suffix for suffix in ("", "/stream", "/with-timestamps", "/stream/with-timestamps"))
# ElevenLabs' apply_text_normalization: on, off, or (auto) the server's default
NORMALIZATION = {"on": Switches(), "off": OFF, "auto": None}
ROUTE_PREFIXES = ELEVENLABS_PREFIXES   # ElevenLabs' error shape (and a shared route's for its clients: errors.shaped)


class TextToSpeechRequest(BaseModel):
    """The body. ``model_id``, ``voice_settings``, ``language_code``, ``previous_text`` / ``next_text`` and
    pronunciation dictionaries are accepted and ignored; ``apply_text_normalization`` ``on``/``off`` turns
    :mod:`app.normalize` on or off (``auto``: the server's default)."""

    model_config = ConfigDict(extra="ignore")
    text: StrictStr = Field(min_length=1)
    model_id: StrictStr | None = None
    seed: Seed | None = None                        # wins over a query seed (docs/api-elevenlabs.md)
    apply_text_normalization: Literal["auto", "on", "off"] = "auto"


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
    voices = await _voices(request)
    return {"voices": voices, "has_more": False, "total_count": len(voices), "next_page_token": None}


@router.get("/v1/voices/{voice_id}", include_in_schema=False)
async def get_voice(voice_id: str, request: Request):
    """One voice of the list (``voices.get``); ``with_settings`` is accepted and ignored."""
    for voice in await _voices(request):
        if voice["voice_id"] == voice_id:
            return voice
    return ApiError("voice_not_found", f"voice {voice_id!r} not found", "voice_id").elevenlabs_response()


@router.get("/v2/voices", include_in_schema=False)
async def search_voices(request: Request):
    """``voices.search``: ``search`` (in the name and description, any case), ``category``, ``voice_type``
    (``default``: the built-in one; ``personal``, ``non-default``, ``non-community``: the registered ones),
    ``voice_ids``, ``sort`` (``name`` or ``created_at_unix``) and ``sort_direction``, then ``page_size``
    (1..100, default 10) and ``next_page_token``. Other filters (labels, sharing) match every voice: ours carry
    none. A value outside what ElevenLabs documents is a 400 ``invalid_value`` in its shape."""
    q = request.query_params
    try:
        size, offset = _search_page(q)
        _check_choices(q)
    except ApiError as e:
        return e.elevenlabs_response()
    voices = await _voices(request)
    term = (q.get("search") or "").lower()
    ids = set(q.getlist("voice_ids")) - {""}
    kind = q.get("voice_type")
    voices = [v for v in voices
              if (not term or term in f"{v['name']} {v['description'] or ''}".lower())
              and q.get("category") in (None, "", v["category"]) and (not ids or v["voice_id"] in ids)
              and (kind in (None, "", "saved")
                   or kind != "community" and (kind == "default") == (v["category"] == "premade"))]
    if q.get("sort"):
        voices.sort(key=lambda v: (v[q["sort"]] or 0) if q["sort"] == "created_at_unix" else v["name"].lower(),
                    reverse=q.get("sort_direction") == "desc")
    page = voices[offset:offset + size]
    more = offset + size < len(voices)
    return {"voices": page, "has_more": more, "total_count": len(voices),
            "next_page_token": str(offset + size) if more else None}


# /v2/voices' enumerated parameters and the values ElevenLabs documents for each
SEARCH_CHOICES = {"sort": ("name", "created_at_unix"), "sort_direction": ("asc", "desc"),
                  "voice_type": ("personal", "community", "default", "workspace", "non-default", "non-community",
                                 "saved"),
                  "category": ("premade", "cloned", "generated", "professional")}


def _search_page(q) -> tuple[int, int]:
    """``page_size`` (1..100, default 10) and the offset ``next_page_token`` (ours: a count, 0 and up)."""
    size, offset = q.get("page_size") or "10", q.get("next_page_token") or "0"
    if not _count(size, 3) or not 1 <= int(size) <= 100:
        raise ApiError("invalid_value", f"page_size {size[:16]!r}: an integer in 1..100", "page_size")
    if not _count(offset, 9):
        raise ApiError("invalid_value", f"next_page_token {offset[:16]!r}: a token this server returned",
                       "next_page_token")
    return int(size), int(offset)


def _count(value: str, digits: int) -> bool:
    """ASCII digits only, at most ``digits`` of them (never a sign, a space or a 5,000-digit parse)."""
    return value.isascii() and value.isdigit() and len(value) <= digits


def _check_choices(q) -> None:
    """Each enumerated parameter, when given (an empty value is none), one of its documented values."""
    for name, allowed in SEARCH_CHOICES.items():
        value = q.get(name)
        if value and value not in allowed:
            raise ApiError("invalid_value", f"{name} {value[:64]!r}: one of {', '.join(allowed)}", name)


async def _voices(request: Request) -> list[dict]:
    """Every voice a request may name, in ElevenLabs' shape (``TTSService.list_voices``, without OpenAI's names)."""
    service: TTSService = request.app.state.service
    entries = await run_in_threadpool(service.list_voices, False)
    return [{"voice_id": e.id, "name": e.name, "category": "cloned" if e.record else "premade", "labels": {},
             "description": None if e.record else "the model's own voice (no reference)",
             "created_at_unix": e.record.created_at if e.record else None, "is_owner": e.record is not None}
            for e in entries]


@router.get("/v1/user", include_in_schema=False)
async def get_user(request: Request):
    """``user.get``: one local account with no quota to count (what clients read to check their key)."""
    service: TTSService = request.app.state.service
    voices = await run_in_threadpool(service.voices.list)
    limit = service.settings.max_voices
    return {"user_id": "mossrt", "workspace_id": "mossrt", "first_name": "mossrt", "created_at": service.created,
            "is_new_user": False, "is_onboarding_completed": True, "is_onboarding_checklist_completed": True,
            "can_use_delayed_payment_methods": False, "is_api_key_hashed": False, "seat_type": "workspace_admin",
            "subscription": {"tier": "self-hosted", "status": "active", "character_count": 0,
                             "character_limit": service.settings.max_input_chars, "max_credit_limit_extension": 0,
                             "can_extend_character_limit": False, "allowed_to_extend_character_limit": False,
                             "voice_slots_used": len(voices), "professional_voice_slots_used": 0,
                             "professional_voice_slots_used_in_workspace": 0, "voice_limit": limit,
                             "voice_add_edit_counter": 0, "professional_voice_limit": 0,
                             "can_extend_voice_limit": False, "can_use_instant_voice_cloning": True,
                             "can_use_professional_voice_cloning": False,
                             "current_overage": {"amount": "0", "currency": "usd"}}}


def _query_seed(request: Request) -> int | None:
    """``?seed=``, refused as the WebSockets refuse it (same bounds, ``invalid_request``)."""
    try:
        return QuerySeed.from_query(request.query_params).seed
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError("invalid_request", f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


async def _body(request: Request) -> TextToSpeechRequest:
    try:
        data = json.loads(await request.body() or b"null")
    except HTTPException as e:      # the request guard's 408 / 413 while the body streamed in: in ElevenLabs' shape
        if e.status_code not in HTTP_CODES:
            raise
        raise ApiError(HTTP_CODES[e.status_code], str(e.detail),
                       headers=dict(e.headers) if e.headers is not None else None) from None
    except Exception as e:  # noqa: BLE001 - json_error says which failures are bad JSON
        err = json_error(e)
        if err is None:
            raise
        raise err from None
    try:
        return TextToSpeechRequest.model_validate(data)
    except ValidationError as e:
        detail = e.errors()[0]
        raise ApiError("invalid_request",
                       f"{'.'.join(map(str, detail['loc'])) or 'body'}: {detail['msg']}") from None


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
        query_seed = _query_seed(request)
        body = await _body(request)
        require_speakable(body.text, "text")        # whitespace or zero-width text: empty_input, as every transport
        voice = await run_in_threadpool(service.resolve_voice, voice_id, "voice_id")   # reads its codes
        seed = next((s for s in (body.seed, query_seed, service.settings.elevenlabs_seed) if s is not None), None)
        utterance = await aprepare_utterance(service, body.text, voice, SamplingFields(
            seed=seed, greedy=service.settings.elevenlabs_greedy or None), param="text",
            normalization_options=NORMALIZATION[body.apply_text_normalization], disconnected=request.is_disconnected)
        model = service.model
        assert model is not None, "require_ready() passed: the model is loaded"
        encoder = fmt.encoder(model.codec.sample_rate)
        try:
            handle = await utterance.start(service, AsyncSink(), arrived=request.state.started)
        except BaseException:
            encoder.close()
            raise
    except (ApiError, EngineError) as e:      # counted by the request guard with its status
        return from_engine(e).elevenlabs_response()
    meter = StreamMeter(metrics, "elevenlabs_http", request.state.started)
    end = StreamEnd(handle, TurnAudio(meter, encoder=encoder), metrics, endpoint)
    aligner = Alignments(utterance.normalized, clock) if timestamps else None
    chunks = aligned_audio(end, aligner, utterance.text)            # what the model reads
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request.state.request_id}
    if timestamps == "whole":
        assert aligner is not None, "a with-timestamps reply has its aligner"
        reply = await whole(request, end, whole_aligned(chunks, aligner))
        return JSONResponse(reply if reply is not None else {}, headers=headers)
    stall = service.policy.stall_timeout
    if timestamps:
        return StreamedResponse(_ndjson(chunks), end, stall, media_type="application/json", headers=headers)
    return StreamedResponse((data async for data, _, _ in chunks if data), end, stall,
                            media_type=encoder.content_type, headers=headers)


async def _ndjson(chunks: AsyncIterator[AlignedAudio]) -> AsyncIterator[bytes]:
    """One JSON object per line, as ElevenLabs streams with-timestamps."""
    async for data, alignment, normalized in chunks:
        if data or alignment or normalized:
            line = {"audio_base64": base64.b64encode(data).decode(), "alignment": alignment,
                    "normalized_alignment": normalized}
            yield (json.dumps(line, separators=(",", ":")) + "\n").encode()
