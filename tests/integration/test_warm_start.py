"""A fresh worker warms its kernels before it says ready, within its memory limit.

That its first request is then as quick as the next ones is a speed figure, measured by
``python -m bench.restart`` (``first_over_warm``), not asserted here: the suite has no
timing assertions (one noisy neighbour on a shared 2-core machine decided this test).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Router


def test_a_fresh_worker_warms_up_within_its_limit_before_it_serves(
        fresh_router: Callable[..., Router]) -> None:
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
    for i in range(4):
        with router.http.stream("POST", "/v1/completions", json={
                "prompt": f"a fresh prompt, number {i}, for the warm start", "max_tokens": 4,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        # (a chunk may carry several tokens: the usage counts them)
        assert chunks[-1]["usage"]["completion_tokens"] == 4
    # The loop's own account of its time: four requests of 4 tokens took steps, each
    # inside a loop iteration that had work.
    loop = router.memory()["workers"][0]["loop"]
    assert loop["steps"] >= 4 and 0 < loop["engine_s"] <= loop["busy_s"], loop
    assert 0 <= loop["store_s"] <= loop["busy_s"] - loop["engine_s"], loop
