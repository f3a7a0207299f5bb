"""Under a tight --memory-limit-mb with the OOM guard armed: admission prevents the abort.

The demo model's KV cache costs 64 KiB per token, so a few hundred tokens in a batch
cross a limit of 200 MiB. The guard (`--oom-guard abort`) makes crossing it as fatal as a
Metal OOM, so these tests show the gate is real: the same workload without admission
aborts the worker.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import wait_until
from tests.integration.conftest import Router

LIMIT = ["--memory-limit-mb", "200", "--oom-guard", "abort"]
WORKLOAD_TIMEOUT_S = 180.0


def workload() -> list[dict[str, Any]]:
    """16 requests of mixed lengths (one 8x the others) and mixed max_tokens."""
    bodies = [{"prompt": [70 + i] * 60, "max_tokens": 20 + 10 * (i % 5), "ignore_eos": True,
               "temperature": 0} for i in range(15)]
    bodies.insert(5, {"prompt": [99] * 480, "max_tokens": 60, "ignore_eos": True, "temperature": 0})
    return bodies


class Watcher(threading.Thread):
    """Polls /v1/memory while the workload runs: the most running and queued seen."""

    def __init__(self, router: Router) -> None:
        super().__init__(daemon=True)
        self.router = router
        self.stop = threading.Event()
        self.max_running = 0
        self.max_queued = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.router.url, timeout=10) as http:
            while not self.stop.wait(0.02):
                try:
                    memory = http.get("/v1/memory").json()
                except httpx.HTTPError:
                    continue
                self.max_queued = max(self.max_queued, memory["queued"])
                if memory["workers"]:
                    self.max_running = max(self.max_running, memory["workers"][0]["running"])


def run_workload(router: Router) -> list[httpx.Response]:
    with httpx.Client(base_url=router.url, timeout=WORKLOAD_TIMEOUT_S) as http, \
            concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=b) for b in workload()]
        return [f.result(timeout=WORKLOAD_TIMEOUT_S) for f in futures]


def test_admission_keeps_a_tight_limit(fresh_router: Callable[..., Router]) -> None:
    router = fresh_router(*LIMIT)
    pid = router.worker()["pid"]
    report = router.memory()["workers"][0]
    assert report["limit_bytes"] == 200 * 2**20

    # Never fits: a 400 before any GPU work, and the worker is untouched.
    too_big = router.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4000})
    assert too_big.status_code == 400, too_big.text
    error = too_big.json()["error"]
    assert error["code"] == "insufficient_memory"
    assert error["needed_bytes"] > report["budget_bytes"]
    assert 0 < error["max_request_tokens"] < 4000

    watcher = Watcher(router)
    watcher.start()
    try:
        responses = run_workload(router)
    finally:
        watcher.stop.set()
        watcher.join(10)
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    for body, r in zip(workload(), responses):
        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    assert watcher.max_running >= 2, "requests should run together when they fit"
    assert watcher.max_queued >= 1, "requests that do not fit now should wait in the router"
    final = router.memory()["workers"][0]
    assert final["peak_bytes"] <= final["limit_bytes"]
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
    # The calibration stayed honest: every step's measured peak was within its prediction,
    # or the worker grew its cost model (and, as the same pid shows, nothing aborted).
    assert final["worst_measured_over_predicted"] > 0
    assert final["worst_measured_over_predicted"] <= 1.0 or final["cost_model"]["scale"] > 1.0


def test_without_admission_the_guard_aborts_and_the_router_survives(
        fresh_router: Callable[..., Router]) -> None:
    router = fresh_router(*LIMIT, "--unsafe-no-admission")
    pid = router.worker()["pid"]
    responses = run_workload(router)
    assert any(r.status_code == 503 for r in responses)
    assert {r.json()["error"]["code"] for r in responses if r.status_code != 200} <= {
        "worker_lost", "request_quarantined"}
    assert router.popen.poll() is None
    worker = wait_until(lambda: (w := router.worker()).get("last_exit") and w or None, 30,
                        "the worker's exit to be recorded", on_fail=router.log)
    assert worker["last_exit"]["signal"] == "SIGABRT"
    assert any("OOM guard" in line and "above the limit" in line
               for line in worker["last_exit"]["stderr_tail"])
    assert worker["pid"] != pid or worker["state"] != "ready"


def test_oom_guard_raise_is_survived_without_a_restart(fresh_router: Callable[..., Router]) -> None:
    router = fresh_router("--memory-limit-mb", "200", "--oom-guard", "raise", "--unsafe-no-admission")
    pid = router.worker()["pid"]
    responses = run_workload(router)
    codes = [r.status_code for r in responses]
    assert 503 in codes, "the overload should have tripped the guard"
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "worker_lost"
            assert "Retry-After" in r.headers
    assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
    ok = router.http.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
    assert ok.status_code == 200


def test_queued_requests_that_can_no_longer_fit_are_answered_when_the_model_grows(
        fresh_router: Callable[..., Router]) -> None:
    """The test hook (SIGUSR1 with --test-grow-scale) grows the worker's scale as an
    overshoot would. A queued request that now can never fit gets its 400 at once, not a
    queue timeout; one that still fits stays queued and is served."""
    import os
    import signal

    router = fresh_router(*LIMIT, "--max-running-requests", "1", "--worker-arg=--test-grow-scale=4")
    pid = router.worker()["pid"]
    most = router.memory()["workers"][0]["max_request_tokens"]
    with httpx.Client(base_url=router.url, timeout=WORKLOAD_TIMEOUT_S) as http, \
            concurrent.futures.ThreadPoolExecutor(2) as pool, \
            http.stream("POST", "/v1/completions", json={
                "prompt": [5] * 8, "max_tokens": most - 16, "ignore_eos": True, "stream": True}) as running:
        assert running.status_code == 200
        big = pool.submit(http.post, "/v1/completions", json={
            "prompt": [7] * (most // 2), "max_tokens": most // 10, "ignore_eos": True})
        small = pool.submit(http.post, "/v1/completions", json={
            "prompt": [9] * 8, "max_tokens": 8, "ignore_eos": True})
        wait_until(lambda: router.memory()["queued"] == 2, 30, "both requests queued behind the running one",
                   on_fail=router.log)
        os.kill(pid, signal.SIGUSR1)
        refused = big.result(timeout=10)  # not the 300 s queue timeout
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert error["max_request_tokens"] < most // 2 + most // 10 <= most
        assert error["needed_bytes"] > router.memory()["workers"][0]["budget_bytes"]
        assert router.memory()["queued"] == 1 and not small.done()
        report = router.memory()["workers"][0]
        assert report["scale"] > 1 and report["scale_history"][-1][2] == "test hook"
    # Closing the running stream cancels it: the small one runs.
    done = small.result(timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
    assert router.worker()["pid"] == pid
