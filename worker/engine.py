"""The engine: continuous batching on mlx-lm's BatchGenerator. Knows nothing of sockets.

``add`` inserts a request, ``cancel`` removes it (its row is freed at once), ``step`` runs
one ``BatchGenerator.next()`` and returns every request's new tokens. Per-row state
(prompt progress, decoding or not) is kept here from the generator's public responses
(``progress``, ``end_of_prompt``) and prefill work from its public ``stats()``, as
mlx-lm's own server does. The one thing mirrored rather than read is the generator's rule
for which waiting rows join the next prefill chunk (``_next_prefill``); the chunk size is
a plain attribute set between steps. ``tests/`` pins both (``prefill_step_size``,
``prefill_batch_size``, ``completion_batch_size``, ``insert(..., samplers=,
stop_sequences=)``, ``remove``, and the mirror against the generator's own choice).
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
    prefilled: int = 0          # prompt tokens processed (the generator's ``progress``)
    decoding: bool = False      # the prompt is done (``end_of_prompt``)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill before the last one (fed when decoding starts)."""
        return 0 if self.decoding else max(0, self.prompt_tokens - 1 - self.prefilled)

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
        self.last_prefilled_tokens = 0      # prompt tokens the last step processed

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
        with self.generator.stats() as stats:
            prompt_responses, responses = self.generator.next()
        self.num_steps += 1
        self.last_prefilled_tokens = stats.prompt_tokens
        for p in prompt_responses:
            run = self._by_uid.get(p.uid)
            if run is not None:
                run.prefilled = int(p.progress[0])
                run.decoding = run.decoding or bool(p.end_of_prompt)
        outputs: list[Output] = []
        wanted: list[tuple[Any, int, int]] = []
        for r in responses:
            # A finished response holds its prompt cache, which pins the whole batch's
            # cache buffers; drop it at once.
            r.prompt_cache = None
            run = self._by_uid.get(r.uid)
            if run is None:
                continue
            run.decoding = True
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

    def _next_prefill(self) -> list[Running]:
        """The rows the next step's prefill chunk covers: a mirror of BatchGenerator._next.

        Rows already in the prompt batch go on; waiting rows join, oldest first, while the
        prompt batch and the whole batch have room; nothing is prefilled when the decoding
        batch is full. A row with only its last token left moves to decoding instead. The
        generator decodes before it prefills, so rows that reach max_tokens in this step
        make room already (one that stops on EOS cannot be foreseen).
        """
        g = self.generator
        decoding = sum(1 for r in self.running.values() if r.decoding and r.generated + 1 < r.max_tokens)
        if decoding >= g.completion_batch_size:
            return []
        started = [r for r in self.running.values() if not r.decoding and r.prefilled > 0]
        waiting = [r for r in self.running.values() if not r.decoding and r.prefilled == 0]
        room = max(0, min(g.prefill_batch_size - len(started), g.completion_batch_size - decoding))
        return [r for r in started + waiting[:room] if r.prompt_left > 0]

    def longest_prefill_left(self) -> int:
        """The most prompt tokens (before the last one) any row of the next chunk has left."""
        return max((r.prompt_left for r in self._next_prefill()), default=0)

    def prefill_rows(self) -> int:
        """Rows that the next step's prefill chunk covers."""
        return len(self._next_prefill())

    def num_prefilling(self) -> int:
        """Requests whose prompt is not yet fully processed."""
        return sum(1 for r in self.running.values() if not r.decoding)

    def totals(self) -> list[int]:
        """prompt + max_tokens of every running request, oldest first: the padded shape."""
        return [r.total_tokens for r in self.running.values()]
