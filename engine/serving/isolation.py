"""Failure isolation: a graph call that fails is retried stream by stream, so a stream whose state breaks a
graph fails alone, and each output is applied exactly once."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from engine.serving.slots import SlotEntry
from engine.serving.tick import TickResult

log = logging.getLogger("mossrt.runner")

Item = TypeVar("Item")
Output = TypeVar("Output")
Done = TypeVar("Done")


def run_isolated(run: Callable[[list[Item]], list[Output]], commit: Callable[[Item, Output], Done | None],
                 items: list[Item], fail: Callable[[Item, Exception], None]) -> list[Done]:
    """``run(items)``, the batched graph call, returns one output per item; if it raises, each item is run
    alone, failing (``fail``) only those that raise. Then ``commit(item, output)`` applies each output exactly
    once (a failing commit fails its item alone): a call that succeeded is never run again, so no row is
    computed twice and no request is read after it was consumed. Returns the commits' results (not None)."""
    try:
        outputs = list(zip(items, run(items)))
    except Exception as batch_error:  # noqa: BLE001
        if len(items) == 1:
            fail(items[0], batch_error)
            return []
        log.warning("batched call failed (%s); retrying %d streams one by one", batch_error, len(items))
        outputs = []
        for item in items:
            try:
                outputs += zip([item], run([item]))
            except Exception as exc:  # noqa: BLE001
                fail(item, exc)
    out = []
    for item, output in outputs:
        try:
            done = commit(item, output)
        except Exception as exc:  # noqa: BLE001 - one stream's results, never the others'
            fail(item, exc)
            continue
        if done is not None:
            out.append(done)
    return out


def fail_entry(e: SlotEntry, exc: Exception, result: TickResult) -> None:
    """The runner could not compute ``e``'s stream: its request is dropped, its turn ends with ERROR, and the
    tick reports it."""
    log.error("stream in slot %d failed: %s", e.slot, exc)
    e.request = None
    e.stream.fail()
    result.failed.append((e.stream, exc))
