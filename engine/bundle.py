"""Loading a bundle: manifest checks and onnxruntime sessions on the chosen provider."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import onnxruntime as ort

from .errors import BundleError

SUPPORTED_FORMAT_VERSION = 1
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def resolve_providers(device: str = "auto") -> list[str]:
    """``cpu``, ``cuda`` (fails if onnxruntime has no CUDA provider) or ``auto`` (CUDA when available)."""
    available = ort.get_available_providers()
    if device == "auto":
        device = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if device not in PROVIDERS:
        raise BundleError(f"unknown device {device!r}: use cpu, cuda or auto")
    if PROVIDERS[device][0] not in available:
        raise BundleError(f"device {device!r} requested but onnxruntime offers only {available} "
                          "(install the 'cuda' extra: onnxruntime-gpu)")
    return PROVIDERS[device]


class Bundle:
    """A bundle directory written by ``mossrt export``: ``manifest.json`` plus ONNX graphs."""

    def __init__(self, directory: str | Path, device: str = "auto", threads: int | None = None):
        self.dir = Path(directory)
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise BundleError(f"{self.dir}: not a bundle (no manifest.json); create one with 'mossrt export'")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BundleError(f"{path}: unreadable manifest: {e}") from None
        if self.manifest.get("format") != "mossrt-bundle":
            raise BundleError(f"{path}: not a mossrt bundle manifest")
        if self.manifest.get("format_version") != SUPPORTED_FORMAT_VERSION:
            raise BundleError(f"{path}: bundle format {self.manifest.get('format_version')} is not supported "
                              f"(this mossrt reads version {SUPPORTED_FORMAT_VERSION}); re-export it")
        for name, info in self.manifest.get("files", {}).items():
            f = self.dir / name
            if not f.is_file() or f.stat().st_size != info["bytes"]:
                raise BundleError(f"{self.dir}: file {name} is missing or truncated; re-export the bundle")
        self.providers = resolve_providers(device)
        self.device = "cuda" if self.providers[0].startswith("CUDA") else "cpu"
        self.threads = threads if threads is not None else int(os.environ.get("MOSSRT_THREADS", "0"))
        if not isinstance(self.threads, int) or not 0 <= self.threads <= 256:
            raise BundleError(f"threads must be an integer in 0..256 (0 = all cores), got {self.threads!r}")
        self._sessions: dict[str, ort.InferenceSession] = {}

    def has_graph(self, name: str) -> bool:
        return name in self.manifest.get("graphs", {})

    def section(self, key: str) -> dict:
        if key not in self.manifest:
            raise BundleError(f"{self.dir}: the bundle has no {key!r} part; export it with 'mossrt export'")
        return self.manifest[key]

    def session(self, name: str) -> ort.InferenceSession:
        """The (cached) onnxruntime session of graph ``name``."""
        if name not in self._sessions:
            if not self.has_graph(name):
                raise BundleError(f"{self.dir}: the bundle has no graph {name!r}")
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if self.threads:
                opts.intra_op_num_threads = self.threads
            opts.log_severity_level = 3
            path = self.dir / self.manifest["graphs"][name]["file"]
            self._sessions[name] = ort.InferenceSession(str(path), opts, providers=self.providers)
        return self._sessions[name]

    def verify(self) -> None:
        """Check the sha256 of every file listed in the manifest (slow for real-size bundles)."""
        for name, info in self.manifest.get("files", {}).items():
            h = hashlib.sha256()
            with open(self.dir / name, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            if h.hexdigest() != info["sha256"]:
                raise BundleError(f"{self.dir}: {name} does not match its manifest checksum")
