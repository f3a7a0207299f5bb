"""router/ops/console.py: `mlx-router status` renders /status on one screen (pure parts)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import pytest

from router.ops import console
from router.ops.console import human_bytes, memory_bar, render, sparkline

GiB = 1 << 30


def body(**over: Any) -> dict[str, Any]:
    worker = {"state": "ready", "reason": "serving", "pid": 4242, "incarnation": "123456789012345678",
              "restarts": 2, "mode": "spawn", "running": 1,
              "last_exit": {"code": None, "signal": "SIGKILL", "reason": "killed by SIGKILL",
                            "at": 940.0},
              "memory": {"device": "metal", "device_name": "Apple M3 Max", "limit_bytes": 8 * GiB,
                         "active_bytes": 2 * GiB,
                         "cache_bytes": GiB, "reserved_bytes": GiB // 2, "headroom_bytes": 5 * GiB,
                         "peak_bytes": 3 * GiB, "max_running_requests": 8, "report_age_s": 0.1},
              "prompt_cache": {"hits": 3, "ram_bytes": GiB, "tiers": {"disk_bytes": 1}}}
    b = {"status": "ok", "model": "demo", "version": "0.1.0", "at": 1000.0, "queued": 3, "running": 1,
         "tokens_per_s": 41.5, "ttft": {"count": 4, "last_s": 0.2, "p50_s": 0.15, "p95_s": 1.5},
         "workers": [worker],
         "rejections": [{"at": 990.0, "request_id": "r9", "endpoint": "chat", "status": 429,
                         "code": "queue_full", "param": None, "message": "the queue is full"},
                        {"at": 980.0, "request_id": "r8", "endpoint": "chat", "status": 400,
                         "code": "invalid_request", "param": "messages", "message": None}],
         "history": [{"at": 990.0 + i, "headroom_bytes": i * GiB} for i in range(6)]}
    b.update(over)
    return b


def test_render_shows_the_facts_of_the_page() -> None:
    text = render(body(), width=120)
    for fact in ("OK", "demo", "queued 3", "running 1", "tokens/s 41.5", "p50 150 ms", "p95 1.50 s",
                 "pid 4242", "incarnation 123456789012345678", "restarts 2", "running 1/8",
                 "last exit: SIGKILL: killed by SIGKILL (60 s ago)", "memory on metal (Apple M3 Max)",
                 "limit 8.00 GiB",
                 "headroom 5.00 GiB", "reserved 512.00 MiB", "prompt cache: hits 3, ram_bytes 1.00 GiB",
                 "429 queue_full  r9  the queue is full", "400 invalid_request  r8  bad messages",
                 "headroom, last 6 s  ▁▂▃▄▅▅"):
        assert fact in text, fact
    assert all(len(line) <= 120 for line in text.splitlines())


def test_the_block_store_gets_a_line() -> None:
    worker = body()["workers"][0]
    worker["prompt_cache"]["blocks"] = {"block_tokens": 256, "ram": 12, "disk": 30, "shared": 4,
                                        "shared_bytes": GiB, "written": 30, "written_bytes": 2 * GiB}
    text = render(body(workers=[worker]), width=160)
    assert "blocks of 256 tokens: RAM 12, disk 30, shared 4 (1.00 GiB), written 30 (2.00 GiB)" in text


def test_several_models_get_a_line_each_and_one_model_none() -> None:
    models = [{"id": "chat", "state": "loaded", "pinned": True, "workers": 1, "queued": 2, "running": 1,
               "memory": {"weights_bytes": 4 * GiB, "used_bytes": 5 * GiB}},
              {"id": "coder", "state": "unloaded", "pinned": False, "workers": 0, "queued": 0, "running": 0,
               "memory": {"weights_bytes": 2 * GiB, "used_bytes": 0}}]
    text = render(body(models=models), width=120)
    assert "Models:" in text
    assert "chat                 loaded (pinned)  workers 1  queued 2  running 1  weights 4.00 GiB" in text
    assert "coder                unloaded  workers 0" in text
    assert "Models:" not in render(body(models=models[:1]), width=120)


def test_render_without_a_worker_report() -> None:
    worker = {"state": "restarting", "reason": "backing off 2s", "pid": None, "incarnation": None,
              "restarts": 1, "mode": "spawn", "running": 0, "last_exit": None, "memory": None,
              "prompt_cache": None}
    text = render(body(status="restarting", workers=[worker], rejections=[], history=[]), width=80)
    assert "RESTARTING" in text and "why: backing off 2s" in text and "pid -" in text
    assert "Recent rejections: none" in text and "memory on" not in text


def test_pieces() -> None:
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(1536) == "1.50 KiB"
    assert memory_bar({"limit_bytes": 10, "active_bytes": 5, "cache_bytes": 2}, 10) == "[#####++...]"
    assert memory_bar({"limit_bytes": 0}, 10) == ""
    assert sparkline([0, 0], 5) == "▁▁" and sparkline([1, 2, 3, 4], 2) == "▆█"
    assert sparkline([1, 2], 5, top=4) == "▃▅"


def test_an_error_body_is_reported_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    # What a router answers a refused Host (403) or an older router answers (404): an error
    # body, not a status; `mlx-router status` says so and exits 1.
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps({"error": {"message": "host not allowed", "code": "host_not_allowed"}})
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        rc = console._once(f"http://127.0.0.1:{server.server_address[1]}", as_json=False, clear=False)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 1
    assert "host not allowed" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_ends_it_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mlx-router status --json | head -c 10`: no BrokenPipeError traceback."""
    import os

    from router.ops import console

    monkeypatch.setattr(console, "fetch", lambda url: {"status": "ok", "queue": {}, "x": "y" * 100_000})
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as out:
        monkeypatch.setattr("sys.stdout", out)
        assert console.main(["--json"]) in (0, 1)


def test_watch_count_must_be_positive() -> None:
    from router.ops import console

    with pytest.raises(SystemExit) as info:
        console.main(["--watch", "--count", "0"])
    assert info.value.code == 2
