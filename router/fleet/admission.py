"""Why was a request refused, or why is it still waiting? Pure decisions over numbers.

Two questions, answered from the cost model the worker published in ``hello`` and its
latest ``status``:
- ``check_ever``: can this request ever run? No → 400 before any GPU work.
- ``can_dispatch``: may it go to the worker now? No → it stays queued. A stale report
  means "queue", never "admit".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from common import costmodel
from common.costmodel import CostModel
from common.errors import BadRequest, ContextLengthExceeded, InsufficientMemory

# A status report older than this is too old to admit on.
STALE_REPORT_S = 2.0
# The context assumed for a model whose config does not say and whose worker has not said
# hello yet (the hello's cost model then shrinks a default that was too large).
UNKNOWN_CONTEXT_TOKENS = 4096


class Verdict(StrEnum):
    DISPATCH = "dispatch"
    QUEUE = "queue"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the router knows of its worker, as plain numbers."""

    model: CostModel
    admission: bool
    max_running: int
    report_age_s: float
    held: bool = False              # the worker said "not now"; wait for a fresh report


def check_ever(model: CostModel, admission: bool, prompt_tokens: int, max_tokens: int, *,
               scoring: bool = False, prompt_known: bool = True) -> BadRequest | None:
    """The 400s: over the context, or more memory than an idle worker has (``scoring``:
    with its prompt's logprobs, whose scoring chunks and scored KV cost more).
    ``prompt_known`` False: ``prompt_tokens`` is a lower bound (nothing tokenized yet)."""
    total = prompt_tokens + max_tokens
    prompt = f"{prompt_tokens} prompt tokens" if prompt_known else "at least 1 prompt token"
    if total > model.context_length:
        return ContextLengthExceeded(
            f"this model's maximum context length is {model.context_length} tokens; the "
            f"request has {prompt} and max_tokens {max_tokens} "
            f"({total}{'' if prompt_known else ' or more'} in all)",
            param="messages" if prompt_tokens > max_tokens else "max_tokens",
            sizes=(prompt_tokens, max_tokens, model.context_length))
    if admission and costmodel.never_fits(model, prompt_tokens, max_tokens, scoring=scoring):
        limit = costmodel.max_request_tokens(model, scoring=scoring)
        scored = " with its prompt's logprobs" if scoring else ""
        prompt = f"prompt {prompt_tokens}" if prompt_known else "a prompt of at least 1"
        return InsufficientMemory(
            f"the request needs more memory than the worker has even when idle: {prompt} "
            f"+ max_tokens {max_tokens} tokens{scored}; at most {limit} fit",
            param="max_tokens",
            needed_bytes=costmodel.request_cost_bytes(model, prompt_tokens, max_tokens, scoring=scoring),
            max_request_tokens=limit)
    return None


def room_left(model: CostModel | None, admission: bool, prompt_tokens: int, ceiling: int | None,
              context_length: int | None = None) -> int:
    """max_tokens of a request that asked for none: the context left after its prompt, no
    more than an idle worker can hold after it while the prompt prefills at the full step
    (never a 400 for a number it did not ask for), nor than ``ceiling`` (--default-max-tokens, --max-tokens-limit). Without a cost
    model yet (a model not loaded) the context is ``context_length`` from its config, and
    the dispatcher shrinks it to the worker's room at its hello. At least 1: a prompt that
    alone does not fit gets ``check_ever``'s own 400."""
    if model is not None and admission:
        # Room that leaves the prompt a full prefill chunk; else (a prompt near the edge) any
        room = costmodel.max_new_tokens(model, prompt_tokens) \
            or costmodel.max_new_tokens(model, prompt_tokens, costmodel.MIN_CHUNK_TOKENS)
    elif model is not None:
        room = model.context_length - prompt_tokens
    else:
        room = (context_length or UNKNOWN_CONTEXT_TOKENS) - prompt_tokens
    return max(1, min(room, ceiling) if ceiling is not None else room)


def check_max_tokens_only(model: CostModel, admission: bool, max_tokens: int) -> BadRequest | None:
    """Before tokenizing anything: a prompt has at least one token, so this bound is safe.
    Its sizes carry that 1: Claude Code retries with max_tokens = limit - input - 1000, and
    the retry's own refusal, after tokenizing, has the prompt's real size."""
    return check_ever(model, admission, 1, max_tokens, prompt_known=False)


def can_dispatch(view: WorkerView, in_flight_totals: list[int], prompt_tokens: int,
                 max_tokens: int) -> Verdict:
    """Dispatch only what the worker has reserved room for, by the router's own count."""
    if view.held or view.report_age_s > STALE_REPORT_S:
        return Verdict.QUEUE
    if len(in_flight_totals) >= view.max_running:
        return Verdict.QUEUE
    if not view.admission:
        return Verdict.DISPATCH
    # The worker's own test, with live headroom left to the worker (it may say "not now").
    fits, _ = costmodel.fits_now(view.model, in_flight_totals, prompt_tokens, max_tokens, 0,
                                 view.model.budget_bytes)
    return Verdict.DISPATCH if fits else Verdict.QUEUE
