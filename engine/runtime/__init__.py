"""The graph runtime: bundles and their manifest, the device and its tensors, placement against
onnxruntime's kernel tables, threads, timing, graph statistics."""
