"""Random-weight checkpoints in the upstream on-disk layout, for benchmarks at real size.

Never commit their output: the real-size codec is ~7 GB of float32. Shapes and names follow the
upstream ``config.json`` and state dict; values are random (the audio is noise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from safetensors.numpy import save_file

from .codec import parse_codec_config, StageSpec

SHARD_BYTES = 1 << 30


def _transformer(d_in: int, d: int, heads: int, layers: int, d_ff: int, d_out: int) -> dict:
    return {"module_type": "Transformer", "input_dimension": d_in, "d_model": d, "num_heads": heads,
            "num_layers": layers, "dim_feedforward": d_ff, "output_dimension": d_out, "causal": True,
            "conv_layout": True, "gating": "none", "layer_scale": 0.01, "max_period": 10000,
            "norm": "layer_norm", "positional_embedding": "rope"}


def _patch(h: int) -> dict:
    return {"module_type": "PatchedPretransform", "patch_size": h}


def real_codec_config() -> dict:
    """The MOSS-Audio-Tokenizer ``config.json`` at real size (1,774,566,400 parameters)."""
    return {
        "architectures": ["MossAudioTokenizerModel"],
        "model_type": "moss-audio-tokenizer",
        "sampling_rate": 24000, "downsample_rate": 1920, "causal_transformer_context_duration": 10,
        "code_dim": 768, "quantizer_type": "rlfq", "dtype": "float32", "version": "4.26.1.a",
        "encoder_kwargs": [
            _patch(240), _transformer(240, 768, 12, 12, 3072, 384),
            _patch(2), _transformer(768, 768, 12, 12, 3072, 384),
            _patch(2), _transformer(768, 768, 12, 12, 3072, 640),
            _patch(2), _transformer(1280, 1280, 20, 32, 5120, 768),
        ],
        "decoder_kwargs": [
            _transformer(768, 1280, 20, 32, 5120, 1280), _patch(2),
            _transformer(640, 768, 12, 12, 3072, 768), _patch(2),
            _transformer(384, 768, 12, 12, 3072, 768), _patch(2),
            _transformer(384, 768, 12, 12, 3072, 240), _patch(240),
        ],
        "quantizer_kwargs": {"input_dim": 768, "rvq_dim": 512, "output_dim": 768, "num_quantizers": 32,
                             "codebook_size": 1024, "codebook_dim": 8, "quantizer_type": "rlfq"},
    }


def tiny_codec_config(scale: int = 16, layers: int = 1) -> dict:
    """The real codec config with every width divided by ``scale`` (head_dim 16) and ``layers`` per stage:
    the same stage list, windows and Identity/Linear projections as the real model, in ~0.6M parameters."""
    config = real_codec_config()
    for side in ("encoder_kwargs", "decoder_kwargs"):
        for m in config[side]:
            if m["module_type"] != "Transformer":
                continue
            for key in ("input_dimension", "output_dimension"):
                if m[key] != 240:  # the 240-sample patch boundary keeps its size
                    m[key] //= scale
            m["d_model"] //= scale
            m["dim_feedforward"] //= scale
            m["num_heads"] = m["d_model"] // 16
            m["num_layers"] = layers
    q = config["quantizer_kwargs"]
    q["input_dim"] //= scale
    q["output_dim"] //= scale
    q["rvq_dim"] //= scale
    config["code_dim"] //= scale
    return config


def codec_tensors(config: dict, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray]]:
    """Random tensors for every name the upstream codec state dict holds, layer by layer."""
    spec = parse_codec_config(config)
    normal = lambda *shape, std=0.02: (rng.standard_normal(shape, dtype=np.float32) * std)
    for s in [StageSpec(**d) for d in spec.encoder + spec.decoder]:
        D, F = s.d_model, None
        if s.input_dim != D:
            yield f"{s.module}.input_proj.weight", normal(D, s.input_dim)
        for layer in range(s.layers):
            lp = f"{s.module}.transformer.layers.{layer}"
            F = config_ff(config, s.module)
            yield f"{lp}.self_attn.in_projs.0.weight", normal(3 * D, D)
            yield f"{lp}.self_attn.out_projs.0.weight", normal(D, D)
            yield f"{lp}.linear1.weight", normal(F, D)
            yield f"{lp}.linear2.weight", normal(D, F)
            for n in ("norm1", "norm2"):
                yield f"{lp}.{n}.weight", 1.0 + normal(D)
                yield f"{lp}.{n}.bias", normal(D)
            yield f"{lp}.layer_scale_1.scale", np.full(D, 0.1, np.float32)
            yield f"{lp}.layer_scale_2.scale", np.full(D, 0.1, np.float32)
        if s.output_dim != D:
            yield f"{s.module}.output_proj.weight", normal(s.output_dim, D)

    def wn(prefix: str, out_ch: int, in_ch: int):
        yield f"{prefix}.bias", normal(out_ch)
        yield f"{prefix}.parametrizations.weight.original0", np.abs(normal(out_ch, 1, 1, std=1.0)) + 0.5
        yield f"{prefix}.parametrizations.weight.original1", normal(out_ch, in_ch, 1, std=1.0)

    q = config["quantizer_kwargs"]
    yield from wn("quantizer.input_proj", q["rvq_dim"], q["input_dim"])
    yield from wn("quantizer.output_proj", q["output_dim"], q["rvq_dim"])
    for i in range(q["num_quantizers"]):
        yield from wn(f"quantizer.quantizers.{i}.in_proj", q["codebook_dim"], q["rvq_dim"])
        yield from wn(f"quantizer.quantizers.{i}.out_proj", q["rvq_dim"], q["codebook_dim"])
        yield f"quantizer.quantizers.{i}.codebook.weight", normal(q["codebook_size"], q["codebook_dim"], std=1.0)


def config_ff(config: dict, module: str) -> int:
    side, idx = module.split(".")
    return int(config[f"{side}_kwargs"][int(idx)]["dim_feedforward"])


def write_checkpoint(out_dir: str | Path, config: dict, tensors: Iterator[tuple[str, np.ndarray]],
                     progress: Callable[[str], None] = lambda msg: None) -> Path:
    """Write ``config.json`` and safetensors shards (with ``model.safetensors.index.json`` when more than one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Each shard is written as soon as it is full, so memory stays at about one shard.
    written: list[tuple[Path, list[str], int]] = []
    current: dict[str, np.ndarray] = {}

    def flush():
        path = out / f"shard-{len(written):05d}.tmp"
        save_file(current, str(path))
        written.append((path, list(current), sum(a.nbytes for a in current.values())))
        progress(f"shard {len(written)} written")
        current.clear()

    for name, array in tensors:
        current[name] = np.ascontiguousarray(array)
        if sum(a.nbytes for a in current.values()) >= SHARD_BYTES:
            flush()
    if current:
        flush()
    if len(written) == 1:
        written[0][0].rename(out / "model.safetensors")
        return out
    weight_map = {}
    for i, (path, names, _) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / fname)
        weight_map.update({k: fname for k in names})
    total = sum(n for _, _, n in written)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    return out


def make_codec_checkpoint(out_dir: str | Path, seed: int = 0, preset: str = "real", progress=lambda msg: None) -> Path:
    """A random codec checkpoint: ``real`` dimensions (~7 GB, benchmarks) or ``tiny`` (demo bundle)."""
    config = {"real": real_codec_config, "tiny": tiny_codec_config}[preset]()
    return write_checkpoint(out_dir, config, codec_tensors(config, np.random.default_rng(seed)), progress)
