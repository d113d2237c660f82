"""The LocalAI backend's gRPC interceptors: the bearer token LocalAI may require, and the gate that refuses new
calls while the running ones drain at shutdown."""

from __future__ import annotations

import hmac
import os
import threading
from typing import Any, Callable, Mapping

import grpc

AUTH_ENV = "LOCALAI_GRPC_AUTH_TOKEN"


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable[[Any, Any], Any]) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` running ``behavior``."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, **kw)
    return grpc.unary_unary_rpc_method_handler(behavior, **kw)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>`` metadata, else UNAUTHENTICATED
    (LocalAI sends it when ``LOCALAI_GRPC_AUTH_TOKEN`` is set; compared in constant time)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key.lower() == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                break
        handler = continuation(handler_call_details)
        if handler is None or hmac.compare_digest(given, self._expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or invalid bearer token (this backend requires LOCALAI_GRPC_AUTH_TOKEN)")

        return _rebuild(handler, deny)


class DrainGate(grpc.ServerInterceptor):
    """Counts running calls and, once :meth:`close` is called, refuses new ones with UNAVAILABLE itself.

    The server keeps accepting connections while its running calls drain, so a call that arrives then is
    refused here, deterministically; left to ``grpc.Server.stop`` one that raced the stop came back
    CANCELLED. A call counts from its handler's start until gRPC reports it terminated."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)

        def gated(request, context):
            with self._cond:
                closed = self._closed
                if not closed:
                    self._running += 1
            if closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the backend is stopping: retry on another instance")
            if not context.add_callback(self._leave):
                self._leave()                   # already terminated (the caller left before we started)
            return behavior(request, context)

        return _rebuild(handler, gated)

    def _leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse every call from now on."""
        with self._cond:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call runs, at most ``timeout`` seconds; whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout=max(0.0, timeout))


def interceptors_from_env(env: Mapping[str, str] = os.environ) -> list[grpc.ServerInterceptor]:
    """The bearer-token check when ``LOCALAI_GRPC_AUTH_TOKEN`` is set, else none."""
    token = env.get(AUTH_ENV, "")
    return [BearerTokenInterceptor(token)] if token else []
