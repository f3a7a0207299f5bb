"""GET /openapi.json: the router's HTTP surface as OpenAPI 3.1, written by hand.

``ENDPOINTS`` holds one entry per endpoint; adding an endpoint to the app means adding one
``Endpoint`` here (a test checks that the two agree). Request schemas carry the limits
this router was started with, so a client (or a schema-driven fuzzer) sees the real bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.version import __version__
from router.http.limits import MAX_STOP_CHARS, Limits

JSON = "application/json"
SSE = "text/event-stream"
ERROR_STATUSES = {
    404: "No such model (model_not_found; with one model served, any name is it) or file",
    400: "Invalid request (the error's param names the field), context length or memory",
    401: "Missing or wrong API key",
    403: "Host or Origin not allowed",
    408: "The body did not arrive in time",
    413: "Body too large",
    429: "Queue full (Retry-After)",
    500: "The request's own grammar, sampler or processor failed (request_failed); it alone",
    503: "No worker, queue timeout, worker lost, memory pressure (Retry-After)",
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    summary: str
    responses: dict[int, tuple[str, dict[str, Any]]]   # status -> (description, content)
    request: str | None = None                         # a component schema name
    guarded: bool = True                               # needs the API key when one is set
    errors: tuple[int, ...] = (401, 403)
    tags: tuple[str, ...] = field(default=("api",))
    query: dict[str, dict[str, Any]] = field(default_factory=dict)         # name -> schema
    path_params: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> schema
    error: str = "Error"                               # the error body's component schema


def json_of(schema: str) -> dict[str, Any]:
    return {JSON: {"schema": ref(schema)}}


GENERATION_ERRORS = (400, 401, 403, 404, 408, 413, 429, 500, 503)
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("post", "/v1/chat/completions", "OpenAI chat completion, streamed (SSE) or not",
             {200: ("The completion; with stream=true, SSE chunks ending in data: [DONE]",
                    {**json_of("ChatCompletion"), SSE: {"schema": ref("SseEvent")}})},
             request="ChatCompletionRequest", errors=GENERATION_ERRORS),
    Endpoint("post", "/v1/completions", "OpenAI text completion, streamed (SSE) or not",
             {200: ("The completion; with stream=true, SSE chunks ending in data: [DONE]",
                    {**json_of("Completion"), SSE: {"schema": ref("SseEvent")}})},
             request="CompletionRequest", errors=GENERATION_ERRORS),
    Endpoint("post", "/v1/messages", "Anthropic Messages (what Claude Code speaks), streamed or not",
             {200: ("The message; with stream=true, Anthropic's SSE event sequence",
                    {**json_of("Message"), SSE: {"schema": ref("SseEvent")}})},
             request="MessagesRequest", errors=GENERATION_ERRORS, error="AnthropicError"),
    Endpoint("post", "/v1/messages/count_tokens", "The prompt tokens a Messages body would take",
             {200: ("The count", json_of("TokenCount"))}, request="MessagesRequest",
             errors=(400, 401, 403, 404, 408, 413, 503), error="AnthropicError"),
    Endpoint("post", "/v1/responses", "OpenAI Responses (what Codex speaks), stateless, streamed or not",
             {200: ("The response; with stream=true, the Responses event sequence",
                    {**json_of("Response"), SSE: {"schema": ref("SseEvent")}})},
             request="ResponsesRequest", errors=GENERATION_ERRORS),
    Endpoint("get", "/v1/models", "The served model", {200: ("Models", json_of("ModelList"))}),
    Endpoint("get", "/v1/models/{model_id}", "One model by name (with one model served, any name)",
             {200: ("The model", json_of("Model"))}, errors=(401, 403, 404),
             path_params={"model_id": {"type": "string"}}),
    Endpoint("get", "/v1/memory", "The worker's latest memory report",
             {200: ("Memory", json_of("Memory"))}, tags=("status",)),
    Endpoint("post", "/admin/workers/restart", "Restart the worker and forget its crash history",
             {200: ("Restarting", json_of("Restarting"))}, tags=("admin",)),
    Endpoint("get", "/health", "Ready or not, and each worker's state (no key needed)",
             {200: ("Ready", json_of("Health")), 503: ("Not ready", json_of("Health"))},
             guarded=False, errors=(403,), tags=("status",)),
    Endpoint("get", "/metrics", "Prometheus metrics",
             {200: ("Prometheus text", {"text/plain": {"schema": {"type": "string"}}})},
             guarded=False, errors=(403,), tags=("status",)),
    Endpoint("get", "/", "The status page",
             {200: ("HTML", {"text/html": {"schema": {"type": "string"}}})},
             guarded=False, errors=(403,), tags=("status",)),
    Endpoint("get", "/status", "The status page's data (what `mlx-router status` shows)",
             {200: ("Status", json_of("Status"))}, guarded=False, errors=(400, 403),
             tags=("status",), query={"since": {"type": "number"}}),
    Endpoint("get", "/static/{name}", "The status page's script and style",
             {200: ("A file", {"text/css": {"schema": {"type": "string"}},
                               "text/javascript": {"schema": {"type": "string"}},
                               "image/svg+xml": {"schema": {"type": "string"}},
                               "text/html": {"schema": {"type": "string"}}})},
             guarded=False, errors=(403, 404), tags=("status",),
             path_params={"name": {"type": "string"}}),
    Endpoint("get", "/openapi.json", "This document",
             {200: ("OpenAPI 3.1", {JSON: {"schema": {"type": "object"}}})},
             guarded=False, errors=(403,), tags=("status",)),
)


def _operation(e: Endpoint) -> dict[str, Any]:
    responses: dict[str, Any] = {
        str(status): {"description": text, "content": content}
        for status, (text, content) in e.responses.items()}
    for status in e.errors:
        responses[str(status)] = {"description": ERROR_STATUSES[status], "content": json_of(e.error)}
    op: dict[str, Any] = {"summary": e.summary, "tags": list(e.tags), "responses": responses,
                          "operationId": e.method + "".join(c if c.isalnum() else "_" for c in e.path)}
    params = [{"name": n, "in": "query", "required": False, "schema": v} for n, v in e.query.items()]
    params += [{"name": n, "in": "path", "required": True, "schema": v}
               for n, v in e.path_params.items()]
    if params:
        op["parameters"] = params
    if e.request is not None:
        op["requestBody"] = {"required": True, "content": json_of(e.request)}
    op["security"] = [{"bearer": []}, {"apiKey": []}] if e.guarded else []
    return op


def build_spec(limits: Limits, context_length: int | None = None) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for e in ENDPOINTS:
        paths.setdefault(e.path, {})[e.method] = _operation(e)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Headroom (mlx-router)", "version": __version__,
                 "description": "Memory-safe LLM serving on MLX; OpenAI-compatible."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
            "schemas": schemas(limits, context_length)},
    }


def _max_tokens(limits: Limits, context_length: int | None) -> dict[str, Any]:
    bound = min(b for b in (limits.max_tokens, context_length, 2**63 - 1) if b is not None)
    return {"type": ["integer", "null"], "minimum": 1, "maximum": bound}


def schemas(limits: Limits, context_length: int | None) -> dict[str, Any]:
    max_tokens = _max_tokens(limits, context_length)
    stop = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                      {"type": "array", "maxItems": 4,
                       "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                      {"type": "null"}]}
    sampling: dict[str, Any] = {
        "model": {"type": ["string", "null"]},
        "max_tokens": max_tokens,
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "seed": {"type": ["integer", "null"]},
        "stop": stop,
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"],
                           "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "n": {"type": ["integer", "null"], "minimum": 1, "description": "up to --max-n"},
        "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM's extension"},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 10},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "logit_bias": {"type": ["object", "null"],
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "response_format": {"type": ["object", "null"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}}},
    }
    prompt_logprobs = {"type": ["integer", "null"], "minimum": 0, "maximum": 20, "description":
                       "vLLM's extension: each prompt token's logprob and the k most likely (not with stream)"}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part},
                              {"type": "null"}]},
        "name": {"type": "string"}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"enum": ["stop", "length", "tool_calls", None]}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}}},
        "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
            "type": {"const": "error"}, "error": {
                "type": "object", "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
        # The Messages and Responses bodies are translated to a chat request (README); these
        # name their required fields, the README lists the rest.
        "MessagesRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
            "system": {"type": ["string", "array"]}, "max_tokens": max_tokens,
            "tools": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"}}},
        "Message": {"type": "object", "required": ["id", "type", "role", "content", "stop_reason",
                                                   "usage"], "properties": {
            "type": {"const": "message"}, "content": {"type": "array", "items": {"type": "object"}},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]}}},
        "TokenCount": {"type": "object", "required": ["input_tokens"], "properties": {
            "input_tokens": {"type": "integer", "minimum": 0}}},
        "ResponsesRequest": {"type": "object", "properties": {
            "input": {"type": ["string", "array"]}, "instructions": {"type": "string"},
            "max_output_tokens": max_tokens, "store": {"const": False},
            "tools": {"type": "array", "items": {"type": "object"}}, "stream": {"type": "boolean"}}},
        "Response": {"type": "object", "required": ["id", "object", "status", "output"],
                     "properties": {"object": {"const": "response"},
                                    "status": {"enum": ["completed", "incomplete", "failed"]},
                                    "output": {"type": "array", "items": {"type": "object"}}}},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
            **sampling, "max_completion_tokens": max_tokens,
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
            "prompt_logprobs": prompt_logprobs,
            "tools": {"type": ["array", "null"], "items": {"type": "object"}},
            "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"},
                                      {"type": "null"}]},
            "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                         "items": message}}},
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            **sampling, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
            "max_tokens": {**max_tokens, "minimum": 0, "description": "0 only with echo: the prompt alone"},
            "echo": {"type": ["boolean", "null"], "description":
                     "the text starts with the prompt; with logprobs, they cover its tokens too"},
            "prompt_logprobs": prompt_logprobs,
            "prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {"type": "array", "minItems": 1, "maxItems": 64,
                 "items": {"type": "string", "minLength": 1}}]}}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "model", "choices", "usage"],
                           "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "finish_reason": finish,
                "message": {"type": "object", "required": ["role", "content"], "properties": {
                    "role": {"const": "assistant"}, "content": {"type": ["string", "null"]}}}}}}}},
        "Completion": {"type": "object", "required": ["id", "object", "model", "choices", "usage"],
                       "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "text": {"type": "string"},
                "finish_reason": finish}}}}},
        "SseEvent": {"type": "object", "required": ["data"], "description":
                     "One server-sent event: a chunk as JSON, an error event, or [DONE]",
                     "properties": {"data": {"type": "string"}, "event": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}},
        "Model": {"type": "object", "required": ["id", "object"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"}}},
        "Health": {"type": "object", "required": ["status", "workers"], "properties": {
            "status": {"type": "string"}, "model": {"type": "string"},
            "queued": {"type": "integer", "minimum": 0},
            "warnings": {"type": "array", "items": {"type": "string"}},
            "workers": {"type": "array", "items": ref("Worker")}}},
        "Worker": {"type": "object", "required": ["state"], "properties": {
            "state": {"enum": ["starting", "ready", "restarting", "down", "failed"]},
            "pid": {"type": ["integer", "null"]}, "incarnation": {"type": ["integer", "null"]},
            "restarts": {"type": "integer"}, "last_exit": {"type": ["object", "null"]}}},
        "Memory": {"type": "object", "required": ["queued", "workers"], "properties": {
            "queued": {"type": "integer", "minimum": 0},
            "workers": {"type": "array", "items": {"type": "object"}}}},
        "Status": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"}, "model": {"type": "string"},
            "warnings": {"type": "array", "items": {"type": "string"}}}},
        "Restarting": {"type": "object", "required": ["status"], "properties": {
            "status": {"const": "restarting"}, "workers": {"type": "array", "items": ref("Worker")}}},
    }
