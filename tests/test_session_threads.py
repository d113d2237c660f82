"""Intra-op thread pools: a frame runs several sessions in turn (backbone step, depth, codec), so either
each session has a pool that never spins, or one pool serves every session of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TEST_DEVICE

from engine.runtime.bundle import Bundle

ROOT = Path(__file__).resolve().parent.parent

# a process that serves one bundle: its sessions, the OS threads they added, and what onnxruntime says of them
POOL_PROBE = """
import json, os, sys
from engine.runtime.bundle import Bundle
from engine.errors import BundleError
def spin(o):
    try:
        return o.get_session_config_entry("session.intra_op.allow_spinning")
    except Exception:
        return "default"
before = len(os.listdir("/proc/self/task"))
try:
    b = Bundle(sys.argv[1], device=sys.argv[2], threads=2, shared_pool=True)
except BundleError as e:
    print(json.dumps({"error": str(e)})); raise SystemExit
opts = [b.session(n).get_session_options() for n in sorted(b.info.graphs)]
print(json.dumps({"sessions": len(opts), "threads_added": len(os.listdir("/proc/self/task")) - before,
                  "own_pools": sorted({o.use_per_session_threads for o in opts}),
                  "spinning": sorted({spin(o) for o in opts}), "bundle_threads": b.threads}))
"""


def probe(bundle_dir: Path, pool: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOSSRT_THREAD_POOL"}
    if pool is not None:
        env["MOSSRT_THREAD_POOL"] = pool
    out = subprocess.run([sys.executable, "-c", POOL_PROBE, str(bundle_dir), TEST_DEVICE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_session_of_a_bundle_spins_its_own_pool(full_bundle_dir):
    """A bundle opened as a library opens it (this test process: other bundles, other thread counts) gives
    each session a pool of its own that never spins: a pool spinning after its run slowed the next
    session's (docs/performance.md, Thread pools). Read back from the sessions onnxruntime made."""
    bundle = Bundle(full_bundle_dir, device=TEST_DEVICE, threads=2)
    names = sorted(bundle.info.graphs)
    assert {"backbone", "depth", "codec_decoder"} <= set(names), names
    for name in names:
        options = bundle.session(name).get_session_options()
        assert options.use_per_session_threads, name
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0", name
        assert options.intra_op_num_threads == 2, name


def test_a_process_serving_one_bundle_runs_every_session_on_one_pool(full_bundle_dir):
    """``shared_pool`` (what ``mossrt serve``, ``bench`` and ``synth`` ask for): all the bundle's sessions
    run on one pool, so two threads for five sessions add one worker thread, not one per session; with
    ``MOSSRT_THREAD_POOL=own`` each session gets its own pool again (one worker each), and a bad value is
    refused by name."""
    shared = probe(full_bundle_dir, None)
    assert shared["sessions"] >= 5 and shared["own_pools"] == [False], shared
    assert shared["threads_added"] == 1 and shared["bundle_threads"] == 2, shared
    own = probe(full_bundle_dir, "own")
    assert own["own_pools"] == [True] and own["spinning"] == ["0"], own
    assert own["threads_added"] == own["sessions"], own
    bad = probe(full_bundle_dir, "sometimes")
    assert bad == {"error": "MOSSRT_THREAD_POOL must be one of shared, own, got 'sometimes'"}, bad
