"""MOSS-Audio-Tokenizer → two stateful streaming ONNX step graphs (encoder and decoder).

Both graphs process whole 1920-sample frames and carry each attention layer's sliding-window KV as
host-owned state: per layer the last ``context - 1`` rotated keys/values of the stage (a ring whose
slot ``j`` holds position ``p ≡ j (mod C)``), plus the stream's frame position. The new rows of the call
are attended in the same call and returned, so every query sees exactly its ``context``-token window:
any chunking equals the one-pass decode (upstream's own streaming does not, past 10 s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto

from .checkpoint import Checkpoint, CheckpointError, parse_config, weight_norm
from .graph import GraphBuilder

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
SAMPLE_RATE = 24000


@dataclass(frozen=True)
class StageSpec:
    """One causal transformer stage of the codec, as the runtime needs to size its KV rings."""

    module: str           # checkpoint prefix, e.g. "decoder.0"
    layers: int
    heads: int
    head_dim: int
    d_model: int
    input_dim: int
    output_dim: int
    context: int          # attention window in this stage's tokens
    tokens_per_frame: int # tokens of this stage per 1920-sample frame
    max_period: float

    @property
    def past_rows(self) -> int:
        return self.context - 1


@dataclass(frozen=True)
class CodecSpec:
    sample_rate: int
    samples_per_frame: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int
    rvq_dim: int
    encoder: list
    decoder: list
    encoder_patches: list
    decoder_patches: list

    def to_json(self) -> dict:
        return asdict(self)


def parse_codec_config(cfg: dict) -> CodecSpec:
    """Read the stage lists of an upstream codec ``config.json`` (the decoder list is in execution order)."""
    if "language_config" in cfg:
        raise CheckpointError("this is a MOSS-TTS-Realtime checkpoint, not a codec: pass it as --model "
                              "(and the MOSS-Audio-Tokenizer directory as --codec)")
    return parse_config(_parse_codec_config, cfg, "MOSS-Audio-Tokenizer")


def _parse_codec_config(cfg: dict) -> CodecSpec:
    hop = int(cfg["downsample_rate"])
    duration = float(cfg["causal_transformer_context_duration"])
    rate_hz = int(cfg.get("sampling_rate", cfg.get("sample_rate", SAMPLE_RATE)))

    def stages(modules: list, prefix: str, samples_per_token: float, encoder: bool):
        out, patches = [], []
        for idx, m in enumerate(modules):
            if m["module_type"] == "PatchedPretransform":
                h = int(m["patch_size"])
                samples_per_token = samples_per_token * h if encoder else samples_per_token / h
                patches.append((idx, h))
            elif m["module_type"] == "Transformer":
                if m.get("positional_embedding", "rope") != "rope" or m.get("gating", "none") != "none" \
                        or m.get("norm", "layer_norm") != "layer_norm" or not m.get("causal", True):
                    raise CheckpointError(f"unsupported codec transformer settings in {prefix}.{idx}: {m}")
                d, heads = int(m["d_model"]), int(m["num_heads"])
                out.append(StageSpec(
                    module=f"{prefix}.{idx}", layers=int(m["num_layers"]), heads=heads, head_dim=d // heads,
                    d_model=d, input_dim=int(m["input_dimension"]),
                    output_dim=int(m.get("output_dimension", d)),
                    context=int(rate_hz / samples_per_token * duration),
                    tokens_per_frame=int(round(hop / samples_per_token)),
                    max_period=float(m.get("max_period", 10000)),
                ))
            else:
                raise CheckpointError(f"unknown codec module type {m['module_type']!r}")
        return out, patches

    enc, enc_patches = stages(cfg["encoder_kwargs"], "encoder", 1.0, True)
    dec, dec_patches = stages(cfg["decoder_kwargs"], "decoder", float(hop), False)
    q = cfg["quantizer_kwargs"]
    if q.get("quantizer_type", cfg.get("quantizer_type")) != "rlfq":
        raise CheckpointError("only the rlfq quantizer is supported")
    return CodecSpec(
        sample_rate=rate_hz, samples_per_frame=hop, num_quantizers=int(q["num_quantizers"]),
        codebook_size=int(q["codebook_size"]), codebook_dim=int(q["codebook_dim"]), rvq_dim=int(q["rvq_dim"]),
        encoder=[asdict(s) for s in enc], decoder=[asdict(s) for s in dec],
        encoder_patches=enc_patches, decoder_patches=dec_patches,
    )


# ---------------------------------------------------------------------------------------------- pieces
def _wn(ckpt: Checkpoint, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Weight-normed 1x1 Conv1d → (weight [out, in], bias [out])."""
    w = weight_norm(ckpt.get(f"{prefix}.parametrizations.weight.original0"),
                    ckpt.get(f"{prefix}.parametrizations.weight.original1"))
    return w.reshape(w.shape[0], -1), ckpt.get(f"{prefix}.bias")


def _patch(gb: GraphBuilder, x: str, h: int, channels: int) -> str:
    """Encoder patchify, time-major: [B, T, C] → [B, T/h, C*h], channel ``c*h + j`` = input c at ``t*h + j``."""
    y = gb.op("Reshape", [x, gb.const([0, -1, h, channels], np.int64)])
    return gb.reshape(gb.transpose(y, [0, 1, 3, 2]), [0, -1, channels * h])


def _unpatch(gb: GraphBuilder, x: str, h: int, channels: int, flat: bool = False) -> str:
    """Decoder unpatchify (exact inverse): [B, T, C] → [B, T*h, C/h], output ``[t*h + j, c] = x[t, c*h + j]``;
    ``flat``: straight to the waveform's [B, T*h*C/h] (the same row-major order, one reshape fewer)."""
    y = gb.reshape(x, [0, 0, channels // h, h])
    return gb.reshape(gb.transpose(y, [0, 1, 3, 2]), [0, -1] if flat else [0, -1, channels // h])


def _window_bias(gb: GraphBuilder, P: str, pos: str, past_rows: int) -> str:
    """Additive attention bias [B, 1, T, C+T] for queries at ``pos[b, i] = P[b, 0] + i`` (``P`` [B, 1]) over
    the ring and the new rows.

    Ring slot j holds position ``P - C + ((j - P) mod C)`` (valid when >= 0), new row k position ``P + k``;
    a key is visible to a query iff it is valid and ``0 <= q - k < context = C + 1``, i.e. iff
    ``0 <= q - k <= min(q, C)`` (valid: ``k >= 0``). Keys and queries are made 4-D ([B, 1, 1, C+T] and
    [B, 1, T, 1]), so the mask comes out in the bias's shape.
    """
    C = past_rows
    ring = gb.op("Add", [gb.op("Sub", [P, gb.const(C, np.int64)]),
                         gb.op("Mod", [gb.op("Sub", [gb.const(np.arange(C)[None, :], np.int64), P]),
                                       gb.const(C, np.int64)], fmod=0)])       # [B, C]
    keys = gb.unsqueeze(gb.concat([ring, pos], 1), [1, 2])                    # [B, 1, 1, C+T]
    queries = gb.unsqueeze(pos, [1, 3])                                       # [B, 1, T, 1]
    d = gb.op("Sub", [queries, keys])                                         # [B, 1, T, C+T]
    ok = gb.op("And", [gb.op("GreaterOrEqual", [d, gb.const(0, np.int64)]),
                       gb.op("LessOrEqual", [d, gb.op("Min", [queries, gb.const(C, np.int64)])])])
    return gb.op("Where", [ok, gb.const(0.0), gb.const(np.finfo(np.float32).min)])


def past_names(side: str, stage: int, layer: int) -> tuple[str, str]:
    return f"{side}.past_key.{stage}.{layer}", f"{side}.past_value.{stage}.{layer}"


def _rotary_tables(gb: GraphBuilder, pos: str, shape: str, spec: StageSpec) -> tuple[str, str, str]:
    """(position_ids [B, T], cos_cache, sin_cache [B*T, D/2]) for ``com.microsoft.RotaryEmbedding`` at the
    positions ``pos`` [B, T] (``shape``: [B, T] as int64): row ``b*T + i`` of the caches holds the angles of
    ``pos[b, i]``, so the caches
    cover exactly this call's positions, however far the stream has run. Upstream RoPE (moshi style):
    freqs = exp(i * -ln(max_period) * 2 / D), angles pos * freqs in float32."""
    Dh = spec.head_dim
    freqs = np.exp(np.arange(Dh // 2, dtype=np.float32) * np.float32(-math.log(spec.max_period) * 2 / Dh))
    ang = gb.op("Mul", [gb.cast(gb.reshape(pos, [-1, 1]), FLOAT), gb.const(freqs)])          # [B*T, D/2]
    ids = gb.op("Reshape", [gb.arange(gb.op("Size", [pos])), shape])
    return ids, gb.op("Cos", [ang]), gb.op("Sin", [ang])


def _skip_layer_norm(gb: GraphBuilder, x: str, delta: str, weight: np.ndarray, bias: np.ndarray,
                     name: str) -> tuple[str, str]:
    """(LayerNorm(x + delta), x + delta) in one ``com.microsoft.SkipLayerNormalization``."""
    y, _, _, total = gb.op("SkipLayerNormalization", [x, delta, gb.weight(name + ".weight", weight),
                                                      gb.weight(name + ".bias", bias)],
                           outs=[gb.fresh("skip_layer_norm"), "", "", gb.fresh("residual")], domain="com.microsoft",
                           epsilon=1e-5)
    return y, total


def _stage(gb: GraphBuilder, ckpt: Checkpoint, x: str, spec: StageSpec, frame_pos: str, side: str,
           index: int) -> tuple[str, str]:
    """One ProjectedTransformer over time-major x [B, T, in] from the call's first frame ``frame_pos`` [B, 1];
    returns (y [B, T, out], present [L,2,B,H,T,Dh]).

    Per layer: LayerNorm (the residual add fused in: SkipLayerNormalization), the packed in_proj, interleaved
    RoPE (RotaryEmbedding), MultiHeadAttention over the ring and the new rows (its present holds both: the
    new rows are its last T), out_proj and linear2 with the layer scales folded into their weights, GELU."""
    p, H, Dh, D = spec.module, spec.heads, spec.head_dim, spec.d_model
    if f"{p}.input_proj.weight" in ckpt:
        x = gb.linear(x, ckpt.get(f"{p}.input_proj.weight"), f"{p}.input_proj")
    elif spec.input_dim != D:
        raise CheckpointError(f"missing tensor {p}.input_proj.weight")
    tpf = spec.tokens_per_frame
    pos0 = frame_pos if tpf == 1 else gb.op("Mul", [frame_pos, gb.const(tpf, np.int64)])          # [B, 1]
    shape = gb.op("Shape", [x], start=0, end=2)                                                  # [B, T]
    pos = gb.op("Add", [pos0, gb.arange(gb.op("Gather", [shape, gb.const(1, np.int64)], axis=0))])  # [B, T]
    bias = _window_bias(gb, pos0, pos, spec.past_rows)
    rope = _rotary_tables(gb, pos, shape, spec)
    presents, delta = [], None
    for layer in range(spec.layers):
        lp = f"{p}.transformer.layers.{layer}"
        get = lambda n: ckpt.get(f"{lp}.{n}")
        with gb.scope(lp):
            if delta is None:
                h = gb.layer_norm(x, get("norm1.weight"), get("norm1.bias"), f"{lp}.norm1", 1e-5)
            else:
                h, x = _skip_layer_norm(gb, x, delta, get("norm1.weight"), get("norm1.bias"), f"{lp}.norm1")
            qkv = gb.linear(h, get("self_attn.in_projs.0.weight"), f"{lp}.self_attn.in_proj")
            q, k, v = gb.op("Split", [qkv], n_out=3, axis=-1, num_outputs=3)                  # [B, T, H*Dh]
            q, k = (gb.op("RotaryEmbedding", [t, rope[0], rope[1], rope[2]], domain="com.microsoft", interleaved=1,
                          num_heads=H) for t in (q, k))
            pk, pv = past_names(side, index, layer)
            gb.input(pk, FLOAT, ["batch", H, spec.past_rows, Dh])
            gb.input(pv, FLOAT, ["batch", H, spec.past_rows, Dh])
            # present outputs requested although unused: without them onnxruntime 1.32's CPU kernel ignores the
            # past (measured: wrong audio)
            att = gb.op("MultiHeadAttention", [q, k, v, "", "", bias, pk, pv], n_out=3, domain="com.microsoft",
                        num_heads=H, scale=1.0 / math.sqrt(Dh))[0]
            presents += [k, v]                                            # the new rows, [B, T, H*Dh]
            scale1, scale2 = get("layer_scale_1.scale"), get("layer_scale_2.scale")
            att = gb.linear(att, get("self_attn.out_projs.0.weight") * scale1[:, None], f"{lp}.self_attn.out_proj")
            h, x = _skip_layer_norm(gb, x, att, get("norm2.weight"), get("norm2.bias"), f"{lp}.norm2")
            h = gb.op("Gelu", [gb.linear(h, get("linear1.weight"), f"{lp}.linear1")], domain="com.microsoft")
            delta = gb.linear(h, get("linear2.weight") * scale2[:, None], f"{lp}.linear2")
    assert delta is not None, "a codec transformer has at least one layer"
    x = gb.op("Add", [x, delta])
    if f"{p}.output_proj.weight" in ckpt:
        x = gb.linear(x, ckpt.get(f"{p}.output_proj.weight"), f"{p}.output_proj")
    elif spec.output_dim != D:
        raise CheckpointError(f"missing tensor {p}.output_proj.weight")
    # [k0, v0, k1, v1, ...] each [B, T, H*Dh] side by side → [B, T, L, 2, H, Dh] (a constant shape) →
    # [L, 2, B, H, T, Dh]: one reshape and one transpose per stage rather than per layer
    packed = gb.reshape(gb.concat(presents, -1), [0, 0, spec.layers, 2, H, Dh])
    return x, gb.transpose(packed, [2, 3, 0, 4, 1, 5])


def _dequant_tables(ckpt: Checkpoint, spec: CodecSpec) -> np.ndarray:
    """``out_proj_i(codebook_i[c])`` for every level and code, stacked: [n_q * codebook_size, rvq_dim]."""
    tables = []
    for i in range(spec.num_quantizers):
        qp = f"quantizer.quantizers.{i}"
        w, b = _wn(ckpt, f"{qp}.out_proj")
        tables.append(ckpt.get(f"{qp}.codebook.weight") @ w.T + b)
    return np.concatenate(tables, 0).astype(np.float32)


def _declare_present(gb: GraphBuilder, present: str, side: str, index: int, spec: StageSpec, t_dim: str) -> None:
    gb.output(present, f"{side}.present.{index}", FLOAT, [spec.layers, 2, "batch", spec.heads, t_dim, spec.head_dim])


# ---------------------------------------------------------------------------------------------- graphs
def build_decoder(ckpt: Checkpoint, spec: CodecSpec, path: Path, weight_dtype,
                  block_size: int | None = None) -> GraphBuilder:
    """codes [B, N, n_q_total] + n_quantizers + frame_pos [B] + ring KV → audio [B, N*1920] + new KV
    (``block_size``: int8 matmul weights' scale block, default graph.INT8_BLOCK)."""
    gb = GraphBuilder("codec_decoder", path, weight_dtype, block_size=block_size)
    nq, K = spec.num_quantizers, spec.codebook_size
    codes = gb.input("codes", INT64, ["batch", "frames", nq])
    n_quant = gb.input("n_quantizers", INT64, [])
    frame_pos = gb.input("frame_pos", INT64, ["batch"])
    first_frame = gb.unsqueeze(frame_pos, [1])              # [B, 1], shared by the stages
    idx = gb.op("Add", [codes, gb.const(np.arange(nq, dtype=np.int64) * K, np.int64)])
    if gb.weight_dtype == np.int8:    # rows gathered from an fp16 table: the table is never widened whole
        parts = gb.embedding(idx, _dequant_tables(ckpt, spec), "quantizer.dequant_table")
    else:
        parts = gb.op("Gather", [gb.weight("quantizer.dequant_table", _dequant_tables(ckpt, spec)), idx], axis=0)
    # parts: [B, N, nq, rvq]
    level_on = gb.cast(gb.op("Less", [gb.const(np.arange(nq, dtype=np.int64)[:, None], np.int64), n_quant]), FLOAT)
    z = gb.op("ReduceSum", [gb.op("Mul", [parts, level_on]), gb.const([2], np.int64)], keepdims=0)
    w, b = _wn(ckpt, "quantizer.output_proj")
    x = gb.linear(z, w, "quantizer.output_proj", b)
    patches = dict(spec.decoder_patches)
    stages = [StageSpec(**s) for s in spec.decoder]
    channels, si = None, 0
    modules = sorted([(int(s.module.split(".")[1]), s) for s in stages] + [(i, h) for i, h in patches.items()],
                     key=lambda t: t[0])
    for _, item in modules:
        if isinstance(item, StageSpec):
            x, present = _stage(gb, ckpt, x, item, first_frame, "decoder", si)
            _declare_present(gb, present, "decoder", si, item, f"tokens{si}")
            channels, si = item.output_dim, si + 1
        else:
            x = _unpatch(gb, x, item, channels, flat=item is modules[-1][1])
            channels //= item
    audio = x if isinstance(modules[-1][1], int) else gb.reshape(x, [0, -1])
    gb.output(audio, "audio", FLOAT, ["batch", "samples"])
    return gb


def build_encoder(ckpt: Checkpoint, spec: CodecSpec, path: Path, weight_dtype) -> GraphBuilder:
    """waveform [B, N*1920] + frame_pos [B] + valid_frames [B] + ring KV → codes [B, N, n_q] + new KV.

    Frames at index >= valid_frames[b] of this call are the zero-padded tail: as upstream, the
    quantizer sees a zeroed residual there (their codes come from the biases alone).
    """
    gb = GraphBuilder("codec_encoder", path, weight_dtype)
    wave = gb.input("waveform", FLOAT, ["batch", "samples"])
    frame_pos = gb.input("frame_pos", INT64, ["batch"])
    first_frame = gb.unsqueeze(frame_pos, [1])              # [B, 1], shared by the stages
    valid = gb.input("valid_frames", INT64, ["batch"])
    x = gb.unsqueeze(wave, [2])                                                       # [B, S, 1]
    patches = dict(spec.encoder_patches)
    stages = [StageSpec(**s) for s in spec.encoder]
    channels, si = 1, 0
    modules = sorted([(int(s.module.split(".")[1]), s) for s in stages] + [(i, h) for i, h in patches.items()],
                     key=lambda t: t[0])
    for _, item in modules:
        if isinstance(item, StageSpec):
            x, present = _stage(gb, ckpt, x, item, first_frame, "encoder", si)
            _declare_present(gb, present, "encoder", si, item, f"tokens{si}")
            channels, si = item.output_dim, si + 1
        else:
            x = _patch(gb, x, item, channels)
            channels *= item
    w, b = _wn(ckpt, "quantizer.input_proj")
    residual = gb.linear(x, w, "quantizer.input_proj", b)                            # [B, N, rvq]
    n_frames = gb.dim(residual, 1)
    keep = gb.op("Less", [gb.unsqueeze(gb.arange(n_frames), [0]), gb.unsqueeze(valid, [1])])
    keep = gb.unsqueeze(gb.cast(keep, FLOAT), [2])                                   # [B, N, 1]
    codes = []
    for i in range(spec.num_quantizers):
        qp = f"quantizer.quantizers.{i}"
        residual = gb.op("Mul", [residual, keep])
        w_in, b_in = _wn(ckpt, f"{qp}.in_proj")
        u = gb.linear(residual, w_in, f"{qp}.in_proj", b_in)                         # [B, N, cd]
        book = gb.weight(f"{qp}.codebook", ckpt.get(f"{qp}.codebook.weight"))       # [K, cd]
        un, bn = _l2_normalize(gb, u), _l2_normalize(gb, book)
        # -||a - b||^2 expanded as upstream (DAC-style): |a|^2 - 2 a.b + |b|^2, argmin over codes
        dist = gb.op("Add", [
            gb.op("Sub", [gb.op("ReduceSum", [gb.op("Mul", [un, un]), gb.const([-1], np.int64)], keepdims=1),
                          gb.op("Mul", [gb.op("MatMul", [un, gb.transpose(bn, [1, 0])]), gb.const(2.0)])]),
            gb.op("ReduceSum", [gb.op("Mul", [bn, bn]), gb.const([-1], np.int64)], keepdims=0)])
        code = gb.op("ArgMin", [dist], axis=-1, keepdims=1)                          # [B, N, 1]
        codes.append(code)
        w_out, b_out = _wn(ckpt, f"{qp}.out_proj")
        table = gb.weight(f"{qp}.dequant_table", ckpt.get(f"{qp}.codebook.weight") @ w_out.T + b_out)
        residual = gb.op("Sub", [residual, gb.op("Gather", [table, gb.squeeze(code, [2])], axis=0)])
    gb.output(gb.concat(codes, 2), "codes", INT64, ["batch", "frames", spec.num_quantizers])
    return gb


def _l2_normalize(gb: GraphBuilder, x: str) -> str:
    """``F.normalize``: x / max(||x||_2, 1e-12) over the last axis."""
    norm = gb.op("Sqrt", [gb.op("ReduceSum", [gb.op("Mul", [x, x]), gb.const([-1], np.int64)], keepdims=1)])
    return gb.op("Div", [x, gb.op("Max", [norm, gb.const(1e-12)])])


def codec_tensor_names(spec: CodecSpec, ckpt: Checkpoint) -> list[str]:
    """Every tensor the exporter reads, to fail early with the complete list of missing ones."""
    names = []
    for s in [StageSpec(**d) for d in spec.encoder + spec.decoder]:
        for layer in range(s.layers):
            lp = f"{s.module}.transformer.layers.{layer}"
            names += [f"{lp}.{n}" for n in ("self_attn.in_projs.0.weight", "self_attn.out_projs.0.weight",
                                              "linear1.weight", "linear2.weight", "norm1.weight", "norm1.bias",
                                              "norm2.weight", "norm2.bias", "layer_scale_1.scale",
                                              "layer_scale_2.scale")]
        if s.input_dim != s.d_model:
            names.append(f"{s.module}.input_proj.weight")
        if s.output_dim != s.d_model:
            names.append(f"{s.module}.output_proj.weight")
    wn = lambda p: [f"{p}.bias", f"{p}.parametrizations.weight.original0", f"{p}.parametrizations.weight.original1"]
    names += wn("quantizer.input_proj") + wn("quantizer.output_proj")
    for i in range(spec.num_quantizers):
        qp = f"quantizer.quantizers.{i}"
        names += wn(f"{qp}.in_proj") + wn(f"{qp}.out_proj") + [f"{qp}.codebook.weight"]
    return names
