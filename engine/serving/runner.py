"""The device side of generation: one tick advances every stream that has work, in batched graph calls.

A :class:`StepRunner` owns the backbone KV slot pool and the codec decoder rings for up to ``slots``
streams (a stream holds one slot while attached). Each :meth:`StepRunner.tick`:

1. asks every attached stream what it wants fed (``StreamState.want``);
2. runs prefills as batch-1 backbone calls on the stream's own slot, in chunks of ``prefill_chunk_rows``
   at fixed offsets of the prefill (so results never depend on load), at most about
   ``prefill_rows_per_tick`` rows per tick: running streams wait at most that long for a newcomer. A
   stream's system block is a chunk of its own, so its KV can come from the prefix cache instead (a
   device-to-device copy). A chunk's hidden states stay on the device; only the last row of a request
   is kept (copied on the device) for the depth call;
3. runs one batched backbone step for every stream that feeds one row, at the tick's batch bucket
   (``engine/model/buckets.py``: the smallest of 1, 2, 4, … slots covering the highest slot with work, bound once
   at fixed addresses); slots of the bucket with nothing to feed ride along with a dummy row written past
   their valid rows, or into a free slot (no stream's cache changes);
4. runs one batched depth call, at the same bucket, for every stream whose rows are complete (per-row
   sampling settings, draws and first-frame flags), reading the step's hidden states where the step left
   them (on the device); only the codes and per-row finiteness flags come back;
5. decodes audio in one batched codec call: a turn's first frame at once, later frames in chunks that
   grow along ``codec_schedule`` (fewer, larger calls), but never later than the stream's playback
   needs them; frames are handed back, in order, once their audio exists.

A failing call is retried stream by stream, so a stream whose state breaks a graph fails alone
(``engine.serving.isolation``). The runner composes pieces by job: the slot table (``engine.serving.slots``:
who holds which slot, attach, detach, park, trades), the graph calls (``engine.serving.compute``: steps 2-4)
and codec pacing (``engine.serving.pacing``: step 5). Not thread-safe: one thread drives a runner (the
scheduler's loop, or a session's caller).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import InputError
from engine.kv.prefix import PrefixCache
from engine.model.buckets import BucketBuffers, BufferStats, PrefillBuffers
from engine.serving.compute import TickCompute
from engine.serving.pacing import CodecPacer
from engine.serving.slots import SlotEntry, SlotTable
from engine.serving.stream import StreamState
from engine.serving.tick import RunnerTiming, TickResult

if TYPE_CHECKING:
    from engine.model.tts import TTSModel

DEFAULT_PREFILL_CHUNK_ROWS = 64
DEFAULT_PREFILL_ROWS_PER_TICK = 64
SERVICE_CODEC_SCHEDULE = (1, 1, 2, 4, 6)   # frames per codec call along a turn (the last repeats)


class StepRunner:
    """``slots`` stream slots of ``model`` and their ticks: the slot table (:attr:`slot_table`), the graph
    calls (:attr:`compute`) and the codec pacing (:attr:`pacer`), composed in a tick's order."""

    def __init__(self, model: TTSModel, slots: int, max_context_rows: int,
                 prefill_chunk_rows: int = DEFAULT_PREFILL_CHUNK_ROWS,
                 prefill_rows_per_tick: int = DEFAULT_PREFILL_ROWS_PER_TICK,
                 codec_schedule: tuple[int, ...] = (1,), prefix_cache: PrefixCache | None = None,
                 capture: bool = False):
        for name, v in (("slots", slots), ("prefill_chunk_rows", prefill_chunk_rows),
                        ("prefill_rows_per_tick", prefill_rows_per_tick), ("max_context_rows", max_context_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be an integer >= 1, got {v!r}")
        self.model = model
        self.codec_schedule = tuple(model.codec.check_chunk_sizes(codec_schedule))
        self.slots = slots
        self.max_context_rows = max_context_rows
        self.prefix_cache = prefix_cache
        self.kv = model.kv_pool(slots, max_context_rows)
        self.decoder = model.codec.streaming_decoder(slots, model.layout.codebooks)
        self.timing = RunnerTiming(codec=self.decoder.timing)
        self.slot_table = SlotTable(self.kv, self.decoder, slots, max_context_rows)
        self.compute = TickCompute(model, self.slot_table, self.timing, prefill_chunk_rows, prefill_rows_per_tick,
                                   prefix_cache, capture)
        self.pacer = CodecPacer(model, self.slot_table, self.decoder, self.codec_schedule, self.compute.bucket_sizes)

    # ------------------------------------------------------------------ what the pieces hold
    @property
    def codec_call_sizes(self) -> tuple[int, ...]:
        """The only frame counts a codec call takes: the schedule's sizes and 1."""
        return self.pacer.call_sizes

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return self.compute.bucket_sizes

    @property
    def buffer_stats(self) -> BufferStats:
        return self.compute.buffer_stats

    @property
    def prefill_buffers(self) -> PrefillBuffers:
        return self.compute.prefill_buffers

    @property
    def buckets(self) -> dict[int, BucketBuffers]:
        """The batch buckets' buffers made so far, by bucket size."""
        return self.compute.buckets

    @property
    def entries(self) -> list[SlotEntry]:
        """The attached streams' entries, by slot."""
        return self.slot_table.entries

    @property
    def capture(self) -> bool:
        """Whether the buckets' calls run as captured CUDA graphs."""
        return self.compute.capture

    @property
    def warmed(self) -> bool:
        """Whether :meth:`warm_up` ran: codec calls take bucketed stream counts."""
        return self.pacer.warmed

    # ------------------------------------------------------------------ slots
    @property
    def attached(self) -> int:
        return self.slot_table.attached

    @property
    def free_slots(self) -> int:
        return self.slot_table.free_slots

    def bytes_per_stream(self) -> int:
        return self.kv.nbytes_per_slot + self.decoder.state_bytes_per_stream

    def attach(self, stream: StreamState, rows: np.ndarray | None = None) -> int:
        """Give ``stream`` a slot (``SlotTable.attach``); ``rows``: its parked context's KV rows."""
        return self.slot_table.attach(stream, rows)

    def detach(self, stream: StreamState) -> None:
        """Free the stream's slot, all or nothing (``SlotTable.detach``)."""
        self.slot_table.detach(stream)

    def park_row_count(self, stream: StreamState) -> int:
        """Rows a park of the stream copies (``SlotTable.park_row_count``)."""
        return self.slot_table.park_row_count(stream)

    def park_rows(self, stream: StreamState) -> np.ndarray:
        """A host copy of the rows the stream's context uses; changes nothing (``SlotTable.park_rows``)."""
        return self.slot_table.park_rows(stream)

    def take_lost(self) -> list[StreamState]:
        """Idle streams whose context a failed slot trade could not restore since the last call."""
        return self.slot_table.take_lost()

    def context_kv(self, stream: StreamState) -> np.ndarray:
        """A copy of the stream's KV rows [layers, 2, kv_heads, rows, head_dim] (tests, diagnostics)."""
        return self.slot_table.context_kv(stream)

    # ------------------------------------------------------------------ warm-up
    def warm_up(self) -> list[int]:
        """Make every call shape the loop will run before any stream attaches, so no live tick stalls on a
        first use (bindings, onnxruntime's first-run allocations, a CUDA graph's warm-up runs and capture):
        each bucket's backbone step, its depth call at every bound history window (64 to 4,096 frames: a
        request's ``repetition_window`` picks one, and a first use during serving would stall every stream's
        tick on a capture) and, from then on, the codec's calls at each bucket's stream count and each of
        ``codec_call_sizes``. Every row is padding, as the loop runs free slots: step rows write their dummy
        row at a free slot's length (its lengths stay), depth codes are dropped, codec rows ride with 0 frames
        (rings and positions untouched). With capture each call runs ``CAPTURE_WARM_RUNS`` times. Must run on
        the thread that will run the ticks (onnxruntime keeps captured graphs per thread). Returns the buckets
        warmed."""
        if self.slot_table.entries:
            raise InputError("warm up before any stream attaches")
        self.compute.warm_up()
        self.pacer.warm_up()
        return list(self.bucket_sizes)

    # ------------------------------------------------------------------ one tick
    def tick(self) -> TickResult:
        """Advance every attached stream that has work: ask for requests, trade slots so generating streams
        come first, run the graph calls, decode and hand back the due audio."""
        t0 = time.perf_counter()
        run0 = self.timing.run_s()
        result = TickResult()
        streams = self.slot_table.collect_requests()
        self.timing.slot_trades += self.slot_table.generating_first()
        for e, frame in self.compute.run(result):
            e.pending.append(frame)
        self.pacer.hand_back(result)
        if result.worked:
            spent = time.perf_counter() - t0
            self.timing.ticks += 1
            self.timing.tick_s += spent
            self.timing.recent_ticks.append((spent, self.timing.run_s() - run0, streams))
            self.pacer.note_tick(spent)
        return result

    def has_work(self) -> bool:
        """Whether a tick now would run a graph or hand back frames."""
        return self.seconds_until_work() == 0

    def seconds_until_work(self) -> float | None:
        """When a tick would next have something to do: 0 now (a request to feed, frames to decode or hand
        back), the seconds until some listener's audio runs low enough for pending frames to be decoded
        early, or None when nothing changes until a stream does (new text, a resumed consumer, a close)."""
        if any(e.request is not None for e in self.slot_table.entries):
            return 0.0
        return self.pacer.seconds_until_audio_due()

    def codec_call_frames(self, wanted: int) -> int:
        """Frames of the next codec call when ``wanted`` are due (``CodecPacer.call_frames``)."""
        return self.pacer.call_frames(wanted)
