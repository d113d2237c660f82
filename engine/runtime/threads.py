"""Intra-op thread pools: each session its own, or one pool shared by every session of the process.

A frame runs several sessions one after another (backbone step, depth, codec, the small copy graphs). With
a pool per session, a pool's threads spin after its run and take the cores from the next session's, so
per-session pools do not spin. One pool shared by every session has no such neighbours, so its threads may
spin between runs and a session's parallel ops start without waking sleeping threads: a process that serves
one bundle (``mossrt serve``, ``mossrt bench``, ``mossrt synth``) asks for it before its first session.
Measured in docs/performance.md (Thread pools).
"""

from __future__ import annotations

import os
import threading

import onnxruntime as ort

POOL_ENV = "MOSSRT_THREAD_POOL"
POOLS = ("shared", "own")

_lock = threading.Lock()
_shared_threads: int | None = None       # the shared pool's size once this process has made it


def share_one_pool(threads: int) -> None:
    """From now on every session of this process runs on one intra-op pool of ``threads`` threads (0: one
    per physical core). Call it before the process's first session. onnxruntime's global pool cannot be
    resized or given up, so a second call with another size is a ValueError (the same size is a no-op)."""
    global _shared_threads
    with _lock:
        if _shared_threads is None:
            ort.set_global_thread_pool_sizes(threads, 1)     # inter-op: sessions run their nodes in sequence
            _shared_threads = threads
        elif _shared_threads != threads:
            raise ValueError(f"this process already runs its sessions on one pool of {_shared_threads} "
                             f"thread(s) (0: all cores); it cannot also have {threads}")


def pool_setting() -> str:
    """``MOSSRT_THREAD_POOL``: ``shared`` (the default) lets a process that serves one bundle share one pool;
    ``own`` keeps a pool per session (a process that hosts bundles of other thread counts, such as a test
    runner, or LocalAI's backend, whose LoadModel chooses the threads later). Anything else is a ValueError."""
    value = os.environ.get(POOL_ENV, "").strip() or "shared"
    if value not in POOLS:
        raise ValueError(f"{POOL_ENV} must be one of {', '.join(POOLS)}, got {value!r}")
    return value


def shared_pool_threads() -> int | None:
    """The shared pool's size (0: all cores), or None while sessions have pools of their own."""
    return _shared_threads


def give_pool(opts: ort.SessionOptions, threads: int) -> None:
    """Give a session's options their pool: the process's shared pool when it has one (``threads`` is then
    the pool's), else a pool of their own of ``threads`` threads (0: all cores) that never spins."""
    if _shared_threads is not None:
        opts.use_per_session_threads = False
        return
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")


def describe_pools() -> str:
    """One line for a log: which intra-op pools this process's sessions run on."""
    if _shared_threads is None:
        return "intra-op threads: a pool per session, not spinning between runs"
    size = f"{_shared_threads} threads" if _shared_threads else "a thread per physical core"
    return f"intra-op threads: one pool of {size} shared by every session"
