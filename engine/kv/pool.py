"""Host-owned KV memory: the backbone's slot pool (the codec's rings are engine/audio/rings.py).

The backbone's slots and the codec's rings are tensors on the sessions' device
(``engine/runtime/device.py``), bound by pointer, and changed on the device by small in-place graphs.
Streams live in slots; a call binds a contiguous prefix of slots (or one slot) so no per-step copy ever
grows with the context. When a stream leaves, the last slot's stream is moved into the hole (one copy of
its filled rows) so the active slots stay a prefix.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from engine.runtime.device import ELEMENT, DeviceTensor, SlotRows, _graph, helper_options, slot_rows, stacked_rows

# where one (layer, K/V) tensor ``t``'s block of head ``h`` lies: (device type, address)
BlockAddress = Callable[[int, int], tuple[str, int]]


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
                 device: str = "cpu", providers: list[str] | None = None,
                 dtype: np.dtype = np.dtype(np.float32)) -> None:
        self.layers, self.slots, self.rows = layers, slots, rows
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, device
        self.capacity = rows + 1          # rows per slot in memory, the backbone's total_sequence_length
        self.dtype = np.dtype(dtype)      # the bundle's compute dtype: cached prefixes are kept in it too
        self.tensors = [DeviceTensor((slots, kv_heads, rows + 1, head_dim), device, self.dtype)
                        for _ in range(2 * layers)]
        self._providers = providers or ["CPUExecutionProvider"]
        self._rows = SlotRows(2 * layers, kv_heads, head_dim, self._providers, self.dtype)
        self._blocks: ort.InferenceSession | None = None     # the park/resume copy graph, made at first use
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
        """Move the stream of slot ``src`` into slot ``dst``: :meth:`copy_slot`, then the lengths."""
        self.copy_slot(src, dst)
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0

    def copy_slot(self, src: int, dst: int, n: int | None = None) -> None:
        """Copy the first ``n`` rows (default: the filled ones) of slot ``src`` over slot ``dst``, on the device,
        and nothing else: the lengths stay as they are, so a caller moving a stream commits them only once
        every copy of the move succeeded (a failure leaves ``src`` whole and the bookkeeping as it was: the
        retry is exact). One plain copy per (layer, K/V, head) block, as a park's: an indexed scatter moves the
        same rows several times slower (measured in docs/architecture.md, *Host-owned KV*)."""
        n = int(self.lengths[src]) if n is None else n
        if n:
            self._copy_blocks(n, lambda t, h: (self.device, self._block_ptr(t, src, h)),
                              lambda t, h: (self.device, self._block_ptr(t, dst, h)))

    def host_bytes(self, n: int) -> int:
        """Bytes of a host copy of ``n`` rows (:meth:`park_rows`), known before making it."""
        return 2 * self.layers * self.kv_heads * n * self.head_dim * self.dtype.itemsize

    # A prefix is a device tensor [layers * 2, kv_heads, n, head_dim] of the pool's dtype: index 2 * layer + j
    # holds what the layer's K (j = 0) or V (j = 1) slot holds in its first n rows.
    @staticmethod
    def prefix_rows(prefix: DeviceTensor) -> int:
        """Rows of a prefix."""
        return prefix.shape[2]

    def copy_rows(self, prefix: DeviceTensor, slot: int, n: int | None = None) -> None:
        """Start slot ``slot`` with the first ``n`` (default: all) rows of ``prefix``, on the device."""
        n = self.prefix_rows(prefix) if n is None else n
        self._rows.copy(stacked_rows(prefix), slot_rows(self.tensors, slot), n)
        self.lengths[slot] = n

    def prefix_of(self, slot: int, n: int) -> DeviceTensor:
        """A new prefix holding the first ``n`` rows of slot ``slot`` (a device-to-device copy)."""
        prefix = self._new_prefix(n)
        self._rows.read_into(slot_rows(self.tensors, slot), n, stacked_rows(prefix))
        return prefix

    def upload_prefix(self, rows: np.ndarray) -> DeviceTensor:
        """A new prefix from host rows [layers, 2, kv_heads, n, head_dim] (of the pool's dtype)."""
        prefix = self._new_prefix(rows.shape[3])
        self._rows.write(stacked_rows(prefix), rows.reshape(-1, *rows.shape[2:]))
        return prefix

    def download_prefix(self, prefix: DeviceTensor) -> np.ndarray:
        """A host copy of a prefix, [layers, 2, kv_heads, n, head_dim]."""
        rows = self._rows.read(stacked_rows(prefix), self.prefix_rows(prefix))
        return rows.reshape(self.layers, 2, *rows.shape[1:])

    def _new_prefix(self, n: int) -> DeviceTensor:
        return DeviceTensor((2 * self.layers, self.kv_heads, n, self.head_dim), self.device, self.dtype)

    def park_rows(self, slot: int, n: int) -> np.ndarray:
        """A compact host copy of the first ``n`` rows of a slot, [layers, 2, kv_heads, n, head_dim] (a parked
        stream's context): device to host, one contiguous block per layer, K/V and head."""
        host = np.empty((self.layers, 2, self.kv_heads, n, self.head_dim), self.dtype)
        if n:
            flat = host.reshape(-1, self.kv_heads, n, self.head_dim)       # a view: the same memory
            self._copy_blocks(n, lambda t, h: (self.device, self._block_ptr(t, slot, h)),
                              lambda t, h: ("cpu", flat[t, h].ctypes.data))
        return host

    def write_rows(self, slot: int, rows: np.ndarray, set_length: bool = True) -> None:
        """Start slot ``slot`` with host rows [layers, 2, kv_heads, n, head_dim] (a parked stream's, from
        :meth:`park_rows`): host to device; then its length (``set_length`` False: the caller commits it)."""
        n = rows.shape[3]
        if n:
            flat = np.ascontiguousarray(rows, self.dtype).reshape(-1, self.kv_heads, n, self.head_dim)
            self._copy_blocks(n, lambda t, h: ("cpu", flat[t, h].ctypes.data),
                              lambda t, h: (self.device, self._block_ptr(t, slot, h)))
        if set_length:
            self.lengths[slot] = n

    def _block_ptr(self, tensor: int, slot: int, head: int) -> int:
        """Address of row 0 of one (layer, K/V) tensor's block of ``slot`` and ``head``: its rows are
        contiguous."""
        t = self.tensors[tensor]
        block = (slot * self.kv_heads + head) * self.capacity
        return int(t.value.data_ptr()) + block * self.head_dim * self.dtype.itemsize

    def _copy_blocks(self, n: int, src: BlockAddress, dst: BlockAddress) -> None:
        """Copy rows 0..n-1 of every (layer, K/V, head) block from ``src(t, h)`` to ``dst(t, h)`` (each a
        (device, address) pair) in one call of an Identity graph bound to both sides by pointer: a plain copy
        (host to device, device to host, device to device, or a memcpy on CPU), no index tensors. The two sides
        never overlap (different slots, or a host buffer)."""
        if self._blocks is None:
            f = ELEMENT[self.dtype]
            count = 2 * self.layers * self.kv_heads

            def io(name: str) -> onnx.ValueInfoProto:
                return helper.make_tensor_value_info(name, f, ["n", self.head_dim])

            self._blocks = ort.InferenceSession(_graph(
                "kv_blocks", [helper.make_node("Identity", [f"x.{i}"], [f"y.{i}"]) for i in range(count)],
                [io(f"x.{i}") for i in range(count)], [io(f"y.{i}") for i in range(count)]),
                helper_options(), providers=self._providers)
        binding = self._blocks.io_binding()
        f, shape = ELEMENT[self.dtype], [n, self.head_dim]
        for t in range(len(self.tensors)):
            for h in range(self.kv_heads):
                i = t * self.kv_heads + h
                (src_dev, src_ptr), (dst_dev, dst_ptr) = src(t, h), dst(t, h)
                binding.bind_input(f"x.{i}", src_dev, 0, f, shape, src_ptr)
                binding.bind_output(f"y.{i}", dst_dev, 0, f, shape, dst_ptr)
        self._blocks.run_with_iobinding(binding)

    def rows_of(self, slot: int, n: int | None = None) -> np.ndarray:
        """A host copy of the first ``n`` (default: all valid) rows of a slot, [layers, 2, kv_heads, n,
        head_dim]."""
        n = int(self.lengths[slot]) if n is None else n
        if n == 0:
            return np.zeros((self.layers, 2, self.kv_heads, 0, self.head_dim), self.dtype)
        rows = self._rows.read(slot_rows(self.tensors, slot), n)
        return rows.reshape(self.layers, 2, *rows.shape[1:])
