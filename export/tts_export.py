"""``mossrt export --tts``: one MOSS-TTS-Realtime checkpoint directory → the TTS graphs of a bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from .bundle import BundleWriter
from .checkpoint import Checkpoint
from .graph import COMPUTE_DTYPES, INT8_BLOCK, INT8_BLOCKS
from .tts import (
    IGNORED_TENSORS,
    build_backbone,
    build_depth,
    build_sampling_filter,
    check_tensor_shapes,
    parse_tts_config,
    tts_tensor_names,
)

# storage of large weights; compute is float32 throughout (but see int8). int8 = weight-only symmetric
# int8 for matmul weights with a scale per block of 64 inputs (graph.INT8_BLOCK; 128 with --int8-block), as
# com.microsoft.MatMulNBits (bits 8, accuracy_level 4: on CPU the activations are quantized to int8 per block
# inside the kernel); embedding tables stay float16.
# int4 = the same with 4-bit weights and one scale per block of 32 input channels (MatMulNBits bits 4).
TTS_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8", "int4": "int8"}
GRAPHS = {"backbone": "backbone", "depth": "depth", "sampling_filter": "sampling_filter"}


def export_tts(model_dir: str | Path, writer: BundleWriter, dtype: str = "fp32",
               progress: Callable[[str], None] = lambda msg: None, progress_bar: bool = False,
               compute_dtype: str = "fp32", int8_block: int = INT8_BLOCK) -> None:
    """Write ``backbone.onnx``, ``depth.onnx``, ``sampling_filter.onnx`` and the manifest's ``tts`` section.

    ``compute_dtype`` (fp32, fp16, bf16) is what the backbone computes in and keeps its KV in (fp16 runs
    on CPU and CUDA, bf16 on CUDA only); the depth transformer too, with its logits cast to float32 for the
    in-graph sampler. ``int8_block`` (one of graph.INT8_BLOCKS) is the inputs per scale of int8 weights.

    Fails before writing anything with the list of missing (or misshapen) tensors, and afterwards if the
    checkpoint holds tensors the exporter did not map (``language_model.embed_tokens.weight`` is dead
    upstream and intentionally ignored).
    """
    if dtype not in TTS_DTYPES:
        raise ValueError(f"tts dtype must be one of {sorted(TTS_DTYPES)}, got {dtype!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    if int8_block not in INT8_BLOCKS:
        raise ValueError(f"int8 block must be one of {list(INT8_BLOCKS)}, got {int8_block!r}")
    ckpt = Checkpoint(model_dir, progress_bar=progress_bar)
    cfg = parse_tts_config(ckpt.config)
    ckpt.require(tts_tensor_names(cfg))
    check_tensor_shapes(ckpt, cfg)
    weight_dtype = np.dtype(TTS_DTYPES[dtype])
    bits = 4 if dtype == "int4" else 8
    block = int8_block if dtype == "int8" else None
    progress(f"tts backbone ({cfg.backbone.layers} layers, {dtype} weights, {compute_dtype} compute)")
    writer.add_graph(build_backbone(ckpt, cfg, writer.graph_path(GRAPHS["backbone"]), weight_dtype, bits,
                                    COMPUTE_DTYPES[compute_dtype], block),
                     "MOSS-TTS-Realtime backbone: grid rows + KV buffer → hidden + new K/V")
    progress(f"tts depth ({cfg.local.layers} local layers x {cfg.rvq} positions, {dtype} weights, "
             f"{compute_dtype} compute)")
    writer.add_graph(build_depth(ckpt, cfg, writer.graph_path(GRAPHS["depth"]), weight_dtype, bits,
                                 COMPUTE_DTYPES[compute_dtype], block),
                     "MOSS-TTS-Realtime local transformer: one 16-code frame, sampling inside")
    progress("tts sampling filter")
    writer.add_graph(build_sampling_filter(writer.graph_path(GRAPHS["sampling_filter"]), cfg.audio_vocab, cfg.rvq),
                     "MOSS-TTS-Realtime sampling filter (penalty, temperature, top-k, top-p)")
    ckpt.check_all_used(ignore=IGNORED_TENSORS)
    writer.set_section("tts", {
        "dtype": dtype,
        "compute_dtype": compute_dtype,
        **({"int8_block": int8_block} if dtype == "int8" else {}),
        "graphs": dict(GRAPHS),
        "config": cfg.to_json(),
        "ignored_tensors": [n for n in IGNORED_TENSORS if n in ckpt],
        "source_config": ckpt.config,
    })
