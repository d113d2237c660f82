"""Operations: liveness, readiness, Prometheus metrics, and the model list."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import ApiError, elevenlabs_client
from ..schemas import AudioModelList, ModelCard, ModelList, Named
from ..service import MODEL_ALIASES, MODEL_ID, TTSService
from ..session.policy import require_key

router = APIRouter()


@router.get("/health")
async def health():
    """Alive (the process answers); says nothing about the model. ``pid``: the API process that answered (one
    of several under ``--api-workers``)."""
    return {"status": "ok", "pid": os.getpid()}


@router.get("/ready")
async def ready(request: Request):
    """200 once the bundle is loaded and warmed up; 503 while loading, after a load failure, while draining and
    once the engine is broken."""
    service: TTSService = request.app.state.service
    state = service.health_state
    body = {"status": state, "bundle": str(service.bundle.dir), "demo": service.bundle.is_demo,
            "device": service.bundle.device, "device_reason": service.bundle.device_reason}
    if state == "failed":
        body["error"] = service.error
    snap = service.engine_snapshot()
    if state == "broken":                                        # broken: the running engine says why
        body["error"] = service.engine.broken if service.engine is not None else snap.broken
    if snap.stats is not None:
        s = snap.stats
        body["streams"] = {"capacity": s.capacity, "active": s.active, "queued": s.queued}
    return JSONResponse(body, status_code=200 if state == "ready" else 503)


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
async def metrics(request: Request):
    service: TTSService = request.app.state.service
    m = request.app.state.metrics
    m.ready.set(1 if service.health_state == "ready" else 0)
    snap = service.engine_snapshot()
    return Response(m.render(snap.stats, snap.prefix, service.take_resume_seconds()), media_type=CONTENT_TYPE_LATEST)


def _cards(service: TTSService) -> list[ModelCard]:
    owner = "mossrt (demo bundle: random weights)" if service.bundle.is_demo else "mossrt"
    return [ModelCard(id=name, created=service.created, owned_by=owner) for name in (MODEL_ID, *MODEL_ALIASES)]


@router.get("/v1/models", dependencies=[Depends(require_key)], response_model=ModelList,
            responses={200: {"description": "OpenAI's list; to an ElevenLabs client (an ``xi-api-key`` header, or "
                                            "its SDK) ElevenLabs' array of ``{model_id, name, ...}``"}})
async def list_models(request: Request):
    """Our model and the OpenAI names we accept for it (any ``model`` string is accepted by the speech route)."""
    service: TTSService = request.app.state.service
    if wants_elevenlabs(request):
        return JSONResponse(elevenlabs_models(service, (MODEL_ID, *MODEL_ALIASES)))
    return ModelList(data=_cards(service))


def elevenlabs_models(service: TTSService, names: tuple[str, ...]) -> list[dict]:
    """``GET /v1/models`` for an ElevenLabs client (``models.list``; see :func:`wants_elevenlabs`)."""
    demo = " (demo bundle: random weights, the audio is noise)" if service.bundle.is_demo else ""
    return [{"model_id": name, "name": "MOSS-TTS-Realtime" if i == 0 else name, "can_do_text_to_speech": True,
             "can_do_voice_conversion": False, "can_use_style": False, "can_use_speaker_boost": False,
             "can_be_finetuned": False, "serves_pro_voices": False, "requires_alpha_access": False,
             "token_cost_factor": 1.0, "maximum_text_length_per_request": service.settings.max_input_chars,
             "description": "streaming text-to-speech" + demo,
             "languages": [{"language_id": "en", "name": "English"}, {"language_id": "zh", "name": "Chinese"}]}
            for i, name in enumerate(names)]


def wants_elevenlabs(request: Request) -> bool:
    """Whether ``GET /v1/models`` comes from an ElevenLabs client (:func:`app.errors.elevenlabs_client`): its
    list, and its errors, are then ElevenLabs'."""
    return elevenlabs_client(request.headers)


@router.get("/v1/audio/models", dependencies=[Depends(require_key)], response_model=AudioModelList)
async def list_audio_models(request: Request):
    """The speech models, as Open WebUI and Kokoro list them (``models``) and in OpenAI's list (``data``)."""
    cards = _cards(request.app.state.service)
    return AudioModelList(data=cards, models=[Named(id=c.id, name=c.id) for c in cards])


@router.get("/v1/models/{model_id}", dependencies=[Depends(require_key)], response_model=ModelCard)
async def get_model(model_id: str, request: Request):
    for card in _cards(request.app.state.service):
        if card.id == model_id:
            return card
    raise ApiError("model_not_found", f"model {model_id!r} not found", "model")
