"""LocalAI's ``Backend`` gRPC service for MOSS-TTS-Realtime: the ``moss-tts-realtime`` external backend.

LocalAI spawns the backend with ``--addr HOST:PORT``, polls ``Health`` until it answers ``OK``, sends
``LoadModel`` (the model YAML as ``ModelOptions``) and then ``TTS`` (write a WAV to ``dst``) or
``TTSStream`` (a ``{"sample_rate": N}`` message, then s16le mono PCM chunks as frames are generated).

Loading, warm-up, voice names and sampling settings go through :class:`app.service.TTSService`, the
same object the HTTP service uses; every request opens a stream on its one scheduler, which is where
concurrent requests are batched. Errors are gRPC status codes (``context.abort``), never a crash:

=====================================  ============================
no model loaded / it failed to load     FAILED_PRECONDITION
model still loading, or Free'd mid-way  UNAVAILABLE
empty text, bad param, unknown voice    INVALID_ARGUMENT
no free stream slot in queue_timeout    RESOURCE_EXHAUSTED
ModelIdentity names another model       NOT_FOUND ("model identity mismatch", LocalAI's sentinel)
client cancelled                        CANCELLED
anything else                           INTERNAL
=====================================  ============================

This module never imports ``export``: exporting a Hugging Face checkpoint at LoadModel time uses an
exporter callable injected by the caller (``mossrt localai`` passes one).

The servicer composes the pieces by job: ``lifecycle`` (the model: LoadModel, Status, Free), ``bundles``
(which bundle a LoadModel names, exported when it is a checkpoint), ``voices`` (a request's voice and its
reference files), ``speech`` (TTS and TTSStream), ``rpc_status`` (failures as statuses) and ``interceptors``
(the bearer token, the drain at shutdown).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping

import grpc

from ..metrics import Metrics
from ..settings import LocalAIServer, bounds
from . import backend_pb2 as pb
from . import backend_pb2_grpc as pb_grpc
from .bundles import BundleSource, Exporter
from .interceptors import AUTH_ENV, DrainGate, interceptors_from_env
from .lifecycle import ModelLifecycle, ServerDefaults
from .options import BACKEND_NAME
from .rpc_status import LoadFailed, streaming, unary
from .speech import Speech
from .voices import VoiceFiles

log = logging.getLogger("mossrt.localai")

MAX_MESSAGE_BYTES = 50 * 1024 * 1024
# grpc core's own bounds below the servicer, pinned rather than left to its defaults (docs/operations.md):
# a request's metadata (header block) over the hard limit is RESOURCE_EXHAUSTED, and a value past it is
# skipped, not buffered; a client's pings without a call more often than every 5 min earn a strike, and
# past 2 strikes the connection gets GOAWAY too_many_pings and is closed (a ping flood)
METADATA_SOFT_BYTES = 8 * 1024
METADATA_HARD_BYTES = 16 * 1024
PING_STRIKES = 2
PING_INTERVAL_WITHOUT_CALLS_MS = 5 * 60 * 1000
_WORKERS = LocalAIServer.model_fields["max_workers"]
DEFAULT_MAX_WORKERS: int = _WORKERS.default
DEFAULT_GRACE_SECONDS: float = LocalAIServer.model_fields["grace"].default
WORKERS_ENV = "PYTHON_GRPC_MAX_WORKERS"


def max_workers_from_env(env: Mapping[str, str] = os.environ) -> int:
    """Concurrent calls: ``PYTHON_GRPC_MAX_WORKERS`` (LocalAI's name for its Python backends), in the declared
    bounds."""
    raw = env.get(WORKERS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_WORKERS
    lo, hi, _ = bounds(_WORKERS)
    try:
        value = int(raw, 10)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ValueError(f"{WORKERS_ENV} must be an integer in {lo}..{hi}, got {raw!r}")
    return value


# ---------------------------------------------------------------------------------------------- the servicer
class MossTTSBackend(pb_grpc.BackendServicer):
    """``Health``, ``LoadModel``, ``TTS``, ``TTSStream``, ``Status``, ``Free``; every other RPC of the
    proto answers UNIMPLEMENTED (the generated base class)."""

    def __init__(self, defaults: ServerDefaults | None = None, exporter: Exporter | None = None,
                 demo_bundle: Callable[[], Path] | None = None):
        self.metrics = Metrics()                 # the streams' meters (this backend serves no /metrics)
        self.voices = VoiceFiles()
        self.lifecycle = ModelLifecycle(defaults or ServerDefaults(), BundleSource(exporter, demo_bundle),
                                        on_free=self.voices.clear)
        self.speech = Speech(self.lifecycle, self.voices, self.metrics)

    def preload(self, bundle: str | Path, *, listen: Callable[[], None] = lambda: None) -> None:
        """Load ``bundle`` in the background, ``listen`` once it is registered (:meth:`ModelLifecycle.preload`)."""
        self.lifecycle.preload(bundle, listen=listen)

    def close(self) -> None:
        """Shutdown: free the model without waiting for a load in progress."""
        self.lifecycle.close()

    def Health(self, request, context):
        return pb.Reply(message=b"OK")

    def LoadModel(self, request, context):
        return self.lifecycle.load_model(request)

    def Free(self, request, context):
        return self.lifecycle.free()

    def Status(self, request, context):
        return self.lifecycle.status()

    @unary
    def TTS(self, request, context):
        return self.speech.tts(request, context)

    @streaming
    def TTSStream(self, request, context):
        return self.speech.stream(request, context)


# ---------------------------------------------------------------------------------------------- serving
def build_server(addr: str, backend: MossTTSBackend, max_workers: int | None = None,
                 interceptors: list[grpc.ServerInterceptor] | None = None) -> tuple[grpc.Server, int]:
    """The gRPC server (not started) and the port it bound."""
    workers = max_workers or max_workers_from_env()
    server = grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="localai-grpc"),
        options=[("grpc.max_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_metadata_size", METADATA_SOFT_BYTES),
                 ("grpc.absolute_max_metadata_size", METADATA_HARD_BYTES),
                 ("grpc.http2.max_ping_strikes", PING_STRIKES),
                 ("grpc.http2.min_ping_interval_without_data_ms", PING_INTERVAL_WITHOUT_CALLS_MS)],
        interceptors=interceptors_from_env() if interceptors is None else interceptors)
    pb_grpc.add_BackendServicer_to_server(backend, server)
    try:
        port = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {addr}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {addr}")
    return server, port


def serve(addr: str, *, bundle: str | Path | None = None, exporter: Exporter | None = None,
          demo_bundle: Callable[[], Path] | None = None, defaults: ServerDefaults | None = None,
          max_workers: int | None = None, grace: float = DEFAULT_GRACE_SECONDS) -> None:
    """Serve until SIGTERM/SIGINT (call from the main thread), then stop gracefully: running calls get
    ``grace`` seconds, the rest are cancelled, and the model is freed. A model still loading goes on on its
    daemon thread: the caller ends the process without the interpreter's teardown (``mossrt localai`` does)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend = MossTTSBackend(defaults, exporter=exporter, demo_bundle=demo_bundle)
    gate = DrainGate()
    server, port = build_server(addr, backend, max_workers, interceptors=[gate, *interceptors_from_env()])
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if bundle is None:
            server.start()
        else:
            try:
                backend.preload(bundle, listen=server.start)
            except LoadFailed as e:
                log.error("loading %s failed: %s (LoadModel can load another)", bundle, e)
        log.info("%s backend listening on %s (port %d, %d workers%s)", BACKEND_NAME, addr, port,
                 max_workers or max_workers_from_env(), ", bearer token required" if os.environ.get(AUTH_ENV) else "")
        while not stop.wait(0.5):
            pass
        gate.close()                             # before the line below: a call after it is refused
        log.info("stopping: running calls get %.0f s", grace)
        deadline = time.monotonic() + grace
        gate.wait_idle(grace)
        server.stop(max(0.0, deadline - time.monotonic())).wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        backend.close()
