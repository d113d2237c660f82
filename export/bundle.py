"""Writing a bundle directory: ONNX graphs plus ``manifest.json`` (shapes, dtypes, sha256 of every file)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import onnx

from engine.runtime.manifest import FORMAT, FORMAT_VERSION, sha256_file

from . import EXPORTER_VERSION
from .graph import GraphBuilder, value_info_summary


class BundleWriter:
    """Collects graphs and sections for one bundle directory and writes the manifest last.

    An existing manifest in the directory is extended, so the codec and the TTS graphs can be
    exported in separate runs into the same bundle.
    """

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "manifest.json"
        self.manifest: dict = json.loads(path.read_text()) if path.is_file() else {}
        self.manifest.setdefault("graphs", {})

    def graph_path(self, name: str) -> Path:
        return self.dir / f"{name}.onnx"

    def add_graph(self, gb: GraphBuilder, doc: str = "") -> None:
        model: onnx.ModelProto = gb.save(doc)
        name = gb.path.stem
        self.manifest["graphs"][name] = {
            "file": gb.path.name,
            "data": gb.path.name + ".data",
            "opset": model.opset_import[0].version,
            "inputs": value_info_summary(model.graph.input),
            "outputs": value_info_summary(model.graph.output),
        }

    def set_section(self, key: str, value) -> None:
        self.manifest[key] = value

    def add_file(self, name: str, data: bytes) -> None:
        (self.dir / name).write_bytes(data)

    def finish(self) -> Path:
        self.manifest.update({
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "exporter": {"name": "mossrt", "version": EXPORTER_VERSION},
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        })
        files = {}
        for p in sorted(self.dir.iterdir()):
            if p.is_file() and p.name != "manifest.json" and not p.name.endswith(".tmp"):
                files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        self.manifest["files"] = files
        path = self.dir / "manifest.json"
        path.write_text(json.dumps(self.manifest, indent=1) + "\n")
        return path
