"""What a bundle's manifest says of its TTS model, without a graph session: the config, the tokenizer, the
prompt layout and builder, the sampling defaults, the codec's description, and the checks of caller input
they decide.

The request side of the service (an API process) needs exactly this to check and tokenize a request; the
engine core's :class:`engine.model.tts.TTSModel` adds the graph sessions on top of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from engine.audio.codec import Codec
from engine.errors import BundleError, InputError
from engine.kv.pool import BackboneKVPool
from engine.model.prompt import GridLayout, PromptBuilder
from engine.model.sampling import SamplingParams
from engine.model.tokenizer import TextTokenizer
from engine.runtime.bundle import Bundle
from engine.runtime.device import KV_DTYPES


def check_compute_dtype(compute_dtype: str, device: str) -> None:
    """bf16 bundles run on CUDA only: onnxruntime's CPU provider has no bfloat16 kernels for most of the
    backbone's ops (GroupQueryAttention, MatMul, the fused norms), so a bf16 bundle is refused on CPU
    rather than left to fail at its first call."""
    if compute_dtype == "bf16" and device != "cuda":
        raise BundleError("this bundle computes in bf16, which runs on the CUDA provider only: use --device "
                          "cuda, or export with --compute-dtype fp16 (or fp32) for CPU")


class ModelSpec:
    """A bundle's TTS model as its manifest describes it (no graph session is opened: the codec's sessions
    open at its first call, so only a process that encodes or decodes pays for them)."""

    def __init__(self, bundle: Bundle, codec: Codec | None = None) -> None:
        self.bundle = bundle
        tts = bundle.section("tts")
        self.config = tts.config
        self.compute_dtype = tts.compute_dtype
        check_compute_dtype(tts.compute_dtype, bundle.device)
        self.kv_dtype = KV_DTYPES[tts.compute_dtype]     # backbone KV slots and cached prefixes
        self.tokenizer = TextTokenizer.from_bundle(bundle)
        self.codec = codec or Codec(bundle)
        demo = bundle.info.demo
        # the demo bundle's end rule for its random model (engine.serving.stream), None for every real bundle
        self.demo_end_frames_per_text_id = demo.end_frames_per_text_id if demo is not None else None
        gen = bundle.section("generation")
        special = bundle.section("tokenizer").special_ids
        self.layout = GridLayout(
            codebooks=self.config.rvq, codebook_size=self.codec.codebook_size, audio_pad=self.config.audio_pad,
            audio_bos=self.config.audio_bos, audio_eos=self.config.audio_eos, text_pad_id=special.text_pad,
            audio_pad_text_id=special.audio_pad, text_lead=gen.prefill_text_tokens)
        self.prompt = PromptBuilder(self.tokenizer, self.layout)
        self.history_pad = self.config.history_pad
        self.vocab = self.config.vocab
        self.sampling_defaults = gen.sampling_defaults.model_dump()

    def default_sampling(self, **overrides: float | None) -> SamplingParams:
        """The bundle's sampling defaults with ``overrides`` (None: keep the default), validated."""
        return SamplingParams.from_defaults(self.sampling_defaults, **overrides)

    def kv_bytes_per_slot(self, rows: int) -> int:
        """Bytes of one slot of ``rows`` context rows (a KV pool's), known before allocating it."""
        c = self.config
        return BackboneKVPool.bytes_per_slot(c.layers, c.kv_heads, c.head_dim, rows, self.kv_dtype)

    def check_text_ids(self, ids: Iterable[int]) -> npt.NDArray[np.int64]:
        """Token ids as a flat int64 array, each a valid row of the text embedding."""
        try:
            arr = np.asarray(list(ids))
        except TypeError:
            raise InputError("token ids must be a list of integers") from None
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise InputError("token ids must be a flat list of integers")
        if arr.min() < 0 or arr.max() >= self.vocab:
            raise InputError(f"token ids must lie in 0..{self.vocab - 1}")
        return arr.astype(np.int64)
