"""The open-file limit a server starts with: its soft limit raised to the hard one."""

from __future__ import annotations

# Past this a raise buys nothing a server can use (each connection is a descriptor; a million idle sockets
# is far beyond any slot count) and some kernels refuse RLIM_INFINITY for RLIMIT_NOFILE.
CEILING = 1 << 20


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most ``CEILING``), as Go's runtime does
    for every server: the soft limit is often 1,024, and with every descriptor taken new connections,
    /health included, are closed unanswered (docs/operations.md, Limits). Returns (before, after) when it
    changed the limit, else None (already there, or no ``resource`` module, or the kernel refused)."""
    try:
        import resource
    except ImportError:                                      # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    return soft, target
