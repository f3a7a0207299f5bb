"""Crash loops and poison prompts: the supervisor gives up loudly or quarantines the cause."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai

from common.protocol import ExitCode
from tests.conftest import free_port, wait_until
from tests.integration.conftest import NO_EOS, READY_TIMEOUT_S, ROOT, Router, isolated_env

# Under this limit the demo model serves short requests (up to 256 tokens), but a
# 3000-token prompt's KV cache (64 KiB per token) cannot fit: with admission off it aborts
# the worker every time, a few hundred tokens into its prefill (CPU prefill is slow: at
# 110 MiB each death took ~20 s of prefill first, this test ~60 s on a quiet machine).
TIGHT_LIMIT_MB = "60"
POISON = {"prompt": [65] * 3000, "max_tokens": 8}


def test_poison_prompt_is_quarantined_and_the_worker_stays_ready(
        fresh_router: Callable[..., Router]) -> None:
    router = fresh_router("--memory-limit-mb", TIGHT_LIMIT_MB, "--oom-guard", "abort",
                          "--unsafe-no-admission")
    first_pid = router.worker()["pid"]
    # The default openai client retries 503s twice; quarantine must stop that cycle.
    client = router.client(max_retries=2)
    try:
        client.completions.create(model="m", **POISON)
        raise AssertionError("the poison prompt must not succeed")
    except openai.APIStatusError as exc:
        assert exc.status_code == 503
        assert exc.response.json()["error"]["code"] == "request_quarantined"
        assert exc.response.headers["x-should-retry"] == "false"
    worker = wait_until(lambda: (w := router.worker()).get("state") == "ready" and w or None,
                        60, "the worker to be ready again", on_fail=router.log)
    assert worker["pid"] != first_pid and worker["restarts"] == 2
    assert worker["last_exit"]["signal"] == "SIGABRT"
    assert any("OOM guard" in line for line in worker["last_exit"]["stderr_tail"])
    # Asked again, it is refused at once without touching the worker.
    again = router.http.post("/v1/completions", json=POISON)
    assert again.status_code == 503 and again.json()["error"]["code"] == "request_quarantined"
    assert router.worker()["pid"] == worker["pid"]
    ok = client.completions.create(model="m", prompt="short and sweet", max_tokens=4, extra_body=NO_EOS)
    assert ok.usage is not None and ok.usage.completion_tokens == 4


def test_worker_that_cannot_load_ends_failed_not_looping(tmp_path: Path, cache_home: Path) -> None:
    bad = Router(tmp_path, cache_home, "--queue-timeout", "5", model=str(tmp_path / "no-such-model"))
    try:
        bad.wait_answering()
        worker = wait_until(lambda: (w := bad.worker()).get("state") == "failed" and w or None,
                            60, "the worker state to become failed", on_fail=bad.log)
        assert worker["restarts"] == 0
        assert worker["last_exit"]["code"] == 3
        assert "load" in worker["last_exit"]["reason"]
        assert bad.http.get("/health").status_code == 503
        # Requests are answered at once rather than left to wait for a worker that won't come.
        r = bad.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        # Operators can ask again; it fails again and stays failed.
        assert bad.http.post("/admin/workers/restart").status_code == 200
        wait_until(lambda: (w := bad.worker()).get("state") == "failed"
                   and w["last_exit"]["at"] > worker["last_exit"]["at"],
                   60, "the retried worker to fail again", on_fail=bad.log)
    finally:
        bad.stop()


def test_in_a_terminal_a_model_that_cannot_load_ends_the_router(tmp_path: Path, cache_home: Path) -> None:
    """A newcomer's wrong path, typed in a terminal (stdin a TTY) with one model: the router
    exits with the worker's load error and its exit code instead of serving 503s in
    ``failed``. Without a terminal it stays up (the test above)."""
    port = free_port()
    argv = [sys.executable, "-m", "router", "--model", str(tmp_path / "no-such-model"),
            "--port", str(port), "--worker-addr", f"ipc://{tmp_path}/r{port}.sock"]
    terminal, stdin = pty.openpty()
    try:
        proc = subprocess.Popen(argv, env=isolated_env(cache_home, tmp_path), cwd=ROOT, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=READY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=15)
            raise AssertionError(f"the router did not exit:\n{out.decode(errors='replace')}") from None
    finally:
        os.close(stdin)
        os.close(terminal)
    log = out.decode(errors="replace")
    assert proc.returncode == ExitCode.LOAD_ERROR, log
    assert "model failed to load" in log and "no-such-model" in log, log
    assert "exiting" in log, log


def test_worker_without_memory_for_a_minimal_request_fails_with_a_breakdown(
        tmp_path: Path, cache_home: Path) -> None:
    bad = Router(tmp_path, cache_home, "--memory-limit-mb", "12", "--queue-timeout", "5")
    try:
        bad.wait_answering()
        worker = wait_until(lambda: (w := bad.worker()).get("state") == "failed" and w or None,
                            60, "the worker state to become failed", on_fail=bad.log)
        assert worker["last_exit"]["code"] == 4
        tail = "\n".join(worker["last_exit"]["stderr_tail"])
        assert "weights" in tail and "runtime baseline" in tail and "Remedy" in tail
        r = bad.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    finally:
        bad.stop()
