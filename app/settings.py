"""Service settings, each declared once: its name, type, bounds, default, ``MOSSRT_*`` environment variable, help,
and whether ``mossrt serve`` also takes it as a flag. The flags (``mossrt/serve.py``), the engine limits the
service uses (:meth:`ServerSettings.limits`) and the settings table of ``docs/operations.md`` (a test compares
it with :func:`settings_table`) are all derived from this class. The LocalAI backend's own settings are declared
here too: its LoadModel options (:class:`LocalAIOptions`) and its process's (:class:`LocalAIServer`).
"""

from __future__ import annotations

import ipaddress
import os
import typing
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated

from engine.limits import DEFAULT_MAX_TEXT_CHARS, Limits
from engine.serving.scheduler import DEFAULT_QUEUE_TIMEOUT

ENV_PREFIX = "MOSSRT_"
# the service's stream slots are smaller than the offline tools' (engine.limits.DEFAULT_MAX_CONTEXT_ROWS,
# 8192 rows): a served stream holds its KV slot while it generates, and 4096 rows is over 4 minutes of audio
SERVER_MAX_CONTEXT_ROWS = 4096
# the lists a client may be let read without a key (Open WebUI lists voices and models without sending one)
KEYLESS_ROUTE_CHOICES = ("/v1/models", "/v1/audio/models", "/v1/audio/voices", "/v1/voices", "/v2/voices")


def wyoming_uri_is_local(uri: str) -> bool:
    """Whether a Wyoming URI is reachable from this host only: ``unix://`` (file permissions), or TCP on a loopback
    address or ``localhost``. Any other host name counts as remote: what it resolves to is not known here."""
    parts = urlsplit(uri)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split(value):
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def setting(default, help: str, *, flag: bool = True, metavar: str | None = None, **bounds):
    """A setting's declaration: its default, bounds (``ge``/``gt``/``le``/``lt``), help, and whether
    ``mossrt serve`` takes it as a flag too (``--the-name``) or as its environment variable only."""
    return Field(default, description=help, json_schema_extra={"flag": flag, "metavar": metavar}, **bounds)


def _default_voices_dir() -> Path:
    return Path.home() / ".local" / "share" / "mossrt" / "voices"


class ServerSettings(BaseSettings):
    """Validated at start-up; a bad value stops the server with the flag's and the variable's name."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    # the model and the process
    bundle: Path | None = setting(None, "bundle directory (default: the built-in demo bundle)", metavar="DIR")
    host: str = setting("127.0.0.1", "bind address (containers use 0.0.0.0)")
    port: int = setting(8000, "bind port", ge=1, le=65535)
    wyoming_uri: str | None = setting(None, "also serve the Wyoming protocol (Home Assistant) at tcp://HOST:PORT "
                                           "or unix://PATH, in the same process; no authentication: with API keys "
                                           "set, a TCP address off loopback needs --wyoming-allow-keyless-remote "
                                           "(unset: off)", metavar="URI")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "onnxruntime provider (auto: CUDA when every node "
                                                             "of the bundle runs there)")
    threads: int = setting(0, "intra-op threads (0: all cores)", ge=0, le=256)
    verify: Literal["quick", "full", "off"] = setting("quick", "bundle check at start: sizes (quick) or every "
                                                               "sha256 (full)")
    log_format: Literal["text", "json"] = setting("text", "log lines as text or JSON")
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "log level")
    cuda_graphs: Literal["on", "off"] | None = setting(None, "capture each batch bucket's step as CUDA graphs "
                                                             "(unset: on with CUDA when the graphs place fully "
                                                             "there)")
    warm_buckets: Literal["on", "off"] | None = setting(None, "run every batch bucket's calls once before /ready "
                                                              "turns 200 (unset: on when CUDA graphs are on)")
    engine_process: Literal["on", "off"] = setting("off", "run the engine core (scheduler, KV slots, the device "
                                                        "loop) in a process of its own, so that no request's work "
                                                        "stalls a stream (off: in this process, as today)")
    api_workers: int | None = setting(None, "API processes (HTTP, WebSocket; each its own interpreter) sharing one "
                                            "engine core process; more than 1 needs --engine-process on (unset: 1 "
                                            "with the engine in this process, else a quarter of the cores, 1 to 8)",
                                      ge=1, le=64)
    # capacity
    max_streams: int | None = setting(None, "concurrently generating streams, i.e. KV slots (unset: what half the "
                                            "available memory holds, at most 64)", ge=1, le=1024)
    kv_budget_bytes: int | None = setting(None, "memory for KV slots when --max-streams is unset (unset: half the "
                                                "available memory)", flag=False, ge=1)
    prefix_cache_bytes: int = setting(512 * 2**20, "device memory kept for system-prompt and voice KV prefixes",
                                      flag=False, ge=0)
    parked_context_bytes: int | None = setting(None, "host memory for the KV rows of idle conversations parked to "
                                                     "give their slot to a waiting stream; past it the one parked "
                                                     "first loses its context (unset: an eighth of physical "
                                                     "memory)", flag=False, ge=0)
    max_context_rows: int = setting(SERVER_MAX_CONTEXT_ROWS, "context rows per stream: its KV slot", ge=256,
                                    le=1 << 17)
    queue_timeout: float = setting(DEFAULT_QUEUE_TIMEOUT, "seconds a request waits for a free stream, then 429",
                                   ge=0.0, le=600.0)
    drain_timeout: float = setting(60.0, "seconds running turns may finish after SIGTERM", ge=0.0, le=3600.0)
    shutdown_delay: float = setting(0.0, "seconds after SIGTERM with /ready 503 and the listener open (the "
                                         "preStop window)", ge=0.0, le=600.0)
    # what a request may hold
    api_keys: Annotated[list[str], NoDecode] = setting([], "accepted API keys (the flag repeatable, the variable "
                                                           "comma-separated; none: no authentication)", metavar="KEY")
    cors_origins: Annotated[list[str], NoDecode] = setting([], "browser origins allowed, * = any (the flag "
                                                               "repeatable, the variable comma-separated): CORS, and "
                                                               "the Origin of WebSocket upgrades", metavar="ORIGIN")
    keyless_routes: Annotated[list[str], NoDecode] = setting([], "read-only routes a client without a key may "
                                                                 "GET when keys are set (the flag repeatable, the "
                                                                 "variable comma-separated; of: "
                                                                 + ", ".join(KEYLESS_ROUTE_CHOICES) + ")",
                                                             metavar="PATH")
    max_input_chars: int = setting(DEFAULT_MAX_TEXT_CHARS, "longest text of one request", ge=1, le=100_000)
    normalize_text: Literal["off", "on"] = setting("off", "normalize the text of a whole utterance (numbers, "
                                                          "currency, dates, times, URLs, e-mail addresses, phone "
                                                          "numbers) when its request does not say (Kokoro's "
                                                          "normalization_options; docs/normalization.md)")
    max_voice_seconds: float = setting(30.0, "longest voice sample", ge=1.0, le=600.0)
    max_upload_bytes: int = setting(10 * 1024 * 1024, "largest multipart upload (voice samples)", ge=1024,
                                    le=1 << 30)
    max_body_bytes: int = setting(1024 * 1024, "largest JSON request body, refused before it is parsed", ge=1024,
                                  le=1 << 30)
    header_timeout: float = setting(10.0, "seconds a connection may take to send a request's headers", gt=0,
                                    le=600.0)
    max_header_bytes: int = setting(64 * 1024, "largest request line and headers (a WebSocket upgrade's too), "
                                               "then 431 before the key is checked", ge=8 * 1024, le=1 << 20)
    max_header_count: int = setting(100, "most header fields of a request, then 431", ge=16, le=1000)
    max_url_bytes: int = setting(8 * 1024, "longest request URL, then 414", ge=1024, le=64 * 1024)
    body_timeout: float = setting(60.0, "seconds a request's body may take to arrive, then 408", gt=0, le=3600.0)
    stall_timeout: float = setting(30.0, "seconds a stream waits for its client to take audio, then it ends (every "
                                         "transport)", gt=0, le=3600.0)
    max_voices: int = setting(1000, "registered voices kept at most (POST /v1/audio/voices is a 409 beyond)",
                              ge=1, le=1_000_000)
    voices_dir: Path = setting(_default_voices_dir(), "where registered voices are stored", metavar="DIR")
    # WebSocket sessions (ours and the ElevenLabs-compatible ones)
    ws_idle_timeout: float = setting(60.0, "seconds a socket with no turn running may go without a message "
                                           "(keep-alives count, refused messages do not), then "
                                           "it is closed (an ElevenLabs inactivity_timeout above it is cut to it)",
                                     gt=0, le=3600.0)
    ws_text_timeout: float = setting(30.0, "seconds an open turn waits for more text while it has nothing to "
                                           "speak, then its text is ended for it", gt=0, le=3600.0)
    ws_auth_timeout: float = setting(10.0, "seconds an ElevenLabs socket without a key in its handshake has to "
                                           "send it in its first message", gt=0, le=600.0)
    ws_max_message_bytes: int = setting(4 * 1024 * 1024, "largest WebSocket message", ge=1024,
                                        le=64 * 1024 * 1024)
    ws_max_buffered_chars: int = setting(8192, "text received but not yet spoken, per socket", ge=16,
                                         le=1_000_000)
    ws_max_turns: int = setting(200, "turns of one socket", ge=1, le=100_000)
    ws_max_sessions: int = setting(1000, "open WebSocket sessions (ours and the ElevenLabs ones) per server: an "
                                         "idle one holds no slot, so this bounds them; more are refused "
                                         "(too_many_sessions)", ge=1, le=1_000_000)
    ws_max_contexts: int = setting(5, "open contexts of one ElevenLabs multi-context socket (ElevenLabs allows "
                                      "5)", ge=1, le=1000)
    # the Wyoming listener: its protocol has no keys, so what its peers reach is bounded apart (docs/wyoming.md)
    wyoming_max_sessions: int = setting(64, "open Wyoming connections per server, counted apart from "
                                            "--ws-max-sessions (keyless peers cannot take the sessions keyed "
                                            "clients need); more are refused (too_many_sessions)", ge=1,
                                        le=1_000_000)
    wyoming_voices: Literal["builtin", "all"] | None = setting(None, "voices Wyoming lists and speaks: builtin "
                                                                     "(default and OpenAI's names) or all (the "
                                                                     "uploaded ones too; unset: builtin when API "
                                                                     "keys are set, else all)")
    wyoming_allow_keyless_remote: Literal["off", "on"] = setting("off", "with API keys set, let --wyoming-uri bind a "
                                                                        "TCP address off loopback: every peer that "
                                                                        "reaches it may speak, without a key",
                                                                 validate_default=True)
    # ElevenLabs-compatible routes: their clients send no sampling settings (a seed only as a query parameter)
    elevenlabs_seed: int | None = setting(None, "seed of an ElevenLabs request that names none", ge=0, lt=2**32)
    elevenlabs_greedy: bool = setting(False, "greedy decoding on the ElevenLabs routes (reproducible)",
                                      flag=False)

    @field_validator("api_keys", "cors_origins", "keyless_routes", mode="before")
    @classmethod
    def _comma_list(cls, value):
        return _split(value)

    @field_validator("wyoming_uri")
    @classmethod
    def _wyoming_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        parts = urlsplit(uri)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme == "tcp" and parts.hostname and port:
            return uri
        if parts.scheme == "unix" and parts.path:
            return uri
        raise ValueError("a Wyoming URI is tcp://HOST:PORT or unix://PATH")

    @field_validator("wyoming_allow_keyless_remote")
    @classmethod
    def _wyoming_exposure(cls, allow: str, info: ValidationInfo) -> str:
        # declared after api_keys and wyoming_uri: both are validated by now (absent here when they failed)
        uri, keys = info.data.get("wyoming_uri"), info.data.get("api_keys")
        if allow == "off" and keys and uri and not wyoming_uri_is_local(uri):
            raise ValueError(f"API keys are set, and --wyoming-uri {uri} is not a loopback address: Wyoming has no "
                             "authentication, so every peer that reaches the port could list and speak voices "
                             "without a key. Bind tcp://127.0.0.1:PORT or unix://PATH, or allow it with "
                             "--wyoming-allow-keyless-remote on (docs/wyoming.md)")
        return allow

    def wyoming_uploaded_voices(self) -> bool:
        """Whether Wyoming lists and speaks uploaded voices (``--wyoming-voices``; unset: only without keys,
        since the keys keep them, their names and their timbre, from keyless clients)."""
        return self.wyoming_voices == "all" if self.wyoming_voices is not None else not self.api_keys

    @field_validator("api_workers")
    @classmethod
    def _workers(cls, workers: int | None, info: ValidationInfo) -> int | None:
        # declared after engine_process: validated by now
        if workers is not None and workers > 1 and info.data.get("engine_process") != "on":
            raise ValueError(f"{workers} API workers share one engine core process: give --engine-process on too")
        return workers

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise ValueError("API keys must be at least 8 characters without spaces")
        return keys

    @field_validator("keyless_routes")
    @classmethod
    def _keyless(cls, routes: list[str]) -> list[str]:
        for r in routes:
            if r not in KEYLESS_ROUTE_CHOICES:
                raise ValueError(f"{r!r} is not a read-only list route: one of {', '.join(KEYLESS_ROUTE_CHOICES)}")
        return routes

    def api_worker_count(self) -> int:
        """The API processes to run: the setting, else 1 with the engine in this process and a quarter of
        the cores (1 to 8) with the engine core in its own (the core's loop and onnxruntime keep the rest)."""
        if self.api_workers is not None:
            return self.api_workers
        return 1 if self.engine_process == "off" else max(1, min(8, len(os.sched_getaffinity(0)) // 4))

    def limits(self) -> Limits:
        """The engine limits the service holds every stream to."""
        return Limits(max_text_chars=self.max_input_chars, max_voice_seconds=self.max_voice_seconds,
                      max_context_rows=self.max_context_rows)


class LocalAIOptions(BaseModel):
    """The LocalAI backend's own LoadModel options (``app/localai/options.py`` parses them from the model YAML's
    ``options:``); the service settings LoadModel may also give are :class:`ServerSettings` fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_timeout: float = setting(1800.0, "seconds LoadModel waits for loading and warm-up", ge=1.0, le=86_400.0)
    default_voice: str | None = setting(None, "voice used when a request names none: a registered voice or a "
                                              "reference audio path (unset: ModelOptions.AudioPath, i.e. YAML "
                                              "tts.audio_path, else the model's own voice)")
    reference_dir: str | None = setting(None, "one more directory whose audio files a request's voice may name, "
                                              "such as the folder of LocalAI's voice profiles (besides the models "
                                              "and voices directories)")
    output_dir: str | None = setting(None, "the folder TTS may write its dst files in (unset: any existing folder "
                                           "but the model, voices and reference folders; a dst is always a new "
                                           "file)")
    # exporting a Hugging Face checkpoint (parameters.model names a checkpoint instead of a bundle)
    codec: str | None = setting(None, "MOSS-Audio-Tokenizer checkpoint directory or hub id (required to export a "
                                      "checkpoint)")
    tokenizer: str | None = setting(None, "tokenizer.json or a directory holding it (unset: the TTS checkpoint "
                                          "directory)")
    dtype: Literal["fp32", "fp16", "int8", "int4"] = setting("fp32", "weight type of the exported TTS graphs")
    codec_dtype: Literal["fp32", "fp16", "int8"] | None = setting(None, "weight type of the exported codec (unset: "
                                                                        "dtype if fp32/fp16)")
    cache_dir: str | None = setting(None, "where exported bundles are kept (unset: "
                                          "<ModelPath>/moss-tts-realtime/bundles, else "
                                          "~/.cache/mossrt/localai-bundles)")


class LocalAIServer(BaseModel):
    """The LocalAI backend process's own settings (``mossrt localai``'s flags, LocalAI's environment)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    addr: str = setting("localhost:50051", "HOST:PORT to listen on (LocalAI appends it)")
    grace: float = setting(5.0, "seconds running calls may finish after SIGTERM/SIGINT", ge=0.0)
    max_workers: int = setting(4, "concurrent calls (LocalAI's PYTHON_GRPC_MAX_WORKERS)", ge=1, le=1024)


# ---------------------------------------------------------------------------------------------- derived
def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    """``max_streams`` → ``--max-streams``; the list settings take one value per flag (``--api-key``)."""
    singular = {"api_keys": "api_key", "cors_origins": "cors_origin",
                "keyless_routes": "keyless_route"}.get(field, field)
    return "--" + singular.replace("_", "-")


def bounds(info) -> tuple:
    """(lowest, highest, lowest excluded) of a field's numeric bounds."""
    lo = hi = None
    open_lo = False
    for m in info.metadata:
        for attr, is_open in (("ge", False), ("gt", True)):
            if getattr(m, attr, None) is not None:
                lo, open_lo = getattr(m, attr), is_open
        for attr in ("le", "lt"):
            if getattr(m, attr, None) is not None:
                hi = getattr(m, attr)
    return lo, hi, open_lo


def choices(info) -> tuple | None:
    """The values of a ``Literal`` setting (None for others)."""
    if typing.get_origin(info.annotation) is Literal:
        return typing.get_args(info.annotation)
    args = [a for a in typing.get_args(info.annotation) if a is not type(None)] or [info.annotation]
    literal = next((a for a in args if typing.get_origin(a) is Literal), None)
    return typing.get_args(literal) if literal is not None else None


def value_type(info) -> type:
    """The type of a setting's values, ``None`` aside (``int`` for ``int | None``; a ``list``'s item type)."""
    args = [a for a in typing.get_args(info.annotation) if a is not type(None)] or [info.annotation]
    return args[0]


def is_flag(info) -> bool:
    return bool((info.json_schema_extra or {}).get("flag", True))


def _default_text(field: str, info) -> str:
    if field == "voices_dir":
        return "`~/.local/share/mossrt/voices`"
    value = info.default
    if value is None or value == []:
        return "unset"
    if isinstance(value, bool):
        return "off" if not value else "on"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value // (1 << 20)} MiB"
    return f"`{value}`"


def _bounds_text(info) -> str:
    c = choices(info)
    if c:
        return " \\| ".join(f"`{v}`" for v in c)
    lo, hi, open_lo = bounds(info)
    if lo is None and hi is None:
        return ""
    return f"{'>' if open_lo else ''}{lo if lo is not None else ''}..{hi if hi is not None else ''}"


def settings_table() -> str:
    """The Markdown table of every setting (``docs/operations.md`` holds it; a test keeps them equal)."""
    rows = ["| setting | flag | environment | default | values | meaning |", "|---|---|---|---|---|---|"]
    for field, info in ServerSettings.model_fields.items():
        flag = f"`{flag_name(field)}`" if is_flag(info) else "—"
        rows.append(f"| {field} | {flag} | `{env_name(field)}` | {_default_text(field, info)} | {_bounds_text(info)} "
                    f"| {info.description} |")
    return "\n".join(rows)
