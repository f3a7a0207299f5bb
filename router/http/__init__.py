"""The HTTP APIs (OpenAI, Anthropic Messages, Responses) and their output shapes, SSE,
errors as HTTP, the OpenAPI document, request limits and request ids.

The seam of the router: a chat-completions handler (``api.py``) turns a request into a
plan and token ids with ``chat`` and hands its jobs to ``fleet``; neither knows the other.
"""
