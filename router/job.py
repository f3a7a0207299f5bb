"""Job: one request's life inside the router, from queue to last token."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from common.errors import HeadroomError


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True, eq=False)
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None


Event = TokenEvent | HeadroomError


@dataclass(slots=True, eq=False)
class Job:
    """A request: its prompt ids, sampling, deadline and the events it is waiting for."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    deadline: float                       # monotonic seconds: queued past this → 503
    enqueued_at: float
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    state: JobState = JobState.QUEUED
    incarnation: int | None = None        # the worker it runs on
    num_output_tokens: int = 0
    num_dispatches: int = 0
    dispatched_at: float | None = None
    first_token_at: float | None = None

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens

    def fingerprint(self) -> str:
        """Identity for quarantine: the same prompt and sampling is the same poison."""
        h = hashlib.blake2b(digest_size=12)
        h.update(repr((self.prompt_ids, self.sampling)).encode())
        return h.hexdigest()

    def fail(self, error: HeadroomError) -> None:
        if self.state is not JobState.DONE:
            self.state = JobState.DONE
            self.events.put_nowait(error)
