"""The bundle a LoadModel names: a bundle directory as is, ``demo``, or a Hugging Face checkpoint exported once
into a cache by an injected exporter (this package never imports ``export``; ``mossrt localai`` injects one)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol

from engine.errors import EngineError
from engine.runtime.bundle import Bundle

from .options import BACKEND_NAME, LoadConfig
from .rpc_status import LoadFailed

log = logging.getLogger("mossrt.localai")


class Exporter(Protocol):
    """Writes a bundle from checkpoints (``mossrt localai`` injects one built on the ``export`` package)."""

    def __call__(self, model: str, codec: str, out_dir: Path, *, tokenizer: str | None, dtype: str,
                 codec_dtype: str | None) -> None: ...


def _dir_signature(path: Path) -> list:
    """Names, sizes and mtimes of a checkpoint directory's files: a changed checkpoint gets a new cache key."""
    try:
        return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    except OSError:
        return []


class BundleSource:
    """Finds (or exports) the bundle directory of a LoadModel; every failure is :class:`LoadFailed`."""

    def __init__(self, exporter: Exporter | None = None, demo_bundle: Callable[[], Path] | None = None):
        self.exporter = exporter
        self.demo_bundle = demo_bundle

    def bundle_dir(self, cfg: LoadConfig) -> Path:
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
            raise LoadFailed(f"{cfg.model}: no such bundle or checkpoint directory (looked at {looked})")
        if self.exporter is None:
            raise LoadFailed(f"{spec}: not a mossrt bundle (no manifest.json), and this server was started "
                             "without a checkpoint exporter: write a bundle with 'mossrt export' and set "
                             "parameters.model to its directory")
        if not cfg.options.codec:
            raise LoadFailed(f"{spec}: not a mossrt bundle (no manifest.json). To export it as a MOSS-TTS-Realtime "
                             "checkpoint, add the option \"codec:<MOSS-Audio-Tokenizer directory or hub id>\" "
                             "(and \"tokenizer:<tokenizer.json>\" if the checkpoint has none)")
        return self._export(cfg, spec, source, self.exporter, cfg.options.codec)

    @staticmethod
    def _cache_root(cfg: LoadConfig) -> Path:
        if cfg.options.cache_dir:
            return Path(cfg.options.cache_dir).expanduser()
        if cfg.model_path:
            return Path(cfg.model_path) / BACKEND_NAME / "bundles"
        return Path.home() / ".cache" / "mossrt" / "localai-bundles"

    def _export(self, cfg: LoadConfig, spec: str, source: Path | None, exporter: Exporter, codec: str) -> Path:
        opts = cfg.options
        codec_path = Path(codec).expanduser()
        codec_spec = str(codec_path.resolve()) if codec_path.exists() else codec
        key_src = {"model": spec, "model_files": _dir_signature(source) if source else [], "codec": codec_spec,
                   "codec_files": _dir_signature(codec_path) if codec_path.is_dir() else [],
                   "tokenizer": opts.tokenizer, "dtype": opts.dtype, "codec_dtype": opts.codec_dtype}
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
            log.info("exporting %s (codec %s, %s) into %s; this takes a while", spec, codec_spec, opts.dtype, target)
            t0 = time.monotonic()
            exporter(spec, codec_spec, tmp, tokenizer=opts.tokenizer, dtype=opts.dtype, codec_dtype=opts.codec_dtype)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)                 # whole bundles only: a crash never leaves half of one
            log.info("exported in %.1f s: %s", time.monotonic() - t0, target)
        except Exception as e:  # noqa: BLE001 - CheckpointError, OSError, ...: LoadModel reports it
            shutil.rmtree(tmp, ignore_errors=True)
            raise LoadFailed(f"exporting {spec} failed: {type(e).__name__}: {e}") from None
        return target.resolve()
