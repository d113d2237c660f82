"""Sampling settings: validation, defaults from the bundle manifest, and the seeded random source."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.errors import InputError

MAX_REPETITION_WINDOW = 4096  # longer than any turn; bounds the per-frame history the host builds
MAX_SEED = 1 << 63
MAX_TOP_K = 1 << 20           # above the audio vocabulary (= keep all); bounded so it always fits int64


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, applied per codebook in upstream order:
    repetition penalty → (greedy argmax) | temperature → top-k → top-p → draw.

    ``temperature == 0`` means greedy, as upstream. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. The penalty applies in greedy mode too, but never to a turn's first frame.
    """

    temperature: float = 0.8
    top_p: float = 0.6
    top_k: int = 30
    repetition_penalty: float = 1.1
    repetition_window: int = 50
    greedy: bool = False

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, object], **overrides: float | None) -> "SamplingParams":
        """The bundle's defaults (manifest ``generation.sampling_defaults``) with ``overrides`` (None = keep)."""
        # the values are checked by validated(), whatever their types
        fields: dict[str, Any] = {k: v for k, v in defaults.items() if k in cls.__dataclass_fields__}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields).validated()

    def validated(self) -> "SamplingParams":
        """``self``, or an InputError naming the first setting out of its range."""
        def num(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(value):
                raise InputError(f"{name} must be a finite number, got {value!r}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            num(name, getattr(self, name))
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) \
                or not 0 <= self.top_k <= MAX_TOP_K:
            raise InputError(f"top_k must be an integer in 0..{MAX_TOP_K} (0 = off), got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.repetition_window, (int, np.integer)) or isinstance(self.repetition_window, bool) \
                or not 1 <= self.repetition_window <= MAX_REPETITION_WINDOW:
            raise InputError(f"repetition_window must be an integer in 1..{MAX_REPETITION_WINDOW}, "
                             f"got {self.repetition_window!r}")
        if not isinstance(self.greedy, (bool, np.bool_)):
            raise InputError(f"greedy must be true or false, got {self.greedy!r}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


class FrameRandom:
    """The uniforms a frame's draws consume, from one seeded generator per stream (PCG64)."""

    def __init__(self, seed: int | None, codebooks: int) -> None:
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                                 or not 0 <= seed < MAX_SEED):
            raise InputError(f"seed must be an integer in 0..{MAX_SEED - 1}, got {seed!r}")
        if seed is None:
            entropy = np.random.SeedSequence().entropy
            assert isinstance(entropy, int), "a SeedSequence made without entropy draws one int of it"
            seed = entropy % (1 << 63)
        self.seed = int(seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._codebooks = codebooks

    def next_frame(self) -> npt.NDArray[np.float32]:
        """The uniforms of the next frame's draws, one per codebook."""
        return self._rng.random(self._codebooks, dtype=np.float32)
