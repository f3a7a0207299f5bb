"""A conversation's cached turns near the limit: their joins are promised, never an abort
(real router and worker, demo model, the OOM guard armed as Metal's abort)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.integration.conftest import Router

# Where a conversation's first cached turn passed the limit by 1 % before its join was
# promised (650 tokens and growing: its hit spans several blocks).
JOIN = ["--memory-limit-mb", "160", "--oom-guard", "abort"]
JOIN_BASE_TOKENS = 650
TIMEOUT_S = 120.0


def test_a_growing_conversation_near_the_limit_never_passes_it_when_its_turns_join_from_cache(
        tmp_path: Path, cache_home: Path) -> None:
    """A hit of several blocks joins the batch through their concatenation, held beside the
    row's own copy for that step: admission promises it. When it was only charged to the
    step's chunk, a conversation's later turns near the limit passed it (here --oom-guard
    abort: the worker died, as on Metal) and were retried cold. Now each turn joins from the
    cache within the limit or runs cold (here cold: the join does not fit): never an abort.
    (That cached turns still join where they fit: tests/integration/test_prefix_cache.py.)"""
    router = Router(tmp_path, cache_home, *JOIN)
    try:
        router.wait_ready()
        pid = router.worker()["pid"]
        rng = random.Random(3)
        ids = [rng.randrange(3, 500) for _ in range(JOIN_BASE_TOKENS)]
        for more in (60, 120):  # the second is the first cached turn: where it aborted
            ids += [rng.randrange(3, 500) for _ in range(more)]
            resp = router.http.post("/v1/completions", timeout=TIMEOUT_S, json={
                "prompt": ids, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            assert resp.status_code == 200, resp.text
        final = router.memory()["workers"][0]
        assert final["peak_bytes"] <= final["limit_bytes"]
        assert router.worker()["pid"] == pid and router.worker()["restarts"] == 0
    finally:
        router.stop()
