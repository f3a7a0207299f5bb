"""Coding-agent sessions for `python -m bench agents` (pure: no servers, no MLX).

A session is what a coding agent sends turn after turn: a system prompt and tool
definitions (shared by every session, as one agent's are), the user's task, then
exchanges that only ever append: the assistant's answer (text and a tool call) and the
tool's result. Each turn adds ~`turn_tokens` (the previous answer plus a tool result), so
a session grows from ~`system_tokens` to ~`grow_to_tokens`; the bench measures its last
`turns` turns. The first of them is cold (no system has seen the session: its earlier
exchanges arrive in one prompt, as when an agent resumes), every later one can reuse the
turn before it.

Every system gets exactly the same token sequences: the assistant answers are scripted
(not the model's own output, which would differ between systems), and each turn's prompt
is rendered once with the model's chat template. The scripted answers also diverge from
what the server generated, as real agents' re-serialized answers do, so a cache reuses
the previous prompt, not the previous generation.

Sessions differ from their first tokens on (each repetition's system prompt starts with
its own random tag, from an unseeded generator) so nothing can reuse an earlier
workload's or run's cache; within one workload the sessions share the system prompt's
body and the tools, and differ from the environment block at its end, and in their task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.prompts import WORDS, make_prompt

Message = dict[str, Any]
# render(messages, tools) -> the prompt's token ids with the generation prompt, as a
# server renders an OpenAI chat request (messages in the wire shape: see template_messages).
Render = Callable[[list[Message], list[dict[str, Any]]], list[int]]


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _i(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": description, **extra}


# What a coding agent declares (Claude Code, Codex, OpenCode and Cline send 8-20 of these).
AGENT_TOOLS: list[dict[str, Any]] = [
    _fn("read_file", "Read a file from the workspace. Returns its lines prefixed with line numbers. "
        "Use offset and limit for large files; read a file before editing it.",
        {"path": _s("Path of the file, relative to the workspace root."),
         "offset": _i("First line to read (1-based).", minimum=1),
         "limit": _i("Number of lines to read.", minimum=1, maximum=2000)}, ["path"]),
    _fn("write_file", "Create a file, or overwrite an existing one, with the given content.",
        {"path": _s("Path of the file, relative to the workspace root."),
         "content": _s("The whole new content of the file.")}, ["path", "content"]),
    _fn("edit_file", "Replace an exact string in a file. The old string must occur exactly once "
        "unless replace_all is set; keep indentation as it is in the file.",
        {"path": _s("Path of the file."), "old_string": _s("The exact text to replace."),
         "new_string": _s("The replacement text."),
         "replace_all": {"type": "boolean", "description": "Replace every occurrence.", "default": False}},
        ["path", "old_string", "new_string"]),
    _fn("list_directory", "List the entries of a directory, with sizes and kinds.",
        {"path": _s("Directory, relative to the workspace root."),
         "ignore": {"type": "array", "items": {"type": "string"}, "description": "Glob patterns to skip."}},
        ["path"]),
    _fn("grep", "Search file contents with a regular expression (ripgrep syntax).",
        {"pattern": _s("The regular expression."), "path": _s("File or directory to search."),
         "glob": _s("Only files matching this glob, e.g. '*.py'."),
         "output_mode": _s("What to return.", enum=["content", "files_with_matches", "count"]),
         "context_lines": _i("Lines of context around each match.", minimum=0, maximum=20)},
        ["pattern"]),
    _fn("glob", "Find files by name with a glob pattern, newest first.",
        {"pattern": _s("The glob, e.g. 'src/**/*.ts'."), "path": _s("Directory to search in.")},
        ["pattern"]),
    _fn("run_command", "Run a shell command in the workspace and return its exit code, stdout "
        "and stderr. Long-running commands are stopped after the timeout.",
        {"command": _s("The command line."), "description": _s("Five to ten words on what it does."),
         "timeout_s": _i("Seconds before it is stopped.", minimum=1, maximum=600),
         "cwd": _s("Working directory, relative to the workspace root.")}, ["command"]),
    _fn("update_plan", "Record the task list: what is done, what is in progress, what is next.",
        {"items": {"type": "array", "description": "The whole list, in order.", "items": {
            "type": "object", "properties": {
                "step": _s("What to do."),
                "status": _s("Where it stands.", enum=["pending", "in_progress", "completed"])},
            "required": ["step", "status"]}}},
        ["items"]),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """Sizes in tokens of the served model's tokenizer (targets: each piece is fitted to
    at most its share; the rendered counts are what the report shows)."""

    system_tokens: int      # system prompt + tool definitions, as rendered
    grow_to_tokens: int     # the last measured turn's prompt (0: no earlier exchanges)
    turn_tokens: int        # new tokens a turn: the previous answer plus a tool result
    num_turns: int          # measured turns per session; the first is cold
    num_tools: int = len(AGENT_TOOLS)

    def __post_init__(self) -> None:
        if self.num_turns < 2:
            raise ValueError("num_turns must be >= 2: one cold turn and at least one cached turn")
        if min(self.system_tokens, self.turn_tokens) < 32 or self.grow_to_tokens < 0:
            raise ValueError("system_tokens and turn_tokens must be >= 32, grow_to_tokens >= 0")
        if not 0 <= self.num_tools <= len(AGENT_TOOLS):
            raise ValueError(f"num_tools must be within 0..{len(AGENT_TOOLS)}")


@dataclass(frozen=True, slots=True)
class Session:
    tag: str
    messages: tuple[Message, ...]               # the whole conversation the last turn sends
    turn_ends: tuple[int, ...]                  # turn t sends messages[:turn_ends[t]]
    prompt_ids: tuple[tuple[int, ...], ...]     # turn t's rendered prompt
    tool_times_s: tuple[float, ...]             # the pause after turn t ("tool time")
    tools: tuple[dict[str, Any], ...]

    def request(self, turn: int) -> list[Message]:
        """Turn ``turn``'s messages, in the OpenAI wire shape (arguments as JSON text)."""
        return [dict(m) for m in self.messages[:self.turn_ends[turn]]]

    def new_tokens(self, turn: int) -> int:
        """Tokens this turn adds to the one before (the whole prompt on the first turn)."""
        before = len(self.prompt_ids[turn - 1]) if turn else 0
        return len(self.prompt_ids[turn]) - before


def template_messages(messages: Sequence[Message]) -> list[Message]:
    """What a server hands its chat template: tool-call arguments parsed from JSON text to
    objects (mlx_lm.server and Headroom's router both do this)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _parsed(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _parsed(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def tool_times(rng: random.Random, num: int, range_s: tuple[float, float]) -> tuple[float, ...]:
    low, high = range_s
    return tuple(round(rng.uniform(low, high), 3) for _ in range(num))


def _call_arguments(tool: dict[str, Any], k: int, rng: random.Random) -> dict[str, Any]:
    """Plausible values for the tool's required parameters."""
    params = tool["function"]["parameters"]
    out: dict[str, Any] = {}
    for name in params["required"]:
        kind = params["properties"][name]["type"]
        word = rng.choice(WORDS)
        out[name] = (f"src/{word}_{k}.py" if "path" in name else
                     [{"step": f"fix {word}", "status": "in_progress"}] if kind == "array" else
                     k if kind == "integer" else f"{word} {k}")
    return out


def _exchange(encode: Callable[[str], list[int]], tools: Sequence[dict[str, Any]], k: int,
              answer_tokens: int, result_tokens: int, rng: random.Random) -> tuple[Message, Message]:
    """The assistant's answer with one tool call, and the tool's result."""
    tool = tools[k % len(tools)] if tools else None
    text = make_prompt(encode, f"Step {k}:", answer_tokens, rng).text
    answer: Message = {"role": "assistant", "content": text}
    if tool is None:
        return answer, {"role": "user", "content": make_prompt(encode, f"Result {k}:", result_tokens, rng).text}
    call_id = f"call_{k}"
    answer["tool_calls"] = [{"id": call_id, "type": "function", "function": {
        "name": tool["function"]["name"], "arguments": json.dumps(_call_arguments(tool, k, rng))}}]
    result = make_prompt(encode, f"exit 0, {k}:", result_tokens, rng).text
    return answer, {"role": "tool", "tool_call_id": call_id, "content": result}


def make_sessions(encode: Callable[[str], list[int]], render: Render, label: str, num: int,
                  shape: Shape, *, tool_time_s: tuple[float, float], seed: int) -> list[Session]:
    """``num`` sessions of one workload. ``seed`` fixes the tool times (the same for every
    system); the words are unseeded, so no run finds an earlier one's cache."""
    words = random.Random()
    times = random.Random(seed)
    tools = list(AGENT_TOOLS[:shape.num_tools])
    fixed = len(render([{"role": "system", "content": ""}], tools))
    envs = [f"\n\nEnvironment: session {i}, working directory /work/project-{i}." for i in range(num)]
    body_tokens = shape.system_tokens - fixed - max(len(encode(e)) for e in envs)
    if body_tokens < 16:
        need = shape.system_tokens - body_tokens + 16
        raise ValueError(f"the tools (and template) take {fixed} tokens of this tokenizer, each "
                         f"session's environment line {need - 16 - fixed}: give at least {need} "
                         "system tokens, or fewer tools")
    tag = f"{label}-{words.randrange(1 << 30):x}"
    body = make_prompt(encode, f"You are coding agent {tag}.", body_tokens, words).text
    answer_tokens = max(8, shape.turn_tokens // 4)
    sessions = []
    for i, env in enumerate(envs):
        system = {"role": "system", "content": body + env}
        task = {"role": "user", "content": make_prompt(encode, f"Task {i}:", shape.turn_tokens // 2, words).text}
        head = [system, task]
        head_tokens = len(render(head, tools))
        probe = _exchange(encode, tools, 0, answer_tokens, 8, words)
        overhead = len(render([*head, *probe], tools)) - head_tokens - answer_tokens - 8
        result_tokens = max(8, shape.turn_tokens - answer_tokens - max(0, overhead))
        earlier = num_earlier_exchanges(head_tokens, shape)
        messages = list(head)
        for k in range(earlier + shape.num_turns - 1):
            messages += _exchange(encode, tools, k, answer_tokens, result_tokens, words)
        ends = tuple(len(head) + 2 * (earlier + t) for t in range(shape.num_turns))
        prompts = tuple(tuple(render(messages[:end], tools)) for end in ends)
        sessions.append(Session(f"{tag}-{i}", tuple(messages), ends, prompts,
                                tool_times(times, shape.num_turns, tool_time_s), tuple(tools)))
    return sessions


def num_earlier_exchanges(head_tokens: int, shape: Shape) -> int:
    """Exchanges before the first measured turn, so the last one's prompt is ~grow_to."""
    gap = shape.grow_to_tokens - head_tokens - (shape.num_turns - 1) * shape.turn_tokens
    return max(0, round(gap / shape.turn_tokens))


def accounting(sessions: Sequence[Session]) -> dict[str, Any]:
    """The token counts the report prints: what a turn sends and what it adds."""
    first = [len(s.prompt_ids[0]) for s in sessions]
    last = [len(s.prompt_ids[-1]) for s in sessions]
    new = [s.new_tokens(t) for s in sessions for t in range(1, len(s.prompt_ids))]
    return {"sessions": len(sessions), "turns": len(sessions[0].prompt_ids) if sessions else 0,
            "first_prompt_tokens_mean": _mean(first), "last_prompt_tokens_mean": _mean(last),
            "new_tokens_per_turn_mean": _mean(new), "new_tokens_per_turn_min": min(new, default=0),
            "new_tokens_per_turn_max": max(new, default=0),
            "earlier_exchanges": (sessions[0].turn_ends[0] - 2) // 2 if sessions else 0,
            "tool_time_s_total": round(sum(sum(s.tool_times_s[:-1]) for s in sessions), 3)}


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else float("nan")
