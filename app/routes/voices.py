"""``/v1/audio/voices``: register a reference recording once (its codec codes are stored), list, get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from app.voices import VOICE_NAME_PATTERN
from engine.errors import InputError, VoiceExistsError, VoiceLimitError

from ..errors import ApiError
from ..schemas import DeletedVoice, Named, VoiceList, VoiceObject
from ..service import DEFAULT_VOICE, OPENAI_VOICES, TTSService
from ..session.policy import require_key
from ..uploads import decode_upload

router = APIRouter(dependencies=[Depends(require_key)])


@router.post("/v1/audio/voices", response_model=VoiceObject)
async def create_voice(request: Request, name: str = Form(..., pattern=VOICE_NAME_PATTERN),
                       audio_sample: UploadFile = File(...)):
    """Multipart ``name`` + ``audio_sample`` (any common format and rate, at most 10 MiB by default, 0.5 s to
    the voice length limit). Encoded once; usable as ``voice: "<name>"`` or ``{"id": "<id>"}``."""
    service: TTSService = request.app.state.service
    service.require_ready()
    if name.lower() in (DEFAULT_VOICE, *OPENAI_VOICES):
        raise ApiError("reserved_name", f"{name!r} is a built-in voice name; pick another", "name")
    limit = service.settings.max_upload_bytes
    data = await audio_sample.read(limit + 1)
    if len(data) > limit:
        raise ApiError("file_too_large", f"audio_sample is larger than {limit} bytes", "audio_sample")
    try:
        service.voices.check_name(name)
    except InputError as e:
        raise ApiError("invalid_value", str(e), "name") from None
    if await run_in_threadpool(service.voices.find, name) is not None:    # may rebuild the index from disk
        raise ApiError("voice_exists", f"a voice named {name!r} already exists; delete it first or pick another name",
                       "name")
    try:
        service.voices.check_room()                  # before any decoding; add() checks again under its lock
        wav, rate = await run_in_threadpool(decode_upload, data, service.limits)
        rec = await run_in_threadpool(service.register_voice, name, wav, rate)
    except VoiceExistsError as e:      # registered by another request meanwhile
        raise ApiError("voice_exists", str(e), "name") from None
    except VoiceLimitError as e:
        raise ApiError("voice_limit_reached", str(e)) from None
    except InputError as e:
        raise ApiError("invalid_audio", str(e), "audio_sample") from None
    return VoiceObject(**rec.public())


@router.get("/v1/audio/voices", response_model=VoiceList)
async def list_voices(request: Request):
    """The registered voices (``data``) and every voice a request may name (``voices``: ``default``, OpenAI's
    names, the registered ones; what Open WebUI's voice menu lists)."""
    service: TTSService = request.app.state.service
    entries = await run_in_threadpool(service.list_voices)
    return VoiceList(data=[VoiceObject(**e.record.public()) for e in entries if e.record is not None],
                     voices=[Named(id=e.id, name=e.name) for e in entries])


@router.get("/v1/audio/voices/{voice_id}", response_model=VoiceObject)
async def get_voice(voice_id: str, request: Request):
    rec = await run_in_threadpool(request.app.state.service.voices.find, voice_id)   # may rebuild the index
    if rec is None:
        raise ApiError("not_found", f"voice {voice_id!r} not found", "voice_id")
    return VoiceObject(**rec.public())


@router.delete("/v1/audio/voices/{voice_id}", response_model=DeletedVoice)
async def delete_voice(voice_id: str, request: Request):
    rec = await run_in_threadpool(request.app.state.service.voices.delete, voice_id)   # removes files
    if rec is None:
        raise ApiError("not_found", f"voice {voice_id!r} not found", "voice_id")
    return DeletedVoice(id=rec.id)
