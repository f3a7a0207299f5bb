"""The engine: continuous batching on mlx-lm's BatchGenerator. Knows nothing of sockets.

``add`` inserts a request, ``cancel`` removes it (its row is freed at once), ``step`` runs
one ``BatchGenerator.next()`` (up to three while only first tokens are coming) and returns
every request's new tokens. Per-row state
(prompt progress, decoding or not) is kept here from the generator's public responses
(``progress``, ``end_of_prompt``) and prefill work from its public ``stats()``, as
mlx-lm's own server does. The one thing mirrored rather than read is the generator's rule
for which waiting rows join the next prefill chunk (``_next_prefill``); the chunk size is
a plain attribute set between steps. ``tests/`` pins both (``prefill_step_size``,
``prefill_batch_size``, ``completion_batch_size``, ``insert(..., samplers=,
stop_sequences=)``, ``remove``, and the mirror against the generator's own choice).

With a prefix cache (``worker/prefix_cache.py``), a request may start from a cached prefix
(``insert(caches=, all_tokens=)``: only the rest is prefilled) and its prompt is inserted
in segments cut at the chat's message boundaries, where the generator stops a chunk: each
boundary's KV is extracted for the cache there, and a finished row's KV at its end
(``extract_cache`` and the finished response's ``prompt_cache``, as mlx-lm's server does).

A request that asks for its prompt's logprobs is scored first, outside the generator
(``worker/scoring.py``): one chunk per step, beside the generator's own, in its own cache.
Once scored it sends those logprobs and joins the generator the way a cache hit does (its
scored KV as the cached prefix, only the last token left to feed), or ends if it asked for
no tokens. It never starts from the prefix cache: every position it scores must be run.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from common import costmodel
from common.protocol import SamplingParams
from worker.containment import RowFailures
from worker import kvcopy
from worker.grammar import GrammarCompiler
from worker.prefix_cache import CacheTiers, Reuse
from worker.sampling import logprob_rows, make_processors, make_sampler
from worker.scoring import PromptLogprob, PromptScorer

log = logging.getLogger(__name__)

# Generator calls a step may add, back to back, to reach a prompt's first token.
FIRST_TOKEN_CALLS = 2
# An output's finish reason when the row's own sampler or processors failed (``failure``
# says why); the core answers it as the request's own error, never the worker's.
FAILED = "failed"
# The uid of a row that is scoring its prompt: it is not in the generator yet.
NOT_IN_GENERATOR = -1


@dataclass(frozen=True, slots=True)
class RowArgs:
    """What the generator takes for a row besides its prompt (kept by a row that joins it
    only once its prompt is scored)."""

    sampler: Any
    processors: list[Any]
    stops: StopSequences


@dataclass(slots=True)
class Running:
    """One request inside the generator."""

    request_id: str
    uid: int
    prompt_tokens: int
    max_tokens: int
    num_logprobs: int | None = None
    generated: int = 0
    prefilled: int = 0          # prompt tokens processed after the cached ones (``progress``)
    decoding: bool = False      # the prompt is done (``end_of_prompt``)
    cached_tokens: int = 0      # prompt tokens that came from the prefix cache
    hit: Reuse | None = None    # the cached blocks or entry it holds until it joins the batch
    prompt_ids: list[int] | None = None     # kept while boundaries are left to store
    boundaries: list[int] | None = None     # message ends still to store, ascending
    scorer: PromptScorer | None = None      # its prompt's logprobs, until the row joins the batch
    joins: RowArgs | None = None            # how it joins the generator once scored
    scored: bool = False                    # its KV start (``cached_tokens``) was scored, not reused

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill before the last one (fed when decoding starts)."""
        rest = self.prompt_tokens - self.cached_tokens
        return 0 if self.decoding else max(0, rest - 1 - self.prefilled)

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
    cached_tokens: int | None = None         # set on a request's first output
    failure: str | None = None               # the row's own failure ended it (its cause)
    prompt_logprobs: list[PromptLogprob] | None = None  # the prompt's, once scored


class Engine:
    """Wraps BatchGenerator: insert, cancel, step → outputs."""

    def __init__(self, model: Any, eos_token_ids: list[int], *, prefill_step_size: int,
                 prefill_batch_size: int, max_batch_size: int,
                 grammars: GrammarCompiler | None = None) -> None:
        self.grammars = grammars
        kvcopy.install()  # rows joining and leaving a large batch copy it one layer at a time
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
        self.failures = RowFailures()       # rows whose own sampler or processors raised
        self.num_steps = 0
        self.last_prefilled_tokens = 0      # prompt tokens the last step processed
        self.last_chained_s = 0.0           # of the last step, spent in calls for first tokens
        self.score_step = 0                 # tokens of the next scoring chunk (the core's choice)
        self.last_scored_tokens = 0         # prompt tokens the last step scored
        self.cache: CacheTiers | None = None
        self.kv_bytes_per_token = 0         # to charge an extraction before it is made
        # A cache that cannot trim (recurrent state) cannot serve an exact re-send from the
        # whole prompt: its prompt is also kept one token short.
        self.can_trim = can_trim_prompt_cache(make_prompt_cache(model))
        # Stored after the step (``store_pending``): rows at a message boundary, and the KV
        # of rows that finished.
        self._at_boundaries: list[int] = []
        self._finished: list[tuple[list[int], list[Any]]] = []
        # Cancelled rows still in the generator, removed together (``remove_cancelled``):
        # each removal filters every layer of the batch's KV, so thirty clients gone at
        # once, removed one by one, stalled every other stream for seconds.
        self._cancelled_uids: list[int] = []

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def idle(self) -> None:
        """Called by the loop when there is nothing to step (a distributed group's rank 0
        checks its peers here)."""

    def set_prefill_step(self, tokens: int) -> None:
        """Read by the generator at every step, so a change applies to the next chunk."""
        self.generator.prefill_step_size = tokens

    def set_score_step(self, tokens: int) -> None:
        """The next scoring chunk (``_score``)."""
        self.score_step = tokens

    def add(self, request_id: str, prompt_ids: list[int], *, max_tokens: int,
            sampling: SamplingParams = SamplingParams(), hit: Reuse | None = None,
            boundaries: list[int] | None = None, compiled: Future[Any] | None = None) -> None:
        """Insert a request; with ``hit``, its first ``hit.tokens`` come from the cache.
        ``boundaries`` (message ends) cut the rest into segments whose KV is stored. One
        that asks for prompt logprobs is scored first (``_score``). ``compiled``: its
        grammar, as the admission waited for it."""
        processors = make_processors(sampling, self.grammars, compiled, len(prompt_ids))
        row = RowArgs(self.failures.sampler(request_id, make_sampler(sampling)),
                      self.failures.processors(request_id, processors),
                      self._no_eos if sampling.ignore_eos else self._eos)
        if sampling.prompt_logprobs is not None:
            scorer = PromptScorer(self.generator.model, prompt_ids, sampling.prompt_logprobs)
            self.running[request_id] = Running(
                request_id, NOT_IN_GENERATOR, len(prompt_ids), max_tokens, sampling.num_logprobs,
                cached_tokens=costmodel.scored_kv_start(len(prompt_ids), max_tokens), scorer=scorer,
                joins=row, scored=True)
            return
        cached = hit.tokens if hit is not None else 0
        cuts = self._cuts(cached, len(prompt_ids), boundaries or []) if self.cache else []
        edges = [cached, *cuts, len(prompt_ids)]
        (uid,) = self.generator.insert_segments(
            [[prompt_ids[a:b] for a, b in zip(edges, edges[1:])]],
            max_tokens=[max_tokens],
            caches=[hit.views] if hit is not None else None,
            all_tokens=[prompt_ids[:cached]] if hit is not None else None,
            samplers=[row.sampler], logits_processors=[row.processors], stop_sequences=[row.stops],
        )
        run = Running(request_id, uid, len(prompt_ids), max_tokens, sampling.num_logprobs,
                      cached_tokens=cached, hit=hit, prompt_ids=prompt_ids if cuts else None,
                      boundaries=cuts or None)
        self.running[request_id] = run
        self._by_uid[uid] = run

    def _cuts(self, cached: int, num_tokens: int, boundaries: list[int]) -> list[int]:
        """Where the prompt's prefill stops so that a prefix's KV can be stored; each stop
        costs the row a step before its first token.

        A cache that cannot trim is served only by exact prefixes: every message boundary,
        and the prompt less its last token. One that can trim is served at any of them by
        trimming the finished row's entry (prompt and answer), so it stops once at most: at
        the first boundary (the system prompt and tools, which other conversations share,
        stored while this one still runs), and only when the cached prefix ends before it
        (a hit of the template's header and a shared first block is common, and once
        skipped the store for any hit at all). A cached turn's rest is then prefilled in as
        few steps as a cold prompt that long.
        """
        ends = boundaries if self.can_trim else [*boundaries, num_tokens - 1]
        inside = sorted({b for b in ends if cached < b < num_tokens})
        if self.can_trim:
            return inside[:1] if boundaries and cached < min(boundaries) else []
        return inside

    def cancel(self, request_id: str) -> bool:
        run = self.running.pop(request_id, None)
        self.failures.forget(request_id)
        if run is None:
            return False
        if run.uid != NOT_IN_GENERATOR:
            del self._by_uid[run.uid]
            self._cancelled_uids.append(run.uid)
        self._joined(run)
        return True

    def remove_cancelled(self) -> None:
        """Take the rows cancelled since the last call out of the batch, in one filter."""
        if self._cancelled_uids:
            uids, self._cancelled_uids = self._cancelled_uids, []
            self.generator.remove(uids)

    def _joined(self, run: Running) -> None:
        """The row's copy of its cached prefix is made (or it is gone): the entry is no
        longer promised to it."""
        if run.hit is not None and self.cache is not None:
            self.cache.release(run.hit)
        run.hit = None
        run.scorer = None

    def joining_bytes(self) -> int:
        """Cached entries whose rows have not joined the batch: their copy is still to come
        (a scored row's copy is in its length: ``totals``)."""
        return sum(r.hit.nbytes for r in self.running.values() if r.hit is not None)

    def joining_assembled_bytes(self) -> int:
        """Of those copies, what is held beside the rows' own KV (``Reuse.assembled_bytes``)."""
        return sum(r.hit.assembled_bytes for r in self.running.values() if r.hit is not None)

    def cancel_all(self) -> list[str]:
        ids = list(self.running)
        for request_id in ids:
            self.cancel(request_id)
        self.remove_cancelled()
        self._finished.clear()  # after a failed step, nothing of it is kept
        self._at_boundaries.clear()
        return ids

    def step(self) -> list[Output]:
        """One engine step: a decode for the running batch and at most one prefill chunk.

        A prompt's first token comes two generator calls after its last chunk (one moves
        the row to decoding and feeds its last token, the next returns the token). When
        nothing decodes and no chunk is left, those calls are made here, back to back:
        around the worker's loop, its work between steps (the gate, sockets, a status)
        would sit twice in every first token's time, with the device idle.
        """
        self.remove_cancelled()
        with self.generator.stats() as stats:
            prompt_responses, responses = self.generator.next()
            self._progress(prompt_responses)
            chained_at = time.perf_counter()
            for _ in range(FIRST_TOKEN_CALLS):
                if responses or not self._first_token_next():
                    break
                prompt_responses, responses = self.generator.next()
                self._progress(prompt_responses)
            self.last_chained_s = time.perf_counter() - chained_at
        scored = self._score()
        self.num_steps += 1
        self.last_prefilled_tokens = stats.prompt_tokens + self.last_scored_tokens
        failed = self.failures.take()
        outputs: list[Output] = []
        wanted: list[tuple[Any, int, int]] = []
        # Finished rows leave ``running`` only once nothing of this step can raise: after a
        # memory error (the logprobs' evaluation) the core fails what is still running, so
        # a row taken out before it would have its end never sent.
        ended: list[Running] = [r for o in scored if o.finish_reason is not None
                                and (r := self.running.get(o.request_id)) is not None]
        for r in responses:
            run = self._by_uid.get(r.uid)
            if run is not None and run.request_id in failed:
                r.prompt_cache = None  # nothing of a failed row is kept or sent
                continue
            if self.cache is not None and run is not None and r.finish_reason is not None \
                    and r.prompt_cache is not None and r.all_tokens:
                # Stored once the finished row's promise is released (``store_pending``).
                self._finished.append((list(r.all_tokens), r.prompt_cache))
            # A finished response's prompt cache pins the whole batch's cache buffers: only
            # the copy for the prefix cache may keep it, and only until it is made.
            r.prompt_cache = None
            if run is None:
                continue
            run.decoding = True
            run.generated += 1
            # The EOS token ends the stream but is not part of the text.
            ids = [] if r.finish_reason == "stop" else [r.token]
            if r.finish_reason is not None:
                ended.append(run)
            if run.num_logprobs is not None and ids:
                wanted.append((r.logprobs, r.token, run.num_logprobs))
            outputs.append(Output(run.request_id, ids, r.finish_reason,
                                  [] if run.num_logprobs is not None else None,
                                  (0 if run.scored else run.cached_tokens) if run.generated == 1 else None))
        for out, row in zip((o for o in outputs if o.logprobs is not None and o.token_ids),
                            logprob_rows(wanted)):
            out.logprobs.append(row)
        for run in ended:
            self._by_uid.pop(run.uid, None)
            del self.running[run.request_id]
        for request_id, cause in failed.items():
            if request_id in self.running:
                self.cancel(request_id)  # its row leaves the batch; the others go on
                outputs.append(Output(request_id, [], FAILED, failure=cause))
        return outputs + scored

    # -- prompt logprobs ---------------------------------------------------------------

    def _scoring(self) -> Running | None:
        """The row the next scoring chunk is for: the oldest still scoring."""
        return next((r for r in self.running.values()
                     if r.scorer is not None and r.uid == NOT_IN_GENERATOR), None)

    def scoring_context(self) -> int:
        """The longest prompt still being scored (0: none): the most context its chunks see."""
        return max((r.prompt_tokens for r in self.running.values()
                    if r.scorer is not None and r.uid == NOT_IN_GENERATOR), default=0)

    def score_left(self) -> int:
        """Positions that row has left to score."""
        run = self._scoring()
        return run.scorer.left if run is not None and run.scorer is not None else 0

    def _score(self) -> list[Output]:
        """One chunk (``score_step`` tokens) of the oldest prompt being scored, after the
        generator's step. A prompt scored to its last token sends its logprobs and ends
        (max_tokens 0) or joins the generator from its scored KV in the next step."""
        self.last_scored_tokens = 0
        run = self._scoring()
        if run is None or run.scorer is None:
            return []
        scorer = run.scorer
        with mx.stream(self.generator.stream):  # the generator's: this KV joins its batch
            self.last_scored_tokens = scorer.step(self.score_step)
        if scorer.left:
            return []
        # Its prompt's scores go out now; its KV joins in the next step, charged until it has.
        if run.max_tokens == 0:  # done: ``step`` takes it out of ``running``
            run.scorer = None
            return [Output(run.request_id, [], "length", cached_tokens=0, prompt_logprobs=scorer.rows)]
        self._join(run, scorer)
        return [Output(run.request_id, [], None, prompt_logprobs=scorer.rows)]

    def _join(self, run: Running, scorer: PromptScorer) -> None:
        """Insert a scored row as a cache hit is inserted: the scored KV and its tokens (for
        the processors' context), with only the prompt's last token left to feed."""
        args, done, prompt = run.joins, scorer.done, scorer.prompt
        assert args is not None
        (uid,) = self.generator.insert_segments(
            [[prompt[done:]]], max_tokens=[run.max_tokens],
            caches=[scorer.cache] if done else None, all_tokens=[prompt[:done]] if done else None,
            samplers=[args.sampler], logits_processors=[args.processors], stop_sequences=[args.stops])
        run.uid, run.joins = uid, None
        self._by_uid[uid] = run

    def _progress(self, prompt_responses: list[Any]) -> None:
        for p in prompt_responses:
            run = self._by_uid.get(p.uid)
            if run is not None:
                run.prefilled = int(p.progress[0])
                run.decoding = run.decoding or bool(p.end_of_prompt)
                self._joined(run)
                if p.end_of_segment and not p.end_of_prompt and self._at_boundary(run):
                    self._at_boundaries.append(p.uid)

    def _first_token_next(self) -> bool:
        """Only first tokens are coming: rows are running, none decodes yet (a generator
        call that decodes answers), no chunk is left to prefill, and no row stands at a
        message boundary whose KV is to be stored before it moves on."""
        return (any(r.uid != NOT_IN_GENERATOR for r in self.running.values())
                and not self._at_boundaries and not self._next_prefill())

    # -- the prefix cache's stores ---------------------------------------------------

    def _at_boundary(self, run: Running) -> bool:
        """The row's last chunk ended at one of its message boundaries."""
        done = run.cached_tokens + run.prefilled
        if not run.boundaries or done not in run.boundaries:
            return False
        run.boundaries = [b for b in run.boundaries if b > done] or None
        return True

    def _store_boundaries(self, uids: list[int]) -> None:
        assert self.cache is not None
        wanted = [u for u in uids if self._wants(self._by_uid[u].cached_tokens + self._by_uid[u].prefilled,
                                                 self._by_uid[u].prompt_ids or [])]
        for uid, (cache, tokens) in self.generator.extract_cache(wanted).items():
            self._store(tokens, cache, keep=False, asked=True)
        for uid in uids:
            run = self._by_uid[uid]
            if not run.boundaries:
                run.prompt_ids = None

    def _wants(self, num_tokens: int, prompt: list[int]) -> bool:
        assert self.cache is not None
        try:
            return self.cache.wants(num_tokens, prompt, num_tokens * self.kv_bytes_per_token)
        except Exception as exc:
            self.cache.fault("wants", exc)
            return False

    def store_pending(self) -> None:
        """Copy into the prefix cache what the last step reached: rows at a message boundary
        (the batch stands still until the next step) and rows that finished. Called after
        the step's peak is measured and finished rows' promises are released, so the copies
        are neither taken for the batch's peak nor made from memory promised to it."""
        uids = [u for u in self._at_boundaries if u in self._by_uid]
        finished, self._at_boundaries, self._finished = self._finished, [], []
        if uids:
            self._store_boundaries(uids)
        for tokens, cache in finished:
            self._store(tokens, cache, keep=True)

    def _store(self, tokens: list[int] | None, cache: list[Any], *, keep: bool, asked: bool = False) -> None:
        """Hand one row's extracted caches to the prefix cache, evaluated (their own buffers,
        so the batch's can go): here, or by the block store one layer at a time as it copies
        out its new blocks. A copy the gate has no room for is never made."""
        if self.cache is None or not tokens or (not asked and not self._wants(len(tokens), tokens)):
            return
        if not self.cache.copies_by_layer:
            mx.eval([c.state for c in cache])
        try:
            self.cache.store(list(tokens), cache, keep=keep)
        except Exception as exc:
            self.cache.fault("store", exc)

    def _next_prefill(self) -> list[Running]:
        """The rows the next step's prefill chunk covers: a mirror of BatchGenerator._next.

        Rows already in the prompt batch go on; waiting rows join, oldest first, while the
        prompt batch and the whole batch have room; nothing is prefilled when the decoding
        batch is full. A row with only its last token left moves to decoding instead. The
        generator decodes before it prefills, so rows that reach max_tokens in this step
        make room already (one that stops on EOS cannot be foreseen).
        """
        g = self.generator
        rows = [r for r in self.running.values() if r.uid != NOT_IN_GENERATOR]
        decoding = sum(1 for r in rows if r.decoding and r.generated + 1 < r.max_tokens)
        if decoding >= g.completion_batch_size:
            return []
        started = [r for r in rows if not r.decoding and r.prefilled > 0]
        waiting = [r for r in rows if not r.decoding and r.prefilled == 0]
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
        """How long each running request's KV can get (prompt + max_tokens, more for a row
        that started from a cached prefix off the cache's step, and a scored row with its
        scored KV until it joins), oldest first: the padded shape."""
        return [costmodel.scored_reach_tokens(r.prompt_tokens, r.max_tokens) if r.scorer is not None
                else costmodel.kv_reach_tokens(r.total_tokens, r.cached_tokens) for r in self.running.values()]
