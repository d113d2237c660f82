"""Reading upstream Hugging Face checkpoints: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory is unusable: missing files, or tensors missing / unexpected / misshapen."""


T = TypeVar("T")


def parse_config(parse: Callable[[dict], T], cfg: dict, what: str) -> T:
    """``parse(cfg)``, with a malformed config (a missing key, a value of the wrong type) reported as a
    :class:`CheckpointError` naming ``what`` instead of a traceback; its own CheckpointErrors pass through."""
    try:
        return parse(cfg)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"not a usable {what} config.json ({type(e).__name__}: {e})") from None


class Checkpoint:
    """Lazy tensor access over ``model.safetensors`` or ``model.safetensors.index.json`` shards.

    Tensors come back as float32 (bf16/fp16 are widened; ml_dtypes gives numpy its bfloat16). Every
    name read is recorded, so :meth:`check_all_used` can list tensors the exporter did not map.
    """

    def __init__(self, directory: str | Path, progress_bar: bool = False):
        self.dir = Path(directory)
        self._handles: dict[Path, object] = {}
        cfg = self.dir / "config.json"
        if not cfg.is_file():
            raise CheckpointError(
                f"{self.dir}: no config.json (expected an upstream Hugging Face checkpoint directory)")
        self.config = _read_json(cfg, "config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{cfg}: config.json must hold a JSON object")
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            weight_map = _read_json(index, "the safetensors index")
            if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
                raise CheckpointError(f"{index}: no \"weight_map\" object (a damaged or foreign index)")
            self._files = {}
            for name, shard in weight_map["weight_map"].items():
                if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
                    raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a shard file name")
                self._files[name] = self.dir / shard
            missing = sorted({p.name for p in self._files.values() if not p.is_file()})
            if missing:
                raise CheckpointError(f"{self.dir}: shards listed in the index are missing: {', '.join(missing[:5])}")
        elif single.is_file():
            self._files = {name: single for name in self._handle(single).keys()}
        else:
            raise CheckpointError(f"{self.dir}: neither model.safetensors nor model.safetensors.index.json")
        self.used: set[str] = set()
        self._bar = None
        if progress_bar:  # a bar over the tensors read (the real model takes minutes)
            from tqdm import tqdm

            self._bar = tqdm(total=len(self._files), unit="tensor", desc=f"export {self.dir.name}", leave=False,
                             disable=None)  # None: only on a terminal

    def names(self) -> list[str]:
        return sorted(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="np")
            except Exception as e:  # SafetensorError (truncated, corrupt header), OSError
                raise CheckpointError(f"{path}: not a readable safetensors file ({str(e)[:200]})") from None
        return self._handles[path]

    def shape(self, name: str) -> list[int]:
        self._require([name])
        return list(self._handle(self._files[name]).get_slice(name).get_shape())

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        self._require([name])
        if self._bar is not None and name not in self.used:
            self._bar.update(1)
        self.used.add(name)
        try:
            array = self._handle(self._files[name]).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # a truncated data section surfaces when the tensor is read
            raise CheckpointError(f"{self._files[name]}: tensor {name} cannot be read ({str(e)[:200]})") from None
        return array.astype(dtype, copy=False) if dtype is not None else array

    def _require(self, names) -> None:
        missing = [n for n in names if n not in self._files]
        if missing:
            raise CheckpointError(f"{self.dir}: missing tensors: {', '.join(missing[:20])}"
                                  + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))

    def require(self, names) -> None:
        """Fail with the full list of absent tensors before any graph is written."""
        self._require(list(names))

    def unused(self, prefixes: tuple[str, ...] = ("",), ignore: tuple[str, ...] = ()) -> list[str]:
        return [n for n in self.names()
                if n.startswith(prefixes) and n not in self.used and not n.startswith(ignore)]

    def check_all_used(self, prefixes: tuple[str, ...] = ("",), ignore: tuple[str, ...] = ()) -> None:
        if self._bar is not None:
            self._bar.close()
        left = self.unused(prefixes, ignore)
        if left:
            raise CheckpointError(f"{self.dir}: unmapped tensors: {', '.join(left[:20])}"
                                  + (f" (+{len(left) - 20} more)" if len(left) > 20 else ""))


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not readable JSON ({e})") from None


def weight_norm(g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Fold torch weight_norm (dim=0): ``g * v / ||v||`` with the norm over every axis but 0."""
    g64, v64 = g.astype(np.float64), v.astype(np.float64)
    norm = np.sqrt((v64 ** 2).reshape(v64.shape[0], -1).sum(axis=1)).reshape((-1,) + (1,) * (v.ndim - 1))
    return (g64 * v64 / norm).astype(np.float32)


def resolve_checkpoint(spec: str | Path) -> Path:
    """A local checkpoint directory, or a Hugging Face hub id (``owner/name``) downloaded at the user's
    site with ``huggingface_hub`` (the ``hub`` extra); this project's own machines cannot reach the hub."""
    path = Path(spec)
    if path.exists():
        return path
    text = str(spec)
    if text.count("/") == 1 and not text.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CheckpointError(f"{text}: no such directory; to download it as a hub id install the 'hub' "
                                  "extra (pip install 'mossrt[hub]')") from None
        try:
            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
        except Exception as e:
            raise CheckpointError(f"{text}: download from the Hugging Face hub failed: {e}") from None
    raise CheckpointError(f"{text}: no such checkpoint directory")
