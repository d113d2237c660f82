"""ElevenLabs WebSocket messages: the client's (validated) and the query parameters of a connection; the
seed, which the HTTP routes take from their query (or body) with the same bounds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_INACTIVITY_TIMEOUT = 3600   # ElevenLabs documents 180; livekit sends 300 by default
DEFAULT_INACTIVITY_TIMEOUT = 20
Seed = Annotated[StrictInt, Field(ge=0, lt=2**32)]     # ElevenLabs: 0..4294967295, in a query or a body


def _query_ints(query, keys: tuple[str, ...]) -> dict[str, Any]:
    """The query as a dict, the integer parameters among ``keys`` as ints where they are (else left as text,
    for the model's validation to name)."""
    data: dict[str, Any] = dict(query)
    for key in keys:
        if key in data:
            try:
                data[key] = int(data[key])
            except ValueError:
                pass
    return data


class QuerySeed(BaseModel):
    """The HTTP routes' query ``seed``, validated as the WebSockets' (:class:`ConnectionParams`)."""

    model_config = ConfigDict(extra="ignore")
    seed: Seed | None = None

    @classmethod
    def from_query(cls, query) -> "QuerySeed":
        return cls.model_validate(_query_ints(query, ("seed",)))


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
    seed: Seed | None = None
    enable_logging: bool = True
    enable_ssml_parsing: bool = False
    apply_text_normalization: str | None = None
    alignment: Literal["speech", "read"] = "speech"   # ours: when a character is sent (docs/api-elevenlabs.md)

    @classmethod
    def from_query(cls, query) -> "ConnectionParams":
        return cls.model_validate(_query_ints(query, ("inactivity_timeout", "seed")))
