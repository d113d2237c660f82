"""Checkpoint → ONNX bundle. Used by the CLI only; never imported at serve time."""

EXPORTER_VERSION = "0.1.0"
