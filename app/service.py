"""The engine as the service sees it: one bundle, one model, one scheduler, the voice registry, readiness.

Transports (HTTP, WebSocket, gRPC) only translate: they resolve a voice and settings here, open a
stream handle, and map typed errors. Loading and warm-up run in the background so ``/health`` answers
at once and ``/ready`` turns 200 when the batch buckets (with ``warm_buckets``) and the first synthesis have run.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from app.voices import VoiceRecord, VoiceRegistry
from engine.audio.voices import resolve_voice
from engine.core.client import CoreAddress, EngineClient
from engine.core.config import CoreConfig
from engine.core.local import WARM_TIMEOUT_S, EngineSnapshot, LocalEngine
from engine.errors import InputError, VoiceGoneError
from engine.limits import Limits
from engine.model.sampling import SamplingParams
from engine.model.spec import ModelSpec
from engine.runtime.bundle import Bundle
from engine.serving.scheduler import Scheduler, StreamHandle

from .errors import ApiError
from .normalize import warm as normalize_warm
from .session.policy import SessionPolicy
from .session.sampling import SamplingFields
from .settings import ServerSettings

log = logging.getLogger("mossrt.service")

MODEL_ID = "moss-tts-realtime"
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# OpenAI's built-in voice names: this model has one default timbre (no reference), which they all map to.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
DEFAULT_VOICE = "default"
# Kokoro's voice mixing ("a+b", "a(0.5)+b(0.5)"): a name never has these (app.voices.VOICE_NAME_PATTERN)
VOICE_MIX = re.compile(r"[+()]")


@dataclass(frozen=True)
class VoiceEntry:
    """A voice a request may name: the model's own timbre (``builtin``), an OpenAI name mapped to it
    (``openai``), or a registered recording (``uploaded``, with its record)."""

    id: str
    name: str
    kind: str
    record: VoiceRecord | None = None


def parked_context_bytes(settings: ServerSettings) -> int:
    """Host memory for parked conversations' KV rows: the setting, else an eighth of physical memory."""
    if settings.parked_context_bytes is not None:
        return settings.parked_context_bytes
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8


def core_config(settings: ServerSettings, bundle: Bundle) -> CoreConfig:
    """The engine's settings from the service's (the slots, budgets, timeouts and capture choices)."""
    s = settings
    on = lambda flag: None if flag is None else flag == "on"      # unset: the engine decides
    return CoreConfig(bundle_dir=str(bundle.dir), device=s.device, threads=s.threads or None,
                      limits=s.limits(), slots=s.max_streams or None,
                      kv_budget_bytes=s.kv_budget_bytes, prefix_cache_bytes=s.prefix_cache_bytes,
                      parked_bytes=parked_context_bytes(s), queue_timeout=s.queue_timeout,
                      cuda_graphs=on(s.cuda_graphs), warm_buckets=on(s.warm_buckets))


class TTSService:
    """One API process's service. ``core``: the engine core to join (an API worker of ``mossrt serve
    --api-workers N``, whose supervisor started it); else the engine runs in this process (``engine_process``
    off) or in a core process this one starts (on)."""

    def __init__(self, settings: ServerSettings, bundle: Bundle, core: CoreAddress | None = None):
        self.settings = settings
        self.bundle = bundle
        self.limits: Limits = settings.limits()
        self.policy = SessionPolicy.from_settings(settings)
        self.core = core_config(settings, bundle)
        # in this process (engine_process off), else the client of the core process that start() begins
        self.engine: LocalEngine | EngineClient | None = \
            LocalEngine(self.core, bundle) if settings.engine_process == "off" and core is None else None
        self.core_address = core
        self.spec: ModelSpec | None = None          # the request side's model (engine_process on)
        self._failed: str | None = None             # a failure on this side (the model's spec, the normalizer)
        self._normalizer_warm = False
        self.on_engine_death: Callable[[str], None] | None = None     # mossrt serve: exit non-zero
        self._draining = False
        self.voices = VoiceRegistry(settings.voices_dir, bundle.identity, max_voices=settings.max_voices)
        self.created = int(time.time())
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the loaded engine
    @property
    def model(self) -> ModelSpec | None:
        """The model once loaded (None before): the engine's own in-process, its manifest part otherwise."""
        if isinstance(self.engine, LocalEngine):
            return self.engine.model
        return self.spec if self.engine is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        """The running scheduler once loaded, when it runs in this process (None before, and with
        engine_process on)."""
        return self.engine.scheduler if isinstance(self.engine, LocalEngine) else None

    @property
    def state(self) -> str:
        """loading -> warming -> ready -> draining; failed on a load error."""
        if self._failed is not None:
            return "failed"
        if self._draining:
            return "draining"
        return self.engine.state if self.engine is not None else "loading"

    @property
    def error(self) -> str | None:
        return self._failed or (self.engine.error if self.engine is not None else None)

    @property
    def sessions_open(self) -> int:
        """WebSocket sessions past their gate (bounded by ws_max_sessions), as the engine counts them."""
        return self.engine_snapshot().sessions_open

    def engine_snapshot(self) -> EngineSnapshot:
        """The engine's state and counters now (the last known while a core process does not answer)."""
        if isinstance(self.engine, EngineClient):
            return self.engine.fresh_snapshot()
        return self.engine.snapshot() if self.engine is not None else EngineSnapshot(state="loading")

    @property
    def core_pid(self) -> int | None:
        """The engine core process's id (engine_process on, once started), else None."""
        return self.engine.core.pid if isinstance(self.engine, EngineClient) else None

    def take_resume_seconds(self) -> list[float]:
        return self.engine.take_resume_seconds() if self.engine is not None else []

    def _loaded_model(self) -> ModelSpec:
        """The model, once loaded: request paths reach here after ``require_ready`` (or from ``_load``)."""
        model = self.model
        if model is None:
            raise ApiError("loading", "the model is loading")
        return model

    def _running(self) -> LocalEngine | EngineClient:
        """The engine, once loaded (as ``_loaded_model``)."""
        if self.engine is None or self.model is None:
            raise ApiError("loading", "the model is loading")
        return self.engine

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Load the model and warm it up on a background thread. An API worker first does its own part here
        (the manifest's model, the normalizer's data, the core joined: a second or two) before its app takes
        connections, so that whichever worker a connection reaches answers as the core stands."""
        if self.core_address is not None:
            if self._open_spec():
                self._warm_normalizer()
            if self._failed is None:
                self.engine = EngineClient(self.core_address, self._engine_died)
                self.engine.wait_known(30)
        self._thread = threading.Thread(target=self._load, name="mossrt-load", daemon=True)
        self._thread.start()

    def _open_spec(self) -> bool:
        try:
            self.spec = ModelSpec(self.bundle)       # tokenizer, prompt layout: the request side's part
            return True
        except Exception as e:  # noqa: BLE001 - reported by /ready and the log, the process stays up
            log.exception("opening the bundle failed")
            self._failed = f"{type(e).__name__}: {e}"
            return False

    def _warm_normalizer(self) -> bool:
        try:
            if self.settings.normalize_text == "on" and not self._normalizer_warm:
                normalize_warm()                # the rules' data (pint, phonenumbers) loaded before /ready
            self._normalizer_warm = True
            return True
        except Exception as e:  # noqa: BLE001 - reported by /ready and the log, the process stays up
            log.exception("warming the normalizer failed")
            self._failed = f"{type(e).__name__}: {e}"
            return False

    def wait_ready(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state == "ready"

    def _load(self) -> None:
        if isinstance(self.engine, LocalEngine):
            self.engine.load()
        elif isinstance(self.engine, EngineClient):     # an API worker's, joined in start()
            self.engine.wait_settled(WARM_TIMEOUT_S)
        elif self._failed is None:
            if not self._open_spec():
                return
            self.engine = EngineClient.start(self.core, self._engine_died, self.settings.log_level)
            self.engine.wait_settled(WARM_TIMEOUT_S)
        if self.state != "ready":
            return
        if self._warm_normalizer():
            log.info("ready: bundle %s%s", self.bundle.dir, self._demo_note())

    def _engine_died(self, why: str) -> None:
        """The core process exited (its streams have their engine_broken error): /ready says so, and the
        process that serves is told to exit non-zero."""
        log.error("%s", why)
        if self.on_engine_death is not None:
            self.on_engine_death(why)

    def _demo_note(self) -> str:
        demo = self.bundle.info.demo
        return f", DEMO bundle ({demo.describe()})" if self.bundle.is_demo and demo is not None else ""

    async def claim_session(self) -> bool:
        """One more open WebSocket session, unless ``ws_max_sessions`` are open (then False). Awaited: with the
        engine core in its own process it is a call there, which the event loop must not block on."""
        engine = self._running()
        if isinstance(engine, EngineClient):
            return await engine.aclaim_session(self.settings.ws_max_sessions)
        return engine.claim_session(self.settings.ws_max_sessions)

    def release_session(self) -> None:
        if self.engine is not None:
            self.engine.release_session()

    def drain(self, hold: float = 0.0) -> None:
        """SIGTERM: readiness off and no new streams at once, running turns get ``drain_timeout`` seconds to
        finish; returns no earlier than ``hold`` seconds (the preStop window, while /ready answers 503),
        then stops the engine. Blocking."""
        started = time.monotonic()
        if self.state == "ready" and self.engine is not None:
            finished = self.engine.drain(self.settings.drain_timeout)
            log.info("drained (%s)", "all turns finished" if finished else "timeout: remaining streams stopped")
        self._draining = True
        time.sleep(max(0.0, hold - (time.monotonic() - started)))
        self.close()

    def close(self) -> None:
        """Stop now: readiness off, the scheduler's loop ends and open streams get an error."""
        self._draining = True
        if self.engine is not None:
            self.engine.stop()

    @property
    def health_state(self) -> str:
        """``state``, or ``broken`` once the running engine is unusable (``Scheduler.broken``)."""
        if self.state == "ready" and self.engine is not None and self.engine.broken:
            return "broken"
        return self.state

    def require_ready(self) -> None:
        if self.health_state == "broken":
            raise ApiError("engine_broken", f"the engine is broken: {self.engine and self.engine.broken}")
        if self.state == "ready":
            return
        if self.state == "draining":
            raise ApiError("draining", "the server is shutting down")
        if self.state == "failed":
            raise ApiError("load_failed", f"the model failed to load: {self.error}")
        if self.state == "warming":
            raise ApiError("warming", "the model is warming up")
        raise ApiError("loading", "the model is loading")

    # ------------------------------------------------------------------ requests
    def resolve_voice(self, voice, param: str = "voice") -> np.ndarray | None:
        """The one place a request's voice becomes prompt codes: ``default`` / OpenAI names → none (the
        model's own timbre), a registered voice's name or id, or ``{"id": ...}``."""
        key = voice.get("id") if isinstance(voice, dict) else voice
        if key is None or (isinstance(key, str) and key.lower() in (DEFAULT_VOICE, *OPENAI_VOICES)):
            return None                                  # "alloy" and {"id": "alloy"} alike
        if not isinstance(key, str):
            raise ApiError("invalid_value", "voice must be a name or {\"id\": ...}", param)
        rec = self.voices.find(key)
        if rec is None and VOICE_MIX.search(key):
            raise ApiError("voice_mixing_unsupported", f"voice {key!r}: mixing voices ('a+b', 'a(0.5)+b') is "
                           "Kokoro's; this model takes one voice: 'default', one of OpenAI's names, or a voice "
                           "registered with POST /v1/audio/voices", param)
        if rec is None:
            raise ApiError("voice_not_found", f"unknown voice {key!r}: use 'default', one of OpenAI's names, or a "
                           "voice registered with POST /v1/audio/voices", param)
        try:
            codes = resolve_voice(self._loaded_model(), self.limits, codes=self.voices.codes(rec))
        except VoiceGoneError as e:      # deleted since it was looked up: as if it never was
            raise ApiError("voice_not_found", f"unknown voice {key!r}: {e}", param) from None
        except InputError as e:
            raise ApiError("voice_unusable", str(e), param) from None
        assert codes is not None, "a registered voice's codes resolve to codes"
        self._load_prefix(rec, codes)
        return codes

    def list_voices(self, openai_names: bool = True) -> list[VoiceEntry]:
        """Every voice ``resolve_voice`` takes, in the order lists show them: ``default``, OpenAI's names (unless
        ``openai_names`` is false: ElevenLabs clients know none), then the registered voices. Blocking (the
        registry may rebuild its index from disk): call it off the event loop."""
        entries = [VoiceEntry(DEFAULT_VOICE, "Default", "builtin")]
        if openai_names:
            entries += [VoiceEntry(name, name.capitalize(), "openai") for name in OPENAI_VOICES]
        return entries + [VoiceEntry(r.id, r.name, "uploaded", r) for r in self.voices.list()]

    def sampling(self, fields: SamplingFields) -> SamplingParams:
        try:
            return self._loaded_model().default_sampling(
                temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k,
                repetition_penalty=fields.repetition_penalty, repetition_window=fields.repetition_window,
                greedy=fields.greedy or None)
        except InputError as e:
            raise ApiError("invalid_value", str(e)) from None

    def open_stream(self, voice_codes, params: SamplingParams, seed: int | None, sink,
                    allow_special_tokens: bool = False, *, one_shot: bool = False,
                    may_park_others: bool = True) -> StreamHandle:
        """A scheduler stream (``Scheduler.open_stream``): ``one_shot`` for one utterance (its slot freed
        without a copy when its turn ends, never parked), ``may_park_others`` False for one whose turns take
        only a free slot (never park another stream's context, so never evict one)."""
        handle = self._running().open_stream(voice_codes, params, seed, sink, allow_special_tokens,
                                             one_shot=one_shot, may_park_others=may_park_others)
        return cast(StreamHandle, handle)     # a RemoteStream has every StreamHandle call the service makes

    def start_utterance(self, ids, voice_codes, params: SamplingParams, seed: int | None, sink,
                        max_frames: int | None = None, allow_special_tokens: bool = False,
                        wait: float | None = None, text: str | None = None,
                        may_park_others: bool = True) -> StreamHandle:
        """A one-shot stream fed one whole utterance (its ids, then the end of its text): when its turn ends
        its slot is freed without a copy, never parked. Blocks while it waits for a slot (``wait``, default
        the queue timeout): call it off the event loop. Closed again if that fails. ``text`` (whose
        tokenization ``ids`` is) is fed as text instead, the same ids, so that frames say which characters
        they read (alignment). ``may_park_others`` False: it takes only a free slot (it never parks, so
        never evicts, another stream's context)."""
        handle = self.open_stream(voice_codes, params, seed, sink, allow_special_tokens, one_shot=True,
                                  may_park_others=may_park_others)
        try:
            handle.begin_turn(max_frames=max_frames, wait=wait)
            self._feed_utterance(handle, ids, text)
        except BaseException:
            handle.close()
            raise
        return handle

    async def astart_utterance(self, ids, voice_codes, params: SamplingParams, seed: int | None, sink,
                               max_frames: int | None = None, allow_special_tokens: bool = False,
                               arrived: float | None = None, text: str | None = None,
                               may_park_others: bool = True) -> StreamHandle:
        """``start_utterance`` for the event loop: waiting for a slot awaits and holds no thread. The queue
        timeout counts from ``arrived`` (the request's ``time.monotonic()`` arrival) when given, so it is
        the time to the 429 however many requests wait."""
        wait = None if arrived is None else max(0.0, self.settings.queue_timeout - (time.monotonic() - arrived))
        handle = self.open_stream(voice_codes, params, seed, sink, allow_special_tokens, one_shot=True,
                                  may_park_others=may_park_others)
        try:
            await handle.abegin_turn(max_frames=max_frames, wait=wait)
            self._feed_utterance(handle, ids, text)
        except BaseException:
            handle.close()
            raise
        return handle

    @staticmethod
    def _feed_utterance(handle: StreamHandle, ids, text: str | None) -> None:
        if text is not None:        # the same ids, fed as text so that frames say which characters they read
            handle.push_text(text)
        else:
            handle.push_token_ids(ids)
        handle.end_text()

    def register_voice(self, name: str, wav: np.ndarray, sample_rate: int) -> VoiceRecord:
        """Encode a reference once with the codec, store its codes, and compute the backbone KV of its
        text-only opening (cached, and kept beside the voice so a restart does not recompute it). Blocking:
        call off the event loop."""
        VoiceRegistry.check_name(name)
        codes = resolve_voice(self._loaded_model(), self.limits, wav=(wav, sample_rate))
        assert codes is not None, "a reference recording always encodes to codes"
        rec = self.voices.add(name, codes)
        kv = self._running().voice_prefix(codes)
        if kv is not None:
            self.voices.save_prefix(rec, kv)     # read back once
        return rec

    def _load_prefix(self, rec: VoiceRecord, codes: np.ndarray) -> None:
        """A registered voice's persisted prefix KV into the cache (once per process: uploaded to the device)."""
        engine = self._running()
        if not engine.has_voice_prefix(codes):
            kv = self.voices.load_prefix(rec, self._loaded_model().kv_dtype)
            if kv is not None:
                engine.load_voice_prefix(codes, kv)
