"""What LocalAI sends, parsed and checked: ``ModelOptions`` (LoadModel) and ``TTSRequest.params``.

Every bad value is an :class:`OptionError` whose message names the key, so LocalAI (which shows
``Result.message`` / the gRPC status message) tells the user which YAML line to fix.

``ModelOptions.Options`` is the model YAML's ``options:`` list of ``"key:value"`` strings (the value is
everything after the first ``:``). The keys are :data:`MODEL_OPTIONS`; an unknown key fails LoadModel
(a typo never silently falls back to a default). Each sets a setting declared once in ``app/settings.py`` (a
:class:`ServerSettings` field, or a :class:`LocalAIOptions` one for the backend's own), whose type, choices and
bounds its parser holds it to. ``TTSRequest.params`` keys are :data:`TTS_PARAMS`, the
same names as the HTTP API's extension fields; unknown params are ignored (LocalAI forwards generic
ones, such as ``ref_text``, that this model has no use for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from pydantic.fields import FieldInfo

from ..audio_formats import MAX_SPEED, MIN_SPEED
from ..session.sampling import SamplingFields
from ..settings import LocalAIOptions, ServerSettings, bounds, choices, value_type

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


def parse_float(what: str, text: str, lo: float | None = None, hi: float | None = None, *,
                above: bool = False) -> float:
    """A finite number in ``lo..hi`` (``above``: ``lo`` itself excluded)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise OptionError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise OptionError(f"{what}: expected a finite number, got {text!r}")
    if lo is not None and (value <= lo if above else value < lo) or (hi is not None and value > hi):
        span = f"above {lo:g} and at most {hi:g}" if above else f"in {lo:g}..{hi:g}"
        raise OptionError(f"{what}: must be a number {span}, got {text.strip()}")
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
    key: str           # the setting it sets: a ServerSettings field, or a LocalAIOptions one (app/settings.py)
    parse: Callable[[str, str], object]
    help: str


def _declared(key: str) -> FieldInfo:
    """The one declaration of a LoadModel option's setting: the service's, else the LocalAI backend's own."""
    return ServerSettings.model_fields.get(key) or LocalAIOptions.model_fields[key]


def _parser(info: FieldInfo) -> Callable[[str, str], object]:
    """A parser of an option's text held to its setting's type, choices and bounds."""
    values = choices(info)
    if values:
        return lambda w, t: parse_choice(w, t, values)
    lo, hi, above = bounds(info)
    kind = value_type(info)
    if kind is int:
        return lambda w, t: parse_int(w, t, lo, hi)
    if kind is float:
        return lambda w, t: parse_float(w, t, lo, hi, above=above)
    return parse_text


def _option(key: str, help: str | None = None) -> ModelOption:
    """The option that sets the setting ``key``, parsed as declared; ``help`` where LocalAI's wording differs."""
    info = _declared(key)
    return ModelOption(key, _parser(info), help or info.description or key)


MODEL_OPTIONS: dict[str, ModelOption] = {
    "device": _option("device"),
    "provider": _option("device", "alias of device"),
    "threads": _option("threads"),
    "voices_dir": _option("voices_dir", "directory of registered voices (names usable as voice)"),
    "max_streams": _option("max_streams"),
    "engine_process": _option("engine_process"),
    "max_context_rows": _option("max_context_rows"),
    "max_input_chars": _option("max_input_chars"),
    "max_voice_seconds": _option("max_voice_seconds"),
    "queue_timeout": _option("queue_timeout", "seconds a request waits for a free stream slot, then "
                                              "RESOURCE_EXHAUSTED"),
    "stall_timeout": _option("stall_timeout", "seconds a TTSStream waits for its caller to take audio, then it is "
                                              "cancelled"),
    "verify": _option("verify"),
    "load_timeout": _option("load_timeout"),
    "voice": _option("default_voice"),
    "reference_dir": _option("reference_dir"),
    "output_dir": _option("output_dir"),
    # exporting a Hugging Face checkpoint (parameters.model names a checkpoint instead of a bundle)
    "codec": _option("codec"),
    "tokenizer": _option("tokenizer"),
    "dtype": _option("dtype"),
    "codec_dtype": _option("codec_dtype"),
    "cache_dir": _option("cache_dir"),
}
_MAX_THREADS = bounds(ServerSettings.model_fields["threads"])[1]


@dataclass(frozen=True)
class LoadConfig:
    """One LoadModel request, checked. Its service settings (``settings``) override the server's defaults;
    what it leaves out falls back to them, then to the declared defaults."""

    model: str                              # ModelOptions.Model as given: the model's identity
    candidates: tuple[Path, ...]            # where the bundle/checkpoint may be, in order
    model_path: str = ""                    # ModelOptions.ModelPath (LocalAI's models directory)
    audio_path: str = ""                    # ModelOptions.AudioPath (YAML tts.audio_path)
    settings: Mapping[str, object] = field(default_factory=dict)   # ServerSettings fields it gives
    options: LocalAIOptions = field(default_factory=LocalAIOptions)
    explicit: frozenset[str] = field(default_factory=frozenset)   # option keys given (after aliasing)

    def value(self, key: str) -> object:
        """What it holds for an option's setting (None for a service setting it does not give)."""
        if key in LocalAIOptions.model_fields:
            return getattr(self.options, key)
        return self.settings.get(key)


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
        opts["threads"] = min(int(request.Threads), _MAX_THREADS)
    if "device" not in opts and request.CUDA:
        opts["device"] = "cuda"
    own = {k: opts.pop(k) for k in list(opts) if k in LocalAIOptions.model_fields}
    return LoadConfig(model=model or model_file, candidates=tuple(dict.fromkeys(candidates)), model_path=model_path,
                      audio_path=request.AudioPath.strip(), settings=opts,
                      options=LocalAIOptions.model_validate(own), explicit=explicit)


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
    """``TTSRequest.params`` -> :class:`TTSParams` (each value parsed as its key's type; unknown keys ignored)."""
    values: dict[str, Any] = {}
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
