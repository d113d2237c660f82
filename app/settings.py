"""Service settings: every ``mossrt serve`` flag is also a ``MOSSRT_*`` environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated


def _split(value):
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


class ServerSettings(BaseSettings):
    """Validated at start-up; a bad value stops the server with the variable's name."""

    model_config = SettingsConfigDict(env_prefix="MOSSRT_", frozen=True, extra="ignore")

    bundle: Path | None = Field(None, description="bundle directory (none: the built-in demo bundle)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Bearer keys; none = open")
    voices_dir: Path = Path.home() / ".local" / "share" / "mossrt" / "voices"
    max_streams: int | None = Field(None, ge=1, le=1024, description="concurrent streams (KV slots)")
    kv_budget_bytes: int | None = Field(None, ge=1, description="memory for KV slots when max_streams is unset")
    prefix_cache_bytes: int = Field(512 * 2**20, ge=0, description="Device memory (bytes) of system-prompt and voice KV kept for reuse")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(0, ge=0, le=256)
    max_input_chars: int = Field(4096, ge=1, le=100_000)
    max_context_rows: int = Field(4096, ge=256, le=1 << 17)
    max_voice_seconds: float = Field(30.0, ge=1.0, le=600.0)
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1024, le=1 << 30)
    queue_timeout: float = Field(10.0, ge=0.0, le=600.0, description="seconds a request waits for a slot")
    drain_timeout: float = Field(60.0, ge=0.0, le=3600.0, description="seconds streams may finish after SIGTERM")
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    verify: Literal["quick", "full", "off"] = "quick"
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # WebSocket sessions
    ws_idle_timeout: float = Field(60.0, gt=0, le=3600.0)
    ws_max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    ws_max_buffered_chars: int = Field(8192, ge=16, le=1_000_000, description="text received but not yet spoken")
    ws_max_turns: int = Field(200, ge=1, le=100_000)
    ws_text_timeout: float = Field(30.0, gt=0, le=3600.0, description="seconds a turn waits for more text before "
                                   "its text is ended for it")
    # ElevenLabs-compatible routes: their clients send no sampling settings (a seed only as a query parameter)
    elevenlabs_seed: int | None = Field(None, ge=0, lt=2**32, description="seed when a request names none")
    elevenlabs_greedy: bool = Field(False, description="greedy decoding on the ElevenLabs routes (reproducible)")
    max_voices: int = Field(1000, ge=1, le=1_000_000, description="registered voices the server keeps at most")
    # what one client may hold: request bodies, read times, streams it stops taking, the shutdown window
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=1 << 30, description="largest JSON (non-upload) body")
    header_timeout: float = Field(10.0, gt=0, le=600.0, description="seconds to send a request's headers")
    body_timeout: float = Field(60.0, gt=0, le=3600.0, description="seconds for a request's body to arrive")
    stall_timeout: float = Field(30.0, gt=0, le=3600.0, description="seconds a stream waits for its client "
                                                                  "to take audio before it ends")
    shutdown_delay: float = Field(0.0, ge=0.0, le=600.0, description="seconds after SIGTERM with /ready 503 and "
                                                                   "the listener open (the preStop window)")
    # the GPU step loop
    cuda_graphs: Literal["on", "off"] | None = Field(None, description="capture each batch bucket's step as CUDA "
                                                     "graphs (none: on with CUDA when the graphs place fully there)")
    warm_buckets: Literal["on", "off"] | None = Field(None, description="run every batch bucket's calls once before "
                                                      "/ready turns 200 (none: on when CUDA graphs are on)")

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value):
        return _split(value)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise ValueError("API keys must be at least 8 characters without spaces")
        return keys
