"""The memory cost model: pure functions on numbers, shared by router and worker.

The worker fits the coefficients and publishes them in ``hello`` (``CostModel.to_dict``);
the router applies the same functions to decide "fits ever?" before any GPU work.
No mlx, no asyncio, no clocks here.

Shapes follow what mlx-lm really allocates: ``BatchKVCache`` is one dense, left-padded
tensor per layer whose length grows in steps of ``KV_STEP_TOKENS``; every row is as long
as the longest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "KV_STEP_TOKENS",
    "MIN_REQUEST_TOKENS",
    "CostModel",
    "kv_bytes_per_token",
    "roundup",
    "kv_reach_tokens",
    "kv_aligned_chunk",
    "batch_kv_bytes",
    "prefill_transient_bytes",
    "forward_transient_bytes",
    "growth_spike_bytes",
    "copy_spike_bytes",
    "copies_layerwise",
    "score_rows_per_pass",
    "scoring_transient_bytes",
    "scoring_step_bytes",
    "scored_kv_start",
    "scored_reach_tokens",
    "score_chunk_that_fits",
    "request_cost_bytes",
    "batch_cost_bytes",
    "max_request_tokens",
    "max_new_tokens",
    "never_fits",
    "safe_prefill_chunk",
    "chunk_that_fits",
    "fits_now",
]

# mlx-lm's BatchKVCache.step: caches grow by this many tokens at a time.
KV_STEP_TOKENS = 256
# A batch cache whose layers hold this much each is copied one layer at a time when rows
# join or leave it (worker/kvcopy.py), so only one layer's old and new coexist; a smaller
# one's copies run together, lazily, as mlx-lm makes them (no wait for the step in flight).
# 16 MiB a layer: 512 MiB over 32 layers, where the whole copy starts to cost real rows.
# A worker whose engine copies this way says so in its cost model (``layerwise_copy_bytes``).
LAYERWISE_COPY_BYTES = 16 << 20
# Layers of the new batch a layer-wise copy is charged (``copy_spike_bytes``).
LAYERWISE_COPY_LAYERS = 2
# The smallest request worth starting a worker for: one KV step of prompt plus output.
MIN_REQUEST_TOKENS = KV_STEP_TOKENS
# Smallest prefill chunk we ever use; below this per-step overhead dominates.
MIN_CHUNK_TOKENS = 32
# A scoring chunk's logits become logprobs a few rows at a time (worker/scoring.py): each
# pass's float32 work stays near this, whatever the chunk and the vocabulary.
SCORE_PASS_BYTES = 64 << 20
# That work per logit: a float32 copy of the logits (4), the top-N's partition ids (4) and
# the rank's comparison (1), as measured on MLX for float32 and bfloat16 models; with a
# margin for the allocator's rounding.
SCORE_BYTES_PER_LOGIT = 12


def roundup(tokens: int, step: int = KV_STEP_TOKENS) -> int:
    """Round up to the cache's growth step (0 stays 0)."""
    return -(-max(tokens, 0) // step) * step


def kv_reach_tokens(total_tokens: int, cached_tokens: int = 0) -> int:
    """The longest a row's KV buffer gets. mlx-lm sizes a row that starts from a cached
    prefix to exactly that prefix, and every later growth adds whole steps to wherever the
    buffer stands: such a row reaches ``cached + roundup(rest)``, up to a step beyond
    ``roundup(total)``. Charged as its length, so the padded shape stays exact."""
    if cached_tokens % KV_STEP_TOKENS == 0:
        return total_tokens
    return cached_tokens + roundup(total_tokens - cached_tokens)


def kv_aligned_chunk(tokens: int) -> int:
    """The largest prefill chunk of at most ``tokens`` that keeps the KV buffer's growths at
    whole steps from the prompt's start (a multiple of the step, or a power of two below
    it): a chunk of 300 would leave the next growth starting at token 300."""
    if tokens >= KV_STEP_TOKENS:
        return tokens // KV_STEP_TOKENS * KV_STEP_TOKENS
    return 1 << (max(tokens, 1).bit_length() - 1)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values (x2) for every layer, for one token of one row."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """The coefficients the worker admits by; all sizes in bytes."""

    kv_bytes_per_token: int
    num_layers: int
    # Transient of one forward, run in order (kernels queued ahead of the device are
    # bounded by MLX's limit, not charged: ``worker/gate.py``'s step limit)
    #   ≈ b + Σ rows (a·chunk + d·context + c·chunk·context):
    # b is fixed per forward whatever its length (e.g. a weight dequantized for a large
    # matmul on CUDA, ~117 MB on an 8B 4-bit model), a per chunk token (activations, a
    # logits row), d per row per context token (attention reads a layer's keys and values
    # through a contiguous copy: ~1.75x a layer's KV per token on the H200, a decode row
    # at 4k on an 8B model ~29 MB, which a·1 + c·context never charged), c per chunk token
    # per context token (attention scores where they are materialized). A decode row is a
    # chunk of one.
    prefill_a_bytes: float
    prefill_c_bytes: float
    prefill_b_bytes: float = 0.0
    prefill_d_bytes: float = 0.0
    # Fraction of one layer's old cache that coexists with the new one when a cache grows.
    growth_factor: float = 1.0
    # When rows join or leave a batch, mlx-lm copies the whole batch cache (concatenate on
    # extend, gather on filter); for a moment old and new coexist: this share of it.
    copy_factor: float = 1.0
    # In-service correction: grows when a step's measured peak exceeds its prediction.
    scale: float = 1.0
    budget_bytes: int
    context_length: int
    prefill_step_tokens: int
    prefill_batch_size: int = 8
    # Logits per position: what scoring a prompt's tokens costs (0: unknown, not charged).
    vocab_size: int = 0
    # Layers this large are copied one at a time when rows join or leave the batch (the
    # worker's engine does it: worker/kvcopy.py, which sets this); 0: every copy is whole.
    layerwise_copy_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def batch_kv_bytes(rows: int, longest_tokens: int, kv_per_token: int) -> int:
    """Dense, left-padded: every row is as long as the longest, rounded to the step."""
    return rows * roundup(longest_tokens) * kv_per_token


def prefill_transient_bytes(m: CostModel, chunk_tokens: int, context_tokens: int, rows: int = 1) -> int:
    """Per-row working memory of one prefill chunk over ``rows`` rows (freed at the end of
    the step); the fixed per-forward part is ``forward_transient_bytes``'s."""
    if chunk_tokens <= 0:
        return 0
    per_row = (m.prefill_a_bytes * chunk_tokens + m.prefill_d_bytes * context_tokens
               + m.prefill_c_bytes * chunk_tokens * context_tokens)
    return int(rows * per_row)


def forward_transient_bytes(m: CostModel, *, chunk_tokens: int, context_tokens: int,
                            prefill_rows: int, decode_rows: int, decode_context: int) -> int:
    """One step's transient: the fixed per-forward term, the prefill chunk, and every
    decoding row as a chunk of one token over its context."""
    if prefill_rows + decode_rows == 0:
        return 0
    return int(m.prefill_b_bytes
               + prefill_transient_bytes(m, chunk_tokens, context_tokens, prefill_rows)
               + prefill_transient_bytes(m, 1, decode_context, decode_rows))


def growth_spike_bytes(m: CostModel, rows: int, longest_tokens: int) -> int:
    """When a layer's cache grows, its old buffer and the new one coexist for a moment."""
    per_layer_old = rows * roundup(longest_tokens) * m.kv_bytes_per_token / max(m.num_layers, 1)
    return int(m.growth_factor * per_layer_old)


def copies_layerwise(m: CostModel, layer_bytes: float) -> bool:
    """Is a batch cache with layers of ``layer_bytes`` copied one layer at a time?"""
    return 0 < m.layerwise_copy_bytes <= layer_bytes


def copy_spike_bytes(m: CostModel, rows: int, longest_tokens: int) -> int:
    """Extending or filtering a batch of several rows copies its cache once: the whole old
    batch beside the new one when its layers are small; when they are large
    (``copies_layerwise``) a layer at a time, and two layers are charged: while one is
    copied its old buffers, the joining rows' padded copy of it and a decode's growth of
    it in the same step can stand beside the new one (measured on the demo model: a join
    into four rows peaked ~1.2 layers over the new batch, 1.07-1.22x a one-layer charge)."""
    if rows < 2:
        return 0
    whole = batch_kv_bytes(rows, longest_tokens, m.kv_bytes_per_token)
    layers = max(m.num_layers, 1)
    layer = whole / layers
    if not copies_layerwise(m, layer):
        return int(m.copy_factor * whole)
    # Never below the largest whole copy a smaller batch is charged (just under the
    # threshold on every layer): a batch's worst case must not fall as it grows.
    return int(m.copy_factor * min(whole, max(LAYERWISE_COPY_LAYERS * layer, m.layerwise_copy_bytes * layers)))


def request_cost_bytes(m: CostModel, prompt_tokens: int, max_tokens: int, *, scoring: bool = False) -> int:
    """Peak cost of one request on an idle worker: its cache, a growth, and the smallest
    prefill chunk the worker would use (an idle worker that is short of memory prefills a
    long prompt in small chunks rather than refuse it).

    ``scoring`` (prompt logprobs): no prefill chunk but a scoring chunk, beside the row's
    decode once it joined, and the row is as long as ``scored_reach_tokens`` says: what
    ``fits_now`` charges an idle worker, so that what passes here is admitted there."""
    if scoring:
        return batch_cost_bytes(m, 1, scored_reach_tokens(prompt_tokens, max_tokens), 0, 0, prompt_tokens) \
            + scoring_step_bytes(m, min(MIN_CHUNK_TOKENS, prompt_tokens), prompt_tokens)
    chunk = min(max(prompt_tokens, 1), MIN_CHUNK_TOKENS, m.prefill_step_tokens)
    return batch_cost_bytes(m, 1, prompt_tokens + max_tokens, chunk, 1, prompt_tokens)


def score_rows_per_pass(vocab_size: int) -> int:
    """Positions of a scoring chunk turned into logprobs at once (SCORE_PASS_BYTES)."""
    return max(1, SCORE_PASS_BYTES // max(vocab_size * SCORE_BYTES_PER_LOGIT, 1))


def scoring_transient_bytes(m: CostModel, chunk_tokens: int, context_tokens: int) -> int:
    """One scoring chunk's working memory, unscaled: the forward of a prefill chunk of one
    row, whose logits it keeps (the per-token term holds a logits row), and the float32
    work of one pass over them (``score_rows_per_pass``): never ``chunk × vocabulary`` of
    it, and never the prompt's whole matrix."""
    if chunk_tokens <= 0:
        return 0
    rows = min(chunk_tokens, score_rows_per_pass(m.vocab_size))
    return (forward_transient_bytes(m, chunk_tokens=chunk_tokens, context_tokens=context_tokens,
                                    prefill_rows=1, decode_rows=0, decode_context=0)
            + rows * m.vocab_size * SCORE_BYTES_PER_LOGIT)


def scoring_step_bytes(m: CostModel, chunk_tokens: int, context_tokens: int) -> int:
    """``scoring_transient_bytes`` at the model's scale: what a step that scores adds."""
    return int(m.scale * scoring_transient_bytes(m, chunk_tokens, context_tokens))


def scored_kv_start(prompt_tokens: int, max_tokens: int) -> int:
    """Where a scored row's KV stands when it joins the batch: all its prompt but the last
    token, scored in its own cache; 0 when it never joins (max_tokens 0) or has nothing
    scored (a one-token prompt)."""
    return prompt_tokens - 1 if max_tokens > 0 else 0


def scored_reach_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """The length a row whose prompt is scored is charged as until it joins the batch: its
    reach from the scored prefix (``kv_reach_tokens``), and that prefix once more, for when
    it joins, the scored cache and the batch's copy of it coexist."""
    start = scored_kv_start(prompt_tokens, max_tokens)
    return kv_reach_tokens(prompt_tokens + max_tokens, start) + start


def score_chunk_that_fits(m: CostModel, context_tokens: int, limit_bytes: int, most: int) -> int:
    """The largest scoring chunk (at most ``most``, at least MIN_CHUNK_TOKENS or ``most`` if
    smaller) whose transient stays within ``limit_bytes``; that floor when none does."""
    def fits(chunk: int) -> bool:
        return scoring_step_bytes(m, chunk, context_tokens) <= limit_bytes

    if fits(most):
        return most
    return _largest(min(MIN_CHUNK_TOKENS, most), most - 1, fits)


def batch_cost_bytes(m: CostModel, rows: int, longest_tokens: int, chunk_tokens: int,
                     prefill_rows: int, context_tokens: int) -> int:
    """Worst case of a batch: every row padded to the longest, plus one step's forward
    (a prefill chunk over ``prefill_rows``, the other rows decoding), plus the larger of a
    growth step and a whole-batch copy (they do not happen in one step)."""
    if rows == 0:
        return 0
    spike = max(growth_spike_bytes(m, rows, longest_tokens), copy_spike_bytes(m, rows, longest_tokens))
    prefill_rows = min(prefill_rows, rows) if chunk_tokens > 0 else 0
    transient = forward_transient_bytes(m, chunk_tokens=chunk_tokens, context_tokens=context_tokens,
                                        prefill_rows=prefill_rows, decode_rows=rows - prefill_rows,
                                        decode_context=longest_tokens)
    return int(m.scale * (batch_kv_bytes(rows, longest_tokens, m.kv_bytes_per_token) + transient + spike))


def never_fits(m: CostModel, prompt_tokens: int, max_tokens: int, *, scoring: bool = False) -> bool:
    """Even an idle worker could not hold it."""
    return request_cost_bytes(m, prompt_tokens, max_tokens, scoring=scoring) > m.budget_bytes


def max_request_tokens(m: CostModel, *, scoring: bool = False) -> int:
    """The longest prompt + max_tokens an idle worker can hold (≤ the context length);
    ``scoring``: with the prompt's logprobs.

    Cost grows monotonically with length, so a binary search over step multiples is exact
    to the step; we charge the whole total as prompt (the conservative split).
    """
    return _largest(0, m.context_length,
                    lambda n: request_cost_bytes(m, n - 1, 1, scoring=scoring) <= m.budget_bytes)


def max_new_tokens(m: CostModel, prompt_tokens: int, chunk_tokens: int | None = None) -> int:
    """The most tokens an idle worker can generate after this prompt while it still prefills
    in chunks of ``chunk_tokens`` (default: its full step): at most the context left, 0 when
    that does not fit. With MIN_CHUNK_TOKENS it is ``never_fits``'s edge, where a request
    prefills in the smallest chunks, many times slower than at the full step."""
    chunk = min(max(prompt_tokens, 1), chunk_tokens or m.prefill_step_tokens, m.prefill_step_tokens)
    prefill = forward_transient_bytes(m, chunk_tokens=chunk, context_tokens=prompt_tokens,
                                      prefill_rows=1, decode_rows=0, decode_context=0)

    def fits(n: int) -> bool:
        total = prompt_tokens + n
        cost = batch_kv_bytes(1, total, m.kv_bytes_per_token) + prefill + growth_spike_bytes(m, 1, total)
        return int(m.scale * cost) <= m.budget_bytes

    return _largest(0, max(m.context_length - prompt_tokens, 0), fits)


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest n in (lo, hi] for which ``fits`` holds, else lo (never tested), where
    ``fits`` holds up to some n and not beyond: cost grows with n, so a binary search."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def safe_prefill_chunk(m: CostModel, free_bytes: int, context_tokens: int, rows: int = 1) -> int:
    """Largest chunk whose transient fits in ``free_bytes``; never above the static step.

    The fixed terms (per forward, and each row's context) are paid whatever the chunk, so
    they come off first."""
    context = max(context_tokens, 1)
    per_token = rows * (m.prefill_a_bytes + m.prefill_c_bytes * context)
    fixed = m.prefill_b_bytes + rows * m.prefill_d_bytes * context
    if per_token <= 0:  # the chunk costs nothing more: the step if the fixed terms fit
        return m.prefill_step_tokens if fixed <= free_bytes else min(m.prefill_step_tokens, MIN_CHUNK_TOKENS)
    chunk = int(max(0.0, free_bytes - fixed) // per_token)
    return min(m.prefill_step_tokens, max(MIN_CHUNK_TOKENS, chunk))


def chunk_that_fits(m: CostModel, rows: int, longest_tokens: int, prefill_rows: int,
                    context_tokens: int, limit_bytes: int, most: int) -> int:
    """The largest prefill chunk (at most ``most``, at least MIN_CHUNK_TOKENS or ``most`` if
    smaller) whose batch worst case stays within ``limit_bytes``; that floor when none
    does (the caller then finds the batch does not fit)."""
    def fits(chunk: int) -> bool:
        return batch_cost_bytes(m, rows, longest_tokens, chunk, prefill_rows, context_tokens) <= limit_bytes

    if fits(most):  # the common case, every step: no search
        return most
    return _largest(min(MIN_CHUNK_TOKENS, most), most - 1, fits)


def fits_now(m: CostModel, running_totals: list[int], prompt_tokens: int, max_tokens: int,
             prefill_rows: int, free_bytes: int, score_context: int = 0, *,
             joining_bytes: int = 0, own_join_bytes: int = 0, scoring: bool = False) -> tuple[bool, int]:
    """Can a request join the running batch now? Returns (fits, the batch's new worst case).

    The batch's worst case is charged in the real padded shape: every row as long as the
    longest prompt + max_tokens, and a prefill chunk as large as fits (the worker sizes its
    chunks to what is left, so a tight batch prefills in smaller chunks rather than wait).
    ``free_bytes`` is live headroom minus what is already promised to running rows but
    not yet allocated; the increment must fit in it. ``score_context``: the longest prompt
    being scored (this request's or a running one's; 0: none), whose scoring chunk runs in
    the same step as the batch's forward: charged beside it at the smallest chunk.
    ``joining_bytes``: what the joins of prefix-cache hits whose rows have not joined the
    batch yet will hold beside those rows' own KV (already promised); ``own_join_bytes``:
    the same for this request's own hit. A row joining from a hit of several blocks holds
    their concatenation beside its own copy for that step: promised with the batch until
    it has joined (on the demo model under 160 MB a conversation's first cached turn passed
    the limit when only the step's chunk was sized to it). ``scoring``: this request's
    prompt is scored (``score_context`` covers it) and its row joins from that KV with
    nothing to prefill, so it adds no prefill row.
    """
    total = prompt_tokens + max_tokens
    old_worst = joining_bytes
    if running_totals:
        old_worst += batch_cost_bytes(m, len(running_totals), max(running_totals), 0, 0, 0)
    longest = max(running_totals + [total])
    rows = len(running_totals) + 1
    # The chunk's rows may include older, longer prompts: charge it at the longest context.
    context = longest if running_totals else prompt_tokens
    room = min(m.budget_bytes, old_worst + max(free_bytes, 0))
    score = scoring_step_bytes(m, min(MIN_CHUNK_TOKENS, score_context), score_context)
    joins = joining_bytes + own_join_bytes
    prefilling = prefill_rows + (0 if scoring else 1)
    chunk = chunk_that_fits(m, rows, longest, prefilling, context, room - score - joins,
                            min(max(prompt_tokens, 1), m.prefill_step_tokens))
    new_worst = batch_cost_bytes(m, rows, longest, chunk, prefilling, context) + score + joins
    fits = new_worst <= m.budget_bytes and new_worst - old_worst <= free_bytes
    return fits, new_worst
