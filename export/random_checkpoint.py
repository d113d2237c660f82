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

from .codec import StageSpec, parse_codec_config

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


# ---------------------------------------------------------------------------------------------- TTS
def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ff: int, **extra) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ff,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
            "layer_types": ["full_attention"] * layers, **extra}


def tts_config(preset: str = "real") -> dict:
    """``MossTTSRealtime`` config: ``real`` (Qwen3-1.7B backbone, 4-layer local) or ``tiny`` (hidden 32)."""
    dims = {"real": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ff=6144),
            "tiny": dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ff=96)}[preset]
    local = dict(dims, layers=4)
    return {
        "architectures": ["MossTTSRealtime"], "model_type": "moss_tts_realtime",
        "audio_pad_token": 1024, "audio_vocab_size": 1027, "rvq": 16,
        "reference_audio_pad": 151654, "text_pad": 151655, "dtype": "float32",
        "language_config": _qwen3(**dims, model_type="qwen3", vocab_size=151936, max_position_embeddings=40960,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000},
                                  bos_token_id=151643, eos_token_id=151645, pad_token_id=None),
        "local_config": _qwen3(**local, model_type="moss_tts_realtime_local_transformer", rvq=16,
                               audio_vocab_size=1027, audio_pad_token=1024, pad_token_id=1024,
                               max_position_embeddings=33,
                               rope_parameters={"rope_type": "linear", "factor": 1.0, "rope_theta": 1000000}),
    }


def tts_tensors(config: dict, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray]]:
    """Random tensors with the upstream names. Head rows of the pad/BOS/EOS ids are zero (as in the real
    model, where they get negligible mass), so random weights never emit them; generation then runs
    to its frame limit."""
    lang, local = config["language_config"], config["local_config"]
    H, V, A = lang["hidden_size"], lang["vocab_size"], config["audio_vocab_size"]
    normal = lambda *shape, std=0.02: rng.standard_normal(shape, dtype=np.float32) * std

    def audio_table():
        t = normal(A, H, std=0.5)
        t[config["audio_pad_token"]] = 0.0
        return t

    def layers(prefix: str, cfg: dict):
        D, hd = cfg["hidden_size"], cfg["head_dim"]
        q, kv, ff = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
        for i in range(cfg["num_hidden_layers"]):
            p = f"{prefix}.layers.{i}"
            yield f"{p}.input_layernorm.weight", 1.0 + normal(D)
            yield f"{p}.self_attn.q_proj.weight", normal(q, D)
            yield f"{p}.self_attn.k_proj.weight", normal(kv, D)
            yield f"{p}.self_attn.v_proj.weight", normal(kv, D)
            yield f"{p}.self_attn.o_proj.weight", normal(D, q)
            yield f"{p}.self_attn.q_norm.weight", 1.0 + normal(hd)
            yield f"{p}.self_attn.k_norm.weight", 1.0 + normal(hd)
            yield f"{p}.post_attention_layernorm.weight", 1.0 + normal(D)
            yield f"{p}.mlp.gate_proj.weight", normal(ff, D)
            yield f"{p}.mlp.up_proj.weight", normal(ff, D)
            yield f"{p}.mlp.down_proj.weight", normal(D, ff)
        yield f"{prefix}.norm.weight", 1.0 + normal(D)

    yield "embed_tokens.0.weight", normal(V, H, std=1.0)
    for c in range(1, config["rvq"] + 1):
        yield f"embed_tokens.{c}.weight", audio_table()
    yield "language_model.embed_tokens.weight", np.zeros((V, H), np.float32)  # never read upstream
    yield from layers("language_model", lang)
    for j in range(config["rvq"] - 1):
        yield f"local_transformer.model.embed_tokens.{j}.weight", audio_table()
    yield from layers("local_transformer.model", local)
    for p in range(config["rvq"]):
        head = normal(A, H, std=0.5)
        head[1024:] = 0.0
        yield f"local_transformer.local_lm_heads.{p}.weight", head


def make_tts_checkpoint(out_dir: str | Path, seed: int = 0, preset: str = "real",
                        tokenizer_json: str | Path | None = None, progress=lambda msg: None) -> Path:
    """A random TTS checkpoint (``tokenizer_json`` is copied beside it when given)."""
    config = tts_config(preset)
    out = write_checkpoint(out_dir, config, tts_tensors(config, np.random.default_rng(seed)), progress)
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    return out
