"""A request's sampling fields, as every transport receives them (TTSService.sampling turns them into the
engine's SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingFields:
    """The OpenAI-extension fields that tune generation (all optional)."""

    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    repetition_window: int | None = None
    greedy: bool | None = None
