"""The transfer plan: which parts go with which transfer to a host that receives files only as a copy of
the repository's working tree (at most ``transfer_mib`` per transfer, the repository itself included).

Each transfer carries the repository plus the parts named in it (ignored paths, so that they travel only
when named); its command copies them into ``dest`` on the host, which outlives the transfers if they
follow one another closely. The last transfer's command runs the check on the parts.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .pack import MANIFEST, MIB, check_parts, read_manifest

DEFAULT_TRANSFER_MIB = 64
DEFAULT_DEST = "/tmp/mossrt-parts"

# The device time a window costs, from the device tool's README (its Limits and Notes; it gives no transfer
# rate, so TRANSFER_S is an assumption until a window measures it). Every start, idle wait and close counts.
DEVICE_BUDGET_S = 900      # "15 minutes of device time" a session, all tries together
START_S = 120              # "a call that finds no warm machine spends a minute or more starting one"; a
                           # failed start costs "1 to 2 minutes": the 2 assumed
TRANSFER_S = 30            # one call's copy of <= 64 MiB there, the part's cp and sha256sum (assumed)
WAIT_S = 30                # between calls the machine waits warm, and counted: "warm after a call: 30 s"
                           # (a longer gap gives it back, /tmp and the parts with it)
CLOSE_S = 30               # after the last call: its warm wait, unless give_back ends it at once
DEFAULT_CHECK_S = 480      # scripts/gpu-check's budget on CUDA (its Plan), the join and install included


@dataclass
class Transfer:
    carry: list[str]                       # paths relative to the repository root
    part_bytes: int
    repo_bytes: int
    command: str
    names: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.part_bytes + self.repo_bytes


@dataclass
class Plan:
    transfers: list[Transfer]
    repo_bytes: int
    transfer_limit: int
    parts_dir: str
    problems: list[str]                    # why the plan cannot be sent as it is (empty: it can)
    check_s: float | None = DEFAULT_CHECK_S    # None: no device window (a CPU dry run)

    @property
    def device_s(self) -> float:
        """Device time the window needs: the start, each transfer, the waits between them, the check, the
        close."""
        n = len(self.transfers)
        return START_S + n * TRANSFER_S + max(n - 1, 0) * WAIT_S + (self.check_s or 0) + CLOSE_S

    def device_line(self) -> str:
        n = len(self.transfers)
        spare = DEVICE_BUDGET_S - self.device_s
        return (f"device time: start {START_S} s + {n} transfer(s) x {TRANSFER_S} s + {max(n - 1, 0)} wait(s) x "
                f"{WAIT_S} s + check <= {self.check_s:g} s + close {CLOSE_S} s = {self.device_s:g} s of the "
                f"{DEVICE_BUDGET_S} s budget ({'spare' if spare >= 0 else 'OVER'} {abs(spare):g} s)")


def travelling_bytes(repo: Path) -> int:
    """Bytes of the working tree that travels: tracked files plus untracked files git does not ignore."""
    def listed(*args: str) -> list[str]:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", *args], capture_output=True, check=True)
        return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]
    total = 0
    for rel in {*listed(), *listed("--others", "--exclude-standard")}:
        path = repo / rel
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def is_ignored(repo: Path, rel: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", rel]).returncode == 0


def make_plan(parts_dir: Path, repo: Path, transfer_mib: float = DEFAULT_TRANSFER_MIB, dest: str = DEFAULT_DEST,
              check_command: str | None = None, check_s: float | None = DEFAULT_CHECK_S) -> Plan:
    """Group the manifest's parts into transfers that fit, first to last, with each one's command; a plan
    whose device time (``check_s`` for the check) is over the session's budget says so in its problems."""
    manifest = read_manifest(parts_dir)
    repo, parts_dir = repo.resolve(), parts_dir.resolve()
    limit = int(transfer_mib * MIB)
    repo_bytes = travelling_bytes(repo)
    problems = []
    try:
        rel_dir = parts_dir.relative_to(repo).as_posix()
    except ValueError:
        rel_dir = None
        problems.append(f"the parts are outside the repository ({parts_dir}): a transfer carries only paths "
                        f"inside it; build them into an ignored folder of it (e.g. .wheelhouse)")
    if rel_dir is not None and not is_ignored(repo, f"{rel_dir}/{MANIFEST}"):
        problems.append(f"{rel_dir} is not ignored by git: its parts would travel with every transfer; "
                        "add it to .gitignore")
    room = limit - repo_bytes
    files = [(MANIFEST, (parts_dir / MANIFEST).stat().st_size)] + [(p["name"], p["bytes"]) for p in manifest["parts"]]
    transfers: list[list[tuple[str, int]]] = [[]]
    for name, size in files:
        if size > room:
            problems.append(f"{name} ({size / MIB:.2f} MiB) cannot travel: the repository takes "
                            f"{repo_bytes / MIB:.2f} of the {transfer_mib:g} MiB a transfer holds, leaving "
                            f"{max(room, 0) / MIB:.2f}; rebuild with --part-mib {max(int(room / MIB) - 1, 1)} or less")
        if transfers[-1] and sum(s for _, s in transfers[-1]) + size > room:
            transfers.append([])
        transfers[-1].append((name, size))
    q = shlex.quote
    check = check_command or f"python3 scripts/gpu-check --parts {q(dest)} --out \"$OUT\""
    hashes = {p["name"]: p["sha256"] for p in manifest["parts"]}
    out = []
    for i, group in enumerate(transfers):
        carry = [f"{rel_dir or parts_dir}/{name}" for name, _ in group]
        copy = f"mkdir -p {q(dest)} && cp -f {' '.join(q(c) for c in carry)} {q(dest)}/"
        # each part is checked as it lands, so a damaged transfer is sent again at once, not found at the end
        sums = "".join(f"{hashes[n]}  {n}\\n" for n, _ in group if n in hashes)
        verify = f" && (cd {q(dest)} && printf '{sums}' | sha256sum -c -)" if sums else ""
        last = i == len(transfers) - 1
        command = f"{copy}{verify} && {check}" if last else f"{copy}{verify} && ls -l {q(dest)}"
        out.append(Transfer(carry, sum(s for _, s in group), repo_bytes, command, [n for n, _ in group]))
    result = Plan(out, repo_bytes, limit, str(parts_dir), problems, check_s)
    if check_s is not None and result.device_s > DEVICE_BUDGET_S:
        problems.append(f"the window needs {result.device_s:g} s of device time, over the {DEVICE_BUDGET_S} s "
                        f"budget: fewer transfers (a smaller repository, larger parts) or a shorter check")
    return result


def format_parts(manifest: dict, parts_dir: Path | None = None) -> str:
    """The archive and each part in the order to send them (size, sha256, and its state when ``parts_dir``
    is given: ok, missing, short, long, over the limit; sizes only, hashes are checked by the join)."""
    states = {s.name: s.state for s in check_parts(parts_dir, manifest, hashes=False)} if parts_dir else {}
    wh = manifest.get("wheelhouse", {})
    lines = [f"transfer plan: {len(manifest['parts'])} part(s), {manifest['archive']['bytes'] / MIB:.1f} MiB "
             f"({manifest['archive']['name']}, sha256 {manifest['archive']['sha256']})"]
    if wh:
        strip = wh.get("strip") or {}
        lines.append(f"  for Python {wh.get('python_version')} {', '.join(wh.get('platforms', [])[:1])}…, extras "
                     f"{','.join(wh.get('extras', []))}; {len(wh.get('wheels', []))} wheels"
                     + (f"; {strip.get('library')} stripped to {', '.join(strip.get('keep', []))} "
                        f"({strip.get('mode')}; original sha256 {strip.get('original_sha256', '')[:16]}…)"
                        if strip else "; CUDA libraries as shipped"))
    lines.append(f"  {MANIFEST} first, then in this order:")
    for p in manifest["parts"]:
        state = f"  [{states[p['name']]}]" if p["name"] in states else ""
        lines.append(f"  {p['name']}  {p['bytes'] / MIB:6.1f} MiB  sha256 {p['sha256']}{state}")
    return "\n".join(lines)


def format_plan(plan: Plan, manifest: dict, parts_dir: Path | None = None) -> str:
    """:func:`format_parts`, then the transfers in the order to send them, each with its carry list and
    command, and what stops the plan from being sent as it is."""
    lines = [format_parts(manifest, parts_dir),
             f"send in this order, back to back (the host keeps {DEFAULT_DEST} only while transfers follow "
             f"within ~30 s); the repository travels with each: {plan.repo_bytes / MIB:.1f} MiB of the "
             f"{plan.transfer_limit / MIB:g} MiB a transfer holds:"]
    for i, t in enumerate(plan.transfers, 1):
        lines.append(f"  transfer {i}/{len(plan.transfers)}: {t.bytes / MIB:.1f} MiB, carry {t.carry}")
        lines.append(f"    command: {t.command}")
    if plan.check_s is not None:
        lines.append(f"  {plan.device_line()}")
    for p in plan.problems:
        lines.append(f"  PROBLEM: {p}")
    return "\n".join(lines)
