"""Loading a bundle: the validated manifest and onnxruntime sessions on the chosen provider.

A :class:`Bundle` may be shared by threads: sessions are created once under a lock, and onnxruntime's
``InferenceSession.run`` is itself thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Literal, overload

import onnxruntime as ort

from engine.errors import BundleError
from engine.runtime.manifest import (
    FORMAT_VERSION,
    CodecSection,
    DemoSection,
    GenerationSection,
    Manifest,
    TokenizerSection,
    TTSSection,
    parse_manifest,
    sha256_file,
)
from engine.runtime.placement import DeviceChoice, Finding, PlacementRefused, bundle_unplaced, choose_device
from engine.runtime.threads import give_pool, pool_setting, share_one_pool, shared_pool_threads

MAX_THREADS = 256
log = logging.getLogger("mossrt.engine")
_PLACEMENT_CACHE: dict[tuple[str, str, str], list[Finding]] = {}


def threads_setting(threads: int | None) -> int:
    """Intra-op threads: the argument, else ``MOSSRT_THREADS``, else 0 (= all cores); checked either way."""
    if threads is None:
        raw = os.environ.get("MOSSRT_THREADS", "0").strip() or "0"
        try:
            threads = int(raw)
        except ValueError:
            raise BundleError(f"MOSSRT_THREADS must be an integer in 0..{MAX_THREADS}, got {raw!r}") from None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= MAX_THREADS:
        raise BundleError(f"threads must be an integer in 0..{MAX_THREADS} (0 = all cores), got {threads!r}")
    return threads


class Bundle:
    """A bundle directory written by ``mossrt export``: ``manifest.json`` plus ONNX graphs.

    Opening checks the manifest's schema and every listed file's presence and size (cheap);
    :meth:`verify` checks every sha256 (reads every byte).
    """

    def __init__(self, directory: str | Path, device: str | None = "auto", threads: int | None = None,
                 profile_dir: str | Path | None = None, defer_refusal: bool = False, shared_pool: bool = False) -> None:
        """``device``: ``auto``, ``cpu`` or ``cuda``, checked against the graphs' kernels before onnxruntime is
        asked (a refusal is a BundleError; with ``defer_refusal`` it is kept in :attr:`refusal` and raised by
        :meth:`session`, so a server can report it); ``None`` opens the files only (no sessions).
        ``shared_pool``: the caller serves this bundle alone, so on CPU every session of the process runs on
        one intra-op pool of ``threads`` threads unless ``MOSSRT_THREAD_POOL=own`` (engine.runtime.threads)."""
        self.dir = Path(directory)
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise BundleError(f"{self.dir}: not a bundle (no manifest.json); create one with 'mossrt export'")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(f"{path}: unreadable manifest: {e}") from None
        try:
            self.info: Manifest = parse_manifest(raw)
        except ValueError as e:
            raise BundleError(f"{path}: {e}") from None
        self.manifest: dict[str, Any] = raw           # the decoded JSON, as written
        for name, entry in self.info.files.items():
            f = self.dir / name
            if not f.is_file() or f.stat().st_size != entry.bytes:
                raise BundleError(f"{self.dir}: file {name} is missing or truncated; re-export the bundle")
        for gname, graph in self.info.graphs.items():
            for fname in (graph.file, graph.data):
                if fname is not None and fname not in self.info.files:
                    raise BundleError(f"{path}: graph {gname!r} names {fname!r}, which the manifest's files "
                                      "do not list")
        self.providers: list[str] = []
        self.device = "none"
        self.device_reason = "opened without a device"
        self.refusal: str | None = None
        if device is not None:
            self._place(device, defer_refusal)
        self.threads = threads_setting(threads)
        if shared_pool:
            try:
                # on CUDA the CPU pools run only shapes and copies: kept per session, as the GPU path was built
                if pool_setting() == "shared" and self.device == "cpu":
                    share_one_pool(self.threads)
            except ValueError as e:
                raise BundleError(str(e)) from None
        elif (pool_threads := shared_pool_threads()) is not None:
            self.threads = pool_threads              # the process's pool serves every session: say its size
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._lock = threading.Lock()

    def _place(self, device: str, defer_refusal: bool) -> None:
        """Choose the provider from the placement check (engine.runtime.placement.choose_device); a refusal raises or,
        deferred, is kept for :meth:`session` to raise."""
        try:
            choice: DeviceChoice = choose_device(device, ort.get_available_providers(), self.unplaced)
        except PlacementRefused as e:
            self.refusal = self.device_reason = f"{self.dir}: {e}"
            if not defer_refusal:
                raise BundleError(self.refusal) from None
            return
        self.providers, self.device, self.device_reason = choice.providers, choice.device, choice.reason
        log.info("device %s: %s", self.device, self.device_reason)

    @property
    def is_demo(self) -> bool:
        return self.info.demo is not None

    @property
    def identity(self) -> str:
        """A short id of this bundle's content (hash of the file checksums): caches keyed by it never mix bundles."""
        digest = hashlib.sha256(json.dumps({k: v.sha256 for k, v in sorted(self.info.files.items())}).encode())
        return digest.hexdigest()[:16]

    def unplaced(self, provider: str) -> list[Finding]:
        """The placement check of every graph on ``provider`` (``cpu``/``cuda``), cached per bundle content."""
        key = (str(self.dir.resolve()), self.identity, provider)
        if key not in _PLACEMENT_CACHE:
            findings = []
            for name, graph in sorted(self.info.graphs.items()):
                path = self.dir / graph.file
                try:
                    findings += bundle_unplaced({name: path}, provider)
                except Exception as e:  # noqa: BLE001 - onnx raises DecodeError and others for a damaged file
                    raise BundleError(f"{path}: the graph does not load ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300] if str(e) else ''}); run 'mossrt verify' "
                                      "or re-export") from None
            _PLACEMENT_CACHE[key] = findings
        return _PLACEMENT_CACHE[key]

    def has_graph(self, name: str) -> bool:
        return name in self.info.graphs

    @overload
    def section(self, key: Literal["codec"]) -> CodecSection: ...
    @overload
    def section(self, key: Literal["tts"]) -> TTSSection: ...
    @overload
    def section(self, key: Literal["tokenizer"]) -> TokenizerSection: ...
    @overload
    def section(self, key: Literal["generation"]) -> GenerationSection: ...
    @overload
    def section(self, key: Literal["demo"]) -> DemoSection: ...

    def section(self, key: str) -> object:
        """A manifest section (validated model) that this bundle must have."""
        value = getattr(self.info, key, None)
        if value is None:
            raise BundleError(f"{self.dir}: the bundle has no {key!r} part; export it with 'mossrt export'")
        return value

    def file_path(self, name: str) -> Path:
        return self.dir / name

    def session(self, name: str, cuda_graph: bool = False) -> ort.InferenceSession:
        """The (cached) onnxruntime session of graph ``name``; a graph that does not load is a BundleError.
        ``cuda_graph``: a session of its own with the CUDA provider's ``enable_cuda_graph`` (its runs then
        capture and replay per ``gpu_graph_id`` run option; -1 runs uncaptured)."""
        key = f"{name}+cuda_graph" if cuda_graph else name
        with self._lock:
            if key not in self._sessions:
                if not self.has_graph(name):
                    raise BundleError(f"{self.dir}: the bundle has no graph {name!r}")
                if not self.providers:
                    raise BundleError(self.refusal or f"{self.dir}: opened without a device; no graph can run")
                path = self.dir / self.info.graphs[name].file
                try:
                    self._sessions[key] = ort.InferenceSession(str(path), self.session_options(name),
                                                               providers=self.session_providers(cuda_graph))
                except Exception as e:  # onnxruntime raises its own (Fail, InvalidGraph, ...) and RuntimeError
                    raise BundleError(f"{path}: the graph does not load ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300]}); run 'mossrt verify' or re-export") from None
            return self._sessions[key]

    def session_options(self, name: str) -> ort.SessionOptions:
        """The options every session of graph ``name`` is made with (``mossrt doctor`` makes its own
        sessions with them, verbose, to read onnxruntime's node placement)."""
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        give_pool(opts, self.threads)
        opts.log_severity_level = 3
        if self.profile_dir is not None:
            opts.enable_profiling = True
            opts.profile_file_prefix = str(self.profile_dir / name)
        return opts

    def session_providers(self, cuda_graph: bool = False) -> list[str | tuple[str, dict[str, str]]]:
        """The provider list of a session (with the CUDA provider's ``enable_cuda_graph`` when asked)."""
        return [(p, {"enable_cuda_graph": "1"}) if cuda_graph and p == "CUDAExecutionProvider" else p
                for p in self.providers]

    def end_profiling(self) -> list[Path]:
        """With ``profile_dir``: write each session's onnxruntime profile (JSON); returns the files."""
        with self._lock:
            return [Path(s.end_profiling()) for s in self._sessions.values() if self.profile_dir is not None]

    def verify(self) -> list[str]:
        """Check the sha256 of every file the manifest lists; raises BundleError naming the first mismatch.
        Returns the names checked."""
        for name, entry in self.info.files.items():
            if sha256_file(self.dir / name) != entry.sha256:
                raise BundleError(f"{self.dir}: {name} does not match its manifest checksum (damaged or modified)")
        return sorted(self.info.files)


__all__ = ["Bundle", "FORMAT_VERSION", "sha256_file", "threads_setting"]
