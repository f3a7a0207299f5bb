"""Nothing waits on memory the worker could give back (issue 30, item 0).

A disk tier populated by an earlier router run on the same ``--prompt-cache-dir``, a limit
so tight that the cached entry of the long prompt and that prompt's own request do not fit
together, the OOM guard armed: one long request and seven short ones sent at once. The
long one's entry is read back from disk (or found in RAM on a retry) and held for it;
before the fix the gate then said "no room now" with nothing running, every time it was
asked, and every request behind it ended 503 ``queue_timeout``. The entry a request would
reuse is evictable like any other: it runs cold instead of waiting (real processes, demo
model).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import httpx

from common import costmodel
from common.costmodel import CostModel
from tests.conftest import wait_until
from tests.integration.conftest import Router

# The run, scaled to a quarter (its prefill took most of a minute on 2 shared cores):
# 266 MiB and one ~1,870-token prompt with fifteen of ~236 there; here 104 MiB, 500 and
# seven of 120 (fifteen cost the suite 5 s more; seven wait behind the long one as well).
# The long prompt's entry (prompt and answer, 516 tokens at 64 KiB each on the demo model,
# ~34 MB) and that prompt's own request (~66 MB, its KV in 256-token steps) fit a ~79 MB
# budget alone, not together: the premise holds for limits of ~89-120 MiB here.
TIGHT = ["--memory-limit-mb", "104", "--oom-guard", "abort"]
LONG_TOKENS, SHORT_TOKENS, NUM_SHORT, MAX_TOKENS = 500, 120, 7, 16
# Bounded: before the fix every request ended here with nothing running; after it they all
# finish well within it, even on shared cores.
QUEUE_TIMEOUT_S = 60.0
TIMEOUT_S = 90.0


def body(prompt: list[int]) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def long_prompt() -> list[int]:
    return [40] * LONG_TOKENS


def disk_tier(router: Router) -> dict[str, Any]:
    return router.memory()["workers"][0]["prompt_cache"]["tiers"]["disk"]


def summary(router: Router) -> str:
    """What the issue read off /v1/memory while nothing ran."""
    w = router.memory()["workers"][0]
    cache = w["prompt_cache"]
    return (f"running {w['running']}, reserved {w['reserved_bytes']} B, headroom {w['headroom_bytes']} B, "
            f"scale {w['scale']}; prompt cache: RAM {cache['ram_bytes']} B, evictable "
            f"{cache['evictable_bytes']} B, disk hits {cache['tiers']['disk']['hits']}; {cache}")


def populate(tmp_path: Path, cache_home: Path) -> None:
    """A first router run on the same folder leaves the long prompt's entry on disk."""
    first = Router(tmp_path, cache_home, *TIGHT)
    try:
        first.wait_ready()
        resp = first.http.post("/v1/completions", json=body(long_prompt()), timeout=TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        wait_until(lambda: (d := disk_tier(first))["writes"] >= 1 and d["pending"] == 0, TIMEOUT_S,
                   "the long prompt's entry written to disk", on_fail=first.log)
    finally:
        first.stop()


def test_a_request_that_fits_alone_runs_beside_a_populated_disk_tier(tmp_path: Path, cache_home: Path) -> None:
    populate(tmp_path, cache_home)
    router = Router(tmp_path, cache_home, *TIGHT, "--queue-timeout", str(QUEUE_TIMEOUT_S))
    try:
        router.wait_ready()
        report = router.memory()["workers"][0]
        assert disk_tier(router)["entries"] >= 1, "the disk tier is populated before any request"
        # The premise, in the worker's own cost model: the long request fits alone, not
        # beside its entry (the disk tier holds that one file).
        model = CostModel.from_dict(report["cost_model"])
        cost = costmodel.request_cost_bytes(model, LONG_TOKENS, MAX_TOKENS)
        entry = (LONG_TOKENS + MAX_TOKENS) * model.kv_bytes_per_token
        assert cost <= model.budget_bytes < cost + entry, (cost, entry, model.budget_bytes)
        pid = router.worker()["pid"]
        # One longer than the largest request: refused before any GPU work, as it should be.
        too_long = router.http.post("/v1/completions", timeout=TIMEOUT_S,
                                    json=body([40] * report["max_request_tokens"]))
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "insufficient_memory"
        bodies = [body(long_prompt())] + [body([41 + i] * SHORT_TOKENS) for i in range(NUM_SHORT)]
        with httpx.Client(base_url=router.url, timeout=TIMEOUT_S) as http, \
                concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
            responses = [f.result(timeout=TIMEOUT_S) for f in futures]
        codes = [r.status_code for r in responses]
        assert codes == [200] * len(bodies), f"{codes}\n{summary(router)}\n{router.log()}"
        assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)
        final = router.memory()["workers"][0]
        assert final["peak_bytes"] <= final["limit_bytes"]
        assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
    finally:
        router.stop()
