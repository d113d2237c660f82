"""A LocalAI request's voice: the default, a registered voice (``app.voices``), or a reference audio file —
a caller's confined to the model and voices folders — encoded once per file version and kept in a small cache."""

from __future__ import annotations

import collections
import threading
from pathlib import Path

import grpc
import numpy as np

from engine.audio.voices import read_reference_audio, resolve_voice
from engine.errors import InputError

from ..errors import ApiError
from ..service import DEFAULT_VOICE, OPENAI_VOICES
from .lifecycle import Loaded
from .rpc_status import Abort

VOICE_CACHE_ENTRIES = 16


class VoiceFiles:
    """Resolves the voice of a request against the loaded model; the reference files' codes are cached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()

    def clear(self) -> None:
        """Forget every cached voice (the model they were encoded for is gone)."""
        with self._lock:
            self._cache.clear()

    def resolve(self, loaded: Loaded, requested: str) -> np.ndarray | None:
        """``""`` -> the default voice (option ``voice``, else ModelOptions.AudioPath, else the model's own);
        ``default`` / OpenAI names -> the model's own; a registered voice's name or id; a reference file."""
        service = loaded.service
        key = requested.strip() or loaded.config.options.default_voice or loaded.config.audio_path
        if not key or key.lower() in (DEFAULT_VOICE, *OPENAI_VOICES):
            return None
        if service.voices.find(key) is None:
            # a caller's file is confined to the model and voices directories; the operator's default is not
            path = self._request_file(loaded, key) if requested.strip() else self._configured_file(loaded, key)
            if path is not None:
                return self._codes(loaded, path)
        try:
            return service.resolve_voice(key)
        except ApiError as e:
            if e.code == "voice_not_found":
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"unknown voice {key!r}: not a voice registered in {service.voices.dir} and not a "
                            "reference audio file in the model or voices directory; use '' or 'default' (the "
                            "model's own voice), a registered voice's name or id, or the path of a reference "
                            "audio file there") from None
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"voice {key!r}: {e.message}") from None

    @staticmethod
    def _request_file(loaded: Loaded, key: str) -> Path | None:
        """The reference file a request names, relative to or inside the model directory (ModelPath, and
        the bundle's), the voices directory or the ``reference_dir`` option's, after resolving ``..`` and every
        symlink — as LocalAI confines its own model paths. None for anything else, whether or not it exists: the
        caller's error never tells an existing file from a missing one, and no file outside is ever opened."""
        roots = []
        for d in (loaded.config.model_path, loaded.bundle_dir, loaded.service.voices.dir,
                  loaded.config.options.reference_dir):
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
    def _configured_file(loaded: Loaded, key: str) -> Path | None:
        """The default voice of the model's configuration (ModelOptions.AudioPath, option ``voice``): the
        operator's, so any path, relative ones from the model directory first."""
        path = Path(key).expanduser()
        candidates = [path]
        if not path.is_absolute() and loaded.config.model_path:
            candidates.insert(0, Path(loaded.config.model_path) / path)
        return next((c for c in candidates if c.is_file()), None)

    def _codes(self, loaded: Loaded, path: Path) -> np.ndarray:
        """A reference audio file -> prompt codes (read within the voice length limit, encoded once per
        file version: later requests reuse the codes)."""
        service, model = loaded.service, loaded.model
        try:
            st = path.stat()
            cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size, service.bundle.identity)
        except OSError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"voice {str(path)!r}: {e.strerror}") from None
        with self._lock:
            if cache_key in self._cache:
                self._cache.move_to_end(cache_key)
                return self._cache[cache_key]
        try:
            wav = read_reference_audio(path, service.limits, what=f"voice {str(path)!r}")
            codes = resolve_voice(model, service.limits, wav=wav, what=f"voice {str(path)!r}")
        except InputError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        assert codes is not None, "a reference recording resolves to codes"
        with self._lock:
            self._cache[cache_key] = codes
            while len(self._cache) > VOICE_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return codes
