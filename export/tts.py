"""MOSS-TTS-Realtime → ONNX graphs: the Qwen3 backbone step, the local "depth" frame sampler, and the
sampling filter on its own (for tests).

* ``backbone`` is one graph for prefill and decode steps. It embeds grid rows (17 summed tables),
  runs the Qwen3 layers against a host-owned, preallocated KV buffer per layer (only the first
  ``past_len[b]`` slots of stream ``b`` are valid), and returns every new row's post-norm hidden state
  plus the new rows' K (after q/k-norm and RoPE) and V, which the host writes at ``past_len..``.
* ``depth`` turns one backbone hidden state into one 16-code frame: the 4-layer local transformer
  unrolled over its 16 positions (fresh causal cache per frame), each head's logits through repetition
  penalty, greedy argmax or temperature / top-k / top-p and an inverse-CDF draw from host uniforms.
* ``sampling_filter`` is the same filter on given logits, exposing the penalized logits and the final
  distribution.

``weight_dtype`` is how large weights are stored, ``compute_dtype`` what the backbone computes in
(activations and its KV slots; see ``GraphBuilder``): its ``hidden`` output is float32 whatever it
computes in, so the depth graph's interface does not depend on it. The depth transformer computes in
``compute_dtype`` too; its head logits are cast to float32 and the sampler is built in float32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from .checkpoint import Checkpoint, CheckpointError, parse_config
from .graph import Dim, GraphBuilder

FLOAT, INT64, INT32, BOOL, DOUBLE = (TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL,
                                     TensorProto.DOUBLE)

RVQ = 16                # audio codebooks per frame (grid columns 1..16)
AUDIO_VOCAB = 1027      # codes 0..1023, 1024 pad, 1025 BOS, 1026 EOS
AUDIO_PAD, AUDIO_BOS, AUDIO_EOS = 1024, 1025, 1026
HISTORY_PAD = AUDIO_VOCAB   # history entries equal to this are padding (never match a logit index)
TEXT_PAD, AUDIO_PAD_TEXT = 151655, 151654   # <|text_pad|>, <|audio_pad|> (upstream hard-codes these)

# Present in upstream checkpoints but never read by upstream inference (it always passes inputs_embeds):
# the text table on the live path is ``embed_tokens.0.weight``.
IGNORED_TENSORS = ("language_model.embed_tokens.weight",)

BACKBONE, LOCAL = "language_model", "local_transformer.model"
_LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight")


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class StackSpec:
    """One Qwen3 decoder stack (the backbone or the local transformer)."""

    prefix: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    rope_factor: float   # "linear" RoPE scaling: positions / factor (1.0 = default RoPE)
    max_positions: int = 32768   # max_position_embeddings: rows of the backbone's RoPE cos/sin tables

    def rope_cache(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """GroupQueryAttention's rotary tables ``[max_positions, head_dim / 2]``: cos and sin of the float32
        angles ``position * inv_freq`` (as transformers forms them), each correctly rounded to ``dtype``."""
        ang = np.arange(self.max_positions, dtype=np.float32)[:, None] * self.inv_freq()[None, :]
        ang = ang.astype(np.float64)
        return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)

    def inv_freq(self) -> np.ndarray:
        """``1 / theta^(arange(0, D, 2) / D)`` in float32, as transformers computes it."""
        exps = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.head_dim)
        inv = np.float32(1.0) / np.power(np.float32(self.rope_theta), exps, dtype=np.float32)
        return (inv / np.float32(self.rope_factor)).astype(np.float32)


@dataclass(frozen=True)
class TTSConfig:
    backbone: StackSpec
    local: StackSpec
    vocab: int
    rvq: int
    audio_vocab: int
    audio_pad: int
    audio_bos: int
    audio_eos: int
    text_pad: int
    audio_pad_text: int

    def to_json(self) -> dict:
        """The runtime's view: flat backbone dims (KV buffer sizing) plus both stacks in full."""
        b = self.backbone
        return {
            "hidden": b.hidden, "layers": b.layers, "heads": b.heads, "kv_heads": b.kv_heads,
            "head_dim": b.head_dim, "intermediate": b.intermediate, "vocab": self.vocab,
            "rms_eps": b.rms_eps, "rope_theta": b.rope_theta,
            "rvq": self.rvq, "audio_vocab": self.audio_vocab, "audio_pad": self.audio_pad,
            "audio_bos": self.audio_bos, "audio_eos": self.audio_eos, "text_pad": self.text_pad,
            "audio_pad_text": self.audio_pad_text, "history_pad": HISTORY_PAD,
            "backbone": asdict(b), "local": asdict(self.local),
        }


def _rope(cfg: dict, where: str) -> tuple[float, float]:
    """(theta, linear factor) from transformers v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", cfg.get("rope_type", "default")))
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(params.get("factor", 1.0))
    raise CheckpointError(f"{where}: unsupported RoPE type {kind!r} (default and linear are supported)")


def _stack(cfg: dict, prefix: str, where: str) -> StackSpec:
    for key, ok in (("hidden_act", lambda v: v in (None, "silu")), ("attention_bias", lambda v: not v),
                    ("use_sliding_window", lambda v: not v)):
        if not ok(cfg.get(key)):
            raise CheckpointError(f"{where}: unsupported {key}={cfg.get(key)!r}")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise CheckpointError(f"{where}: only full-attention layers are supported, got {cfg['layer_types']}")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: {heads} heads not a multiple of {kv_heads} kv heads")
    theta, factor = _rope(cfg, where)
    return StackSpec(prefix=prefix, layers=int(cfg["num_hidden_layers"]), hidden=hidden, heads=heads,
                     kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
                     intermediate=int(cfg["intermediate_size"]), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, rope_factor=factor,
                     max_positions=int(cfg.get("max_position_embeddings") or 32768))


def parse_tts_config(cfg: dict) -> TTSConfig:
    """Read an upstream ``MossTTSRealtime`` ``config.json`` (``language_config`` + ``local_config``)."""
    if "downsample_rate" in cfg and "language_config" not in cfg:
        raise CheckpointError("this is a MOSS-Audio-Tokenizer (codec) checkpoint: pass it as --codec "
                              "(and the MOSS-TTS-Realtime directory as --model)")
    if "language_config" not in cfg or "local_config" not in cfg:
        raise CheckpointError("not a MOSS-TTS-Realtime config: language_config / local_config missing")
    return parse_config(_parse_tts_config, cfg, "MOSS-TTS-Realtime")


def _parse_tts_config(cfg: dict) -> TTSConfig:
    lang, local = cfg["language_config"], cfg["local_config"]
    backbone = _stack(lang, BACKBONE, "language_config")
    depth = _stack(local, LOCAL, "local_config")
    if depth.hidden != backbone.hidden:
        raise CheckpointError(f"local hidden {depth.hidden} != backbone hidden {backbone.hidden} "
                              "(upstream has no projection between them)")
    rvq = int(cfg.get("rvq", local.get("rvq", RVQ)))
    audio_vocab = int(cfg.get("audio_vocab_size", local.get("audio_vocab_size", AUDIO_VOCAB)))
    if rvq != RVQ or audio_vocab != AUDIO_VOCAB:
        raise CheckpointError(f"expected rvq={RVQ}, audio_vocab_size={AUDIO_VOCAB}; got {rvq}, {audio_vocab}")
    return TTSConfig(backbone=backbone, local=depth, vocab=int(lang["vocab_size"]), rvq=rvq,
                     audio_vocab=audio_vocab, audio_pad=int(cfg.get("audio_pad_token", AUDIO_PAD)),
                     audio_bos=AUDIO_BOS, audio_eos=AUDIO_EOS, text_pad=TEXT_PAD, audio_pad_text=AUDIO_PAD_TEXT)


def _layer_names(spec: StackSpec) -> list[str]:
    return [f"{spec.prefix}.layers.{i}.{n}" for i in range(spec.layers) for n in _LAYER_TENSORS]


def tts_tensor_names(cfg: TTSConfig) -> list[str]:
    """Every tensor the exporter reads, to fail early with the complete list of missing ones."""
    names = [f"embed_tokens.{c}.weight" for c in range(cfg.rvq + 1)]
    names += _layer_names(cfg.backbone) + [f"{BACKBONE}.norm.weight"]
    names += [f"{LOCAL}.embed_tokens.{j}.weight" for j in range(cfg.rvq - 1)]
    names += _layer_names(cfg.local) + [f"{LOCAL}.norm.weight"]
    names += [f"local_transformer.local_lm_heads.{p}.weight" for p in range(cfg.rvq)]
    return names


def check_tensor_shapes(ckpt: Checkpoint, cfg: TTSConfig) -> None:
    """Shape check of every tensor before any graph is written."""
    want: dict[str, tuple] = {"embed_tokens.0.weight": (cfg.vocab, cfg.backbone.hidden)}
    for c in range(1, cfg.rvq + 1):
        want[f"embed_tokens.{c}.weight"] = (cfg.audio_vocab, cfg.backbone.hidden)
    for j in range(cfg.rvq - 1):
        want[f"{LOCAL}.embed_tokens.{j}.weight"] = (cfg.audio_vocab, cfg.local.hidden)
    for p in range(cfg.rvq):
        want[f"local_transformer.local_lm_heads.{p}.weight"] = (cfg.audio_vocab, cfg.local.hidden)
    for s in (cfg.backbone, cfg.local):
        want[f"{s.prefix}.norm.weight"] = (s.hidden,)
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for i in range(s.layers):
            lp = f"{s.prefix}.layers.{i}"
            want.update({
                f"{lp}.input_layernorm.weight": (s.hidden,), f"{lp}.post_attention_layernorm.weight": (s.hidden,),
                f"{lp}.self_attn.q_proj.weight": (q, s.hidden), f"{lp}.self_attn.k_proj.weight": (kv, s.hidden),
                f"{lp}.self_attn.v_proj.weight": (kv, s.hidden), f"{lp}.self_attn.o_proj.weight": (s.hidden, q),
                f"{lp}.self_attn.q_norm.weight": (s.head_dim,), f"{lp}.self_attn.k_norm.weight": (s.head_dim,),
                f"{lp}.mlp.gate_proj.weight": (s.intermediate, s.hidden),
                f"{lp}.mlp.up_proj.weight": (s.intermediate, s.hidden),
                f"{lp}.mlp.down_proj.weight": (s.hidden, s.intermediate),
            })
    bad = [f"{n} {tuple(ckpt.shape(n))} (expected {shape})" for n, shape in want.items()
           if tuple(ckpt.shape(n)) != shape]
    if bad:
        raise CheckpointError(f"{ckpt.dir}: misshapen tensors: {'; '.join(bad[:10])}")


# ---------------------------------------------------------------------------------------------- layers
class Layer:
    """One Qwen3 decoder layer's weights, added to the graph once and shared by every call site.

    q/k/v are one packed projection (``self_attn.qkv_proj``) and gate/up another (``mlp.gate_up_proj``,
    split after its matmul). Qwen3's q/k RMSNorm sits between the projection and RoPE, so the packed q/k/v
    goes through the norm and the rotation whole and a select puts the v heads back as projected, before it
    is handed to the attention op packed. Residual adds are fused into the following norm
    (``SkipSimplifiedLayerNormalization``). The q/k norm weights are laid out once per layer as
    BranchwiseRMSNorm's per-head scale (``qk_norm``), which the backbone and every depth position share.
    """

    def __init__(self, gb: GraphBuilder, ckpt: Checkpoint, spec: StackSpec, index: int):
        lp = f"{spec.prefix}.layers.{index}"
        self.spec, self.name = spec, lp
        vec = lambda n: gb.weight(f"{lp}.{n}", ckpt.get(f"{lp}.{n}"))
        mat = lambda n: ckpt.get(f"{lp}.{n}.weight")
        self.ln1, self.ln2 = vec("input_layernorm.weight"), vec("post_attention_layernorm.weight")
        # [H + 2 KV, D]: BranchwiseRMSNorm's per-head scale for the packed q/k/v (:meth:`rotated_qkv`): each q and
        # k head's norm weight, ones for the v heads (which its select puts back as projected)
        q_norm, k_norm = (ckpt.get(f"{lp}.self_attn.{n}_norm.weight").astype(np.float32) for n in "qk")
        self.qk_norm = gb.tensor(f"{lp}.self_attn.qk_norm", np.concatenate(
            [np.tile(q_norm, (spec.heads, 1)), np.tile(k_norm, (spec.kv_heads, 1)),
             np.ones((spec.kv_heads, spec.head_dim), np.float32)]).astype(gb.compute_dtype))
        self.qkv_proj = gb.matmul_weight(np.concatenate([mat(f"self_attn.{n}_proj") for n in "qkv"]),
                                    f"{lp}.self_attn.qkv_proj")
        self.o = gb.matmul_weight(mat("self_attn.o_proj"), f"{lp}.self_attn.o_proj")
        self.gate_up_proj = gb.matmul_weight(np.concatenate([mat("mlp.gate_proj"), mat("mlp.up_proj")]),
                                        f"{lp}.mlp.gate_up_proj")
        self.down = gb.matmul_weight(mat("mlp.down_proj"), f"{lp}.mlp.down_proj")

    def input_norm(self, gb: GraphBuilder, x: str, delta: str | None) -> tuple[str, str]:
        """(input RMSNorm of the residual stream, the stream): the stream is ``x + delta`` (the previous
        layer's MLP output, added inside the norm) or ``x`` alone."""
        with gb.scope(f"{self.name}.input_layernorm"):
            if delta is None:
                return gb.rms_norm_named(x, self.ln1, self.spec.rms_eps), x
            return gb.skip_rms_norm(x, delta, self.ln1, self.spec.rms_eps)

    def rotated_qkv(self, gb: GraphBuilder, h: str, positions: str, cos: str, sin: str) -> str:
        """Normed input [B, T, hidden] → the packed q/k/v [B, T, (H + 2 KV) * D] GroupQueryAttention takes as
        its one query input: q and k after their per-head RMSNorm and RoPE at ``positions`` (position_ids
        [B, T], or one position [1] for every row), v as projected.

        Every head of the packed projection goes through one ``com.microsoft.BranchwiseRMSNorm`` (an RMSNorm
        over each head_dim group of the flat projection, with each head's own weight: ``qk_norm``)
        and one RotaryEmbedding (every head of a row shares its position); a select then puts the v heads
        back as projected. Normalizing and rotating the v heads costs KV / (H + 2 KV) more elementwise work
        and saves the reshapes and splits around the q/k path."""
        s = self.spec
        heads = s.heads + 2 * s.kv_heads
        with gb.scope(f"{self.name}.self_attn"):
            qkv = gb.matmul(h, self.qkv_proj)
            normed = gb.op("BranchwiseRMSNorm", [qkv, self.qk_norm], domain="com.microsoft",
                           num_branches=heads, epsilon=s.rms_eps)
            rotated = gb.op("RotaryEmbedding", [normed, positions, cos, sin], domain="com.microsoft",
                            interleaved=0, num_heads=heads)
            values = gb.const(np.arange(heads * s.head_dim) >= (s.heads + s.kv_heads) * s.head_dim, np.bool_)
            return gb.op("Where", [values, qkv, rotated])

    def post_attention(self, gb: GraphBuilder, x: str, att: str) -> tuple[str, str]:
        """o_proj of the attention output [B, T, H*D], added to the stream inside the post-attention
        RMSNorm: (normed, stream)."""
        with gb.scope(f"{self.name}.self_attn"):
            delta = gb.matmul(att, self.o)
        with gb.scope(f"{self.name}.post_attention_layernorm"):
            return gb.skip_rms_norm(x, delta, self.ln2, self.spec.rms_eps)

    def mlp(self, gb: GraphBuilder, h: str) -> str:
        """SwiGLU ``down(silu(gate h) * up h)`` with gate and up as one packed matmul."""
        s = self.spec
        with gb.scope(f"{self.name}.mlp"):
            gate_up = gb.matmul(h, self.gate_up_proj)
            gate, up = gb.op("Split", [gate_up, gb.const([s.intermediate, s.intermediate], np.int64)],
                             n_out=2, axis=-1)
            return gb.matmul(gb.op("Mul", [gb.silu(gate), up]), self.down)


def kv_names(layer: int) -> tuple[str, str, str, str]:
    """(past_key, past_value, present_key, present_value) of backbone layer ``layer``."""
    return f"past_key.{layer}", f"past_value.{layer}", f"present_key.{layer}", f"present_value.{layer}"


# ---------------------------------------------------------------------------------------------- backbone
def build_backbone(ckpt: Checkpoint, cfg: TTSConfig, path: Path, weight_dtype, matmul_bits: int = 8,
                   compute_dtype=np.float32, block_size: int | None = None) -> GraphBuilder:
    """grid [B, T, 17] + position_ids [B, T] + seqlens_k [B] + total_sequence_length [] + per-layer KV slots
    [B, KV, capacity, D] → hidden [B, T, hidden] (float32).

    RoPE is ``com.microsoft.RotaryEmbedding`` at the host's ``position_ids`` [B, T] (cos/sin tables of
    ``max_positions`` rows; GroupQueryAttention's own ``do_rotary`` would save one more node a layer but
    needs head_dim % 16 == 0 on CPU, which the tiny golden models lack: one code path for both; its q/k-norm
    inputs would save three, but onnxruntime 1.32's CPU kernel refuses them). Attention is
    ``com.microsoft.GroupQueryAttention`` over the host's KV slots: stream ``b`` attends to its first
    ``seqlens_k[b] + 1`` rows (its past rows plus the T new ones: the host supplies ``past_len + T - 1``)
    and the call writes the new rows' K (after q/k-norm and RoPE) and V at ``past_len..`` of ``present_*``,
    which the host binds to the same memory as ``past_*`` (in place: no per-step copy that grows with the
    context). ``total_sequence_length`` is the slot capacity, a constant of the
    host's pool (no device-side reduction feeds the op's host-side shape input, and a captured graph can
    replay it). Streams with different lengths share a call when T == 1; with T > 1 the batch must be 1
    (GroupQueryAttention's rule), which is how prefills run. KV and activations are ``compute_dtype``.
    """
    s = cfg.backbone
    gb = GraphBuilder("backbone", path, weight_dtype, matmul_bits=matmul_bits, compute_dtype=compute_dtype,
                      block_size=block_size)
    grid = gb.input("grid", INT64, ["batch", "rows", cfg.rvq + 1])
    positions = gb.input("position_ids", INT64, ["batch", "rows"])
    seqlens = gb.input("seqlens_k", INT32, ["batch"])
    total = gb.input("total_sequence_length", INT32, [])
    kv_shape: list[Dim] = ["batch", s.kv_heads, "capacity", s.head_dim]

    # 17 lookups in one: the tables stacked, each column's ids offset to its table, the rows summed over
    # the columns in column order (as upstream accumulates them)
    with gb.scope("embed_tokens"):
        tables = [ckpt.get(f"embed_tokens.{c}.weight", dtype=None) for c in range(cfg.rvq + 1)]
        offsets = np.cumsum([0] + [len(t) for t in tables[:-1]]).astype(np.int64)
        ids = gb.op("Add", [grid, gb.const(offsets, np.int64)])                              # [B, T, 17]
        rows = gb.embedding(ids, np.concatenate(tables), "embed_tokens")                    # [B, T, 17, H]
        x = gb.op("ReduceSum", [rows, gb.const([2], np.int64)], keepdims=0)
    with gb.scope("rotary"):
        cos, sin = (gb.tensor(f"rotary.{n}_cache", t) for n, t in zip(("cos", "sin"), s.rope_cache(gb.compute_dtype)))

    delta = None
    for i in range(s.layers):
        layer = Layer(gb, ckpt, s, i)
        pk, pv, ok, ov = kv_names(i)
        gb.input(pk, gb.float_type, kv_shape)
        gb.input(pv, gb.float_type, kv_shape)
        h, x = layer.input_norm(gb, x, delta)
        qkv = layer.rotated_qkv(gb, h, positions, cos, sin)
        with gb.scope(f"{layer.name}.self_attn"):
            att = gb.op(
                "GroupQueryAttention",
                [qkv, "", "", pk, pv, seqlens, total],
                outs=[gb.fresh("attn"), ok, ov], domain="com.microsoft", num_heads=s.heads,
                kv_num_heads=s.kv_heads, scale=1.0 / math.sqrt(s.head_dim))[0]
        h, x = layer.post_attention(gb, x, att)
        delta = layer.mlp(gb, h)
        gb.declare_output(ok, gb.float_type, kv_shape)
        gb.declare_output(ov, gb.float_type, kv_shape)
    assert delta is not None, "a backbone has at least one layer"
    with gb.scope(f"{BACKBONE}.norm"):
        norm = gb.weight(f"{BACKBONE}.norm.weight", ckpt.get(f"{BACKBONE}.norm.weight"))
        hidden = gb.skip_rms_norm(x, delta, norm, s.rms_eps)[0]
        hidden = hidden if gb.compute_dtype == np.float32 else gb.cast(hidden, FLOAT)
    gb.output(hidden, "hidden", FLOAT, ["batch", "rows", s.hidden])
    return gb


# ---------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplerRows:
    """Per-row sampling settings [B] broadcast once to [B, N, 1] values (N = codebooks per filter call):
    what every codebook's filter reads, computed once per graph rather than once per codebook."""

    penalty: str       # repetition penalty
    temperature: str   # <= 0 counts as 1 (greedy rows)
    kth: str           # int64 index of the k-th largest logit in an ascending sort: V - k (0 keeps all)
    cut: str           # [B, 1, V] top-p: drop where the ascending cumulative probability <= cut (-1: top-p
                       # off; -1 at the last, largest entry too: the max is always kept)


def sampler_rows(gb: GraphBuilder, penalty: str, temperature: str, top_k: str, top_p: str, vocab: int,
                 books: int) -> SamplerRows:
    """:class:`SamplerRows` from the graph's per-row inputs, for filter calls over ``books`` codebooks."""
    V = vocab
    with gb.scope("sampling.rows"):
        row = lambda v: gb.unsqueeze(v, [1, 2])                                            # [B] → [B, 1, 1]
        k_on = gb.op("And", [gb.op("Greater", [top_k, gb.const(0, np.int64)]),
                             gb.op("Less", [top_k, gb.const(V, np.int64)])])
        kth = row(gb.op("Sub", [gb.const(V, np.int64), gb.op("Where", [k_on, top_k, gb.const(V, np.int64)])]))
        if books > 1:   # GatherElements takes indices of the output's shape: one per codebook
            kth = gb.op("Expand", [kth, gb.concat([gb.op("Shape", [top_k]), gb.const([books, 1], np.int64)], 0)])
        temp = gb.op("Where", [gb.op("Greater", [temperature, gb.const(0.0)]), temperature, gb.const(1.0)])
        cut = gb.op("Where", [gb.op("Less", [top_p, gb.const(1.0)]), gb.op("Sub", [gb.const(1.0), top_p]),
                              gb.const(-1.0)])
        cut = gb.op("Where", [gb.const(np.arange(V) < V - 1, np.bool_), row(cut), gb.const(-1.0)])
        return SamplerRows(penalty=row(penalty), temperature=row(temp), kth=kth, cut=cut)


def history_marks(gb: GraphBuilder, history: str, vocab: int, penalty: str) -> str:
    """history [B, W, N] + penalty [B, 1, 1] → the repetition penalty of each id [B, N, V]: ``penalty``
    where the id occurs in codebook n's window, 1 elsewhere (dividing or multiplying by 1 is exact, so
    the filter needs no per-codebook select of its own). Ones are scattered at the window's ids into a
    [B, N, V + 1] map (the history pad V lands in the extra column): O(window), not O(window x V), and
    computed once for all codebooks."""
    with gb.scope("sampling.repetition_penalty"):
        ids = gb.transpose(history, [0, 2, 1])                                              # [B, N, W]
        marks = gb.zeros(gb.concat([gb.op("Shape", [ids], start=0, end=2), gb.const([vocab + 1], np.int64)], 0))
        marks = gb.op("ScatterElements", [marks, ids, gb.op("Expand", [gb.const(1.0), gb.op("Shape", [ids])])],
                      axis=-1)
        seen = gb.op("Greater", [gb.op("Slice", [marks, gb.const([0], np.int64), gb.const([vocab], np.int64),
                                                 gb.const([2], np.int64)]), gb.const(0.0)])
        return gb.op("Where", [seen, penalty, gb.const(1.0)])


@dataclass(frozen=True)
class SortedFilter:
    """The upstream filter chain's values (see :func:`sorted_filter`): ``penalized`` in id order, the rest in the
    ascending order of the temperature-scaled logits (``order`` maps a sorted position to its id)."""

    penalized: str   # [B, N, V] logits after the repetition penalty, id order
    scaled: str      # [B, N, V] penalized / temperature, id order
    order: str       # [B, N, V] int64: the id at each ascending sorted position (ties: lower id first)
    top_k: str       # [B, N, V] sorted scaled logits, -inf below the k-th largest
    probs: str       # [B, N, V] softmax(top_k), sorted
    drop: str        # [B, N, V] bool, sorted: top-p drops the entry (a prefix of the order)


def sorted_filter(gb: GraphBuilder, logits: str, penalties: str, rows: SamplerRows, vocab: int) -> SortedFilter:
    """The upstream ``sample_token`` filter chain on logits [B, N, V] with the per-id ``penalties`` [B, N, V]
    from :func:`history_marks`, up to the top-p decision, in sorted order:

    * repetition penalty on the ids seen in the window (x<0 → x*pen, else x/pen; each id once);
    * / temperature, then top-k (keep logits >= the k-th largest; k <= 0 or k >= V keeps all);
    * top-p: ascending stable sort, cumulative softmax accumulated in float64 as torch's CPU cumsum does,
      drop where it is <= 1 - top_p, always keep the max (top_p >= 1 keeps all).

    Fixed-size: one full-vocabulary sort (TopK with a constant K = V, ties by lower id first: the upstream
    stable sort), thresholds read from it by GatherElements; no shape depends on the data, so nothing
    needs a device→host copy. The kept entries are a suffix of the order and the dropped ones have
    probability 0 or are dropped by top-p, so a draw needs no way back to id order but ``order`` itself.
    """
    neg_inf = gb.const(-np.inf)
    with gb.scope("sampling.repetition_penalty"):
        penalized = gb.op("Where", [gb.op("Less", [logits, gb.const(0.0)]), gb.op("Mul", [logits, penalties]),
                                    gb.op("Div", [logits, penalties])])
    with gb.scope("sampling.temperature"):
        scaled = gb.op("Div", [penalized, rows.temperature])
    with gb.scope("sampling.top_k"):
        asc, order = gb.op("TopK", [scaled, gb.const([vocab], np.int64)], n_out=2, axis=-1, largest=0, sorted=1)
        kth = gb.op("GatherElements", [asc, rows.kth], axis=-1)                              # [B, N, 1]
        top_k = gb.op("Where", [gb.op("Less", [asc, kth]), neg_inf, asc])                    # ties all kept
    with gb.scope("sampling.top_p"):
        # HF TopPLogitsWarper: the -inf entries sort first and add exact zeros to the cumulative sum
        probs = gb.op("Softmax", [top_k], axis=-1)
        cum = gb.cast(gb.op("CumSum", [gb.cast(probs, DOUBLE), gb.const(-1, np.int64)]), FLOAT)
        drop = gb.op("LessOrEqual", [cum, rows.cut])
    return SortedFilter(penalized=penalized, scaled=scaled, order=order, top_k=top_k, probs=probs, drop=drop)


def filter_logits(gb: GraphBuilder, logits: str, penalties: str, rows: SamplerRows, vocab: int) -> tuple[str, str, str]:
    """:func:`sorted_filter` back in id order: ``(penalized, filtered, probs)`` with filtered the scaled logits,
    -inf where top-k or top-p dropped them, and probs = softmax(filtered), the distribution upstream draws
    from."""
    f = sorted_filter(gb, logits, penalties, rows, vocab)
    with gb.scope("sampling.top_p"):
        # ``order`` is a permutation, so every entry of ``scaled`` is overwritten
        kept = gb.op("Where", [f.drop, gb.const(-np.inf), f.top_k])
        filtered = gb.op("ScatterElements", [f.scaled, f.order, kept], axis=-1)
        probs = gb.op("Softmax", [filtered], axis=-1)
    return f.penalized, filtered, probs


def sampling_filter(gb: GraphBuilder, logits: str, history: str, penalty: str, temperature: str,
                    top_k: str, top_p: str, vocab: int, books: int) -> tuple[str, str, str]:
    """:func:`filter_logits` on logits [B, N, V] with history [B, W, N] and per-row parameters [B]."""
    rows = sampler_rows(gb, penalty, temperature, top_k, top_p, vocab, books)
    return filter_logits(gb, logits, history_marks(gb, history, vocab, rows.penalty), rows, vocab)


def draw(gb: GraphBuilder, f: SortedFilter, uniform: str, vocab: int) -> str:
    """Inverse-CDF draw of one id per row from the filtered distribution, in sorted order: f [B, 1, V], u
    [B, 1, 1] in [0, 1) → the id [B, 1] int64 at the first sorted position whose cumulative kept
    probability, over the kept total, exceeds u (read with a batched GatherND, so the id comes out in the
    shape the next position's embedding lookup and the codes output take: no squeeze per codebook).

    The kept probabilities are ``f.probs`` with top-p's drops zeroed (proportional to upstream's
    softmax over the kept logits). Zero-probability entries sort first and never raise the cumulative
    sum, so the first position past u has probability > 0; the last position's ratio is total / total
    = 1 > u exactly, so some position always is (no clamp, no fallback). u = 0 takes the first kept
    position: the lowest id among the largest logits' ties when top-k is 1 (upstream's argmax)."""
    with gb.scope("sampling.draw"):
        cdf = gb.op("CumSum", [gb.op("Where", [f.drop, gb.const(0.0), f.probs]), gb.const(-1, np.int64)])
        total = gb.op("Gather", [cdf, gb.const([vocab - 1], np.int64)], axis=-1)          # [B, 1, 1]
        # the first position past u is the count of those at or below it (the ratio never decreases along
        # the order): a sum, which no kernel's tie order can change (an ArgMax over the 0/1 flags would
        # rest on CUDA's ArgMax returning the first of equal maxima, which cuDNN does not promise)
        below = gb.cast(gb.op("LessOrEqual", [gb.op("Div", [cdf, total]), uniform]), INT64)
        first = gb.op("ReduceSum", [below, gb.const([-1], np.int64)], keepdims=1)          # [B, 1, 1]
        return gb.op("GatherND", [f.order, first], batch_dims=2)                            # [B, 1]


def build_sampling_filter(path: Path, vocab: int = AUDIO_VOCAB, rvq: int = RVQ) -> GraphBuilder:
    """logits [B, 16, V] + history [B, W, 16] + per-row parameters → penalized, probs [B, 16, V]."""
    gb = GraphBuilder("sampling_filter", path)
    logits = gb.input("logits", FLOAT, ["batch", rvq, vocab])
    history = gb.input("history", INT64, ["batch", "window", rvq])
    params = _sampling_inputs(gb)
    penalized, _, probs = sampling_filter(gb, logits, history, *params, vocab=vocab, books=rvq)
    gb.output(penalized, "penalized", FLOAT, ["batch", rvq, vocab])
    gb.output(probs, "probs", FLOAT, ["batch", rvq, vocab])
    return gb


def _sampling_inputs(gb: GraphBuilder) -> tuple[str, str, str, str]:
    return (gb.input("repetition_penalty", FLOAT, ["batch"]), gb.input("temperature", FLOAT, ["batch"]),
            gb.input("top_k", INT64, ["batch"]), gb.input("top_p", FLOAT, ["batch"]))


# ---------------------------------------------------------------------------------------------- depth
class DepthLayer(Layer):
    """A local-transformer layer at one position of the unrolled frame: :class:`Layer`'s packed projections,
    q/k path (:meth:`Layer.rotated_qkv` at the position, a constant) and MLP, with GroupQueryAttention over
    this frame's earlier positions."""

    def attend(self, gb: GraphBuilder, h: str, past: tuple[str, str] | None, seqlens: str, total: int,
               rotary: tuple[str, str]) -> tuple[str, tuple[str, str]]:
        """Normed input h [B, 1, hidden] at position ``total - 1`` → (attention output [B, 1, H*D] for
        :meth:`post_attention`, the (key, value) cache [B, KV, total, D] for the next position); ``rotary``:
        the local stack's (cos, sin) tables of the frame's positions."""
        s = self.spec
        qkv = self.rotated_qkv(gb, h, gb.const([total - 1], np.int64), *rotary)   # one position for every row
        with gb.scope(f"{self.name}.self_attn"):
            present = (gb.fresh("present_key"), gb.fresh("present_value"))
            inputs = [qkv, "", ""] + (list(past) if past else ["", ""])
            att = gb.op("GroupQueryAttention", inputs + [seqlens, gb.const(total, np.int32)],
                        outs=[gb.fresh("attn"), *present], domain="com.microsoft", num_heads=s.heads,
                        kv_num_heads=s.kv_heads, scale=1.0 / math.sqrt(s.head_dim))[0]
            return att, present


def build_depth(ckpt: Checkpoint, cfg: TTSConfig, path: Path, weight_dtype, matmul_bits: int = 8,
                compute_dtype=np.float32, block_size: int | None = None) -> GraphBuilder:
    """One whole frame: hidden [B, hidden] → codes [B, 16], raw head logits [B, 16, V] and ``finite`` [B]
    (whether a row's logits are all finite).

    Position 0 is the backbone hidden state, position p >= 1 the local embedding ``p-1`` of code
    ``p-1``; the 16 positions are unrolled and each attends to the K/V of the earlier ones (a cache of
    p rows at position p: every shape is a constant of the graph).

    The transformer computes in ``compute_dtype``; the interface stays float32 (``hidden`` in, ``logits``
    out) and the head logits are cast to float32 before the sampler, which is built in float32 so
    penalties, temperature, top-k/top-p and the draw are the same whatever the transformer computes in.
    """
    s, V, N = cfg.local, cfg.audio_vocab, cfg.rvq
    gb = GraphBuilder("depth", path, weight_dtype, matmul_bits=matmul_bits, compute_dtype=compute_dtype,
                      block_size=block_size)
    hidden = gb.input("hidden", FLOAT, ["batch", s.hidden])
    x = gb.to_compute(gb.unsqueeze(hidden, [1]), np.float32)                             # [B, 1, H]
    history = gb.input("history", INT64, ["batch", "window", N])
    penalty, temperature, top_k, top_p = _sampling_inputs(gb)
    greedy = gb.input("greedy", BOOL, ["batch"])
    uniform = gb.input("uniform", FLOAT, ["batch", N])
    with gb.computing(np.float32), gb.scope("sampling.greedy"):
        # greedy rows (and temperature <= 0) as settings of the one draw: top-k 1 keeps the largest penalized
        # logit's ties, temperature and top-p 1 leave them as they are, u = 0 takes the first, the lowest id
        greedy = gb.op("Or", [greedy, gb.op("LessOrEqual", [temperature, gb.const(0.0)])])
        top_k = gb.op("Where", [greedy, gb.const(1, np.int64), top_k])
        temperature, top_p = (gb.op("Where", [greedy, gb.const(1.0), v]) for v in (temperature, top_p))
        uniform = gb.op("Where", [gb.unsqueeze(greedy, [1]), gb.const(0.0), uniform])
    with gb.computing(np.float32):
        rows = sampler_rows(gb, penalty, temperature, top_k, top_p, V, books=1)
        # per-codebook slices, made once: the window's id penalties [B, 1, V] and the uniforms [B, 1, 1]
        pens = gb.op("Split", [history_marks(gb, history, V, rows.penalty)], n_out=N, axis=1, num_outputs=N)
        draws = gb.op("Split", [gb.unsqueeze(uniform, [2])], n_out=N, axis=1, num_outputs=N)
    with gb.scope("rotary"):
        # GroupQueryAttention's lengths: position p is the last of p + 1 valid rows
        no_rows = gb.op("ConstantOfShape", [gb.op("Shape", [hidden], start=0, end=1)],
                        value=helper.make_tensor("zero", INT32, [1], [0]))              # [B] int32
        # all 16 at once: [N, B] = p + 0, flattened and split into N pieces of B
        seqlens = gb.op("Split", [gb.reshape(gb.op("Add", [gb.const(np.arange(N)[:, None], np.int32), no_rows]), [-1])],
                        n_out=N, axis=0, num_outputs=N)
        # RotaryEmbedding's tables for the frame's N positions (angles in float32, as upstream)
        rotary_cos, rotary_sin = (gb.tensor(f"local_rotary.{n}_cache", t[:N])
                                  for n, t in zip(("cos", "sin"), s.rope_cache(gb.compute_dtype)))
        rotary = (rotary_cos, rotary_sin)

    layers = [DepthLayer(gb, ckpt, s, i) for i in range(s.layers)]
    final_norm = gb.weight(f"{LOCAL}.norm.weight", ckpt.get(f"{LOCAL}.norm.weight"))
    heads = [gb.matmul_weight(ckpt.get(f"local_transformer.local_lm_heads.{p}.weight"),
                              f"local_transformer.local_lm_heads.{p}") for p in range(N)]
    caches: list[tuple[str, str] | None] = [None] * len(layers)
    codes, all_logits = [], []
    for p in range(N):
        with gb.scope(f"codebook.{p}"):
            delta = None
            for li, layer in enumerate(layers):
                h, x = layer.input_norm(gb, x, delta)
                att, caches[li] = layer.attend(gb, h, caches[li], seqlens[p], p + 1, rotary)
                h, x = layer.post_attention(gb, x, att)
                delta = layer.mlp(gb, h)
            assert delta is not None, "a depth transformer has at least one layer"
            with gb.scope(f"{LOCAL}.norm"):
                h = gb.skip_rms_norm(x, delta, final_norm, s.rms_eps)[0]
            with gb.scope(f"local_transformer.local_lm_heads.{p}"), gb.computing(np.float32):
                logits = gb.to_compute(gb.matmul(h, heads[p]), compute_dtype)              # [B, 1, V] float32
            all_logits.append(logits)
            with gb.computing(np.float32):
                code = draw(gb, sorted_filter(gb, logits, pens[p], rows, V), draws[p], V)         # [B, 1]
            codes.append(code)
            if p + 1 < N:
                x = gb.embedding(code, ckpt.get(f"{LOCAL}.embed_tokens.{p}.weight", dtype=None),
                                 f"{LOCAL}.embed_tokens.{p}")                                 # [B, 1, H]
    gb.output(gb.concat(codes, 1), "codes", INT64, ["batch", N])
    logits = gb.output(gb.concat(all_logits, 1), "logits", FLOAT, ["batch", N, V])
    with gb.scope("finite"), gb.computing(np.float32):
        # per row: whether every logit is finite (x - x is 0 exactly for finite x, NaN for NaN/Inf), so the
        # host reads back [B] flags, not the [B, 16, V] logits, to refuse a damaged bundle's frames
        zeros = gb.op("ReduceSum", [gb.op("Sub", [logits, logits]), gb.const([1, 2], np.int64)], keepdims=0)
        gb.output(gb.op("Equal", [zeros, gb.const(0.0)]), "finite", BOOL, ["batch"])
    return gb
