"""``mossrt export --codec``: one checkpoint directory → the codec graphs of a bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from .bundle import BundleWriter
from .checkpoint import Checkpoint
from .codec import build_decoder, build_encoder, codec_tensor_names, parse_codec_config
from .graph import INT8_BLOCK, INT8_BLOCKS

# codec dtype → (encoder, decoder) weight storage. int8 is the decoder's (read whole for every frame of
# speech): its matmuls read int8 with a scale per block of 64 inputs (MatMulNBits), its dequant table fp16; the
# encoder, which makes the codes of voice prompts, stays fp32 so those codes stay exact.
CODEC_DTYPES = {"fp32": ("float32", "float32"), "fp16": ("float16", "float16"), "int8": ("float32", "int8")}


def export_codec(ckpt_dir: str | Path, writer: BundleWriter, dtype: str = "fp32",
                 progress: Callable[[str], None] = lambda msg: None, progress_bar: bool = False,
                 int8_block: int = INT8_BLOCK) -> None:
    """Write ``codec_encoder.onnx`` and ``codec_decoder.onnx`` and the manifest's ``codec`` section.

    Fails before writing anything with the list of missing tensors, and afterwards if the checkpoint
    holds tensors the exporter did not map. ``int8_block`` (one of graph.INT8_BLOCKS): inputs per scale of
    the int8 decoder's matmul weights.
    """
    if dtype not in CODEC_DTYPES:
        raise ValueError(f"codec dtype must be one of {sorted(CODEC_DTYPES)}, got {dtype!r}")
    if int8_block not in INT8_BLOCKS:
        raise ValueError(f"int8 block must be one of {list(INT8_BLOCKS)}, got {int8_block!r}")
    ckpt = Checkpoint(ckpt_dir, progress_bar=progress_bar)
    spec = parse_codec_config(ckpt.config)
    ckpt.require(codec_tensor_names(spec, ckpt))
    encoder_dtype, decoder_dtype = (np.dtype(t) for t in CODEC_DTYPES[dtype])
    progress("codec encoder")
    writer.add_graph(build_encoder(ckpt, spec, writer.graph_path("codec_encoder"), encoder_dtype),
                     "MOSS-Audio-Tokenizer streaming encoder step")
    progress("codec decoder")
    writer.add_graph(build_decoder(ckpt, spec, writer.graph_path("codec_decoder"), decoder_dtype,
                                   int8_block if dtype == "int8" else None),
                     "MOSS-Audio-Tokenizer streaming decoder step")
    ckpt.check_all_used()
    writer.set_section("codec", {"dtype": dtype, **({"int8_block": int8_block} if dtype == "int8" else {}),
                                 "spec": spec.to_json(), "source_config": ckpt.config})
