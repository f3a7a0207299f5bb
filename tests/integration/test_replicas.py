"""Two workers of one model (--replicas 2): requests spread over both; one's death is its own."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.conftest import wait_until
from tests.integration.conftest import NO_EOS, Router
from tests.integration.test_status import chromium

LOAD_S = 90.0


def ready_workers(router: Router) -> list[dict[str, Any]] | None:
    workers = [w for w in router.health().get("workers", []) if w.get("state") == "ready"]
    return workers if len(workers) == 2 else None


def drain(stream: Any, counts: list[int], i: int, stop: threading.Event) -> str:
    """Read a stream as it comes (so no chunks pile up unread) until it fails or ``stop``."""
    try:
        for _ in stream:
            counts[i] += 1
            if stop.is_set():
                return "ok"
        return "ended"
    except openai.APIError:
        return "error"


def test_two_replicas_share_the_load_and_die_alone(fresh_router: Callable[..., Router], tmp_path: Path) -> None:
    router = fresh_router("--replicas", "2", "--max-running-requests", "2")
    wait_until(lambda: ready_workers(router), LOAD_S, "two ready workers", on_fail=router.log)
    client = router.client()
    streams = [client.completions.create(model="m", prompt="Keep talking.", max_tokens=3000,
                                         stream=True, extra_body={"ignore_eos": True})
               for _ in range(4)]
    iters = [iter(s) for s in streams]
    for it in iters:
        next(it)
    running = sorted(w["running"] for w in router.health()["workers"])
    assert running == [2, 2], "four streams over two workers of two rows each"
    counts, stop = [0] * len(iters), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        readers = [pool.submit(drain, it, counts, i, stop) for i, it in enumerate(iters)]
        # Two more wait in the queue: both workers are full.
        queued = [pool.submit(client.completions.create, model="m", prompt="q", max_tokens=4, extra_body=NO_EOS)
                  for _ in range(2)]
        wait_until(lambda: router.health().get("queued") == 2, 10, "two queued requests")
        victim = router.health()["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: sum(r.done() for r in readers) >= 2, 30, "the dead worker's streams end",
                   on_fail=router.log)
        going = {i: counts[i] for i, r in enumerate(readers) if not r.done()}
        wait_until(lambda: all(counts[i] >= n + 50 for i, n in going.items()), 30,
                   "the other worker's streams go on", on_fail=router.log)
        stop.set()
        outcomes = sorted(r.result(timeout=30) for r in readers)
        assert outcomes == ["error", "error", "ok", "ok"], "the dead worker's streams end, the other's go on"
        for stream in streams:
            stream.close()
        for future in queued:  # not lost: served by the survivor or the restarted worker
            r = future.result(timeout=LOAD_S)
            assert r.usage is not None and r.usage.completion_tokens == 4
    workers = wait_until(lambda: ready_workers(router), LOAD_S, "the killed replica back", on_fail=router.log)
    # The status page shows each worker's own prompt cache, under its model and pid.
    page = chromium(tmp_path, "--dump-dom", router.url + "/")
    assert page.returncode == 0, page.stderr[-2000:]
    for w in workers:
        assert f'class="cache-worker">demo · pid {w["pid"]}</h3>' in page.stdout, page.stdout[-3000:]
