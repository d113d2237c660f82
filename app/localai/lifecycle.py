"""The LocalAI backend's one model: loaded by LoadModel (or at start), described by Status, released by Free
and at shutdown. Its settings are :class:`app.settings.ServerSettings`: LoadModel's options over the command
line's, over the declared defaults."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import grpc

from engine.errors import EngineError
from engine.model.spec import ModelSpec
from engine.runtime.bundle import Bundle

from ..service import TTSService
from ..settings import ServerSettings
from . import backend_pb2
from .bundles import BundleSource
from .options import LoadConfig, OptionError, load_config
from .rpc_status import Abort, LoadFailed

log = logging.getLogger("mossrt.localai")
pb: Any = backend_pb2           # its message classes are built at import time: no type knows them

MODEL_MISMATCH_SENTINEL = "model identity mismatch"     # LocalAI's router looks for it with NOT_FOUND


class ServerDefaults:
    """The command line's settings, by their :class:`ServerSettings` names (None: not given): what LoadModel
    uses where ModelOptions says nothing."""

    def __init__(self, **settings: object) -> None:
        unknown = sorted(set(settings) - set(ServerSettings.model_fields))
        if unknown:
            raise TypeError(f"not a service setting: {', '.join(unknown)}")
        self.settings: dict[str, object] = {k: v for k, v in settings.items() if v is not None}


@dataclass
class Loaded:
    service: TTSService
    bundle_dir: Path
    config: LoadConfig
    identity: str               # ModelOptions.Model of the LoadModel that owns it ("" = preloaded)

    @property
    def model(self) -> ModelSpec:
        """The model itself, once the service is ready (what ``ModelLifecycle.require`` returns is)."""
        model = self.service.model
        assert model is not None, "a ready service holds its model"
        return model


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of this process or ``pid`` (one read of its statm; 0 where there is none)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _release_heap() -> None:
    gc.collect()
    try:                                    # glibc keeps freed arenas: hand them back to the system
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ModelLifecycle:
    """LoadModel, Free, Status, the bundle given at start and shutdown, one at a time; ``on_free`` runs
    whenever the model is let go (what was derived from it goes too)."""

    def __init__(self, defaults: ServerDefaults, bundles: BundleSource, on_free: Callable[[], None]):
        self.defaults = defaults
        self.bundles = bundles
        self._on_free = on_free
        self._lock = threading.RLock()           # LoadModel / Free / preload, one at a time
        self._loaded: Loaded | None = None

    @property
    def loaded(self) -> Loaded | None:
        """The model now loaded (or loading), None when there is none."""
        return self._loaded

    def preload(self, bundle: str | Path, *, listen: Callable[[], None] = lambda: None) -> None:
        """Start loading ``bundle`` in the background (``mossrt localai --bundle``): Health answers at once,
        LoadModel naming the same bundle waits for it. ``listen`` (the server's start) runs once the bundle
        is checked and registered, before its model starts loading, under the load lock: the first call
        already sees it (Status BUSY, TTS "still loading"), no LoadModel comes between, and the listener does
        not wait on the load. It runs when the bundle is refused too (then LoadFailed is raised)."""
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

    # ------------------------------------------------------------------ the RPCs' answers
    def load_model(self, request: Any) -> Any:
        """LoadModel: the model ``request`` (ModelOptions) names, loaded, or why not (a ``Result``)."""
        try:
            cfg = load_config(request)
            with self._lock:
                bundle_dir = self.bundles.bundle_dir(cfg)
                message = self._load_locked(cfg, bundle_dir)
        except (OptionError, LoadFailed) as e:
            log.error("LoadModel failed: %s", e)
            return pb.Result(success=False, message=str(e))
        except Exception as e:  # noqa: BLE001 - LocalAI shows the message; the process stays up
            log.exception("LoadModel failed")
            return pb.Result(success=False, message=f"{type(e).__name__}: {e}")
        log.info("%s", message)
        return pb.Result(success=True, message=message)

    def free(self) -> Any:
        """Free: the model unloaded (a load in progress finishes first); a ``Result``."""
        try:
            with self._lock:
                freed = self._free_locked()
        except Exception as e:  # noqa: BLE001
            log.exception("Free failed")
            return pb.Result(success=False, message=f"{type(e).__name__}: {e}")
        return pb.Result(success=True, message="model freed" if freed else "no model was loaded")

    def status(self) -> Any:
        """Status: the model's state and the process's memory (a ``StatusResponse``)."""
        loaded = self._loaded
        rss = rss_bytes()
        breakdown = {"rss": rss}
        if loaded is None:
            state = pb.StatusResponse.UNINITIALIZED
        else:
            service = loaded.service
            stats = service.engine_snapshot().stats if service.state == "ready" else None
            if stats is not None:
                breakdown["stream_slots"] = stats.capacity * stats.bytes_per_stream
                core = service.core_pid
                if core is not None:                 # engine_process on: the engine's memory is its process's
                    breakdown["engine_core"] = rss_bytes(core)
                    rss += breakdown["engine_core"]
                state = pb.StatusResponse.BUSY if stats.generating else pb.StatusResponse.READY
            elif service.state == "failed":
                state = pb.StatusResponse.ERROR
            else:
                state = pb.StatusResponse.BUSY       # loading
        return pb.StatusResponse(state=state, memory=pb.MemoryUsageData(total=rss, breakdown=breakdown))

    def require(self, request: Any) -> Loaded:
        """The model a speech request may use, else the status that says why not."""
        loaded = self._loaded
        if loaded is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "no model is loaded: call LoadModel first")
        state = loaded.service.state
        if state in ("loading", "warming"):
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if state == "failed":
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"the model failed to load: {loaded.service.error}")
        if state != "ready":
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the model is being unloaded")
        wanted = getattr(request, "ModelIdentity", "")
        if wanted and loaded.identity and wanted != loaded.identity:
            raise Abort(grpc.StatusCode.NOT_FOUND, f"{MODEL_MISMATCH_SENTINEL}: loaded {loaded.identity!r}, "
                                                   f"requested {wanted!r}")
        return loaded

    # ------------------------------------------------------------------ under the lock
    def _settings(self, cfg: LoadConfig, bundle_dir: Path) -> ServerSettings:
        from pydantic import ValidationError

        given: dict[str, Any] = {"bundle": bundle_dir, **self.defaults.settings, **cfg.settings}   # pydantic checks
        try:
            return ServerSettings(**given)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
            raise LoadFailed(f"invalid settings: {problems}") from None

    def _start_locked(self, cfg: LoadConfig, bundle_dir: Path, identity: str, start: bool = True) -> Loaded:
        """Replace the loaded model by ``bundle_dir`` (checked first: a bad bundle leaves the old model);
        ``start``: its load begins now (else the caller starts it)."""
        settings = self._settings(cfg, bundle_dir)
        try:
            bundle = Bundle(bundle_dir, device=settings.device, threads=settings.threads or None)
            if settings.verify == "full":
                log.info("verifying %d files of %s (sha256)", len(bundle.info.files), bundle_dir)
                bundle.verify()
        except EngineError as e:
            raise LoadFailed(str(e)) from None
        self._free_locked()
        try:
            service = TTSService(settings, bundle)
        except EngineError as e:            # the voices directory
            raise LoadFailed(str(e)) from None
        log.info("loading %s (device %s)%s", bundle_dir, bundle.device,
                 ": DEMO bundle, random weights, the audio is noise" if bundle.is_demo else "")
        if start:
            service.start()
        self._loaded = Loaded(service, bundle_dir, cfg, identity)
        return self._loaded

    def _free_locked(self, wait: bool = True) -> bool:
        loaded, self._loaded = self._loaded, None
        self._on_free()
        if loaded is None:
            return False
        service = loaded.service
        if wait:
            service.wait_ready(loaded.config.options.load_timeout)  # a load in progress finishes before it is undone
        service.close()                                    # open streams get an error and end
        del loaded, service                                # the last references: sessions and KV slots go
        _release_heap()
        log.info("model freed")
        return True

    def _load_locked(self, cfg: LoadConfig, bundle_dir: Path) -> str:
        loaded = self._loaded
        note = ""
        timeout = cfg.options.load_timeout
        if loaded is not None and loaded.bundle_dir == bundle_dir:
            loaded.service.wait_ready(timeout)
            if loaded.service.state == "ready":
                differ = sorted(k for k in cfg.explicit if cfg.value(k) != loaded.config.value(k))
                if differ:
                    note = (f"; options {', '.join(differ)} differ from the running model's and are not applied "
                            "(Free it first to reload with them)")
                # the identity, default voice and model path follow the LoadModel that now owns the model
                options = loaded.config.options.model_copy(update={"default_voice": cfg.options.default_voice})
                loaded.config = replace(loaded.config, model=cfg.model, model_path=cfg.model_path,
                                        audio_path=cfg.audio_path, options=options)
                loaded.identity = cfg.model
                return f"{bundle_dir} is already loaded{note}"
            if loaded.service.state in ("loading", "warming"):
                raise LoadFailed(f"{bundle_dir} is still loading after {timeout:g} s (option load_timeout)")
        loaded = self._start_locked(cfg, bundle_dir, identity=cfg.model)
        service = loaded.service
        if not service.wait_ready(timeout):
            if service.state == "failed":
                error = service.error
                self._free_locked()
                raise LoadFailed(f"loading {bundle_dir} failed: {error}")
            raise LoadFailed(f"{bundle_dir} is still loading after {timeout:g} s (option load_timeout); "
                             "it goes on in the background")
        stats = service.engine_snapshot().stats
        assert stats is not None, "a ready service's engine has its stats"
        return (f"loaded {bundle_dir}: device {service.bundle.device}, {stats.capacity} stream slots of "
                f"{service.limits.max_context_rows} context rows"
                + (" (DEMO bundle: random weights, the audio is noise)" if service.bundle.is_demo else ""))
