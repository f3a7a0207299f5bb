"""What a socket sends cannot kill the router: garbage frames, old incarnations, other versions."""

from __future__ import annotations

import msgpack
import zmq

from common.protocol import Heartbeat, TokenRow, Tokens, encode
from tests.conftest import wait_until
from tests.integration.conftest import NO_EOS, Router
from tests.integration.test_stream_cancel import metric


def test_garbage_and_foreign_frames_are_dropped(router: Router) -> None:
    before = router.worker()
    bad_before = metric(router, "headroom_bad_frames_total")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.addr)
    try:
        frames = [b"", b"\x00\x01\x02", b"\xc1" * 64, msgpack.packb([1, 2, 3]),
                  msgpack.packb({"v": 1, "type": ["not", "a", "str"]}),
                  msgpack.packb({"v": 1, "type": "tokens", "incarnation": "x"}),
                  msgpack.packb({"v": True, "type": "heartbeat", "incarnation": 1})]
        for frame in frames:
            sock.send(frame)
        # Well-formed frames from an incarnation the router does not know are ignored.
        sock.send(encode(Tokens(incarnation=12345, step=1, outputs=[TokenRow("nope", [1, 2], None)])))
        sock.send(encode(Heartbeat(incarnation=12345, step=9)))
        # A hello of another protocol version is refused and shown in /health.
        sock.send(msgpack.packb({"v": 999, "type": "hello", "pid": 4242, "package_version": "9.9"}))
        wait_until(lambda: metric(router, "headroom_bad_frames_total") >= bad_before + len(frames) + 1,
                   10, "the bad frames to be counted")
    finally:
        sock.close(0)
        ctx.term()
    health = router.health()
    assert health["status"] == "ok"
    assert health["refused_workers"][0]["pid"] == 4242
    assert router.worker()["pid"] == before["pid"]
    r = router.client().completions.create(model="m", prompt="still fine", max_tokens=3, extra_body=NO_EOS)
    assert r.usage is not None and r.usage.completion_tokens == 3
