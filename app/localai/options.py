"""What LocalAI sends, parsed and checked: ``ModelOptions`` (LoadModel) and ``TTSRequest.params``.

Every bad value is an :class:`OptionError` whose message names the key, so LocalAI (which shows
``Result.message`` / the gRPC status message) tells the user which YAML line to fix.

``ModelOptions.Options`` is the model YAML's ``options:`` list of ``"key:value"`` strings (the value is
everything after the first ``:``). The keys are :data:`MODEL_OPTIONS`; an unknown key fails LoadModel
(a typo never silently falls back to a default). ``TTSRequest.params`` keys are :data:`TTS_PARAMS`, the
same names as the HTTP API's extension fields; unknown params are ignored (LocalAI forwards generic
ones, such as ``ref_text``, that this model has no use for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..audio_formats import MAX_SPEED, MIN_SPEED
from ..service import SamplingFields

BACKEND_NAME = "moss-tts-realtime"


class OptionError(ValueError):
    """A LoadModel option or a TTS param that cannot be used (the message names it)."""


# ---------------------------------------------------------------------------------------------- scalars
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(what: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptionError(f"{what}: expected true or false, got {text!r}")


def parse_int(what: str, text: str, lo: int | None = None, hi: int | None = None) -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise OptionError(f"{what}: expected an integer, got {text!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise OptionError(f"{what}: must be an integer in {lo}..{hi}, got {value}")
    return value


def parse_float(what: str, text: str, lo: float | None = None, hi: float | None = None) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise OptionError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise OptionError(f"{what}: expected a finite number, got {text!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise OptionError(f"{what}: must be a number in {lo:g}..{hi:g}, got {text.strip()}")
    return value


def parse_choice(what: str, text: str, choices: tuple[str, ...]) -> str:
    value = text.strip().lower()
    if value not in choices:
        raise OptionError(f"{what}: expected one of {', '.join(choices)}, got {text!r}")
    return value


def parse_text(what: str, text: str) -> str:
    value = text.strip()
    if not value:
        raise OptionError(f"{what}: the value is empty")
    return value


# ---------------------------------------------------------------------------------------------- LoadModel
@dataclass(frozen=True)
class ModelOption:
    key: str           # the LoadConfig field it sets
    parse: Callable[[str, str], object]
    help: str


_DEVICES = ("auto", "cpu", "cuda")
_VERIFY = ("quick", "full", "off")
_DTYPES = ("fp32", "fp16", "int8", "int4")
_CODEC_DTYPES = ("fp32", "fp16", "int8")

MODEL_OPTIONS: dict[str, ModelOption] = {
    "device": ModelOption("device", lambda w, t: parse_choice(w, t, _DEVICES),
                          "onnxruntime provider: cpu, cuda or auto (CUDA when installed)"),
    "provider": ModelOption("device", lambda w, t: parse_choice(w, t, _DEVICES), "alias of device"),
    "threads": ModelOption("threads", lambda w, t: parse_int(w, t, 0, 256),
                           "intra-op threads, 0..256 (0 = all cores)"),
    "voices_dir": ModelOption("voices_dir", parse_text, "directory of registered voices (names usable as voice)"),
    "max_streams": ModelOption("max_streams", lambda w, t: parse_int(w, t, 1, 1024),
                               "concurrent streams (KV slots), 1..1024 (default: what half the free memory holds)"),
    "max_context_rows": ModelOption("max_context_rows", lambda w, t: parse_int(w, t, 256, 1 << 17),
                                    "context rows per stream, i.e. its KV slot (default 4096)"),
    "max_input_chars": ModelOption("max_input_chars", lambda w, t: parse_int(w, t, 1, 100_000),
                                   "longest text accepted, in characters (default 4096)"),
    "max_voice_seconds": ModelOption("max_voice_seconds", lambda w, t: parse_float(w, t, 1.0, 600.0),
                                     "longest voice reference accepted, in seconds (default 30)"),
    "queue_timeout": ModelOption("queue_timeout", lambda w, t: parse_float(w, t, 0.0, 600.0),
                                 "seconds a request waits for a free stream slot before RESOURCE_EXHAUSTED (10)"),
    "stall_timeout": ModelOption("stall_timeout", lambda w, t: parse_float(w, t, 0.001, 3600.0),
                                 "seconds a TTSStream waits for its caller to take audio before it is cancelled (30)"),
    "verify": ModelOption("verify", lambda w, t: parse_choice(w, t, _VERIFY),
                          "bundle check at load: quick (sizes, default), full (every sha256) or off"),
    "load_timeout": ModelOption("load_timeout", lambda w, t: parse_float(w, t, 1.0, 86_400.0),
                                "seconds LoadModel waits for loading and warm-up (default 1800)"),
    "voice": ModelOption("default_voice", parse_text,
                         "voice used when a request names none: a registered voice or a reference audio path "
                         "(default: ModelOptions.AudioPath, i.e. YAML tts.audio_path, else the model's own voice)"),
    "reference_dir": ModelOption("reference_dir", parse_text,
                                 "one more directory whose audio files a request's voice may name, such as the "
                                 "folder of LocalAI's voice profiles (besides the models and voices directories)"),
    "output_dir": ModelOption("output_dir", parse_text,
                              "the folder TTS may write its dst files in (default: any existing folder but the "
                              "model, voices and reference folders; a dst is always a new file)"),
    # exporting a Hugging Face checkpoint (parameters.model names a checkpoint instead of a bundle)
    "codec": ModelOption("codec", parse_text,
                         "MOSS-Audio-Tokenizer checkpoint directory or hub id (required to export a checkpoint)"),
    "tokenizer": ModelOption("tokenizer", parse_text,
                             "tokenizer.json or a directory holding it (default: the TTS checkpoint directory)"),
    "dtype": ModelOption("dtype", lambda w, t: parse_choice(w, t, _DTYPES),
                         "weight type of the exported TTS graphs: fp32 (default), fp16, int8, int4"),
    "codec_dtype": ModelOption("codec_dtype", lambda w, t: parse_choice(w, t, _CODEC_DTYPES),
                               "weight type of the exported codec: fp32, fp16 or int8 (default: dtype if fp32/fp16)"),
    "cache_dir": ModelOption("cache_dir", parse_text,
                             "where exported bundles are kept (default: <ModelPath>/moss-tts-realtime/bundles, "
                             "else ~/.cache/mossrt/localai-bundles)"),
}


@dataclass(frozen=True)
class LoadConfig:
    """One LoadModel request, checked (fields left None fall back to the server's defaults)."""

    model: str                              # ModelOptions.Model as given: the model's identity
    candidates: tuple[Path, ...]            # where the bundle/checkpoint may be, in order
    model_path: str = ""                    # ModelOptions.ModelPath (LocalAI's models directory)
    audio_path: str = ""                    # ModelOptions.AudioPath (YAML tts.audio_path)
    device: str | None = None
    threads: int | None = None
    voices_dir: str | None = None
    max_streams: int | None = None
    max_context_rows: int | None = None
    max_input_chars: int | None = None
    max_voice_seconds: float | None = None
    queue_timeout: float | None = None
    stall_timeout: float | None = None
    verify: str | None = None
    load_timeout: float = 1800.0
    default_voice: str | None = None
    reference_dir: str | None = None
    output_dir: str | None = None
    codec: str | None = None
    tokenizer: str | None = None
    dtype: str = "fp32"
    codec_dtype: str | None = None
    cache_dir: str | None = None
    explicit: frozenset[str] = field(default_factory=frozenset)   # option keys given (after aliasing)


def parse_options(entries) -> dict[str, object]:
    """``["key:value", ...]`` -> ``{field: value}``; unknown keys, missing ``:`` and repeats fail."""
    out: dict[str, object] = {}
    for raw in entries:
        entry = str(raw)
        if not entry.strip():
            continue
        if ":" not in entry:
            raise OptionError(f"option {entry!r}: expected \"key:value\"")
        key, value = entry.split(":", 1)
        key = key.strip().lower()
        spec = MODEL_OPTIONS.get(key)
        if spec is None:
            raise OptionError(f"unknown option {key!r} for the {BACKEND_NAME} backend; known: "
                              f"{', '.join(sorted(MODEL_OPTIONS))}")
        if spec.key in out:
            raise OptionError(f"option {key!r} is given twice")
        out[spec.key] = spec.parse(f"option {key}", value)
    return out


def load_config(request) -> LoadConfig:
    """A ``ModelOptions`` message -> :class:`LoadConfig`. Precedence: ``Options`` entries, then the typed
    fields (``Threads`` > 0, ``CUDA`` = true), then the server's command-line defaults."""
    opts = parse_options(request.Options)
    model = request.Model.strip()
    model_file = request.ModelFile.strip()
    model_path = request.ModelPath.strip()
    if not model and not model_file:
        raise OptionError("no model given: set parameters.model to a bundle directory (or a checkpoint to export)")
    candidates: list[Path] = []
    if model_file:
        candidates.append(Path(model_file))
    if model:
        p = Path(model).expanduser()
        if model_path and not p.is_absolute():
            candidates.append(Path(model_path) / p)
        candidates.append(p)
    explicit = frozenset(opts)
    if "threads" not in opts and request.Threads > 0:
        opts["threads"] = min(int(request.Threads), 256)
    if "device" not in opts and request.CUDA:
        opts["device"] = "cuda"
    return LoadConfig(model=model or model_file, candidates=tuple(dict.fromkeys(candidates)), model_path=model_path,
                      audio_path=request.AudioPath.strip(), explicit=explicit, **opts)


# ---------------------------------------------------------------------------------------------- TTS params
@dataclass(frozen=True)
class TTSParams:
    """``TTSRequest.params``, coerced (None = the bundle's default)."""

    sampling: SamplingFields = field(default_factory=SamplingFields)
    max_frames: int | None = None
    speed: float = 1.0
    ignored: tuple[str, ...] = ()


_INT = lambda w, t: parse_int(w, t)                      # noqa: E731 - ranges are the engine's to check
_FLOAT = lambda w, t: parse_float(w, t)                  # noqa: E731
TTS_PARAMS: dict[str, tuple[Callable[[str, str], object], str]] = {
    "greedy": (parse_bool, "argmax decoding (true/false)"),
    "seed": (_INT, "makes sampling reproducible (0..2^63-1)"),
    "temperature": (_FLOAT, "sampling temperature (0 = greedy)"),
    "top_p": (_FLOAT, "nucleus probability in (0, 1]"),
    "top_k": (_INT, "keep the k most likely codes (0 = off)"),
    "repetition_penalty": (_FLOAT, "penalty on recent codes (1 = off)"),
    "repetition_window": (_INT, "frames the penalty looks back"),
    "max_frames": (_INT, "frame limit of the utterance (80 ms each)"),
    "speed": (lambda w, t: parse_float(w, t, MIN_SPEED, MAX_SPEED),
              f"playback speed {MIN_SPEED:g}..{MAX_SPEED:g}, pitch preserved (LocalAI forwards OpenAI's speed)"),
}


def parse_tts_params(params) -> TTSParams:
    values: dict[str, object] = {}
    ignored = []
    for key, text in params.items():
        spec = TTS_PARAMS.get(key)
        if spec is None:
            ignored.append(key)
            continue
        if not str(text).strip():
            continue                              # an empty value = unset
        values[key] = spec[0](f"params[{key!r}]", str(text))
    sampling = {k: values.pop(k) for k in list(values) if k in SamplingFields.__dataclass_fields__}
    return TTSParams(sampling=SamplingFields(**sampling), **values, ignored=tuple(sorted(ignored)))
