"""``mossrt export --codec``: one checkpoint directory → the codec graphs of a bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from .bundle import DTYPES, BundleWriter
from .checkpoint import Checkpoint
from .codec import build_decoder, build_encoder, codec_tensor_names, parse_codec_config


def export_codec(ckpt_dir: str | Path, writer: BundleWriter, dtype: str = "fp32",
                 progress: Callable[[str], None] = lambda msg: None, progress_bar: bool = False) -> None:
    """Write ``codec_encoder.onnx`` and ``codec_decoder.onnx`` and the manifest's ``codec`` section.

    Fails before writing anything with the list of missing tensors, and afterwards if the checkpoint
    holds tensors the exporter did not map.
    """
    if dtype not in DTYPES:
        raise ValueError(f"codec dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    ckpt = Checkpoint(ckpt_dir, progress_bar=progress_bar)
    spec = parse_codec_config(ckpt.config)
    ckpt.require(codec_tensor_names(spec, ckpt))
    weight_dtype = np.dtype(DTYPES[dtype])
    progress("codec encoder")
    writer.add_graph(build_encoder(ckpt, spec, writer.graph_path("codec_encoder"), weight_dtype),
                     "MOSS-Audio-Tokenizer streaming encoder step")
    progress("codec decoder")
    writer.add_graph(build_decoder(ckpt, spec, writer.graph_path("codec_decoder"), weight_dtype),
                     "MOSS-Audio-Tokenizer streaming decoder step")
    ckpt.check_all_used()
    writer.set_section("codec", {"dtype": dtype, "spec": spec.to_json(), "source_config": ckpt.config})
