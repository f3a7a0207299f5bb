"""bench/hostcost.py on this machine: every figure it reports is there and positive (no
timing is asserted: the figures are for comparing hosts, read by a person)."""

from __future__ import annotations

from bench import hostcost


def test_the_host_figures_are_all_measured() -> None:
    python = hostcost.python_yardstick()
    assert python["msgpack_status_roundtrip_us"] > 0 and python["status_bytes"] > 1000
    zmq = hostcost.zmq_latency(n=20)
    assert zmq["to_polling_peer_us"] > 0 and zmq["back_us"] > 0
    probe = hostcost.probe_costs()
    assert probe["device"] in ("cpu", "metal", "cuda")
    for key in ("read_cached_us", "read_fresh_us", "device_info_us", "bound_cache_us", "small_eval_us"):
        assert probe[key] > 0, key
