"""This process's peak resident memory, as the kernel counts it."""

from __future__ import annotations


def peak_rss_kb() -> int:
    """Peak RSS since exec, in KiB: ``VmHWM`` of ``/proc/self/status`` (-1 where there is none). Not ``ru_maxrss``:
    on Linux a child's starts at its parent's RSS when forked and carries over exec."""
    return _status_kb("VmHWM:")


def address_space_kb() -> int:
    """This process's address space now, in KiB: ``VmSize`` of ``/proc/self/status`` (-1 where there is none), what
    ``RLIMIT_AS`` limits."""
    return _status_kb("VmSize:")


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1
