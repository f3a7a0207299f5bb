"""Rows: one HTTP request's jobs and the queue their events arrive on (HTTP-only: the
queue and the workers see jobs, never a request's rows)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from router.job import Event, Job


@dataclass(slots=True, eq=False)
class Rows:
    """One request's jobs, a row each, and the queue their tagged events arrive on."""

    request_id: str
    prompt_tokens: int
    plan: Any = None                      # router.chat.plan.OutputPlan: how to read the output back
    model_id: str = ""                    # the model that serves it, as the response names it
    tokenizer: Any = None                 # router.chat.tokenizer.RouterTokenizer of that model
    jobs: list[Job] = field(default_factory=list)
    events: asyncio.Queue[tuple[int, Event]] = field(default_factory=asyncio.Queue)
