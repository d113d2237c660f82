"""Request and response bodies (OpenAI's shapes plus this model's extension fields)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

from engine.limits import HARD_MAX_FRAMES
from engine.model.sampling import MAX_REPETITION_WINDOW, MAX_SEED, MAX_TOP_K

from .audio_formats import ENCODINGS, MAX_OUT_RATE, MAX_SPEED, MIN_OUT_RATE, MIN_SPEED
from .normalize import Switches

ResponseFormat = Literal[ENCODINGS]  # type: ignore[valid-type]


def _whole_number(value):
    """JSON integers, and numbers like 2366.0 that JSON Schema counts as integers; never bools or strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


def _number(value):
    """A JSON number; booleans and strings are refused rather than coerced."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    return value


WholeInt = Annotated[int, BeforeValidator(_whole_number)]
Number = Annotated[float, BeforeValidator(_number)]


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr = Field(min_length=1, max_length=128)


class SamplingExtras(BaseModel):
    """Generation settings beyond OpenAI's fields (all optional; defaults come from the bundle)."""

    seed: WholeInt | None = Field(None, ge=0, le=MAX_SEED - 1)    # le: pydantic prints an lt bound as a float
    temperature: Number | None = Field(None, ge=0, le=100)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: WholeInt | None = Field(None, ge=0, le=MAX_TOP_K)
    repetition_penalty: Number | None = Field(None, gt=0, le=100)
    repetition_window: WholeInt | None = Field(None, ge=1, le=MAX_REPETITION_WINDOW)
    max_frames: WholeInt | None = Field(None, ge=1, le=HARD_MAX_FRAMES)
    greedy: StrictBool | None = None


class SpeechRequest(SamplingExtras):
    """``POST /v1/audio/speech``. Unknown keys are accepted and ignored (clients pass extensions through
    ``extra_body``)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    input: StrictStr = Field(min_length=1)
    voice: StrictStr | VoiceRef = "default"
    instructions: StrictStr | None = Field(None, max_length=4096)
    response_format: ResponseFormat = "mp3"
    speed: Number = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream_format: Literal["audio", "sse"] = "audio"
    # output rate (resampled with soxr; default the model's 24000); ulaw/alaw are for telephony at 8000
    sample_rate: WholeInt | None = Field(None, ge=MIN_OUT_RATE, le=MAX_OUT_RATE)
    allow_special_tokens: StrictBool = False
    # false: the whole audio as one body with its Content-Length (Kokoro's clients); true: streamed as generated
    stream: StrictBool = True
    # word timestamps in the SSE events (stream_format "sse"): {"word", "start_time", "end_time"} in seconds
    return_timestamps: StrictBool = False
    # Kokoro-FastAPI's text normalization switches (app.normalize); absent: the server's default
    normalization_options: Switches | None = None


class CaptionedSpeechRequest(SpeechRequest):
    """``POST /dev/captioned_speech`` (Kokoro-FastAPI's): the speech request, with word timestamps by default.
    Kokoro's ``lang_code`` and ``volume_multiplier`` are accepted and ignored, as every unknown key."""

    model: StrictStr = Field("moss-tts-realtime", min_length=1, max_length=256)
    return_timestamps: StrictBool = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    shutdown_date: None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VoiceObject(BaseModel):
    object: Literal["audio.voice"] = "audio.voice"
    id: str
    name: str
    created_at: int


class Named(BaseModel):
    """An id and a display name (what Open WebUI lists)."""

    id: str
    name: str


class VoiceList(BaseModel):
    """The registered voices (``data``, OpenAI's shape) and every voice a request may name (``voices``:
    Open WebUI's and Kokoro's shape)."""

    object: Literal["list"] = "list"
    data: list[VoiceObject]
    voices: list[Named]


class AudioModelList(BaseModel):
    """``GET /v1/audio/models``: the speech models (``data``, OpenAI's shape; ``models``, Open WebUI's)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[Named]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error of the service (OpenAI's shape)."""

    error: ErrorDetail


class DeletedVoice(BaseModel):
    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool = True
