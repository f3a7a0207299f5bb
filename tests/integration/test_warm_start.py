"""A fresh worker warms its kernels before it says ready: its first request is not slow.

The one timing check in the suite, because it is the promise itself: the first completion
of a fresh router is within 2x of a warm one's time to first token (the median of the
next three; and a second fresh router if the first misses, so one noisy reading on a
shared CI machine does not decide it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Router


def first_token_seconds(router: Router, i: int) -> float:
    started = time.monotonic()
    with router.http.stream("POST", "/v1/completions", json={
            "prompt": f"a fresh prompt, number {i}, for the warm start", "max_tokens": 4,
            "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - started
    raise AssertionError("the stream ended without a token")


def test_the_first_request_is_within_twice_a_warm_ones_time_to_first_token(
        fresh_router: Callable[..., Router]) -> None:
    # Up to two fresh routers: one reading can be a neighbour's noise on a shared 2-core box
    # (seen: 0.24-0.29 s against 0.10 s while another test prefilled), while a worker that
    # did not warm its kernels is slow on every fresh start.
    readings = []
    for attempt in range(2):
        router = fresh_router()
        report = router.memory()["workers"][0]
        assert report["warmup_s"] > 0
        # MLX may hold the weights, its idle baseline and the budget (less, while the system
        # has less free) before its evaluation waits for the device: within the worker's
        # limit, never MLX's own default (on this CPU backend above the worker's 60 % of RAM).
        assert report["weights_bytes"] < report["mlx_limit_bytes"] <= report["limit_bytes"], report
        gauges = {s.labels["field"]: s.value
                  for family in text_string_to_metric_families(router.http.get("/metrics").text)
                  if family.name == "headroom_worker_memory_bytes" for s in family.samples}
        assert gauges["mlx_limit_bytes"] == report["mlx_limit_bytes"], gauges
        assert "warm start in" in router.log()
        first = first_token_seconds(router, 0)
        warm = statistics.median(first_token_seconds(router, i) for i in (1, 2, 3))
        readings.append((round(first, 3), round(warm, 3)))
        # The loop's own account of its time: four requests of up to 4 tokens took steps,
        # each inside a loop iteration that had work.
        loop = router.memory()["workers"][0]["loop"]
        assert loop["steps"] >= 4 and 0 < loop["engine_s"] <= loop["busy_s"], loop
        assert 0 <= loop["store_s"] <= loop["busy_s"] - loop["engine_s"], loop
        if first <= 2 * warm:
            return
        router.stop()
    raise AssertionError(f"first request over twice a warm one's TTFT on two fresh workers: "
                         f"(first, warm) = {readings}")
