"""The graph calls of a tick: prefill chunks, one batched backbone step and one batched depth call.

Prefills run as batch-1 backbone calls on the stream's own slot, in chunks of ``prefill_chunk_rows`` at
fixed offsets of the prefill (so results never depend on load), at most about ``prefill_rows_per_tick`` rows
per tick. A stream's system block is a chunk of its own, so its KV can come from the prefix cache instead (a
device-to-device copy). The step and depth calls run at the tick's batch bucket
(``engine/model/buckets.py``), and every hidden state stays on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.errors import GraphError
from engine.kv.prefix import PrefixCache, prefix_key
from engine.model.buckets import (
    CAPTURE_WARM_RUNS,
    BucketBuffers,
    BufferStats,
    PrefillBuffers,
    bucket_for,
    bucket_sizes,
    history_windows,
)
from engine.model.tts import NON_FINITE_LOGITS
from engine.serving.isolation import fail_entry, run_isolated
from engine.serving.slots import SlotEntry, SlotTable
from engine.serving.stream import Frame, StepRequest
from engine.serving.tick import RunnerTiming, TickResult

if TYPE_CHECKING:
    from engine.model.tts import TTSModel


def _request(e: SlotEntry) -> StepRequest:
    """The request ``e`` is being fed (every entry handed to a call has one)."""
    if e.request is None:
        raise RuntimeError(f"the stream in slot {e.slot} has no request to feed")
    return e.request


class TickCompute:
    """The backbone and depth calls of a runner's ticks over ``table``'s slots (``capture``: the buckets' calls
    run as captured CUDA graphs)."""

    def __init__(self, model: TTSModel, table: SlotTable, timing: RunnerTiming, prefill_chunk_rows: int,
                 prefill_rows_per_tick: int, prefix_cache: PrefixCache | None, capture: bool):
        self.model = model
        self.table = table
        self.kv = table.kv
        self.timing = timing
        self.prefill_chunk_rows = prefill_chunk_rows
        self.prefill_rows_per_tick = prefill_rows_per_tick
        self.prefix_cache = prefix_cache
        self.capture = capture
        self.rider_row = model.prompt.text_rows([model.layout.text_pad_id])[0]
        self.bucket_sizes = bucket_sizes(table.slots)
        self.buffer_stats = BufferStats()
        self.buckets: dict[int, BucketBuffers] = {}
        self.prefill_buffers = PrefillBuffers(model, table.slots, prefill_chunk_rows, self.buffer_stats)

    def warm_up(self) -> None:
        """Each bucket's backbone step and its depth call at every bound history window, on padding rows (see
        ``StepRunner.warm_up``)."""
        runs = CAPTURE_WARM_RUNS if self.capture and self.model.cuda_graphs else 1
        for bucket in self.bucket_sizes:
            bufs = self.bucket([bucket - 1])
            for _ in range(runs):
                bufs.stage_step({}, self.kv.lengths[:bucket], self.rider_row)
                self.model.run_step(bufs)
            for window in history_windows():
                for _ in range(runs):
                    self.model.run_bucket_depth(bufs, bufs.stage_depth([], self.model.history_pad, window))

    def bucket(self, slots: list[int]) -> BucketBuffers:
        """The buffers of the smallest bucket covering ``slots`` (made, allocated and bound, on first use)."""
        bucket = bucket_for(max(slots) + 1, self.bucket_sizes)
        if bucket not in self.buckets:
            self.buckets[bucket] = self.model.step_buffers(bucket, self.kv, self.buffer_stats, self.capture)
        return self.buckets[bucket]

    # ------------------------------------------------------------------ one tick
    def run(self, result: TickResult) -> list[tuple[SlotEntry, Frame]]:
        """The tick's calls for every entry with a request: prefills first come, first served, then one step
        for the streams feeding one row, then one depth call for every stream whose rows are complete.
        Returns the frames made."""
        entries = self.table.entries
        prefills = sorted((e for e in entries if e.request is not None and len(e.request.rows) > 1),
                          key=lambda e: e.serial)
        decodes = [e for e in entries if e.request is not None and len(e.request.rows) == 1]
        done: list[tuple[SlotEntry, bool]] = []    # (entry, whether its hidden row is a prefill's)
        if prefills:
            done += self._prefill(prefills, result)
        if not (decodes or done):
            return []
        # one bucket for the tick's step and depth: they share its hidden buffer
        bufs = self.bucket([e.slot for e in decodes] + [e.slot for e, _ in done])
        if decodes:
            done += self._step(decodes, bufs, result)
        for e, _ in done:
            if not _request(e).sample:          # context rows only (prime): no frame follows
                e.drop_request()
        done = [(e, h) for e, h in done if e.request is not None]
        return self._depth(done, bufs, result) if done else []

    # ------------------------------------------------------------------ prefill
    def _chunk_end(self, e: SlotEntry) -> int:
        """End of the next prefill chunk: chunks start at multiples of prefill_chunk_rows from the start
        of the request, except that each end of a cacheable prefix (``prefix_cuts``) ends a chunk too."""
        req = _request(e)
        n, c, start = len(req.rows), self.prefill_chunk_rows, e.fed
        cuts = [cut for cut in req.prefix_cuts if cut > start]
        if cuts:
            return min(cuts[0], (start // c + 1) * c)
        return min(n, start + c)

    def _from_prefix_cache(self, e: SlotEntry) -> None:
        """Start the slot with the longest cached prefix of the request (its system block's KV, or that
        and the assistant header's), when there is one."""
        req = _request(e)
        if self.prefix_cache is None or not req.prefix_cuts or e.fed or self.kv.lengths[e.slot]:
            return
        cached = self.prefix_cache.get(prefix_key(req.rows[: req.prefix_cuts[0]]))
        held = 0 if cached is None else self.kv.prefix_rows(cached)
        n = max((cut for cut in req.prefix_cuts if cut <= held), default=0)
        if cached is not None and n:
            self.kv.copy_rows(cached, e.slot, n)          # device to device
            e.stream.on_fed(req, req.rows[:n])
            e.fed = n
            self.timing.prefix_rows_copied += n

    def _to_prefix_cache(self, e: SlotEntry) -> None:
        """Keep the request's cacheable prefix once it is all computed, unless a cached one is as long."""
        req = _request(e)
        if self.prefix_cache is None or not req.prefix_cuts or e.fed != req.prefix_cuts[-1] \
                or self.kv.lengths[e.slot] != e.fed:
            return
        key = prefix_key(req.rows[: req.prefix_cuts[0]])
        held = self.prefix_cache.peek(key)
        if held is None or self.kv.prefix_rows(held) < e.fed:
            self.prefix_cache.put(key, self.kv.prefix_of(e.slot, e.fed))

    def _prefill(self, entries: list[SlotEntry], result: TickResult) -> list[tuple[SlotEntry, bool]]:
        """Chunks of the entries' prefills; the hidden states stay on the device (``prefill_buffers``), the
        last row of a request's last chunk kept for the depth call. Their finiteness is not checked here:
        a NaN hidden row (or NaN KV rows it attends to) gives NaN logits, which the depth call's ``finite``
        flag refuses at the turn's first frame."""
        done = []
        budget = self.prefill_rows_per_tick
        for e in entries:
            last = False                    # whether the request's last row was computed (and kept)
            if e.request is not None and not e.stream.aborted(e.request):
                self._from_prefix_cache(e)
            while budget > 0 and e.request is not None and e.fed < len(e.request.rows):
                req = e.request
                if e.stream.aborted(req):
                    e.drop_request()
                    break
                end = self._chunk_end(e)
                rows = req.rows[e.fed:end]
                try:
                    self.model.run_backbone_into(rows[None], self.kv, e.slot, e.slot + 1, self.prefill_buffers.hidden,
                                                 self.timing.prefill)
                    if end == len(req.rows):
                        self.prefill_buffers.keep_last(e.slot, len(rows))
                except Exception as exc:  # noqa: BLE001 - any failure of this stream's call fails this stream only
                    fail_entry(e, exc, result)
                    break
                result.worked = True
                self.kv.lengths[e.slot] += len(rows)
                e.stream.on_fed(req, rows)
                e.fed = end
                budget -= len(rows)
                self._to_prefix_cache(e)
                last = e.fed == len(req.rows)
            if e.request is not None and e.fed == len(e.request.rows):
                # False only for a prime whose rows all came from the prefix cache (no frame follows it): a
                # turn's rows always run past its cacheable prefix
                done.append((e, last))
        return done

    # ------------------------------------------------------------------ step and depth
    def _step(self, entries: list[SlotEntry], bufs: BucketBuffers,
              result: TickResult) -> list[tuple[SlotEntry, bool]]:
        def run(group: list[SlotEntry]) -> list[None]:
            bufs.stage_step({e.slot: _request(e).rows[0] for e in group}, self.kv.lengths[: bufs.bucket],
                            self.rider_row)
            self.timing.idle_rows_stepped += sum(1 for o in self.table.entries[: bufs.bucket] if o.riding_idle)
            self.model.run_step(bufs, self.timing.step)
            return [None] * len(group)                # the hidden states stay in bufs.hidden, on the device

        def commit(e: SlotEntry, _: None) -> tuple[SlotEntry, bool]:
            self.kv.lengths[e.slot] += 1
            req = _request(e)
            e.stream.on_fed(req, req.rows)
            return e, False

        result.worked = True
        return run_isolated(run, commit, entries, lambda e, exc: fail_entry(e, exc, result))

    def _depth(self, done: list[tuple[SlotEntry, bool]], bufs: BucketBuffers,
               result: TickResult) -> list[tuple[SlotEntry, Frame]]:
        """One frame for each stream of ``done``, from its hidden state: in ``bufs.hidden`` already (a step's
        row) or kept by its prefill (copied into its row of the buffer here, on the device)."""
        def run(group: list[tuple[SlotEntry, bool]]) -> list[tuple[np.ndarray, bool]]:
            self.prefill_buffers.to_bucket(bufs, [e.slot for e, from_prefill in group if from_prefill])
            requests = [(e, _request(e)) for e, _ in group]
            window = bufs.stage_depth([(e.slot, req.history, req.params, req.uniform, req.first_frame)
                                       for e, req in requests], self.model.history_pad)
            codes, finite = self.model.run_bucket_depth(bufs, window, self.timing.depth)
            return [(codes[e.slot], bool(finite[e.slot])) for e, _ in group]

        def commit(item: tuple[SlotEntry, bool], out: tuple[np.ndarray, bool]) -> tuple[SlotEntry, Frame] | None:
            e, (codes, finite) = item[0], out
            if not finite:
                raise GraphError(NON_FINITE_LOGITS)
            req, e.request = _request(e), None
            frame = e.stream.accept(req, codes)
            return None if frame is None else (e, frame)

        result.worked = True
        return run_isolated(run, commit, done, lambda item, exc: fail_entry(item[0], exc, result))
