"""Just enough of the Prometheus text format to snapshot ``/metrics`` and diff two snapshots."""

from __future__ import annotations

import math
import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\d+)?$")


def parse(text: str, prefix: str = "mossrt_") -> dict[str, float]:
    """``{'name{labels}': value}`` for the samples whose name starts with ``prefix``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m or not m.group(1).startswith(prefix):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[m.group(1) + (m.group(2) or "")] = value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter and histogram sum/count increases (gauges and buckets left out), rounded, zeros dropped."""
    out = {}
    for key, value in after.items():
        name = key.split("{", 1)[0]
        if not name.endswith(("_total", "_sum", "_count")):
            continue
        d = value - before.get(key, 0.0)
        if abs(d) > 1e-12:
            out[key] = round(d, 6)
    return out


def histogram_means(d: dict[str, float]) -> dict[str, float]:
    """``sum / count`` for every histogram in a delta: the server-side mean over the level."""
    out = {}
    for key, s in d.items():
        name, _, labels = key.partition("{")
        if not name.endswith("_sum"):
            continue
        base = name[: -len("_sum")]
        count = d.get(base + "_count" + ("{" + labels if labels else ""))
        if count:
            out[base + ("{" + labels if labels else "") + ":mean"] = round(s / count, 6)
    return out
