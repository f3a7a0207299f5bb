"""Job: one request's life inside the router, from queue to last token."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from common.errors import HeadroomError
from common.protocol import SamplingParams


# max_tokens of a request that named none, until its prompt is tokenized: then the room
# left in the context (router/fleet/admission.py's room_left). No client can send it (a
# negative max_tokens is a 400; 0 is taken with echo: the prompt's scores alone).
ROOM_LEFT = -1


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Sampling:
    """A row's token budget and how it samples (sent to the worker as is)."""

    max_tokens: int  # ROOM_LEFT until the prompt is tokenized, when the request named none
    params: SamplingParams = SamplingParams()


@dataclass(slots=True, eq=False)
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None
    # One [logprob, top_ids, top_logprobs] per token, when the request asked for them.
    logprobs: list[list[Any]] | None = None
    cached_tokens: int = 0      # on a row's first event: prompt tokens the worker reused
    # Once, before its first token: [logprob, top_ids, top_logprobs, rank] per prompt token
    # after the first, when the request asked for its prompt's logprobs.
    prompt_logprobs: list[list[Any]] | None = None


Event = TokenEvent | HeadroomError


class ChoiceEvents:
    """A job's event sink: tags each event with the job's choice index on its request's
    shared queue, so one loop serves every choice of a request (n > 1, several prompts)."""

    __slots__ = ("shared", "index")

    def __init__(self, shared: asyncio.Queue[tuple[int, Event]], index: int) -> None:
        self.shared = shared
        self.index = index

    def put_nowait(self, event: Event) -> None:
        self.shared.put_nowait((self.index, event))


@dataclass(slots=True, eq=False)
class Job:
    """A request: its prompt ids, sampling, deadline and the events it is waiting for."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    deadline: float                       # monotonic seconds: queued past this → 503
    enqueued_at: float
    events: asyncio.Queue[Event] | ChoiceEvents = field(default_factory=asyncio.Queue)
    state: JobState = JobState.QUEUED
    incarnation: int | None = None        # the worker it runs on
    model: str = ""                       # the model alias whose workers may run it
    num_output_tokens: int = 0
    num_dispatches: int = 0
    dispatched_at: float | None = None
    first_token_at: float | None = None
    arrived_at: float | None = None       # the HTTP request's arrival (parse, checks, tokenizing before enqueued_at)
    first_sent_at: float | None = None    # the first output written to a stream (after first_token_at)
    boundaries: list[int] = field(default_factory=list)   # message ends in the prompt (prefix cache)
    room_left: bool = False               # max_tokens is the room left, not asked: it shrinks, never fails
    grammar_param: str | None = None      # the parameter its grammar came from (response_format, tool_choice)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens

    def fingerprint(self) -> str:
        """Identity for quarantine: the same prompt and sampling is the same poison. The ids
        as 8-byte integers (an 8k-token prompt's repr took 0.9 ms, its bytes 0.3 ms)."""
        h = hashlib.blake2b(digest_size=12)
        h.update(array("q", self.prompt_ids).tobytes())
        h.update(repr(self.sampling).encode())
        return h.hexdigest()

    def fail(self, error: HeadroomError) -> None:
        if self.state is not JobState.DONE:
            self.state = JobState.DONE
            self.events.put_nowait(error)
