"""What a runner's tick reports (:class:`TickResult`) and what its calls cost over time (:class:`RunnerTiming`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.runtime.timing import CallTiming
from engine.serving.stream import Frame, StreamState, TurnStats

TICK_SAMPLES = 8192                    # working ticks kept in RunnerTiming.recent_ticks


@dataclass
class RunnerTiming:
    """The runner's call timings and counts since it was made (metrics, benchmarks, tests)."""

    prefill: CallTiming = field(default_factory=CallTiming)
    step: CallTiming = field(default_factory=CallTiming)
    depth: CallTiming = field(default_factory=CallTiming)
    codec: CallTiming = field(default_factory=CallTiming)
    ticks: int = 0
    tick_s: float = 0.0
    prefix_rows_copied: int = 0
    idle_rows_stepped: int = 0         # step rows of streams between turns riding in the bucket (0 when slots
                                       # are kept in order: docs/architecture.md, "Batch buckets at fixed addresses")
    slot_trades: int = 0               # a generating stream moved below an idle one (rows and codec rings copied)
    # the last working ticks, each (wall seconds, seconds inside graph runs, streams with a request at its
    # start): bounded, so a long-running service keeps a window and the percentiles stay cheap
    recent_ticks: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=TICK_SAMPLES))

    def run_s(self) -> float:
        """Seconds spent inside onnxruntime runs by every call kind so far."""
        return self.prefill.run_s + self.step.run_s + self.depth.run_s + self.codec.run_s


@dataclass
class TickResult:
    """One tick's outcome: frames handed back (in order, with their audio), turns ended, streams failed."""

    frames: list[tuple[StreamState, Frame]] = field(default_factory=list)
    turn_ends: list[tuple[StreamState, int, TurnStats]] = field(default_factory=list)
    failed: list[tuple[StreamState, Exception]] = field(default_factory=list)
    worked: bool = False               # any graph ran
