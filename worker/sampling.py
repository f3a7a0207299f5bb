"""Per-row samplers, logits processors and logprobs, built from the wire ``SamplingParams``.

BatchGenerator takes one sampler and one list of logits processors per row, so every
request in the batch samples its own way. The filters and penalties are mlx-lm's own
(``sample_utils``); what is ours is the per-row PRNG key (a seeded row gives the same
tokens whatever else is in the batch) and the compact logprobs rows sent to the router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p, apply_top_k, apply_top_p, make_frequency_penalty, make_logits_processors,
    make_presence_penalty,
)

from common.protocol import SamplingParams
from worker.grammar import GrammarCompiler

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# JSON has no -inf; a token the row may never sample (a grammar, a -100 bias) reports this instead,
# as vLLM does.
MIN_LOGPROB = -9999.0


def make_sampler(p: SamplingParams) -> Sampler | None:
    """The row's sampler; None means the generator's shared greedy sampler.

    A seeded row carries its own PRNG key, split once per step, so its tokens do not
    depend on the batch or on the global random state.
    """
    if p.temperature <= 0:
        return None
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < p.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:  # a k as large as the vocabulary keeps everything
        filters.append(lambda x: apply_top_k(x, p.top_k) if p.top_k < x.shape[-1] else x)
    inv_temp = 1.0 / p.temperature
    key = [mx.random.key(p.seed)] if p.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_processors(p: SamplingParams, grammars: GrammarCompiler | None = None,
                    compiled: Future[Any] | None = None, prompt_tokens: int = 0) -> list[LogitsProcessor]:
    """Logit bias and the three penalties, each over its own window of recent tokens, then
    the row's grammar (last, so nothing can lift a token it forbids): ``compiled``, when
    the admission waited for it.

    The generator hands each processor the row's prompt and output so far; presence and
    frequency count the output only (the first ``prompt_tokens`` skipped), as OpenAI
    defines them and vLLM applies them: over the prompt, a chat's own end-of-turn token
    pushed the end of the answer down. Repetition (not OpenAI's) covers both, as vLLM's.
    """
    processors = make_logits_processors(
        logit_bias={int(t): float(b) for t, b in p.logit_bias} or None,
        repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,
        repetition_context_size=p.repetition_context_size,
    )
    if p.presence_penalty:
        processors.append(_on_output(make_presence_penalty(p.presence_penalty, p.presence_context_size),
                                     prompt_tokens))
    if p.frequency_penalty:
        processors.append(_on_output(make_frequency_penalty(p.frequency_penalty, p.frequency_context_size),
                                     prompt_tokens))
    if p.grammar is not None:
        if grammars is None:
            raise ValueError("this worker has no grammar compiler")
        processors.append(grammars.processor(p.grammar, compiled))
    return processors


def _on_output(processor: LogitsProcessor, prompt_tokens: int) -> LogitsProcessor:
    def on_output(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(tokens[prompt_tokens:], logits)
    return on_output


def logprob_rows(rows: list[tuple[mx.array, int, int]]) -> list[list[Any]]:
    """``[logprob, top_ids, top_logprobs]`` for each (step logprobs, token, k), in one eval.

    The step's logprobs are the ones the row sampled from (after its processors), most
    likely first.
    """
    if not rows:
        return []
    k_max = max(k for _, _, k in rows)
    stacked = mx.stack([lp for lp, _, _ in rows]).astype(mx.float32)
    tokens = mx.array([t for _, t, _ in rows])
    chosen = mx.take_along_axis(stacked, tokens[:, None], axis=-1)[:, 0]
    if k_max > 0:
        top_ids = top_k_ids(stacked, k_max)
        top_lps = mx.take_along_axis(stacked, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_lps)
        ids_list, lps_list = top_ids.tolist(), top_lps.tolist()
    else:
        mx.eval(chosen)
        ids_list = lps_list = [[] for _ in rows]
    # One transfer each (tolist), never an .item() per row: each is a sync
    return [[finite(lp), ids[:k], [finite(v) for v in lps[:k]]]
            for lp, ids, lps, (_, _, k) in zip(chosen.tolist(), ids_list, lps_list, rows)]


def top_k_ids(x: mx.array, k: int) -> mx.array:
    """The ids of each row's ``k`` largest values, largest first (a partition, then a sort
    of only those; a full sort when k is a large share of the row)."""
    n = x.shape[-1]
    if k * 8 > n:
        return mx.argsort(-x, axis=-1)[:, :k]
    # Partitioned at n - k, not on -x: a negated copy would be another row × vocabulary.
    part = mx.argpartition(x, kth=n - k, axis=-1)[:, n - k:]
    order = mx.argsort(-mx.take_along_axis(x, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


def finite(v: float) -> float:
    """A logprob JSON can carry: -inf (a token the row may never sample) as MIN_LOGPROB."""
    return v if v > MIN_LOGPROB else MIN_LOGPROB
