"""Prompt logprobs: a prompt scored chunk by chunk in its own KV cache, beside the batch.

mlx-lm's BatchGenerator prefills a prompt without ever computing its logits (only the
cache's state is evaluated), so the logprobs of a prompt's own tokens (``echo`` with
``logprobs``, vLLM's ``prompt_logprobs``) need forwards of their own. A ``PromptScorer``
runs them: one chunk per engine step (``Engine.step``), sized by the gate, in a fresh
``make_prompt_cache``. Each chunk's logits (chunk × vocabulary) become, in float32, the next
prompt token's logprob and rank and the N most likely ids, and only those leave the
device: the ``prompt × vocabulary`` matrix never exists (for a 2k-token prompt and a 152k
vocabulary it alone would be over 1 GB), and the float32 work on a chunk's logits is done
a few positions at a time. The chunk's transient is the cost model's
``scoring_transient_bytes``. When the whole prompt but its last token is scored, the
cache joins the generator as a prefix-cache hit's does, so the answer goes on from the
scored KV (the engine's business, not this module's).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from common import costmodel
from worker.sampling import finite, top_k_ids

# One prompt position's scores on the wire: [logprob, top_ids, top_logprobs, rank] (rank 1:
# the most likely token), for the prompt's tokens after the first.
PromptLogprob = list[Any]


class PromptScorer:
    """One prompt's scoring: its own cache, how far it got, and the scores so far."""

    def __init__(self, model: Any, prompt_ids: list[int], num_top: int) -> None:
        self.model = model
        self.prompt = prompt_ids
        self.num_top = num_top
        self.cache: list[Any] = make_prompt_cache(model)
        self.done = 0                               # positions scored: prompt[1:done + 1]
        self.rows: list[PromptLogprob] = []

    @property
    def left(self) -> int:
        """Positions still to score: every prompt token but the first has one."""
        return len(self.prompt) - 1 - self.done

    def step(self, chunk_tokens: int) -> int:
        """Score up to ``chunk_tokens`` more positions; returns how many it scored."""
        start = self.done
        end = min(start + max(chunk_tokens, 1), len(self.prompt) - 1)
        if end <= start:
            return 0
        self.rows += score_chunk(self.model, self.cache, self.prompt[start:end],
                                 self.prompt[start + 1:end + 1], self.num_top)
        self.done = end
        return end - start


def score_chunk(model: Any, cache: list[Any], inputs: list[int], targets: list[int],
                num_top: int) -> list[PromptLogprob]:
    """Feed ``inputs`` into ``cache`` and score each position's next token (``targets``).

    The logits (chunk × vocabulary, in the model's dtype, as any prefill's forward makes
    them) are turned into logprobs a few positions per pass (``score_rows_per_pass``), so
    their float32 work stays within SCORE_PASS_BYTES whatever the chunk.
    """
    logits = model(mx.array(inputs)[None], cache=cache)
    logits = logits.reshape(logits.shape[1:])  # a view: indexing [0] would copy them all
    mx.eval(logits, [c.state for c in cache])
    step = costmodel.score_rows_per_pass(logits.shape[-1])
    rows: list[PromptLogprob] = []
    for start in range(0, len(inputs), step):
        rows += _score_pass(logits[start:start + step], targets[start:start + step], num_top)
    return rows


def _score_pass(logits: mx.array, targets: list[int], num_top: int) -> list[PromptLogprob]:
    """A token's logprob and the top ones are the same float32 subtraction (logit minus the
    log-normaliser), so a token that is the most likely reports exactly the top value:
    lm-evaluation-harness's greedy check compares them with ``==``."""
    logits = logits.astype(mx.float32)
    norm = mx.logsumexp(logits, axis=-1, keepdims=True)
    target_logits = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)
    logprobs = (target_logits - norm)[:, 0]
    ranks = (logits > target_logits).sum(axis=-1) + 1
    top_ids = top_k_ids(logits, num_top) if num_top > 0 else mx.zeros((len(targets), 0), dtype=mx.uint32)
    top_logprobs = mx.take_along_axis(logits, top_ids, axis=-1) - norm
    mx.eval(logprobs, ranks, top_ids, top_logprobs)
    return [[finite(lp), ids, [finite(v) for v in lps], rank]
            for lp, ids, lps, rank in zip(logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist(),
                                          ranks.tolist())]
