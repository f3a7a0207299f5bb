"""The engine: continuous batching on mlx-lm's BatchGenerator. Knows nothing of sockets.

``add`` inserts a request, ``cancel`` removes it (its row is freed at once), ``step`` runs
one ``BatchGenerator.next()`` and returns every request's new tokens. The generator's
chunk and batch sizes are plain attributes we set between steps; ``tests/`` pins the
private surface we rely on (``prefill_step_size``, ``prefill_batch_size``,
``completion_batch_size``, ``insert(..., samplers=, stop_sequences=)``, ``remove``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from common.protocol import SamplingParams
from worker.grammar import GrammarCompiler
from worker.sampling import logprob_rows, make_processors, make_sampler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Running:
    """One request inside the generator."""

    request_id: str
    uid: int
    prompt_tokens: int
    max_tokens: int
    num_logprobs: int | None = None
    generated: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True, slots=True)
class Output:
    """New tokens for one request after one step; ``finish_reason`` None means more follow."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[list[Any]] | None = None  # [logprob, top_ids, top_logprobs] per token


class Engine:
    """Wraps BatchGenerator: insert, cancel, step → outputs."""

    def __init__(self, model: Any, eos_token_ids: list[int], *, prefill_step_size: int,
                 prefill_batch_size: int, max_batch_size: int,
                 grammars: GrammarCompiler | None = None) -> None:
        self.grammars = grammars
        self._eos = StopSequences([[e] for e in eos_token_ids] or None)
        self._no_eos = StopSequences(None)
        self.generator = BatchGenerator(
            model,
            stop_tokens=[[e] for e in eos_token_ids],
            completion_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        self.running: dict[str, Running] = {}
        self._by_uid: dict[int, Running] = {}
        self.num_steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def set_prefill_step(self, tokens: int) -> None:
        """Read by the generator at every step, so a change applies to the next chunk."""
        self.generator.prefill_step_size = tokens

    def add(self, request_id: str, prompt_ids: list[int], *, max_tokens: int,
            sampling: SamplingParams = SamplingParams()) -> None:
        (uid,) = self.generator.insert(
            [prompt_ids],
            max_tokens=[max_tokens],
            samplers=[make_sampler(sampling)],
            logits_processors=[make_processors(sampling, self.grammars)],
            stop_sequences=[self._no_eos if sampling.ignore_eos else self._eos],
        )
        run = Running(request_id, uid, len(prompt_ids), max_tokens, sampling.num_logprobs)
        self.running[request_id] = run
        self._by_uid[uid] = run

    def cancel(self, request_id: str) -> bool:
        run = self.running.pop(request_id, None)
        if run is None:
            return False
        del self._by_uid[run.uid]
        self.generator.remove([run.uid])
        return True

    def cancel_all(self) -> list[str]:
        ids = list(self.running)
        for request_id in ids:
            self.cancel(request_id)
        return ids

    def step(self) -> list[Output]:
        """One engine step: a decode for the running batch and at most one prefill chunk."""
        _, responses = self.generator.next()
        self.num_steps += 1
        outputs: list[Output] = []
        wanted: list[tuple[Any, int, int]] = []
        for r in responses:
            # A finished response holds its prompt cache, which pins the whole batch's
            # cache buffers; drop it at once.
            r.prompt_cache = None
            run = self._by_uid.get(r.uid)
            if run is None:
                continue
            run.generated += 1
            # The EOS token ends the stream but is not part of the text.
            ids = [] if r.finish_reason == "stop" else [r.token]
            if r.finish_reason is not None:
                del self._by_uid[r.uid]
                del self.running[run.request_id]
            if run.num_logprobs is not None and ids:
                wanted.append((r.logprobs, r.token, run.num_logprobs))
            outputs.append(Output(run.request_id, ids, r.finish_reason,
                                  [] if run.num_logprobs is not None else None))
        for out, row in zip((o for o in outputs if o.logprobs is not None and o.token_ids),
                            logprob_rows(wanted)):
            out.logprobs.append(row)
        return outputs

    def num_prefilled_tokens(self) -> int:
        """Prompt tokens processed so far (the generator's private counter)."""
        return int(self.generator._counters.prompt_tokens)

    def longest_prefill_left(self) -> int:
        """The most prompt tokens (before the last one) any row of the next chunk has left.

        Rows being prefilled hold their prompt as segments, [rest, [last token]] (the
        last token is fed when the row moves to decoding); rows waiting to join hold theirs
        whole. Only the rows the next step will take are counted.
        """
        g = self.generator
        segments = [seq[0] for seq in g._currently_processing]
        room = min(g.prefill_batch_size - len(g._prompt_batch),
                   g.completion_batch_size - len(g._generation_batch))
        for i, waiting in enumerate(g._unprocessed_sequences):
            if i >= room:
                break
            segments.append(waiting[1])
        return max((len(s[0]) for s in segments if len(s) > 1), default=0)

    def prefill_rows(self) -> int:
        """Rows that the next step's prefill chunk covers."""
        g = self.generator
        return min(g.prefill_batch_size, len(g._prompt_batch) + len(g._unprocessed_sequences))

    def num_prefilling(self) -> int:
        """Requests whose prompt is not yet fully processed (private generator state)."""
        g = self.generator
        return len(g._prompt_batch) + len(g._unprocessed_sequences)

    def totals(self) -> list[int]:
        """prompt + max_tokens of every running request: the batch's padded shape."""
        return [r.total_tokens for r in self.running.values()]
