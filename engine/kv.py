"""Host-owned KV state of the codec's sliding-window attention stages.

Per stage a ring ``[layers, 2, batch, heads, context-1, head_dim]``: slot ``j`` holds the stream's
token at position ``p ≡ j (mod context-1)`` among its last ``context-1`` tokens. The graph derives slot
positions from the stream's frame position alone, so one stream's state is these arrays plus one int.
On the CPU provider the rings are bound to the graph zero-copy (OrtValues over the numpy memory), so a
call moves only the new rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort


@dataclass(frozen=True)
class RingStage:
    layers: int
    heads: int
    head_dim: int
    rows: int              # context - 1
    tokens_per_frame: int

    @classmethod
    def from_spec(cls, spec: dict) -> "RingStage":
        return cls(spec["layers"], spec["heads"], spec["head_dim"], spec["context"] - 1, spec["tokens_per_frame"])


class RingState:
    """KV rings and frame positions of ``batch`` independent streams for one codec side."""

    def __init__(self, side: str, stages: list[RingStage], batch: int, dtype=np.float32):
        self.side, self.stages, self.batch = side, stages, batch
        self.rings = [np.zeros((s.layers, 2, batch, s.heads, s.rows, s.head_dim), dtype) for s in stages]
        self.frame_pos = np.zeros(batch, np.int64)
        # OrtValues wrapping each layer's K and V views: created once, they alias the ring memory.
        self._bound = {}
        for si, (stage, ring) in enumerate(zip(stages, self.rings)):
            for layer in range(stage.layers):
                for kv, kind in ((0, "key"), (1, "value")):
                    self._bound[f"{side}.past_{kind}.{si}.{layer}"] = ort.OrtValue.ortvalue_from_numpy(ring[layer, kv])

    @property
    def nbytes_per_stream(self) -> int:
        return sum(r.nbytes for r in self.rings) // self.batch

    def bind(self, binding: ort.IOBinding) -> None:
        for name, value in self._bound.items():
            binding.bind_ortvalue_input(name, value)

    def output_names(self) -> list[str]:
        return [f"{self.side}.present.{si}" for si in range(len(self.stages))]

    def advance(self, presents: list[np.ndarray], n_frames: int) -> None:
        """Write each stream's newest rows (``present[l, kv, b, h, t, d]``) into its ring slots."""
        for stage, ring, present in zip(self.stages, self.rings, presents):
            T, C = stage.tokens_per_frame * n_frames, stage.rows
            m = min(T, C)
            for b in range(self.batch):
                start = int(self.frame_pos[b]) * stage.tokens_per_frame + T - m
                slots = (start + np.arange(m)) % C
                ring[:, :, b][:, :, :, slots] = present[:, :, b, :, T - m:]
        self.frame_pos += n_frames

    def reset(self, index: int | None = None) -> None:
        """Forget stream ``index`` (all streams when None): zeroed rings, position 0."""
        sel = slice(None) if index is None else index
        for ring in self.rings:
            ring[:, :, sel] = 0
        self.frame_pos[sel] = 0
