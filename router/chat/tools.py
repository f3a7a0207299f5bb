"""Tool calls in model output, per model family: parse them (streaming) and force them (grammar).

Pure text in, text out, and no MLX: every API handler (chat completions, Anthropic
Messages, Responses) uses the same ``OutputParser``. It splits one choice's text stream
into content, reasoning (between the template's thinking markers) and tool calls, and
never emits a character that a later chunk could turn into a marker. A call is emitted
whole once its closing marker (or the end of the output) is seen: its id and name first,
then its arguments, as OpenAI's incremental ``delta.tool_calls`` expect.

Families (``FORMATS``), chosen from the chat template's markers or forced by a flag:
``hermes`` (Hermes, Qwen 2.5/3: ``<tool_call>{json}</tool_call>``), ``qwen3_coder``
(``<tool_call><function=f><parameter=p>v</parameter></function></tool_call>``),
``llama3_json`` (Llama 3.x: the output is ``{"name": f, "parameters": {...}}``, maybe after
``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]f[ARGS]{...}``)
and ``harmony`` (GPT-OSS channels, in ``router/chat/harmony.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.errors import BadRequest
from router.chat.constraints import guided_schema
from router.chat.harmony import HarmonyParser
from router.chat.streamparser import Delta, StreamParser, ToolCall, held_back, new_call_id, scan
from router.chat.toolspec import Tool, ToolChoice

__all__ = ["FORMATS", "MARKERS", "OutputParser", "detect_format", "call_grammar", "make_parser"]


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:  # cut short (constrained decoding writes whole JSON)
            return ToolCall(new_call_id(), obj["name"], args, complete=False)
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(body: str) -> list[ToolCall] | None:
    """One object, a list of them, or several separated by ';' or newlines; None if not."""
    body = body.strip()
    try:
        parsed = json.loads(body)
        objs = parsed if isinstance(parsed, list) else [parsed]
    except ValueError:
        parts = [p for p in re.split(r";\s*|\n+(?=\{)", body) if p.strip()]
        try:
            objs = [json.loads(p) for p in parts]
        except ValueError:
            return None
    calls = [_call_from_object(o) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|$)", re.S)


_CUT_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)
# What a call's body starts with (a JSON object or list, Qwen3-Coder's <function=), or nothing yet
_CALL_START = re.compile(r"\s*(?:[{\[<]|\Z)")
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)
_BETWEEN = re.compile(r"[\s\[\],;]*")


def _cut_calls(body: str) -> list[ToolCall] | None:
    """JSON calls the output ended inside: the whole ones, then the cut one once its name is
    whole, with the arguments written so far (as OpenAI and Anthropic return a call cut by
    the token limit); None if there is not even one whole name."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        i = _BETWEEN.match(body, i).end()  # type: ignore[union-attr]
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            break
        if (call := _call_from_object(obj)) is None:
            return None
        calls.append(call)
    cut = _cut_call(body[i:])
    return [*calls, cut] if cut is not None else calls or None


def _cut_call(text: str) -> ToolCall | None:
    if (m := _CUT_NAME.match(text)) is None:
        return None
    rest = text[m.end():]
    if key := _ARGS_KEY.match(rest):
        args = rest[key.end():].rstrip()
    elif any(k.startswith(re.sub(r"\s+", "", rest)) for k in (',"arguments":', ',"parameters":')):
        args = ""  # cut inside the key before the arguments
    else:
        return None  # another key after "name": an object, not a call
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return ToolCall(new_call_id(), name, args, complete=False)


def _xml_calls(body: str) -> list[ToolCall] | None:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        args: dict[str, Any] = {}
        for pname, raw in _PARAMETER.findall(inner):
            try:
                args[pname] = json.loads(raw)
            except ValueError:
                args[pname] = raw  # Qwen3-Coder writes strings bare
        calls.append(ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False)))
    return calls or None


def _mistral_calls(body: str) -> list[ToolCall] | None:
    if "[ARGS]" in body:  # v11+: name[ARGS]{json}, one per [TOOL_CALLS]
        calls = []
        parts = body.split("[TOOL_CALLS]")
        if "[ARGS]" not in parts[-1]:  # the output ended in the last call's name
            parts.pop()
        for part in parts:
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                return None
            call = _call_from_object({"name": name.strip(), "arguments": args.strip()})
            if call is None:
                return None
            calls.append(call)
        return calls
    return _json_calls(body)


@dataclass(frozen=True, slots=True)
class Format:
    """A family's call markers, how to read a call's body, and how to force one."""

    name: str
    start: str                  # marker that opens a call ("" = the output starts as a call)
    end: str                    # marker that closes it ("" = the end of the output)
    read: Any                   # body text → list[ToolCall] | None
    template: str               # lark for one call, with NAME and ARGS (a %json rule) in it
    whole_end: str = ""         # a whole call's body ends so, where ``read`` takes a cut one


# Call templates: @@X@@ is a marker (a special token's id where the tokenizer has one, else
# its text), NAME the function's name, ARGS its JSON arguments, XMLARGS Qwen3-Coder's.
FORMATS: dict[str, Format] = {
    "hermes": Format("hermes", "<tool_call>", "</tool_call>", _json_calls,
                     '@@<tool_call>@@ "\\n{\\"name\\": \\"NAME\\", \\"arguments\\": " ARGS '
                     '"}\\n" @@</tool_call>@@'),
    "qwen3_coder": Format("qwen3_coder", "<tool_call>", "</tool_call>", _xml_calls,
                          '@@<tool_call>@@ "\\n<function=NAME>\\n" XMLARGS "</function>\\n" '
                          '@@</tool_call>@@', whole_end="</function>"),
    "llama3_json": Format("llama3_json", "", "", _json_calls,
                          '"{\\"name\\": \\"NAME\\", \\"parameters\\": " ARGS "}"'),
    "mistral": Format("mistral", "[TOOL_CALLS]", "", _mistral_calls,
                      '@@[TOOL_CALLS]@@ "[{\\"name\\": \\"NAME\\", \\"arguments\\": " ARGS "}]"'),
    "harmony": Format("harmony", "", "", None,
                      '@@<|channel|>@@ "commentary to=functions.NAME " @@<|constrain|>@@ "json" '
                      '@@<|message|>@@ ARGS @@<|call|>@@'),
}
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                "<|return|>"),
}


# Families whose template writes several calls in one turn, and what it writes between them
# (Llama 3.x takes one call a turn; Mistral's list and harmony's messages are not forced
# to more than one).
PARALLEL_SEPARATORS = {"hermes": '"\\n"', "qwen3_coder": '"\\n"'}


def detect_format(template: str | None) -> str | None:
    """The tool-call family a chat template speaks, from its markers; None if it takes none."""
    if not template or "tools" not in template:
        return None
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


class OutputParser(StreamParser):
    """One choice's text stream → content, reasoning and tool calls (see the module doc)."""

    def __init__(self, fmt: Format | None, think: tuple[str, str] | None = None,
                 in_reasoning: bool = False, forced: bool = False, one_call: bool = False) -> None:
        self.fmt = fmt
        self.forced = forced        # a grammar forces a call: text outside it is markup
        self.one_call = one_call    # parallel calls off: calls after the first are dropped
        self._calls = 0
        self.think = think
        self.mode = "reasoning" if think and in_reasoning else "content"
        self.buf = ""
        self._started = False       # any content seen (llama3_json decides on the first)
        self._strip = False         # drop whitespace right after a closing marker

    def finish(self) -> Delta:
        out = self.feed("")
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            out.reasoning += rest
        elif self.mode == "call":
            assert self.fmt is not None
            calls = self.fmt.read(rest)
            if calls and self.fmt.whole_end and not rest.rstrip().endswith(self.fmt.whole_end):
                calls[-1].complete = False
            calls = calls or _cut_calls(rest)  # the output ended inside (max_tokens, a stop)
            if calls:
                self._emit(out, calls)
            elif not (self.forced or (self.fmt.start and _CALL_START.match(rest))):
                # (after a call marker, a body that starts as a call is one cut before its
                # name: no markup in the content; without a marker, it may be an answer)
                out.content += self.fmt.start + rest
        elif not self.forced:  # forced, what is held back can only be a call marker's start
            out.content += rest
        return out

    def _step(self, out: Delta) -> bool:
        if self._strip:
            if not self.buf.strip():
                return False
            self.buf, self._strip = self.buf.lstrip(), False
        if self.mode == "reasoning":
            assert self.think is not None
            safe, self.buf, found = scan(self.buf, self.think[1])
            out.reasoning += safe
            if found:
                self.mode, self._strip = "content", True
            return found
        if self.mode == "call":
            assert self.fmt is not None
            if not self.fmt.end:
                return False  # the call runs to the end of the output
            body, rest, found = scan(self.buf, self.fmt.end)
            if not found:
                return False
            calls = self.fmt.read(self.buf[:len(body)])
            if calls:
                self._emit(out, calls)
            else:  # not a call after all: show it as it was written
                out.content += self.fmt.start + body + self.fmt.end
            self.buf, self.mode, self._strip = rest, "content", True
            return True
        return self._content(out)

    def _emit(self, out: Delta, calls: list[ToolCall]) -> None:
        if self.one_call:
            calls = calls[:max(0, 1 - self._calls)]
        self._calls += len(calls)
        out.calls.extend(calls)

    def _content(self, out: Delta) -> bool:
        fmt = self.fmt
        if fmt is not None and not fmt.start and not self._started:
            head = self.buf.lstrip()
            if not head or (len(head) < len("<|python_tag|>") and "<|python_tag|>".startswith(head)):
                return False
            self._started = True
            if head.startswith(("{", "[", "<|python_tag|>")):
                self.buf, self.mode = head.removeprefix("<|python_tag|>"), "call"
                return True
        markers = [m for m in (self.think[0] if self.think else "", fmt.start if fmt else "") if m]
        hits = [(self.buf.find(m), m) for m in markers if m in self.buf]
        if hits:
            i, marker = min(hits)
            out.content += self.buf[:i]
            self.buf = self.buf[i + len(marker):]
            self.mode = "reasoning" if self.think and marker == self.think[0] else "call"
            self._started = True
            return True
        hold = max((held_back(self.buf, m) for m in markers), default=0)
        safe = self.buf[:len(self.buf) - hold]
        out.content += safe
        self._started = self._started or bool(safe.strip())
        self.buf = self.buf[len(safe):]
        return False


def call_grammar(fmt_name: str, tools: list[Tool], choice: ToolChoice,
                 special_id: Any = lambda marker: None) -> str:
    """Lark for the forced call(s): a call to ``choice.name``, or for ``required`` one or more
    calls to any tool (one where ``choice.parallel`` is False).

    ``special_id(marker)`` gives a marker's special-token id, when it is one, so the grammar
    asks for that token rather than its spelling.
    """
    fmt = FORMATS[fmt_name]
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    rules = []
    for i, tool in enumerate(chosen):
        one = fmt.template.replace("NAME", json.dumps(tool.name)[1:-1])
        one = one.replace("XMLARGS", f"xml{i}").replace("ARGS", f"args{i}")
        rules.append(f"call{i}: {_markers(one, special_id)}")
        rules.append(f"args{i}: %json {guided_schema(tool.parameters)}")
        if fmt_name == "qwen3_coder":
            rules.append(f"xml{i}: {_xml_params(tool, i, rules)}")
    alternatives = " | ".join(f"call{i}" for i in range(len(chosen)))
    start = f"start: {alternatives}"
    if choice.mode == "required" and choice.parallel and fmt_name in PARALLEL_SEPARATORS:
        # "one or more" calls, as the templates write several (a newline between them)
        start = f"start: one ({PARALLEL_SEPARATORS[fmt_name]} one)*\none: {alternatives}"
    return "\n".join([start, *rules]) + "\n"


def make_parser(fmt_name: str | None, think: tuple[str, str] | None = None,
                in_reasoning: bool = False, forced: bool = False,
                one_call: bool = False) -> StreamParser:
    """The parser for one choice of a model whose template speaks ``fmt_name``; ``forced``
    when a grammar forces the output to be a call (a cut one then shows no markup),
    ``one_call`` when parallel calls are off. (Harmony ends its turn at its first call.)"""
    if fmt_name == "harmony":
        return HarmonyParser()
    return OutputParser(FORMATS[fmt_name] if fmt_name else None, think, in_reasoning, forced,
                        one_call)


def _markers(template: str, special_id: Any) -> str:
    def one(m: re.Match[str]) -> str:
        token = special_id(m.group(1))
        return f"<[{token}]>" if token is not None else json.dumps(m.group(1))

    return re.sub(r"@@(.+?)@@", one, template)


def _xml_params(tool: Tool, i: int, rules: list[str]) -> str:
    """Qwen3-Coder's parameters: each required one as <parameter=p>JSON</parameter>."""
    props = tool.parameters.get("properties") or {}
    required = tool.parameters.get("required") or []
    if not isinstance(props, dict) or not isinstance(required, list) \
            or not all(isinstance(name, str) for name in required):
        raise BadRequest(f"tool {tool.name!r}: its parameters' properties must be an object and "
                         "required a list of their names", param="tools")
    parts = []
    for j, name in enumerate(required):
        schema = props.get(name, {})
        schema = {} if schema is True else schema  # JSON Schema's "anything"
        if not isinstance(schema, dict):
            raise BadRequest(f"tool {tool.name!r}: the schema of its parameter {name!r} must be "
                             "an object", param="tools")
        rules.append(f"p{i}_{j}: %json {guided_schema(schema)}")
        tag = json.dumps(f"<parameter={name}>\n")  # a lark string, the name escaped
        parts.append(f'{tag} p{i}_{j} "\\n</parameter>\\n"')
    return " ".join(parts) or '""'
