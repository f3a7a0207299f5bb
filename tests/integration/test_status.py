"""The status page, /status, `mlx-router status` and request ids, on one router with a key.

The router runs with --api-key, JSON logs at DEBUG: the page and its data must work without
the key and never show it, and a request's id must reach every log line in both processes.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, wait_until
from tests.integration.conftest import ROOT, Router, start_router

KEY = "sk-status-page-test-key"
CHROMIUM_TIMEOUT_S = 90
CLI_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Router]:
    r = start_router(tmp_path_factory.mktemp("status"), cache_home, "--api-key", KEY,
                     "--log-format", "json", "--log-level", "debug")
    yield r
    r.stop()


def log_records(router: Router) -> list[dict[str, Any]]:
    records = []
    for line in router.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a concurrent write
    return records


def about(router: Router, request_id: str) -> list[dict[str, Any]]:
    return [r for r in log_records(router) if r.get("request_id") == request_id]


def chat(router: Router, request_id: str | None) -> tuple[Any, Any]:
    """(the response headers, the parsed completion), the client closed after."""
    headers = {"X-Request-Id": request_id} if request_id is not None else {}
    with router.client(api_key=KEY) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            extra_headers=headers)
        return raw.headers, raw.parse()


def test_the_ttft_split_places_every_stage_from_both_processes_logs(router: Router) -> None:
    """bench/ttft_split.py reads this router's DEBUG lines (the worker's relayed ones too):
    every traced request has all its stages and the worker's admission by part, so a log
    line renamed in either process breaks the tool here, not on the lent GPU."""
    from bench import ttft_split

    prompts = [f"split {i}: a short prompt for the stages" for i in range(4)]
    traces = asyncio.run(ttft_split.send(router.url, prompts, max_tokens=3, gap_s=0.05, api_key=KEY))

    def placed() -> dict[str, Any] | None:  # the relayed worker lines may trail a moment
        ttft_split.read_log(router.log_path.read_text(errors="replace"), traces)
        doc = ttft_split.summarize(traces)
        return doc if doc["requests"] == len(prompts) - 2 else None

    doc = wait_until(placed, 10, "every request's stages in the log", on_fail=router.log)
    assert doc["untraced"] == 0
    for stage in (*ttft_split.STAGES, "total"):
        assert math.isfinite(doc[stage]["p50_ms"]), stage
    assert set(doc["admission parts p50_ms"]) == set(ttft_split.ADMIT_PARTS)
    assert len(doc["first"]) == 2 and all(first is not None for first in doc["first"])


def status(router: Router) -> dict[str, Any]:
    return router.http.get("/status").json()


# -- request ids ---------------------------------------------------------------------------

def test_request_id_round_trip_into_both_processes_logs(router: Router) -> None:
    headers, completion = chat(router, "trace-0001.a")
    assert headers["x-request-id"] == "trace-0001.a"
    assert completion.id == "chatcmpl-trace-0001.a"
    assert completion._request_id == "trace-0001.a"  # what the openai client reads
    worker = status(router)["workers"][0]

    life = [("router.fleet.dispatch", "queued"), ("router.fleet.dispatch", "dispatched"),
            ("worker.core", "admitted"), ("router.fleet.dispatch", "first token"),
            ("worker.core", "finished"), ("router.http.api", "finished")]

    def whole_life() -> list[dict[str, Any]] | None:
        records = about(router, "trace-0001.a")
        seen = all(any(r["logger"] == logger and r["msg"].startswith(what) for r in records)
                   for logger, what in life)
        return records if seen else None

    records = wait_until(whole_life, 10, "the request's life in both processes' logs",
                         on_fail=router.log)
    worker_lines = [r for r in records if r["logger"].startswith("worker.")]
    assert all(str(r["incarnation"]) == worker["incarnation"] and r["model"] == "demo"
               for r in worker_lines)
    finished = next(r for r in records if r["logger"] == "router.http.api")
    assert finished["level"] == "info" and str(finished["incarnation"]) == worker["incarnation"]
    assert finished["model"] == "demo"
    assert not [r for r in records if r["level"] == "info" and r["logger"] != "router.http.api"]


def test_an_insane_request_id_is_replaced_and_a_missing_one_generated(router: Router) -> None:
    for sent in ("has space/and slash", "x" * 200, None):
        headers, completion = chat(router, sent)
        got = headers["x-request-id"]
        assert got != sent and re.fullmatch(r"[0-9a-f]{24}", got)
        assert completion.id == f"chatcmpl-{got}"


def test_streams_and_errors_carry_the_request_id(router: Router) -> None:
    body = {"model": "demo", "prompt": "hi", "max_tokens": 3, "stream": True}
    with router.http.stream("POST", "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "s-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines()
               if line.startswith("data: {")}
    assert ids == {"cmpl-s-1"}
    refused = router.http.post("/v1/completions", json=body, headers={"X-Request-Id": "no-key-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key-1"
    shown = wait_until(lambda: [r for r in status(router)["rejections"]
                                if r["request_id"] == "no-key-1"], 5, "the 401 in /status")
    assert shown[0]["code"] == "unauthorized" and shown[0]["status"] == 401


def test_a_client_id_shaped_like_a_row_does_not_take_another_requests_row(router: Router) -> None:
    # Request "r7" with n=2 has two rows; a second client naming itself "r7-0" while it
    # streams must not replace (and so orphan) either of them.
    body = {"model": "demo", "prompt": "hi", "max_tokens": 24, "n": 2, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with router.http.stream("POST", "/v1/completions", json=body,
                            headers={**headers, "X-Request-Id": "r7"}) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        other = router.http.post("/v1/completions", headers={**headers, "X-Request-Id": "r7-0"},
                                 json={"model": "demo", "prompt": "hi", "max_tokens": 2,
                                       "ignore_eos": True})
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert other.status_code == 200 and other.json()["id"] == "cmpl-r7-0"
    finishes = {c["index"]: c["finish_reason"] for chunk in rest for c in chunk["choices"]
                if c.get("finish_reason")}
    assert finishes == {0: "length", 1: "length"}


# -- what answers without the key, and what it never shows ------------------------------

def test_page_and_data_answer_without_the_key_and_never_show_it(router: Router) -> None:
    assert router.http.get("/v1/models").status_code == 401
    page = router.http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    texts = [page.text]
    for name in ("status.js", "status.css"):
        r = router.http.get(f"/static/{name}")
        assert r.status_code == 200
        texts.append(r.text)
    r = router.http.get("/status")
    assert r.status_code == 200
    texts.append(r.text)
    for text in texts:
        assert KEY not in text and str(router.log_path.parent) not in text and "http" not in text.replace(
            "http://www.w3.org/2000/svg", "")
    for bad in ("/static/status.py", "/static/..%2F__init__.py", "/static/.hidden.js", "/static/nope.js"):
        assert router.http.get(bad).status_code == 404, bad
    assert router.http.get("/status", params={"since": "soon"}).status_code == 400


def test_status_history_grows_and_since_returns_only_newer(router: Router) -> None:
    def two_with_memory() -> list[dict[str, Any]] | None:
        rows = [h for h in status(router)["history"] if h["active_bytes"] is not None]
        return rows if len(rows) >= 2 else None

    rows = wait_until(two_with_memory, 10, "two memory samples in /status")
    newer = router.http.get("/status", params={"since": rows[-1]["at"]}).json()["history"]
    assert all(h["at"] > rows[-1]["at"] for h in newer)
    s = status(router)
    assert s["ttft"]["count"] >= 1 and s["ttft"]["p50_s"] > 0
    assert s["workers"][0]["memory"]["limit_bytes"] > 0


# -- the page in a real browser ------------------------------------------------------------

def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is missing: install Debian's `chromium` (.ci/run does)"
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000", "--window-size=1280,1000", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)


def test_the_page_in_headless_chromium(router: Router, tmp_path: Path) -> None:
    pid = router.worker()["pid"]
    # Two samples with memory: alone on a fresh router, the first ones precede the worker's report.
    wait_until(lambda: len([h for h in status(router)["history"] if h["active_bytes"] is not None]) >= 2,
               10, "two memory samples in /status")
    shot = tmp_path / "status-page.png"
    done = chromium(tmp_path, "--dump-dom", f"--screenshot={shot}", router.url + "/")
    dom = done.stdout
    assert done.returncode == 0 and "</html>" in dom, done.stderr[-2000:]
    assert f'data-field="pid">{pid}<' in dom
    name = status(router)["workers"][0]["memory"]["device_name"]  # the CPU's name here; on a Mac, its chip
    assert f"<td>cpu · {name}</td>" in dom, "the device and its name"
    assert re.search(r'id="models-panel"[^>]*hidden', dom), "one model: no models table"
    assert "<dt>hits</dt>" in dom and "cache-worker" not in dom, "one worker's cache, unnamed"
    points = re.search(r'id="mem-chart"[^>]*data-points="(\d+)"', dom)
    assert points and int(points.group(1)) >= 2, dom[:4000]
    assert dom.count("<polyline") >= 4 and 'class="badge ok"' in dom
    assert KEY not in dom
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- mlx-router status ---------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", "status", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "100"})


def test_mlx_router_status_screen_json_and_watch(router: Router) -> None:
    pid = router.worker()["pid"]
    screen = cli("--url", router.url)
    assert screen.returncode == 0, screen.stderr
    assert "Headroom  OK  demo" in screen.stdout and f"pid {pid}" in screen.stdout
    assert "limit " in screen.stdout and "headroom " in screen.stdout

    as_json = cli("--url", router.url, "--json")
    assert as_json.returncode == 0
    body = json.loads(as_json.stdout)
    assert body["status"] == "ok" and body["workers"][0]["pid"] == pid

    watched = cli("--port", str(router.port), "--watch", "--interval", "0.1", "--count", "2")
    assert watched.returncode == 0 and watched.stdout.count("\x1b[H\x1b[2J") == 2

    nobody = cli("--url", f"http://127.0.0.1:{free_port()}")
    assert nobody.returncode == 1 and "no router answers" in nobody.stderr
