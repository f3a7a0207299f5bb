"""`python -m bench.hostcost`: what the calls around a request cost on this host, no model.

For the TTFT split's "received → admitted" stage on the GPU host: the device probe's
reads (MLX's allocator counters, ``device_info``, NVML's per-process figure), moving MLX's
cache limit, one ZeroMQ message to a polling peer and back, and a pure-Python yardstick
(msgpack of a status-sized map) to compare this host's speed with another's. Medians in
microseconds; prints one JSON object.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq



def timed(fn: Callable[[], Any], n: int) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return round(statistics.median(samples) * 1e6, 2)


def _peer(addr: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    sock.send(b"hello")
    while True:
        if not sock.poll(50, zmq.POLLIN):
            continue
        msg = sock.recv()
        if msg == b"stop":
            break
        sock.send(str(time.time()).encode())
    sock.close(0)
    ctx.term()


def zmq_latency(n: int = 200) -> dict[str, float]:
    """A ROUTER (the router's side) sends to a DEALER polling with a 50 ms timeout (the idle
    worker's loop), which answers at once: each way's median, on one clock."""
    addr = f"ipc://{tempfile.gettempdir()}/headroom-hostcost-{os.getpid()}.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(addr)
    peer = multiprocessing.Process(target=_peer, args=(addr,), daemon=True)
    peer.start()
    ident, _ = sock.recv_multipart()
    there, back = [], []
    for _ in range(n):
        time.sleep(0.005)
        sent = time.time()
        sock.send_multipart([ident, b"x" * 200])
        _, reply = sock.recv_multipart()
        got = time.time()
        there.append(float(reply) - sent)
        back.append(got - float(reply))
    sock.send_multipart([ident, b"stop"])
    peer.join(5)
    sock.close(0)
    ctx.term()
    return {"to_polling_peer_us": round(statistics.median(there) * 1e6, 1),
            "back_us": round(statistics.median(back) * 1e6, 1)}


def probe_costs() -> dict[str, Any]:
    import mlx.core as mx

    from worker.devices import make_probe

    probe = make_probe(20_000)
    out: dict[str, Any] = {"probe": type(probe).__name__, "device": probe.device}
    out["read_cached_us"] = timed(probe.read, 1000)

    def fresh() -> None:
        probe.invalidate()
        probe.read()

    out["read_fresh_us"] = timed(fresh, 100)
    out["device_info_us"] = timed(mx.device_info, 100)
    out["active_memory_us"] = timed(mx.get_active_memory, 1000)
    nvml = getattr(probe, "_nvml_process_bytes", None)
    if nvml is not None:
        out["nvml_process_bytes_us"] = timed(nvml, 100)
    limits = iter([1 << 30, 2 << 30] * 100)
    out["bound_cache_us"] = timed(lambda: probe.bound_cache(next(limits)), 200)
    x = mx.ones((256, 4096))
    mx.eval(x)
    out["small_eval_us"] = timed(lambda: mx.eval(x + 1), 200)
    return out


def python_yardstick() -> dict[str, float]:
    report = {f"field_{i}": {"a": i, "b": [i] * 8, "c": float(i) / 3, "d": "x" * 20} for i in range(60)}
    packed = msgpack.packb(report)
    return {"msgpack_status_roundtrip_us": timed(lambda: msgpack.unpackb(msgpack.packb(report)), 2000),
            "status_bytes": len(packed),
            "python_loop_us": timed(lambda: sum(i * i for i in range(10_000)), 200)}


def main() -> int:
    out: dict[str, Any] = {"python": python_yardstick(), "zmq": zmq_latency()}
    try:
        out["probe"] = probe_costs()
    except Exception as exc:  # noqa: BLE001 - a host without MLX still reports the rest
        out["probe"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
