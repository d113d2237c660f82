"""Host-owned KV memory: the backbone's slot pool and the codec's sliding-window rings.

The backbone's slots are tensors on the sessions' device (``engine/device.py``), bound by pointer; the
codec's rings are host numpy arrays bound zero-copy (OrtValues over the numpy memory, cached per binding
shape). Streams live in slots; a call binds a contiguous prefix of slots (or one slot) so no per-step copy
ever grows with the context. When a stream leaves, the last slot's stream is
moved into the hole (one copy of its filled rows) so the active slots stay a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .device import DeviceTensor, SlotRows


# ---------------------------------------------------------------------------------------------- backbone
class BackboneKVPool:
    """KV of ``slots`` streams, on the sessions' device: per layer K and V ``[slots, kv_heads, rows + 1,
    head_dim]``.

    ``lengths[s]`` rows of slot ``s`` are valid. The graph (GroupQueryAttention) writes a call's new rows
    at ``lengths[s]..`` of the bound memory itself and reads only the valid rows, so the host only moves
    ``lengths``. The extra row is scratch: a stream that rides along in a batched step without being
    fed (it waits for text) has its dummy row written there or beyond its valid rows, never over them.
    Host memory is allocated lazily by the OS, so untouched slots cost no resident memory.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, rows: int,
                 device: str = "cpu", providers: list[str] | None = None, dtype: np.dtype = np.dtype(np.float32)):
        self.layers, self.slots, self.rows = layers, slots, rows
        self.capacity = rows + 1          # rows per slot in memory, the backbone's total_sequence_length
        self.dtype = np.dtype(dtype)      # the bundle's compute dtype: cached prefixes are kept in it too
        self.tensors = [DeviceTensor((slots, kv_heads, rows + 1, head_dim), device, self.dtype)
                        for _ in range(2 * layers)]
        self._rows = SlotRows(2 * layers, kv_heads, head_dim, providers or ["CPUExecutionProvider"], self.dtype)
        self.lengths = np.zeros(slots, np.int64)

    @staticmethod
    def bytes_per_slot(layers: int, kv_heads: int, head_dim: int, rows: int,
                       dtype: np.dtype = np.dtype(np.float32)) -> int:
        return layers * 2 * kv_heads * (rows + 1) * head_dim * np.dtype(dtype).itemsize

    @property
    def nbytes_per_slot(self) -> int:
        return sum(t.row_bytes for t in self.tensors)

    def bind(self, binding: ort.IOBinding, lo: int, hi: int) -> None:
        """Bind slots ``lo..hi-1`` as each layer's past and present (the same memory: in place)."""
        for layer in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                t = self.tensors[2 * layer + j]
                t.bind_input(binding, f"past_{kind}.{layer}", lo, hi - lo)
                t.bind_output(binding, f"present_{kind}.{layer}", lo, hi - lo)

    def move(self, src: int, dst: int) -> None:
        """Move the stream of slot ``src`` into slot ``dst`` (its filled rows only, on the device)."""
        self._rows.copy(self.tensors, src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def copy_rows(self, src: np.ndarray, slot: int) -> None:
        """Start slot ``slot`` with cached rows ``src`` [layers, 2, kv_heads, n, head_dim] (a prefix)."""
        self._rows.write(self.tensors, slot, src.reshape(-1, *src.shape[2:]))
        self.lengths[slot] = src.shape[3]

    def rows_of(self, slot: int, n: int | None = None) -> np.ndarray:
        """A host copy of the first ``n`` (default: all valid) rows of a slot, [layers, 2, kv_heads, n, head_dim]."""
        n = int(self.lengths[slot]) if n is None else n
        rows = self._rows.read(self.tensors, slot, n)
        return rows.reshape(self.layers, 2, *rows.shape[1:])


# ---------------------------------------------------------------------------------------------- codec
@dataclass(frozen=True)
class RingStage:
    layers: int
    heads: int
    head_dim: int
    rows: int              # context - 1
    tokens_per_frame: int

    @classmethod
    def from_spec(cls, spec) -> "RingStage":
        return cls(spec.layers, spec.heads, spec.head_dim, spec.context - 1, spec.tokens_per_frame)


class RingState:
    """KV rings and frame positions of ``slots`` independent codec streams (one codec side).

    Per stage a ring ``[layers, 2, slots, heads, context-1, head_dim]``: slot ``j`` of a ring holds the
    stream's token at position ``p ≡ j (mod context-1)`` among its last ``context-1`` tokens. The graph
    derives slot positions from the stream's frame position alone, so one stream's state is these rows
    plus one int, and streams at any positions share a call.
    """

    def __init__(self, side: str, stages: list[RingStage], slots: int):
        self.side, self.stages, self.slots = side, stages, slots
        self.rings = [np.zeros((s.layers, 2, slots, s.heads, s.rows, s.head_dim), np.float32) for s in stages]
        self.frame_pos = np.zeros(slots, np.int64)
        self._bound: dict[int, dict[str, ort.OrtValue]] = {}

    @staticmethod
    def bytes_per_stream(stages: list[RingStage]) -> int:
        return sum(s.layers * 2 * s.heads * s.rows * s.head_dim * 4 for s in stages)

    @property
    def nbytes_per_stream(self) -> int:
        return self.bytes_per_stream(self.stages)

    def bind(self, binding: ort.IOBinding, n: int) -> None:
        """Bind the rings and frame positions of streams ``0..n-1``."""
        if n not in self._bound:
            values = {"frame_pos": ort.OrtValue.ortvalue_from_numpy(self.frame_pos[:n])}
            for si, (stage, ring) in enumerate(zip(self.stages, self.rings)):
                for layer in range(stage.layers):
                    for kv, kind in ((0, "key"), (1, "value")):
                        values[f"{self.side}.past_{kind}.{si}.{layer}"] = \
                            ort.OrtValue.ortvalue_from_numpy(ring[layer, kv, :n])
            self._bound[n] = values
        for name, value in self._bound[n].items():
            binding.bind_ortvalue_input(name, value)

    def output_names(self) -> list[str]:
        return [f"{self.side}.present.{si}" for si in range(len(self.stages))]

    def advance(self, presents: list[np.ndarray], frames: np.ndarray) -> None:
        """Write each stream's first ``frames[b]`` frames of new rows (``present[l, kv, b, h, t, d]``) into
        its ring slots and move its position on; streams with 0 frames (riders) are untouched."""
        for stage, ring, present in zip(self.stages, self.rings, presents):
            C = stage.rows
            for b in np.flatnonzero(frames):
                T = stage.tokens_per_frame * int(frames[b])
                m = min(T, C)
                start = int(self.frame_pos[b]) * stage.tokens_per_frame + T - m
                slots = (start + np.arange(m)) % C
                ring[:, :, b][:, :, :, slots] = present[:, :, b, :, T - m:T]
        self.frame_pos[: len(frames)] += frames

    def reset(self, index: int | None = None) -> None:
        """Start stream ``index`` (all when None) afresh at frame 0. Ring rows need no clearing: the graph
        masks every slot a position-0 stream has not written."""
        if index is None:
            self.frame_pos[:] = 0
        else:
            self.frame_pos[index] = 0

    def move(self, src: int, dst: int) -> None:
        for ring in self.rings:
            ring[:, :, dst] = ring[:, :, src]
        self.frame_pos[dst] = self.frame_pos[src]
        self.frame_pos[src] = 0
