"""Where the CPU went during a level, when the generator shares a Linux host with the server (or with anything
else): busy cores of the whole machine, of this process, and of the server (``--server-pid``). The rest is
other tenants, which on a shared box explains many a noisy number. Empty off Linux."""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy() -> float | None:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [int(v) for v in parts[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)          # idle + iowait
    steal = vals[7] if len(vals) > 7 else 0
    return (sum(vals[:8]) - idle - steal) / _TICK


def _process_cpu(pid: int | str) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK        # utime + stime, all threads


class CpuMeter:
    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid
        self.t0 = time.perf_counter()
        self.machine0 = _machine_busy()
        self.client0 = _process_cpu("self")
        self.server0 = _process_cpu(server_pid) if server_pid else None

    def finish(self) -> dict:
        wall = time.perf_counter() - self.t0
        if self.machine0 is None or wall < 1.0:          # /proc/stat counts in ticks: too coarse below ~1 s
            return {}
        machine_now, client_now = _machine_busy(), _process_cpu("self")
        if machine_now is None or client_now is None or self.client0 is None:   # a /proc read failed
            return {}
        machine = (machine_now - self.machine0) / wall
        client = (client_now - self.client0) / wall
        out = {"cpus": os.cpu_count(), "busy_cores": round(machine, 2), "client_cores": round(client, 2)}
        if self.server0 is not None and self.server_pid is not None:      # server0 is read only with a pid
            server_now = _process_cpu(self.server_pid)
            if server_now is not None:
                server = (server_now - self.server0) / wall
                out["server_cores"] = round(server, 2)
                out["other_cores"] = round(max(0.0, machine - client - server), 2)
        else:
            out["other_and_server_cores"] = round(max(0.0, machine - client), 2)
        return out
