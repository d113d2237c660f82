"""The bundle manifest's schema: a damaged or foreign ``manifest.json`` fails with the field it breaks.

Written by ``export/bundle.py``; read here, once, when a bundle is opened. Unknown keys are ignored
(newer exporters may add sections), known ones are validated strictly.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

FORMAT = "mossrt-bundle"
# 2: the backbone attends with GroupQueryAttention over a fixed KV slot it updates in place.
# 3: the host supplies the backbone's position_ids, seqlens_k and total_sequence_length (no past_len);
#    tts.compute_dtype (absent: fp32) is the type of its activations and KV.
# 4: the depth graph also outputs ``finite`` [B] (whether a row's logits are all finite).
FORMAT_VERSION = 4

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _plain_file_name(name: str) -> str:
    """Bundle files are plain names inside the bundle directory: no separators, no '..'."""
    if not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name inside the bundle")
    return name


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class FileEntry(_Model):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TensorInfo(_Model):
    name: str
    dtype: str
    shape: list[int | str | None]


class GraphEntry(_Model):
    file: str
    data: str | None = None
    opset: int = Field(ge=1)
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]

    @field_validator("file", "data")
    @classmethod
    def _inside_bundle(cls, name: str | None) -> str | None:
        return name if name is None else _plain_file_name(name)


class CodecStage(_Model):
    module: str
    layers: int = Field(ge=1)
    heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    d_model: int = Field(ge=1)
    input_dim: int = Field(ge=1)
    output_dim: int = Field(ge=1)
    context: int = Field(ge=2)
    tokens_per_frame: int = Field(ge=1)
    max_period: float


class CodecSpec(_Model):
    sample_rate: int = Field(ge=1000)
    samples_per_frame: int = Field(ge=1)
    num_quantizers: int = Field(ge=1)
    codebook_size: int = Field(ge=2)
    codebook_dim: int = Field(ge=1)
    rvq_dim: int = Field(ge=1)
    encoder: list[CodecStage]
    decoder: list[CodecStage] = Field(min_length=1)
    encoder_patches: list[tuple[int, int]]
    decoder_patches: list[tuple[int, int]]


class CodecSection(_Model):
    dtype: Literal["fp32", "fp16", "int8"]   # int8: the decoder's matmuls, the encoder fp32
    spec: CodecSpec


class StackConfig(_Model):
    prefix: str
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    rms_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_factor: float = Field(gt=0)
    max_positions: int | None = Field(default=None, ge=1)   # rows of the backbone's RoPE tables


class TTSConfig(_Model):
    hidden: int = Field(ge=1)
    layers: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab: int = Field(ge=1)
    rvq: int = Field(ge=1)
    audio_vocab: int = Field(ge=3)
    audio_pad: int = Field(ge=0)
    audio_bos: int = Field(ge=0)
    audio_eos: int = Field(ge=0)
    text_pad: int = Field(ge=0)
    audio_pad_text: int = Field(ge=0)
    history_pad: int = Field(ge=0)
    backbone: StackConfig
    local: StackConfig


class TTSSection(_Model):
    dtype: Literal["fp32", "fp16", "bf16", "int8", "int4"]
    compute_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    config: TTSConfig


class SpecialIds(_Model):
    im_start: int = Field(ge=0)
    im_end: int = Field(ge=0)
    endoftext: int = Field(ge=0)
    audio_pad: int = Field(ge=0)
    text_pad: int = Field(ge=0)


class TokenizerSection(_Model):
    file: str
    special_ids: SpecialIds

    @field_validator("file")
    @classmethod
    def _inside_bundle(cls, name: str) -> str:
        return _plain_file_name(name)


class SamplingDefaults(_Model):
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(ge=0)
    repetition_penalty: float = Field(gt=0)
    repetition_window: int = Field(ge=1)


class GenerationSection(_Model):
    sampling_defaults: SamplingDefaults
    prefill_text_tokens: int = Field(ge=1)


class DemoSection(_Model):
    seed: int
    note: str
    version: int = 1                       # of the demo's build (``mossrt`` rebuilds an older one)
    # the random model's end rule (it never samples EOS on its own): a turn whose text is all fed ends, as at
    # EOS, at this many frames per text id (None: no rule, the turn runs to its frame limit). Only a demo
    # bundle has this section, so no real bundle is ever ended by it.
    end_frames_per_text_id: float | None = Field(None, gt=0, le=100)

    def describe(self) -> str:
        """What the log says of it at load."""
        rule = ("" if self.end_frames_per_text_id is None else
                f"; its turns end by the demo's end rule, {self.end_frames_per_text_id:g} frames per text token "
                "once the text is in, not by the model")
        return self.note + rule


class Manifest(_Model):
    format: Literal["mossrt-bundle"]
    format_version: int
    files: dict[str, FileEntry]
    graphs: dict[str, GraphEntry] = {}
    codec: CodecSection | None = None
    tts: TTSSection | None = None
    tokenizer: TokenizerSection | None = None
    generation: GenerationSection | None = None
    demo: DemoSection | None = None

    @field_validator("files")
    @classmethod
    def _file_names(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for name in files:
            _plain_file_name(name)
        return files


def parse_manifest(raw: object) -> Manifest:
    """Validate a decoded ``manifest.json``; raises ValueError naming each broken field."""
    if isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"bundle format {raw.get('format_version')!r} is not supported (this mossrt reads "
                         f"version {FORMAT_VERSION}); re-export it with 'mossrt export'")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
                             for err in e.errors()[:8])
        raise ValueError(problems) from None
