"""Multi-turn chat workloads and their figures (pure: no servers, no MLX).

A conversation is what an agent sends all day: a long system prompt with tool
definitions, then turns that only ever append (user message, the model's own reply, the
next user message). Each conversation's system prompt starts with its own tag and random
words, so no conversation can reuse another's (or an earlier run's) cache: its first turn
is cold everywhere, and every later turn can reuse the turn before it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.metrics import percentile
from bench.prompts import make_prompt

def string_tools(specs: list[tuple[str, str, dict[str, str]]]) -> list[dict[str, Any]]:
    """OpenAI tool definitions from (name, description, {parameter: description}), every
    parameter a required string."""
    return [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": d}
                                                        for p, d in params.items()},
                       "required": list(params)}}}
        for name, description, params in specs]


# What a coding agent declares (shortened): they are rendered into the system turn.
TOOLS: list[dict[str, Any]] = string_tools([
    ("read_file", "Read a file from the workspace and return its text.",
     {"path": "The file's path, relative to the workspace root."}),
    ("run_command", "Run a shell command in the workspace and return its output.",
     {"command": "The command line.", "timeout_s": "Seconds before it is stopped."}),
    ("search", "Search the workspace for a regular expression.",
     {"pattern": "The expression.", "glob": "Which files to search."}),
    ("edit_file", "Replace one exact string in a file with another.",
     {"path": "The file.", "old": "The text to replace.", "new": "The replacement."}),
])


@dataclass(frozen=True, slots=True)
class Conversation:
    tag: str
    system: str
    users: tuple[str, ...]
    num_tools: int = len(TOOLS)     # the first num_tools of TOOLS go with every turn

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """The request for ``turn`` (0-based): everything before it, unchanged, then its
        user message; ``replies`` are the assistant's answers to the earlier turns."""
        if len(replies) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
        messages = [{"role": "system", "content": self.system}]
        for i in range(turn + 1):
            messages.append({"role": "user", "content": self.users[i]})
            if i < turn:
                messages.append({"role": "assistant", "content": replies[i]})
        return messages


def make_conversations(encode: Callable[[str], list[int]], label: str, num: int, *,
                       system_tokens: int, turns: int, turn_tokens: int,
                       num_tools: int = len(TOOLS)) -> list[Conversation]:
    """``num`` conversations of ``turns`` user messages; token counts are upper bounds."""
    rng = random.Random()  # unseeded: a rerun must not find an earlier run's cache on disk
    out = []
    for i in range(num):
        tag = f"{label}-{i}-{rng.randrange(1 << 30):x}"
        system = make_prompt(encode, f"You are agent {tag}.", system_tokens, rng).text
        users = tuple(make_prompt(encode, f"Turn {t}:", turn_tokens, rng).text for t in range(turns))
        out.append(Conversation(tag, system, users, num_tools))
    return out


@dataclass(slots=True)
class TurnResult:
    system: str
    concurrency: int
    conversation: int
    turn: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None   # None: the system does not report it
    after_restart: bool = False


def summarize(results: list[TurnResult]) -> dict[str, Any]:
    """Cold = first turns; cached = later turns (not the one after a restart)."""
    good = [r for r in results if r.ok and r.ttft_s is not None]
    cold = [r.ttft_s for r in good if r.turn == 0 and not r.after_restart]
    later = [r for r in good if r.turn > 0 and not r.after_restart]
    warm = [r.ttft_s for r in later]
    prompt = sum(r.prompt_tokens for r in later)
    cached = sum(r.cached_tokens or 0 for r in later)
    cold_p50, warm_p50 = percentile(cold, 50), percentile(warm, 50)  # type: ignore[arg-type]
    return {"requests": len(results), "errors": len(results) - len(good),
            "error_samples": sorted({r.error or "" for r in results if not r.ok})[:3],
            "cold_ttft_p50_s": cold_p50, "cached_ttft_p50_s": warm_p50,
            "cached_over_cold": warm_p50 / cold_p50 if cold and warm else float("nan"),
            "cached_token_ratio": cached / prompt if prompt else float("nan"),
            "reports_cached_tokens": any(r.cached_tokens is not None for r in later),
            "cold_prompt_tokens_mean": (sum(r.prompt_tokens for r in good if r.turn == 0)
                                        / max(1, len(cold))),
            "turns": [asdict(r) for r in results]}


def _f(value: Any, fmt: str) -> str:
    return "–" if value is None or value != value else format(value, fmt)


def render(doc: dict[str, Any]) -> str:
    """The tables: per system and concurrency, the restart rows, then the target ratios."""
    results = doc["results"]
    lines = ["| system | c | cold TTFT p50 s | cached TTFT p50 s | cached ÷ cold | cached-token ratio "
             "| peak RSS MiB | errors |", "|---|---|---|---|---|---|---|---|"]
    for name, per in results.items():
        for key, s in per.items():
            if not key.startswith("c"):
                continue
            ratio = _f(s["cached_token_ratio"], ".2f") if s["reports_cached_tokens"] else "0 (not reported)"
            lines.append(f"| {name} | {key[1:]} | {_f(s['cold_ttft_p50_s'], '.3f')} | "
                         f"{_f(s['cached_ttft_p50_s'], '.3f')} | {_f(s['cached_over_cold'], '.3f')} | "
                         f"{ratio} | {s['peak_rss_bytes'] / 2**20:.0f} | {s['errors']} |")
    restarts = {n: per["restart"] for n, per in results.items() if "restart" in per}
    if restarts:
        lines += ["", "| after a SIGKILL | back after s | TTFT s | cached / prompt tokens "
                  "| TTFT ÷ own cold TTFT (c = 1) |", "|---|---|---|---|---|"]
        for name, r in restarts.items():
            cold = results[name].get("c1", {}).get("cold_ttft_p50_s")
            vs = r["ttft_s"] / cold if r["ok"] and cold else None
            lines.append(f"| {name} | {r['back_after_s']:.1f} | {_f(r['ttft_s'], '.3f')} | "
                         f"{r['cached_tokens'] or 0} / {r['prompt_tokens']} | {_f(vs, '.3f')} |")
    hr, ml = results.get("headroom", {}), results.get("mlx_lm_server", {})
    both = [k for k in hr if k.startswith("c") and k in ml]
    lines += [""] if both else []
    for key in both:
        a, b = hr[key]["cached_ttft_p50_s"], ml[key]["cached_ttft_p50_s"]
        lines.append(f"c = {key[1:]}: Headroom's cached-turn TTFT ÷ mlx_lm.server's = "
                     f"{_f(a / b if b else None, '.3f')} (target ≤ 1); ÷ its own cold = "
                     f"{_f(hr[key]['cached_over_cold'], '.3f')} (target ≤ 0.2)")
    return "\n".join(lines)
