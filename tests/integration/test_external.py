"""External mode: router and worker started separately (as under launchd)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tests.conftest import wait_until
from tests.integration.conftest import NO_EOS, Proc, Router, isolated_env

READY_S = 60.0


def start_worker(tmp_path: Path, cache_home: Path, addr: str, n: int) -> Proc:
    argv = [sys.executable, "-m", "worker", "--model", "demo", "--router", addr]
    return Proc(argv, isolated_env(cache_home, tmp_path), tmp_path / f"worker-{n}.log")


def state(router: Router) -> str | None:
    return router.worker().get("state")


def complete(router: Router) -> int:
    # Sampled (temperature 1): without NO_EOS, "external" samples an EOS within 5 tokens
    # in ~0.75% of requests (measured on the demo model), 3 requests a run.
    r = router.client().completions.create(model="m", prompt="external", max_tokens=5, extra_body=NO_EOS)
    return r.usage.completion_tokens if r.usage else 0


def test_external_worker_comes_and_goes(tmp_path: Path, cache_home: Path) -> None:
    router = Router(tmp_path, cache_home, "--worker-mode", "external")
    workers: list[Proc] = []
    try:
        router.wait_answering()
        assert router.http.get("/health").status_code == 503
        assert state(router) == "starting"
        workers.append(start_worker(tmp_path, cache_home, router.addr, 1))
        router.wait_ready(READY_S)
        assert complete(router) == 5
        # Kill the worker: the router sees the silence, says down, keeps running.
        workers[0].popen.send_signal(signal.SIGKILL)
        wait_until(lambda: state(router) == "down", 15, "the worker to be marked down", on_fail=router.log)
        assert router.popen.poll() is None
        # A new worker (a new incarnation) is taken as it connects.
        workers.append(start_worker(tmp_path, cache_home, router.addr, 2))
        router.wait_ready(READY_S)
        assert router.worker()["pid"] == workers[1].pid
        assert complete(router) == 5
        # Restart the router: the worker reconnects by itself and is not stopped by it.
        assert router.stop() == 0
        assert workers[1].popen.poll() is None, "the router must never stop an external worker"
        router = Router(tmp_path, cache_home, "--worker-mode", "external", "--worker-addr", router.addr)
        router.wait_ready(READY_S)
        assert router.worker()["pid"] == workers[1].pid
        assert complete(router) == 5
    finally:
        router.stop()
        for w in workers:
            w.stop()
