"""`mlx-router status`: the status page's facts on one terminal screen (or as JSON).

It reads the router's /status, which answers without the API key, so it works over SSH
with nothing but the URL. ``render`` is pure (a body and a width in, text out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

SPARK = "▁▂▃▄▅▆▇█"
CLEAR = "\x1b[H\x1b[2J"
FETCH_TIMEOUT_S = 5.0


def fetch(url: str) -> dict[str, Any]:
    """The router's /status body (also when it answers 503: the body says why)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=FETCH_TIMEOUT_S) as resp:
            body: dict[str, Any] = json.load(resp)
    except urllib.error.HTTPError as exc:
        body = json.load(exc)
    if not isinstance(body, dict):
        raise ValueError(f"not a JSON object: {str(body)[:100]}")
    return body


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value, units = float(n), ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(value) >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{value:.0f} {units[i]}" if i == 0 else f"{value:.2f} {units[i]}"


def human_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def ago(at: float, now: float) -> str:
    s = max(0.0, now - at)
    return f"{s:.0f} s ago" if s < 90 else f"{s / 60:.0f} min ago" if s < 5400 else f"{s / 3600:.1f} h ago"


def sparkline(values: list[float], width: int, top: float | None = None) -> str:
    """The last ``width`` values as block characters, scaled to ``top`` (default their maximum)."""
    values = values[-width:]
    top = top or max(values, default=0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


def memory_bar(mem: dict[str, Any], width: int) -> str:
    """[active|cache|free] against the limit: '#' active, '+' cache, '.' the rest."""
    limit = mem.get("limit_bytes") or 0
    if limit <= 0:
        return ""
    active = round(width * min(1.0, (mem.get("active_bytes") or 0) / limit))
    cache = min(width - active, round(width * (mem.get("cache_bytes") or 0) / limit))
    return "[" + "#" * active + "+" * cache + "." * (width - active - cache) + "]"


def render(s: dict[str, Any], width: int = 80) -> str:
    now = s.get("at", time.time())
    ttft = s.get("ttft", {})
    lines = [f"Headroom  {s['status'].upper()}  {s.get('model', '')} ({s.get('version', '')})"
             f"  {time.strftime('%H:%M:%S', time.localtime(now))}",
             f"queued {s['queued']}  running {s['running']}  tokens/s {s.get('tokens_per_s', 0):.1f}"
             f"  TTFT p50 {human_s(ttft.get('p50_s'))}  p95 {human_s(ttft.get('p95_s'))}"
             f"  (last {human_s(ttft.get('last_s'))}, n={ttft.get('count', 0)})", ""]
    models = s.get("models") or []
    if len(models) > 1:  # one model is the header's; several get a line each
        lines.append("Models:")
        for m in models:
            mem = m.get("memory") or {}
            pinned = " (pinned)" if m.get("pinned") else ""
            lines.append(f"  {m['id']:<20} {m['state']}{pinned}  workers {m.get('workers', 0)}"
                         f"  queued {m.get('queued', 0)}  running {m.get('running', 0)}"
                         f"  weights {human_bytes(mem.get('weights_bytes'))}"
                         f"  used {human_bytes(mem.get('used_bytes'))}")
        lines.append("")
    for w in s.get("workers", []):
        lines += _worker_lines(w, s.get("history", []), now, width)
    lines.append("Recent rejections:" if s.get("rejections") else "Recent rejections: none")
    for r in s.get("rejections", [])[:5]:
        why = r.get("message") or (f"bad {r['param']}" if r.get("param") else "")
        lines.append(f"  {ago(r['at'], now):>10}  {r['status']} {r['code']}  {r.get('request_id') or '-'}"
                     f"  {why}")
    return "\n".join(line[:width] for line in lines)


def _worker_lines(w: dict[str, Any], history: list[dict[str, Any]], now: float, width: int) -> list[str]:
    mem = w.get("memory") or {}
    incarnation = w.get("incarnation") or "-"
    running = f"{w.get('running', 0)}/{mem['max_running_requests']}" if mem.get(
        "max_running_requests") else str(w.get("running", 0))
    model = f"{w['model']}  " if w.get("model") else ""
    lines = [f"Worker  {model}{w['state']}  pid {w.get('pid') or '-'}  incarnation {incarnation}"
             f"  restarts {w['restarts']}  running {running}  ({w.get('mode', '')})"]
    if w.get("state") != "ready" and w.get("reason"):
        lines.append(f"  why: {w['reason']}")
    exit_ = w.get("last_exit")
    if exit_:
        how = exit_.get("signal") or f"code {exit_.get('code')}"
        lines.append(f"  last exit: {how}: {exit_.get('reason')} ({ago(exit_['at'], now)})")
    if mem:
        device = mem.get("device", "?")
        if mem.get("device_name") and mem["device_name"] != device:
            device = f"{device} ({mem['device_name']})"
        lines.append(f"  memory on {device}, report {human_s(mem.get('report_age_s'))} old:"
                     f" limit {human_bytes(mem.get('limit_bytes'))}")
        lines.append("  " + memory_bar(mem, max(10, min(60, width - 4))))
        lines.append(f"  active {human_bytes(mem.get('active_bytes'))}  cache {human_bytes(mem.get('cache_bytes'))}"
                     f"  reserved {human_bytes(mem.get('reserved_bytes'))}"
                     f"  headroom {human_bytes(mem.get('headroom_bytes'))}"
                     f"  peak {human_bytes(mem.get('peak_bytes'))}")
        spark_width = max(10, min(60, width - 24))
        headroom = [h["headroom_bytes"] for h in history if h.get("headroom_bytes") is not None]
        if headroom:  # scaled to the limit: a full bar is an idle worker
            spark = sparkline(headroom, spark_width, mem.get("limit_bytes"))
            lines.append(f"  headroom, last {len(spark)} s  {spark}")
    cache = w.get("prompt_cache")
    if cache:
        lines.append("  prompt cache: " + ", ".join(
            f"{k} {human_bytes(v) if k.endswith('_bytes') else v}" for k, v in cache.items()
            if not isinstance(v, dict)))
        blocks = cache.get("blocks")
        if isinstance(blocks, dict):
            lines.append(f"  blocks of {blocks.get('block_tokens')} tokens: RAM {blocks.get('ram')}, "
                         f"disk {blocks.get('disk')}, shared {blocks.get('shared')} "
                         f"({human_bytes(blocks.get('shared_bytes'))}), written {blocks.get('written')} "
                         f"({human_bytes(blocks.get('written_bytes'))})")
    return lines + [""]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-router status",
                                description="What the running router says of itself.")
    p.add_argument("--url", help="The router's base URL (default http://HOST:PORT).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--json", action="store_true", help="Print /status as JSON, for scripts.")
    p.add_argument("--watch", action="store_true", help="Refresh the screen until Ctrl-C.")
    p.add_argument("--interval", type=float, default=2.0, help="Seconds between refreshes with --watch.")
    p.add_argument("--count", type=_positive, default=None, help="With --watch, stop after this many screens.")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(args: Sequence[str]) -> int:
    """0 when the router is ok, 1 when it is not (or does not answer)."""
    ns = parser().parse_args(list(args))
    url = ns.url or f"http://{ns.host}:{ns.port}"
    shown, rc = 0, 1
    try:
        if not ns.watch:
            return _once(url, ns.json, clear=False)
        while ns.count is None or shown < ns.count:
            if shown:
                time.sleep(max(0.1, ns.interval))
            rc = _once(url, ns.json, clear=not ns.json)
            shown += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `| head` closed the pipe: the reader has what it wanted
        # Python flushes stdout at exit and would report the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return rc


def _once(url: str, as_json: bool, clear: bool) -> int:
    try:
        body = fetch(url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"{CLEAR if clear else ''}mlx-router: no router answers at {url}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    if "status" not in body:  # not a /status body: an error (403 host, 404 older router)
        error = body.get("error")
        why = error.get("message") if isinstance(error, dict) else json.dumps(body)[:300]
        print(f"{CLEAR if clear else ''}mlx-router: {url} does not give a status: {why}",
              file=sys.stderr, flush=True)
        return 1
    if as_json:
        text = json.dumps(body)
    else:
        text = (CLEAR if clear else "") + render(body, shutil.get_terminal_size((100, 40)).columns)
    print(text, flush=True)
    return 0 if body.get("status") == "ok" else 1
