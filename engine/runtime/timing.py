"""Wall time of graph calls, split into time inside onnxruntime and host time around it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CallTiming:
    calls: int = 0
    total_s: float = 0.0
    run_s: float = 0.0

    def add(self, total: float, run: float) -> None:
        self.calls += 1
        self.total_s += total
        self.run_s += run

    @property
    def host_share(self) -> float:
        return (self.total_s - self.run_s) / self.total_s if self.total_s else 0.0

    def snapshot(self) -> "CallTiming":
        return CallTiming(self.calls, self.total_s, self.run_s)

    def since(self, earlier: "CallTiming") -> "CallTiming":
        return CallTiming(self.calls - earlier.calls, self.total_s - earlier.total_s, self.run_s - earlier.run_s)
