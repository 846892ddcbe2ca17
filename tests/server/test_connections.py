"""server/connections.py: connections of this process found by both their ends and shut down (real sockets)."""

from __future__ import annotations

import socket

import pytest

from server.connections import peer_address, shut_down


@pytest.mark.parametrize(("peer", "address"), [
    ("ipv4:10.0.0.7:41234", ("10.0.0.7", 41234)),
    ("ipv6:[::1]:5", ("::1", 5)),
    ("ipv6:%5B::1%5D:5", ("::1", 5)),
    ("ipv6:[::ffff:127.0.0.2]:80", ("127.0.0.2", 80)),  # a dual-stack socket's view of an IPv4 peer
    ("ipv6:[fe80::1%eth0]:7", ("fe80::1", 7)),
    ("unix:/tmp/s", None),
    ("ipv4:not-an-address:1", None),
    ("ipv4:10.0.0.7:port", None),
])
def test_peer_strings_as_grpc_writes_them(peer: str, address: tuple[str, int] | None) -> None:
    assert peer_address(peer) == address


def test_the_connection_to_that_peer_is_shut_down_and_no_other() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as mine, \
                socket.create_connection(listener.getsockname()) as other:
            first, _ = listener.accept()
            second, _ = listener.accept()
            with first, second:
                port = mine.getsockname()[1]
                assert shut_down([f"ipv4:127.0.0.1:{port}", "ipv4:127.0.0.1:1", "unix:/x"], None) == {f"ipv4:127.0.0.1:{port}"}
                mine.settimeout(5)
                assert mine.recv(1) == b""  # the server's side was shut down: the client reads the end
                other.sendall(b"x")
                accepted = first if first.getpeername()[1] == other.getsockname()[1] else second
                accepted.settimeout(5)
                assert accepted.recv(1) == b"x"  # the other connection is untouched
                assert first.fileno() >= 0 and second.fileno() >= 0  # still open: only shut down, never closed here


def test_nothing_is_shut_down_for_an_address_with_no_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert shut_down([f"ipv4:127.0.0.1:{listener.getsockname()[1]}"], None) == set()  # a listener has no peer
    assert shut_down(["unix:/tmp/nothing"], None) == set() and shut_down([], None) == set()


def test_several_peers_are_shut_down_in_one_pass() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        accepted = [listener.accept()[0] for _ in clients]
        try:
            peers = [f"ipv4:127.0.0.1:{c.getsockname()[1]}" for c in clients[:2]]
            assert shut_down(peers, listener.getsockname()[1]) == set(peers)
            for client in clients[:2]:
                client.settimeout(5)
                assert client.recv(1) == b""
            clients[2].sendall(b"y")
            kept = next(a for a in accepted if a.getpeername()[1] == clients[2].getsockname()[1])
            kept.settimeout(5)
            assert kept.recv(1) == b"y"
        finally:
            for s in clients + accepted:
                s.close()


def _from(port: int, to: tuple[str, int]) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    client.bind(("127.0.0.1", port))
    client.connect(to)
    return client


def test_a_connection_from_the_same_address_and_port_to_another_port_is_not_taken_for_it() -> None:
    # A review (2026-12-06): a decoy connection from the stuck client's own address and port to the health or metrics
    # port was shut down in its place, and the stuck one stayed open. Matched by the local port too, and all matches.
    with socket.create_server(("127.0.0.1", 0)) as decoy_port, socket.create_server(("127.0.0.1", 0)) as service:
        first = _from(0, decoy_port.getsockname())
        port = first.getsockname()[1]
        second = _from(port, service.getsockname())
        decoy, stuck = decoy_port.accept()[0], service.accept()[0]
        try:
            peer = f"ipv4:127.0.0.1:{port}"
            assert shut_down([peer], service.getsockname()[1]) == {peer}
            second.settimeout(5)
            assert second.recv(1) == b""  # the service port's connection ended
            first.sendall(b"z")
            decoy.settimeout(5)
            assert decoy.recv(1) == b"z"  # the other port's connection from the same address and port did not
            assert shut_down([peer], None) == {peer}  # any port: every match
            first.settimeout(5)
            assert first.recv(1) == b""
        finally:
            for s in (first, second, decoy, stuck):
                s.close()
