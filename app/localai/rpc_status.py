"""How the LocalAI backend's failures reach LocalAI: a gRPC status for a request (``context.abort`` once, never a
crash), ``Result(success=False)`` for LoadModel. The status codes are the table in ``server.py``'s docstring."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator

import grpc

from engine.errors import EngineError

from ..errors import ApiError, from_engine, grpc_status
from .options import OptionError

log = logging.getLogger("mossrt.localai")


class Abort(Exception):
    """End the RPC with this status (raised inside handlers; the wrappers call ``context.abort`` once)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class LoadFailed(Exception):
    """LoadModel answers ``Result(success=False, message=...)``."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an exception raised while serving a request: the catalogue's row (app.errors)."""
    if isinstance(exc, Abort):
        return exc.code, exc.message
    if isinstance(exc, OptionError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (ApiError, EngineError)):
        err = from_engine(exc)
        return grpc.StatusCode[grpc_status(err)], err.message
    log.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def unary(method: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """A unary handler whose every failure ends the call with its status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            code, message = status_for(exc)
        context.abort(code, message)
    return wrapper


def streaming(method: Callable[[Any, Any, Any], Iterator[Any]]) -> Callable[[Any, Any, Any], Iterator[Any]]:
    """A response-streaming handler whose every failure ends the call with its status; its generator is closed
    however the call ends."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        inner = method(self, request, context)
        failure = None
        try:
            while True:
                try:
                    item = next(inner)
                except StopIteration:
                    return
                except Exception as exc:  # noqa: BLE001
                    failure = status_for(exc)
                    break
                yield item
        finally:
            inner.close()           # also when gRPC drops this generator (client gone): closes the stream
        context.abort(*failure)
    return wrapper
