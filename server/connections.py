"""Ending one client connection of this process by its peer address, under grpc's feet.

grpc.aio gives a server no way to end one call whose answer is stuck: a stream whose flow-control
window the client never opens keeps its answer queued in grpc-core, and cancelling the handler's
task leaves the call, and its ``--max-concurrent-rpcs`` slot, in place (measured: the slot stayed
taken). The connection is what can be ended, as a proxy's send timeout does: this finds the
process's TCP socket whose remote end is that address and port and whose local end is the port the call came in on
(``/proc/self/fd``, Linux), and shuts it down. grpc
then sees the connection fail, cancels its streams and frees their slots; the descriptor stays
grpc's (a duplicate is shut down and closed, never grpc's own), so it is never closed twice.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import Iterable

_FDS = "/proc/self/fd"


def _ip(text: str) -> str:
    """An address in one form: a v4-mapped IPv6 address (a dual-stack socket's view of an IPv4 peer) as its IPv4."""
    ip = ipaddress.ip_address(text.strip("[]").split("%")[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def peer_address(peer: str) -> tuple[str, int] | None:
    """grpc's peer string as ``(ip, port)`` (``ipv4:10.0.0.7:41234``, ``ipv6:[::1]:5``; ``ipv6:%5B::1%5D:5`` too);
    ``None`` for anything else (a unix socket)."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return None
    host, _, port = peer[5:].replace("%5B", "[").replace("%5D", "]").rpartition(":")
    try:
        return _ip(host), int(port)
    except ValueError:
        return None


def shut_down(peers: Iterable[str], local_port: int | None) -> set[str]:
    """Shut down (both ways) this process's TCP connections whose remote ends are ``peers`` and whose local end is
    ``local_port`` (the port the calls came in on; ``None``: any); the peers found. One pass over the process's
    descriptors whatever the number of peers, and every match taken: a client can connect to another port of this
    process from the same address and port (a different connection), and the first match alone would shut that one
    and leave the stuck connection open (a review, 2026-12-06)."""
    wanted = {address: peer for peer in peers if (address := peer_address(peer)) is not None}
    found: set[str] = set()
    if not wanted:
        return found
    try:
        names = os.listdir(_FDS)
    except OSError:  # no /proc: nothing can be found
        return found
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            copy = socket.socket(fileno=os.dup(fd))
        except (ValueError, OSError):  # not a number, or closed since the listing
            continue
        with copy:
            try:
                if copy.type != socket.SOCK_STREAM or copy.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if local_port is not None and copy.getsockname()[1] != local_port:
                    continue
                remote = copy.getpeername()
                peer = wanted.get((_ip(remote[0]), remote[1]))
                if peer is not None:
                    copy.shutdown(socket.SHUT_RDWR)
                    found.add(peer)
            except OSError:  # a listening socket, or one no longer connected (also between the two calls)
                continue
    return found
