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
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import hashlib
import hmac
import itertools
import json
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import grpc
import numpy as np

from engine.audio.voices import read_reference_audio, resolve_voice
from engine.errors import EngineError, InputError
from engine.runtime.bundle import Bundle
from engine.serving.handles import QueueSink
from engine.serving.stream import FinishReason

from ..audio_formats import StreamEncoder
from ..errors import ApiError, from_engine, grpc_status
from ..metrics import Metrics, StreamMeter
from ..service import DEFAULT_VOICE, OPENAI_VOICES, TTSService
from ..session.pump import Audio, Ended, Failed, TurnAudio, blocking_pump
from ..session.utterance import Utterance, prepare_utterance
from ..settings import ServerSettings
from . import backend_pb2 as pb
from . import backend_pb2_grpc as pb_grpc
from .options import BACKEND_NAME, LoadConfig, OptionError, TTSParams, load_config, parse_tts_params
from .output import DstRefused, DstWriteFailed, OutputFile

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
DEFAULT_MAX_WORKERS = 4
DEFAULT_GRACE_SECONDS = 5.0
AUTH_ENV = "LOCALAI_GRPC_AUTH_TOKEN"
WORKERS_ENV = "PYTHON_GRPC_MAX_WORKERS"
MODEL_MISMATCH_SENTINEL = "model identity mismatch"     # LocalAI's router looks for it with NOT_FOUND
EVENT_POLL_SECONDS = 0.25                               # how often a waiting request looks at its RPC
VOICE_CACHE_ENTRIES = 16


class Exporter(Protocol):
    """Writes a bundle from checkpoints (``mossrt localai`` injects one built on the ``export`` package)."""

    def __call__(self, model: str, codec: str, out_dir: Path, *, tokenizer: str | None, dtype: str,
                 codec_dtype: str | None) -> None: ...


# ---------------------------------------------------------------------------------------------- errors
class _Abort(Exception):
    """End the RPC with this status (raised inside handlers; the wrappers call ``context.abort`` once)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _LoadFailed(Exception):
    """LoadModel answers ``Result(success=False, message=...)``."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an exception raised while serving a request: the catalogue's row (app.errors)."""
    if isinstance(exc, _Abort):
        return exc.code, exc.message
    if isinstance(exc, OptionError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (ApiError, EngineError)):
        err = from_engine(exc)
        return grpc.StatusCode[grpc_status(err)], err.message
    log.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _unary(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            code, message = status_for(exc)
        context.abort(code, message)
    return wrapper


def _streaming(method):
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


# ---------------------------------------------------------------------------------------------- auth
def _rebuild(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
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


def interceptors_from_env(env=os.environ) -> list[grpc.ServerInterceptor]:
    token = env.get(AUTH_ENV, "")
    return [BearerTokenInterceptor(token)] if token else []


def max_workers_from_env(env=os.environ) -> int:
    raw = env.get(WORKERS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_WORKERS
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if not 1 <= value <= 1024:
        raise ValueError(f"{WORKERS_ENV} must be an integer in 1..1024, got {raw!r}")
    return value


# ---------------------------------------------------------------------------------------------- helpers
def rss_bytes() -> int:
    """Resident memory of this process (one read of /proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _release_heap() -> None:
    gc.collect()
    try:                                    # glibc keeps freed arenas: hand them back to the system
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _dir_signature(path: Path) -> list:
    """Names, sizes and mtimes of a checkpoint directory's files: a changed checkpoint gets a new cache key."""
    try:
        return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    except OSError:
        return []


@dataclass(frozen=True)
class ServerDefaults:
    """The command line's settings: what LoadModel uses when ModelOptions says nothing."""

    voices_dir: str | None = None
    max_streams: int | None = None
    device: str | None = None
    threads: int | None = None


@dataclass
class _Loaded:
    service: TTSService
    bundle_dir: Path
    config: LoadConfig
    identity: str               # ModelOptions.Model of the LoadModel that owns it ("" = preloaded)


@dataclass(frozen=True)
class _Job:
    utterance: Utterance
    speed: float
    sample_rate: int


class _SendWatch:
    """A call's sends, watched by one thread: a send that takes longer than ``seconds`` calls ``on_stall``
    once (the stall timeout, as for every transport)."""

    def __init__(self, seconds: float, on_stall: Callable[[], None]):
        self.seconds, self.on_stall = seconds, on_stall
        self._since: float | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="localai-send-watch", daemon=True).start()

    def sending(self) -> None:
        self._since = time.monotonic()

    def sent(self) -> None:
        self._since = None

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self.seconds / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self.seconds:
                self.on_stall()
                return


# ---------------------------------------------------------------------------------------------- the servicer
class MossTTSBackend(pb_grpc.BackendServicer):
    """``Health``, ``LoadModel``, ``TTS``, ``TTSStream``, ``Status``, ``Free``; every other RPC of the
    proto answers UNIMPLEMENTED (the generated base class)."""

    def __init__(self, defaults: ServerDefaults | None = None, exporter: Exporter | None = None,
                 demo_bundle: Callable[[], Path] | None = None):
        self.defaults = defaults or ServerDefaults()
        self.metrics = Metrics()                 # the streams' meters (this backend serves no /metrics)
        self.exporter = exporter
        self.demo_bundle = demo_bundle
        self._lock = threading.RLock()           # LoadModel / Free / preload, one at a time
        self._loaded: _Loaded | None = None
        self._voice_lock = threading.Lock()
        self._voice_cache: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()

    # ------------------------------------------------------------------ lifecycle
    def preload(self, bundle: str | Path, *, listen: Callable[[], None] = lambda: None) -> None:
        """Start loading ``bundle`` in the background (``mossrt localai --bundle``): Health answers at once,
        LoadModel naming the same bundle waits for it. ``listen`` (the server's start) runs once the bundle
        is checked and registered, before its model starts loading, under the load lock: the first call
        already sees it (Status BUSY, TTS "still loading"), no LoadModel comes between, and the listener does
        not wait on the load. It runs when the bundle is refused too (then _LoadFailed is raised)."""
        path = Path(bundle).expanduser()
        config = LoadConfig(model="", candidates=(path,))
        with self._lock:
            try:
                loaded = self._start_locked(config, path.resolve(), identity="", start=False)
            finally:
                listen()
            loaded.service.start()

    def close(self) -> None:
        """Shutdown: free the model without waiting for a load in progress (its thread is a daemon)."""
        with self._lock:
            self._free_locked(wait=False)

    def _settings(self, cfg: LoadConfig, bundle_dir: Path) -> ServerSettings:
        from pydantic import ValidationError

        d = self.defaults
        given = {"bundle": bundle_dir, "device": cfg.device or d.device, "voices_dir": cfg.voices_dir or d.voices_dir,
                 "max_streams": cfg.max_streams or d.max_streams,
                 "threads": cfg.threads if cfg.threads is not None else d.threads,
                 "max_context_rows": cfg.max_context_rows, "max_input_chars": cfg.max_input_chars,
                 "max_voice_seconds": cfg.max_voice_seconds, "queue_timeout": cfg.queue_timeout, "verify": cfg.verify,
                 "stall_timeout": cfg.stall_timeout}
        try:
            return ServerSettings(**{k: v for k, v in given.items() if v is not None})
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
            raise _LoadFailed(f"invalid settings: {problems}") from None

    def _start_locked(self, cfg: LoadConfig, bundle_dir: Path, identity: str, start: bool = True) -> _Loaded:
        """Replace the loaded model by ``bundle_dir`` (checked first: a bad bundle leaves the old model);
        ``start``: its load begins now (else the caller starts it)."""
        settings = self._settings(cfg, bundle_dir)
        try:
            bundle = Bundle(bundle_dir, device=settings.device, threads=settings.threads or None)
            if settings.verify == "full":
                log.info("verifying %d files of %s (sha256)", len(bundle.info.files), bundle_dir)
                bundle.verify()
        except EngineError as e:
            raise _LoadFailed(str(e)) from None
        self._free_locked()
        try:
            service = TTSService(settings, bundle)
        except EngineError as e:            # the voices directory
            raise _LoadFailed(str(e)) from None
        log.info("loading %s (device %s)%s", bundle_dir, bundle.device,
                 ": DEMO bundle, random weights, the audio is noise" if bundle.is_demo else "")
        if start:
            service.start()
        self._loaded = _Loaded(service, bundle_dir, cfg, identity)
        return self._loaded

    def _free_locked(self, wait: bool = True) -> bool:
        loaded, self._loaded = self._loaded, None
        with self._voice_lock:
            self._voice_cache.clear()
        if loaded is None:
            return False
        service = loaded.service
        if wait:
            service.wait_ready(loaded.config.load_timeout)  # a load in progress finishes before it is undone
        service.close()                                    # open streams get an error and end
        del loaded, service                                # the last references: sessions and KV slots go
        _release_heap()
        log.info("model freed")
        return True

    def _bundle_dir(self, cfg: LoadConfig) -> Path:
        """The bundle a LoadModel names: a bundle directory as is, ``demo``, or a checkpoint exported once
        into the cache by the injected exporter."""
        for cand in cfg.candidates:
            if (cand / "manifest.json").is_file():
                return cand.resolve()
        if cfg.model == "demo" and self.demo_bundle is not None:
            return Path(self.demo_bundle()).resolve()
        source = next((c for c in cfg.candidates if c.is_dir()), None)
        spec = str(source.resolve()) if source is not None else cfg.model
        looked = ", ".join(str(c) for c in cfg.candidates)
        hub_id = source is None and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
        if source is None and not hub_id:
            raise _LoadFailed(f"{cfg.model}: no such bundle or checkpoint directory (looked at {looked})")
        if self.exporter is None:
            raise _LoadFailed(f"{spec}: not a mossrt bundle (no manifest.json), and this server was started "
                              "without a checkpoint exporter: write a bundle with 'mossrt export' and set "
                              "parameters.model to its directory")
        if not cfg.codec:
            raise _LoadFailed(f"{spec}: not a mossrt bundle (no manifest.json). To export it as a MOSS-TTS-Realtime "
                              "checkpoint, add the option \"codec:<MOSS-Audio-Tokenizer directory or hub id>\" "
                              "(and \"tokenizer:<tokenizer.json>\" if the checkpoint has none)")
        return self._export(cfg, spec, source)

    def _cache_root(self, cfg: LoadConfig) -> Path:
        if cfg.cache_dir:
            return Path(cfg.cache_dir).expanduser()
        if cfg.model_path:
            return Path(cfg.model_path) / BACKEND_NAME / "bundles"
        return Path.home() / ".cache" / "mossrt" / "localai-bundles"

    def _export(self, cfg: LoadConfig, spec: str, source: Path | None) -> Path:
        codec_path = Path(cfg.codec).expanduser()
        codec_spec = str(codec_path.resolve()) if codec_path.exists() else cfg.codec
        key_src = {"model": spec, "model_files": _dir_signature(source) if source else [], "codec": codec_spec,
                   "codec_files": _dir_signature(codec_path) if codec_path.is_dir() else [],
                   "tokenizer": cfg.tokenizer, "dtype": cfg.dtype, "codec_dtype": cfg.codec_dtype}
        key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
        root = self._cache_root(cfg)
        target = root / key
        if (target / "manifest.json").is_file():
            try:
                Bundle(target, device="cpu")
                log.info("using the bundle exported earlier: %s", target)
                return target.resolve()
            except EngineError as e:
                log.warning("re-exporting %s (%s)", target, e)
        tmp = root / f".{key}.tmp-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("exporting %s (codec %s, %s) into %s; this takes a while", spec, codec_spec, cfg.dtype, target)
            t0 = time.monotonic()
            self.exporter(spec, codec_spec, tmp, tokenizer=cfg.tokenizer, dtype=cfg.dtype, codec_dtype=cfg.codec_dtype)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)                 # whole bundles only: a crash never leaves half of one
            log.info("exported in %.1f s: %s", time.monotonic() - t0, target)
        except Exception as e:  # noqa: BLE001 - CheckpointError, OSError, ...: LoadModel reports it
            shutil.rmtree(tmp, ignore_errors=True)
            raise _LoadFailed(f"exporting {spec} failed: {type(e).__name__}: {e}") from None
        return target.resolve()

    # ------------------------------------------------------------------ RPCs: lifecycle
    def Health(self, request, context):
        return pb.Reply(message=b"OK")

    def LoadModel(self, request, context):
        try:
            cfg = load_config(request)
            with self._lock:
                bundle_dir = self._bundle_dir(cfg)
                message = self._load_locked(cfg, bundle_dir)
        except (OptionError, _LoadFailed) as e:
            log.error("LoadModel failed: %s", e)
            return pb.Result(success=False, message=str(e))
        except Exception as e:  # noqa: BLE001 - LocalAI shows the message; the process stays up
            log.exception("LoadModel failed")
            return pb.Result(success=False, message=f"{type(e).__name__}: {e}")
        log.info("%s", message)
        return pb.Result(success=True, message=message)

    def _load_locked(self, cfg: LoadConfig, bundle_dir: Path) -> str:
        loaded = self._loaded
        note = ""
        if loaded is not None and loaded.bundle_dir == bundle_dir:
            loaded.service.wait_ready(cfg.load_timeout)
            if loaded.service.state == "ready":
                differ = sorted(k for k in cfg.explicit if getattr(cfg, k) != getattr(loaded.config, k))
                if differ:
                    note = (f"; options {', '.join(differ)} differ from the running model's and are not applied "
                            "(Free it first to reload with them)")
                # the identity, default voice and model path follow the LoadModel that now owns the model
                loaded.config = replace(loaded.config, model=cfg.model, model_path=cfg.model_path,
                                        audio_path=cfg.audio_path, default_voice=cfg.default_voice)
                loaded.identity = cfg.model
                return f"{bundle_dir} is already loaded{note}"
            if loaded.service.state in ("loading", "warming"):
                raise _LoadFailed(f"{bundle_dir} is still loading after {cfg.load_timeout:g} s (option load_timeout)")
        loaded = self._start_locked(cfg, bundle_dir, identity=cfg.model)
        service = loaded.service
        if not service.wait_ready(cfg.load_timeout):
            if service.state == "failed":
                error = service.error
                self._free_locked()
                raise _LoadFailed(f"loading {bundle_dir} failed: {error}")
            raise _LoadFailed(f"{bundle_dir} is still loading after {cfg.load_timeout:g} s (option load_timeout); "
                              "it goes on in the background")
        sched = service.scheduler
        return (f"loaded {bundle_dir}: device {service.bundle.device}, {sched.capacity} stream slots of "
                f"{service.limits.max_context_rows} context rows"
                + (" (DEMO bundle: random weights, the audio is noise)" if service.bundle.is_demo else ""))

    def Free(self, request, context):
        try:
            with self._lock:
                freed = self._free_locked()
        except Exception as e:  # noqa: BLE001
            log.exception("Free failed")
            return pb.Result(success=False, message=f"{type(e).__name__}: {e}")
        return pb.Result(success=True, message="model freed" if freed else "no model was loaded")

    def Status(self, request, context):
        loaded = self._loaded
        rss = rss_bytes()
        breakdown = {"rss": rss}
        if loaded is None:
            state = pb.StatusResponse.UNINITIALIZED
        else:
            service = loaded.service
            sched = service.scheduler
            if service.state == "ready" and sched is not None:
                stats = sched.stats()
                breakdown["stream_slots"] = stats.capacity * stats.bytes_per_stream
                state = pb.StatusResponse.BUSY if stats.generating else pb.StatusResponse.READY
            elif service.state == "failed":
                state = pb.StatusResponse.ERROR
            else:
                state = pb.StatusResponse.BUSY       # loading
        return pb.StatusResponse(state=state, memory=pb.MemoryUsageData(total=rss, breakdown=breakdown))

    # ------------------------------------------------------------------ RPCs: speech
    @_unary
    def TTS(self, request, context):
        loaded = self._require_loaded(request)
        job = self._prepare(loaded, request)
        with self._check_dst(loaded, request.dst) as out:        # its folder held open until written
            pcm = b"".join(self._pcm(loaded, job, context, "TTS"))
            samples = np.frombuffer(pcm, dtype="<i2")
            try:
                out.write_wav(samples, job.sample_rate)
            except DstRefused as e:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            except DstWriteFailed as e:
                raise _Abort(grpc.StatusCode.INTERNAL, str(e)) from None
        return pb.Result(success=True, message=f"{samples.size / job.sample_rate:.2f} s -> {out.path}")

    @_streaming
    def TTSStream(self, request, context):
        """The sample rate, then the audio as it is generated. gRPC's send of each reply waits for the caller
        to take it (flow control): one it does not take within the stall timeout cancels the call, which
        closes the stream (its slot freed), as every other transport does."""
        loaded = self._require_loaded(request)
        job = self._prepare(loaded, request)
        pieces = self._pcm(loaded, job, context, "TTSStream")
        stall = loaded.service.policy.stall_timeout

        def stalled():
            self.metrics.stalled.labels("localai").inc()
            log.warning("TTSStream: the caller took no audio for %g s; call cancelled", stall)
            if context is not None:
                context.cancel()

        watch = _SendWatch(stall, stalled)
        try:
            first = next(pieces, None)           # the turn is admitted (or failed) before any reply is sent
            replies = [pb.Reply(message=json.dumps({"sample_rate": job.sample_rate}).encode())]
            for data in itertools.chain([first], pieces):
                if data:
                    replies.append(pb.Reply(audio=data))
                for reply in replies:
                    watch.sending()
                    yield reply                  # returns once gRPC has sent it
                    watch.sent()
                replies = []
        finally:
            watch.close()
            pieces.close()

    # ------------------------------------------------------------------ request plumbing
    def _require_loaded(self, request) -> _Loaded:
        loaded = self._loaded
        if loaded is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "no model is loaded: call LoadModel first")
        state = loaded.service.state
        if state in ("loading", "warming"):
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if state == "failed":
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"the model failed to load: {loaded.service.error}")
        if state != "ready":
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model is being unloaded")
        wanted = getattr(request, "ModelIdentity", "")
        if wanted and loaded.identity and wanted != loaded.identity:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"{MODEL_MISMATCH_SENTINEL}: loaded {loaded.identity!r}, "
                                                    f"requested {wanted!r}")
        return loaded

    def _prepare(self, loaded: _Loaded, request) -> _Job:
        service = loaded.service
        p: TTSParams = parse_tts_params(request.params)
        if p.ignored:
            log.debug("ignoring params %s", ", ".join(p.ignored))
        voice = self._voice(loaded, request.voice)
        utterance = prepare_utterance(service, request.text, voice, p.sampling, p.max_frames, param="text")
        return _Job(utterance, speed=p.speed, sample_rate=service.model.codec.sample_rate)

    def _voice(self, loaded: _Loaded, requested: str) -> np.ndarray | None:
        """``""`` -> the default voice (option ``voice``, else ModelOptions.AudioPath, else the model's own);
        ``default`` / OpenAI names -> the model's own; a registered voice's name or id; a reference file."""
        service = loaded.service
        key = requested.strip() or loaded.config.default_voice or loaded.config.audio_path
        if not key or key.lower() in (DEFAULT_VOICE, *OPENAI_VOICES):
            return None
        if service.voices.find(key) is None:
            # a caller's file is confined to the model and voices directories; the operator's default is not
            path = self._voice_file(loaded, key) if requested.strip() else self._configured_voice_file(loaded, key)
            if path is not None:
                return self._voice_from_file(service, path)
        try:
            return service.resolve_voice(key)
        except ApiError as e:
            if e.code == "voice_not_found":
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"unknown voice {key!r}: not a voice registered in {service.voices.dir} and not a "
                             "reference audio file in the model or voices directory; use '' or 'default' (the "
                             "model's own voice), a registered voice's name or id, or the path of a reference "
                             "audio file there") from None
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"voice {key!r}: {e.message}") from None

    @staticmethod
    def _voice_file(loaded: _Loaded, key: str) -> Path | None:
        """The reference file a request names, relative to or inside the model directory (ModelPath, and
        the bundle's), the voices directory or the ``reference_dir`` option's, after resolving ``..`` and every symlink — as LocalAI confines
        its own model paths. None for anything else, whether or not it exists: the caller's error never tells
        an existing file from a missing one, and no file outside is ever opened."""
        roots = []
        for d in (loaded.config.model_path, loaded.bundle_dir, loaded.service.voices.dir, loaded.config.reference_dir):
            if not d:
                continue
            try:
                roots.append(Path(d).resolve(strict=True))
            except (OSError, RuntimeError, ValueError):
                continue
        try:
            path = Path(key)
            if ".." in path.parts:
                return None
            candidates = [path] if path.is_absolute() else [root / path for root in roots]
            for candidate in candidates:
                real = candidate.resolve()
                if any(real.is_relative_to(root) for root in roots) and real.is_file():
                    return real
        except (OSError, RuntimeError, ValueError):    # a NUL in the name, a symlink loop
            return None
        return None

    @staticmethod
    def _configured_voice_file(loaded: _Loaded, key: str) -> Path | None:
        """The default voice of the model's configuration (ModelOptions.AudioPath, option ``voice``): the
        operator's, so any path, relative ones from the model directory first."""
        path = Path(key).expanduser()
        candidates = [path]
        if not path.is_absolute() and loaded.config.model_path:
            candidates.insert(0, Path(loaded.config.model_path) / path)
        return next((c for c in candidates if c.is_file()), None)

    def _voice_from_file(self, service: TTSService, path: Path) -> np.ndarray:
        """A reference audio file -> prompt codes (read within the voice length limit, encoded once per
        file version: later requests reuse the codes)."""
        try:
            st = path.stat()
            cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size, service.bundle.identity)
        except OSError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"voice {str(path)!r}: {e.strerror}") from None
        with self._voice_lock:
            if cache_key in self._voice_cache:
                self._voice_cache.move_to_end(cache_key)
                return self._voice_cache[cache_key]
        try:
            wav = read_reference_audio(path, service.limits, what=f"voice {str(path)!r}")
            codes = resolve_voice(service.model, service.limits, wav=wav, what=f"voice {str(path)!r}")
        except InputError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        with self._voice_lock:
            self._voice_cache[cache_key] = codes
            while len(self._voice_cache) > VOICE_CACHE_ENTRIES:
                self._voice_cache.popitem(last=False)
        return codes

    def _pcm(self, loaded: _Loaded, job: _Job, context, rpc: str) -> Iterator[bytes]:
        """The utterance as s16le PCM (at the job's speed), a piece per frame as the scheduler delivers it, then
        the encoder's tail.

        Cancellation: a callback registered on the RPC cancels the engine's turn and closes the stream the
        moment gRPC sees the client go (cancel, deadline, disconnect), whichever thread this one is in; the
        pump notices within EVENT_POLL_SECONDS and ends with CANCELLED. The stream is closed however the
        loop ends (its KV slot freed at the next step boundary)."""
        service = loaded.service
        gone = threading.Event()          # the client went away
        finished = threading.Event()      # the turn ended normally (or this generator is done)
        box: list = []                    # the handle, once admitted

        def on_rpc_done():
            if not finished.is_set():
                gone.set()
                for handle in box:
                    try:
                        handle.cancel()
                    except EngineError:
                        pass
                    handle.close()

        frames = 0
        t0 = time.monotonic()
        handle = None
        try:
            if context is not None and not context.add_callback(on_rpc_done):
                raise _Abort(grpc.StatusCode.CANCELLED, "the client went away")
            wait = service.settings.queue_timeout
            left = context.time_remaining() if context is not None else None
            if left is not None:
                wait = max(0.0, min(wait, left))
            handle = job.utterance.start_blocking(service, QueueSink(), wait)
            box.append(handle)
            if gone.is_set():
                handle.close()
            meter = StreamMeter(self.metrics, "localai")
            turn = TurnAudio(meter, encoder=StreamEncoder("pcm", job.sample_rate, job.speed))
            client_gone = lambda: gone.is_set() or (context is not None and not context.is_active())
            for out in blocking_pump(handle, turn, client_gone, EVENT_POLL_SECONDS):
                if isinstance(out, Audio):
                    frames += 1
                    yield out.data
                elif isinstance(out, Failed):
                    if self._loaded is not loaded:
                        raise _Abort(grpc.StatusCode.UNAVAILABLE, "the model was unloaded (Free) during the request")
                    raise out.error
                elif isinstance(out, Ended):
                    if out.stats.finish_reason == FinishReason.CANCELLED or gone.is_set():
                        gone.set()
                        raise _Abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
                    finished.set()
                    log.info("%s: %d frames (%s) in %.2f s", rpc, frames,
                             out.stats.finish_reason.value if out.stats.finish_reason else "done",
                             time.monotonic() - t0)
                    yield out.tail
                    return
            gone.set()                                   # the pump returned: the client is gone
            raise _Abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
        except GeneratorExit:
            gone.set()
            raise
        finally:
            finished.set()
            if handle is not None:
                handle.close()
            if gone.is_set():
                log.info("%s: cancelled by the client after %d frames; stream closed", rpc, frames)

    @staticmethod
    def _check_dst(loaded: _Loaded, dst: str) -> OutputFile:
        """Where ``TTS`` may write (app/localai/output.py): a new file (LocalAI names a new one in its
        generated-content folder, which it has created) in an existing, writable folder, inside ``output_dir``
        when that option is set, and never inside the model, voices or reference folders; its folder is
        opened now and the WAV written relative to it. Every refused path gets the same error, so ``dst``
        cannot probe the file system."""
        if not dst.strip():
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "dst: the output WAV path is empty")
        protected = [loaded.config.model_path, loaded.bundle_dir, loaded.service.voices.dir,
                     loaded.config.reference_dir]
        try:
            return OutputFile(dst, protected, loaded.config.output_dir)
        except DstRefused as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


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
            except _LoadFailed as e:
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
