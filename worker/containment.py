"""A row's own failure ends that row, not the batch.

BatchGenerator runs every row's logits processors and sampler inside one ``next()`` call,
so an exception from one row's grammar matcher, penalty or sampler would fail the whole
step, and with it every request beside it. Each row's callables therefore run guarded:
an exception is recorded against the row's request (its cause kept for the client) and a
neutral value is returned in its place, so the step completes for everyone; the engine
then removes the failed row and drops whatever it produced in that step. Errors of the
engine itself (the forward pass, the device) are raised where they happen, as before: a
memory error is never swallowed here (the gate's recovery path needs it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx

from common.log import about
from worker.gate import is_memory_error
from worker.grammar import GrammarProcessor

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class RowFailures:
    """Guards rows' processors and samplers; collects the failures of the current step."""

    def __init__(self) -> None:
        self._failed: dict[str, str] = {}   # request id → cause, until the engine takes it

    def take(self) -> dict[str, str]:
        """The rows that failed since the last call, with their causes."""
        failed, self._failed = self._failed, {}
        return failed

    def forget(self, request_id: str) -> None:
        self._failed.pop(request_id, None)

    def _fail(self, request_id: str, what: str, exc: Exception) -> None:
        if is_memory_error(exc):
            raise exc  # the step's memory, not the row's fault: the gate's recovery handles it
        if request_id not in self._failed:
            log.warning("%s failed: %s: %s", what, type(exc).__name__, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG), extra=about(request_id))
            self._failed[request_id] = f"{what} failed: {type(exc).__name__}: {exc}"

    def processors(self, request_id: str, processors: list[LogitsProcessor]) -> list[LogitsProcessor]:
        """The row's processors as one guarded processor (none stays none: the generator
        skips per-row work for a batch without processors)."""
        if not processors:
            return []

        def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
            if request_id in self._failed:
                return logits
            out = logits
            for processor in processors:
                try:
                    out = processor(tokens, out)
                except Exception as exc:
                    what = "grammar" if isinstance(processor, GrammarProcessor) else "logits processor"
                    self._fail(request_id, f"the request's {what}", exc)
                    return logits  # any shape-correct row will do: it is dropped after the step
            return out

        return [guarded]

    def sampler(self, request_id: str, sampler: Sampler | None) -> Sampler | None:
        """The row's own sampler, guarded; None (the generator's shared greedy sampler,
        batched for the whole batch) stays None."""
        if sampler is None:
            return None

        def guarded(logprobs: mx.array) -> mx.array:
            if request_id not in self._failed:
                try:
                    return sampler(logprobs)
                except Exception as exc:
                    self._fail(request_id, "the request's sampler", exc)
            return mx.argmax(logprobs, axis=-1)

        return guarded
