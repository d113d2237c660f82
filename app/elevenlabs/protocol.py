"""ElevenLabs WebSocket messages: the client's (validated) and the query parameters of a connection."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_INACTIVITY_TIMEOUT = 3600   # ElevenLabs documents 180; livekit sends 300 by default
DEFAULT_INACTIVITY_TIMEOUT = 20


class ClientMessage(BaseModel):
    """Every field pipecat, livekit-plugins-elevenlabs and the elevenlabs SDK send; others are refused.
    ``voice_settings``, ``generation_config`` (chunk_length_schedule), ``try_trigger_generation`` and
    pronunciation dictionaries are accepted and ignored: the model speaks text as it arrives."""

    model_config = ConfigDict(extra="forbid")
    text: StrictStr | None = None
    context_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    flush: StrictBool | None = None
    close_context: StrictBool | None = None
    close_socket: StrictBool | None = None
    xi_api_key: StrictStr | None = None
    authorization: StrictStr | None = None
    voice_settings: dict[str, Any] | None = None
    generation_config: dict[str, Any] | None = None
    try_trigger_generation: StrictBool | None = None
    pronunciation_dictionary_locators: list[Any] | None = None


class ConnectionParams(BaseModel):
    """Query parameters. ``model_id``, ``auto_mode``, ``language_code`` and the text-processing switches
    are accepted and ignored (one model; it reads text as it comes, in any language it knows)."""

    model_config = ConfigDict(extra="ignore")
    model_id: str | None = None
    output_format: str | None = None
    inactivity_timeout: StrictInt | None = Field(None, ge=1, le=MAX_INACTIVITY_TIMEOUT)
    sync_alignment: bool = False
    auto_mode: bool = False
    language_code: str | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**32)
    enable_logging: bool = True
    enable_ssml_parsing: bool = False
    apply_text_normalization: str | None = None
    alignment: Literal["speech", "read"] = "speech"   # ours: when a character is sent (docs/api-elevenlabs.md)

    @classmethod
    def from_query(cls, query) -> "ConnectionParams":
        data: dict[str, Any] = dict(query)
        for key in ("inactivity_timeout", "seed"):
            if key in data:
                try:
                    data[key] = int(data[key])
                except ValueError:
                    pass                 # the model's validation names it
        return cls.model_validate(data)
