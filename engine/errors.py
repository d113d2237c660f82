"""Typed engine errors; the app maps each class once to HTTP / WebSocket / gRPC errors."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InputError(EngineError, ValueError):
    """The caller's input is invalid (bad codes, empty audio, impossible settings): a 4xx."""


class BundleError(EngineError):
    """The bundle directory is missing, incomplete, corrupted or of an unknown format version."""


class OverloadError(EngineError):
    """No capacity to admit more work right now: a 429/503."""
