"""Typed engine errors; the app maps each class once to HTTP / WebSocket / gRPC errors."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InputError(EngineError, ValueError):
    """The caller's input is invalid (bad codes, empty audio, impossible settings): a 4xx."""


class ContextLimitError(InputError):
    """A turn does not fit the stream's context (prompt rows + text rows + frames > max_context_rows)."""


class ContextEvictedError(EngineError):
    """The stream's parked context was evicted (the parked-context budget): it cannot go on; its next turn
    belongs on a fresh stream."""


class TextTooLongError(InputError):
    """A text has more characters than the limit allows."""


class UnreadableAudioError(InputError):
    """Bytes or a file that the audio reader cannot decode at all."""


class VoiceExistsError(InputError):
    """A voice of that name is already registered."""


class VoiceGoneError(InputError):
    """A registered voice was deleted after it was looked up and before its codes were read."""


class VoiceLimitError(InputError):
    """The voice registry holds as many voices as it may (``max_voices``)."""


class ConcurrentUseError(InputError):
    """An object that is not thread-safe (a StreamingSession) was used by two threads at once."""


class BundleError(EngineError):
    """The bundle directory is missing, incomplete, corrupted or of an unknown format version."""


class OverloadError(EngineError):
    """No capacity to admit more work right now: a 429/503."""


class EngineBrokenError(OverloadError):
    """The engine itself is unusable (its device failed in a way no single stream explains): a 503, and
    ``/ready`` says so until the process is replaced."""


class CapacityError(OverloadError):
    """Every KV slot of the scheduler is taken (and none freed within the wait allowed)."""


class GraphError(EngineError):
    """A graph produced NaN/Inf or failed to run: the bundle is damaged or the runtime misbehaves (a 5xx)."""


class StreamClosedError(InputError):
    """The stream was closed (by its owner or because the scheduler stopped)."""
