"""Runs mossrt bundles on onnxruntime: codec, TTS generation, streaming sessions. Knows nothing of HTTP."""
