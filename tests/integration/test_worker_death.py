"""A worker that dies mid-stream: the router stays up, answers cleanly, restarts it."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import openai
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Router


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_stream_ends_with_error_and_worker_restarts(fresh_router: Callable[..., Router],
                                                    sig: signal.Signals) -> None:
    router = fresh_router()
    first = router.worker()
    stream = router.client().completions.create(
        model="m", prompt="Keep talking.", max_tokens=3000, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    os.kill(first["pid"], sig)
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert "worker" in str(info.value.message)
    assert router.popen.poll() is None, "the router must survive its worker"

    def restarted() -> dict | None:
        w = router.worker()
        return w if w.get("state") == "ready" and w.get("pid") != first["pid"] else None

    worker = wait_until(restarted, 60, "the worker to be restarted and ready", on_fail=router.log)
    assert worker["restarts"] == 1
    assert worker["last_exit"]["signal"] == sig.name
    r = router.client().completions.create(model="m", prompt="Back?", max_tokens=4)
    assert r.usage is not None and r.usage.completion_tokens == 4
