"""Tests for worker/distributed.py's PeerWatch: a distributed rank ends itself, bounded,
once a peer's ring socket closes (MLX would wait for ever on its next collective), and not
when the group stops on purpose. Real sockets (a socketpair), no MLX."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from worker.distributed import PeerWatch, open_files, peer_gone, ring_sockets

BOUND_S = 5.0


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    mine, theirs = socket.socketpair()
    yield mine, theirs
    mine.close()
    theirs.close()


def watch(sock: socket.socket) -> tuple[PeerWatch, threading.Event, list[str]]:
    lost, reasons = threading.Event(), []

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    return PeerWatch([sock], on_lost, interval_s=0.01, grace_s=0.05).start(), lost, reasons


def test_a_live_peer_is_there_with_or_without_unread_bytes(pair: tuple[socket.socket, socket.socket]) -> None:
    mine, theirs = pair
    assert peer_gone(mine) is None
    theirs.sendall(b"frame")
    assert peer_gone(mine) is None
    assert mine.recv(16) == b"frame", "the peek took nothing from the reader"


def test_a_closed_peer_is_gone(pair: tuple[socket.socket, socket.socket]) -> None:
    mine, theirs = pair
    theirs.close()
    assert peer_gone(mine) == "closed by the peer"


def test_the_watch_ends_the_rank_once_the_peer_closes(pair: tuple[socket.socket, socket.socket]) -> None:
    mine, theirs = pair
    w, lost, reasons = watch(mine)
    assert not lost.wait(0.1)
    theirs.close()
    assert lost.wait(BOUND_S)
    assert reasons == ["closed by the peer"]
    w.stand_down()


def test_standing_down_keeps_the_rank_when_the_group_stops_on_purpose(
        pair: tuple[socket.socket, socket.socket]) -> None:
    mine, theirs = pair
    w, lost, _ = watch(mine)
    w.stand_down()
    theirs.close()
    assert not lost.wait(0.3)


def test_ring_sockets_are_the_connected_ones_opened_since() -> None:
    before = open_files()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        found = ring_sockets(before)
        ends = sorted((s.getsockname(), s.getpeername()) for s in found)
        assert ends == sorted((s.getsockname(), s.getpeername()) for s in (client, accepted))
        for s in found:
            s.close()
        assert peer_gone(client) is None, "closing the dups leaves the sockets open"
    finally:
        for s in (client, accepted, listener):
            s.close()


def test_followers_probe_under_the_mlx_memory_limit_rank_0_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 sends the MLX memory limit it set with the probe's stretch; a follower sets
    the same before its first forward (none sent: MLX's default stays)."""
    import mlx.core as mx
    import msgpack

    from worker import distributed

    sent: list[bytes] = []
    monkeypatch.setattr(distributed, "broadcast", lambda group, data: sent.append(data))
    distributed.lead_probe(object(), 4, 123 << 20)
    boot = msgpack.unpackb(sent[0])
    assert boot == {"probe_stretch": 4, "mlx_limit_bytes": 123 << 20}
    before = mx.get_memory_limit()
    try:
        distributed.follow_mlx_limit(boot)
        assert mx.get_memory_limit() == 123 << 20
        distributed.follow_mlx_limit({"probe_stretch": 4, "mlx_limit_bytes": None})
        assert mx.get_memory_limit() == 123 << 20  # nothing sent: left as it is
    finally:
        mx.set_memory_limit(before)
