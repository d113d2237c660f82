"""The settings an engine core is started with: everything the core process needs to open the bundle and
build its scheduler, as plain values (they cross to the core process as JSON)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from engine.limits import Limits

MAX_DEFAULT_SLOTS = 64


@dataclass(frozen=True)
class CoreConfig:
    """How to open the bundle (``device``, ``threads``, ``shared_pool``: as :class:`engine.runtime.bundle.Bundle`)
    and size the engine: ``slots`` (None: from ``kv_budget_bytes``, itself None for half the available memory,
    at most ``MAX_DEFAULT_SLOTS``), the prefix cache's and the parked contexts' bytes, the admission queue's
    timeout, and the capture and warm-up choices (None: the engine decides)."""

    bundle_dir: str
    device: str | None = "auto"
    threads: int | None = None
    shared_pool: bool = True
    limits: Limits = field(default_factory=Limits)
    slots: int | None = None
    kv_budget_bytes: int | None = None
    prefix_cache_bytes: int = 0
    parked_bytes: int = 0
    queue_timeout: float = 10.0
    cuda_graphs: bool | None = None
    warm_buckets: bool | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CoreConfig:
        raw: dict[str, Any] = json.loads(text)
        raw["limits"] = Limits(**raw["limits"])
        return cls(**raw)
