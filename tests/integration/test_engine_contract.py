"""The private surface of mlx-lm's BatchGenerator that worker/engine.py relies on.

mlx-lm is pinned to >=0.32.2,<0.33; an upgrade that moves any of this must fail here,
loudly, rather than in production.
"""

from __future__ import annotations

import inspect
from typing import Any
from pathlib import Path

import pytest
from mlx_lm.generate import BatchGenerator

from common.protocol import SamplingParams
from worker.engine import NOT_IN_GENERATOR, Engine, Output
from worker.loader import load_model

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(cache_home: Path) -> Engine:
    loaded = load_model("demo", {"XDG_CACHE_HOME": str(cache_home)})
    return Engine(loaded.model, list(loaded.eos_token_ids), prefill_step_size=64,
                  prefill_batch_size=8, max_batch_size=32)


def test_generator_signature_we_call() -> None:
    params = inspect.signature(BatchGenerator.__init__).parameters
    for name in ("stop_tokens", "completion_batch_size", "prefill_batch_size", "prefill_step_size"):
        assert name in params, name
    insert = inspect.signature(BatchGenerator.insert).parameters
    for name in ("prompts", "max_tokens", "samplers", "logits_processors", "stop_sequences"):
        assert name in insert, name
    assert "uids" in inspect.signature(BatchGenerator.remove).parameters


def test_public_surface_we_read(engine: Engine) -> None:
    g = engine.generator
    for name in ("prefill_step_size", "prefill_batch_size", "completion_batch_size", "stats"):
        assert hasattr(g, name), name
    response = g.next.__doc__ or ""
    assert "prompt processing responses" in response  # next() -> (prompt, generation)


def test_chunk_size_is_read_at_every_step(engine: Engine) -> None:
    engine.set_prefill_step(16)
    engine.add("chunked", list(range(3, 103)), max_tokens=2, sampling=GREEDY)
    engine.step()
    assert engine.last_prefilled_tokens == 16  # one chunk of the new size
    engine.set_prefill_step(32)
    engine.step()
    assert engine.last_prefilled_tokens == 32
    while engine.has_work:
        engine.step()


def test_the_prefill_mirror_matches_the_generators_choice(engine: Engine) -> None:
    """_next_prefill mirrors BatchGenerator._next's rule for which rows the next chunk
    covers; compare it with the rows the generator really prefilled, step by step, with
    more rows than the prefill batch and a full decoding batch on the way."""
    g = engine.generator
    saved = (g.prefill_batch_size, g.completion_batch_size)
    g.prefill_batch_size, g.completion_batch_size = 3, 5
    engine.set_prefill_step(16)
    try:
        for i, length in enumerate([40, 5, 70, 1, 30, 20, 90, 12]):
            engine.add(f"m{i}", [3 + i] * length, max_tokens=6, sampling=GREEDY)
        seen: list[Any] = []
        real_next = g.next

        def spy() -> Any:
            out = real_next()
            seen[:] = out[0]
            return out

        g.next = spy  # type: ignore[method-assign]
        checked = 0
        while engine.has_work and checked < 200:
            expected = {r.uid for r in engine._next_prefill()}
            tokens = sum(min(16, r.prompt_left) for r in engine._next_prefill())
            engine.step()
            prefilled = {p.uid for p in seen if not p.end_of_prompt}
            assert prefilled == expected, f"step {checked}: generator {prefilled}, mirror {expected}"
            assert engine.last_prefilled_tokens == tokens
            checked += 1
        assert not engine.has_work
    finally:
        del g.next
        g.prefill_batch_size, g.completion_batch_size = saved


def test_longest_prefill_left_follows_the_prompts(engine: Engine) -> None:
    assert engine.longest_prefill_left() == 0
    engine.set_prefill_step(16)
    # 100 tokens: 99 to prefill, the last fed when decoding
    engine.add("long", list(range(3, 103)), max_tokens=2, sampling=GREEDY)
    engine.add("short", list(range(3, 13)), max_tokens=2, sampling=GREEDY)
    assert engine.longest_prefill_left() == 99  # waiting rows count whole
    engine.step()
    assert engine.longest_prefill_left() == 99 - 16  # the short one is done with its 9
    engine.set_prefill_step(engine.longest_prefill_left())
    engine.step()
    assert engine.longest_prefill_left() == 0  # only last tokens left
    while engine.has_work:
        engine.step()


def test_cancel_frees_the_row_at_once(engine: Engine) -> None:
    engine.set_prefill_step(64)
    engine.add("keep", [5] * 10, max_tokens=50, sampling=GREEDY)
    engine.add("drop", [6] * 10, max_tokens=50, sampling=GREEDY)
    for _ in range(4):
        engine.step()
    uid = engine.running["drop"].uid
    assert uid in engine.generator._generation_batch.uids
    assert engine.cancel("drop")
    assert list(engine.running) == ["keep"]
    engine.remove_cancelled()  # the worker's next step does this first
    assert uid not in engine.generator._find_uids([uid])
    assert uid not in engine.generator._generation_batch.uids
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"keep"}


def test_rows_cancelled_together_leave_the_batch_in_one_filter(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each removal filters every layer of the batch's KV: thirty clients gone at once,
    removed one by one, stalled the other streams for seconds."""
    engine.set_prefill_step(64)
    for i in range(6):
        engine.add(f"r{i}", [5 + i] * 10, max_tokens=50, sampling=GREEDY)
    for _ in range(4):
        engine.step()
    removals: list[list[int]] = []
    real_remove = engine.generator.remove
    monkeypatch.setattr(engine.generator, "remove", lambda uids: (removals.append(list(uids)), real_remove(uids))[1])
    for i in range(5):
        assert engine.cancel(f"r{i}")
    outputs = engine.step()
    assert len(removals) == 1 and len(removals[0]) == 5
    assert {o.request_id for o in outputs} == {"r5"}
    engine.cancel_all()


def test_finished_requests_leave_nothing_behind(engine: Engine) -> None:
    engine.add("short", [7] * 8, max_tokens=3, sampling=GREEDY)
    finished = []
    while engine.has_work:
        finished += [o for o in engine.step() if o.finish_reason]
    assert [o.finish_reason for o in finished] == ["length"]
    assert engine.num_prefilling() == 0 and not engine.running
    assert len(engine.generator._generation_batch) == 0


# -- a prompt's first token: the generator calls made back to back --------------------------

def count_calls(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per BatchGenerator.next() call."""
    calls: list[int] = []
    real_next = engine.generator.next

    def counted() -> Any:
        calls.append(1)
        return real_next()

    monkeypatch.setattr(engine.generator, "next", counted)
    return calls


def test_a_lone_prompts_first_token_comes_from_one_step(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its last chunk, the call that feeds its last token and the one that returns the
    token, back to back: one step of the worker's loop instead of three."""
    calls = count_calls(engine, monkeypatch)
    engine.set_prefill_step(64)
    engine.add("lone", list(range(3, 15)), max_tokens=3, sampling=GREEDY)
    first = engine.step()
    assert [(o.request_id, len(o.token_ids)) for o in first] == [("lone", 1)]
    assert len(calls) == 3 and engine.last_prefilled_tokens == 11
    engine.step()
    assert len(calls) == 4  # decoding: one call a step
    while engine.has_work:
        engine.step()


def test_no_back_to_back_calls_while_a_chunk_is_left_or_a_row_decodes(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(engine, monkeypatch)
    engine.set_prefill_step(16)
    engine.add("long", list(range(3, 103)), max_tokens=2, sampling=GREEDY)
    engine.add("short", list(range(3, 13)), max_tokens=20, sampling=GREEDY)
    assert engine.step() == [] and len(calls) == 1   # the long prompt has chunks left
    while "long" in engine.running and not engine.running["short"].generated:
        engine.step()
    assert engine.running["short"].decoding
    engine.add("late", list(range(5, 15)), max_tokens=2, sampling=GREEDY)
    before = len(calls)
    outputs = engine.step()                            # "short" decodes: its token answers
    assert len(calls) == before + 1 and any(o.request_id == "short" for o in outputs)
    while engine.has_work:
        engine.step()


def cached_engine(cache_home: Path, *, prefill_step_size: int) -> Engine:
    """A demo engine with a prefix cache that takes everything (no gate behind it)."""
    from worker.prefix_cache import PrefixCache

    loaded = load_model("demo", {"XDG_CACHE_HOME": str(cache_home)})
    engine = Engine(loaded.model, list(loaded.eos_token_ids), prefill_step_size=prefill_step_size,
                    prefill_batch_size=8, max_batch_size=8)
    engine.cache = PrefixCache(max_bytes=1 << 30, max_entries=8)
    engine.kv_bytes_per_token = 1
    return engine


def test_a_message_boundary_is_stored_before_the_row_moves_on(cache_home: Path) -> None:
    """A row that reaches a boundary stops there for its KV to be stored: no call is
    chained past it, so the entry covers exactly the tokens up to the boundary (here the
    last token's: nothing but the first token's calls are left after it)."""
    engine = cached_engine(cache_home, prefill_step_size=64)
    prompt = list(range(3, 43))
    engine.add("turn", prompt, max_tokens=2, sampling=GREEDY, boundaries=[39])
    assert engine.step() == []          # the chunk up to the boundary, and no further
    engine.store_pending()
    assert [len(e) for e in engine.cache.entries] == [39]
    outputs = engine.step()             # the rest, then the first token, back to back
    assert [o.request_id for o in outputs] == ["turn"]
    while engine.has_work:
        engine.step()


def test_a_prompt_whose_short_hit_ends_before_its_first_boundary_still_stores_it(cache_home: Path) -> None:
    """Sessions share the template's header and a first system block with earlier prompts:
    a hit that ends before the system message's end must not skip storing it (parallel
    sessions with that system prompt reuse it while this one still runs)."""
    engine = cached_engine(cache_home, prefill_step_size=64)
    assert engine.can_trim
    shared = list(range(3, 23))
    engine.add("earlier", shared + list(range(300, 340)), max_tokens=2, sampling=GREEDY)
    while engine.has_work:
        engine.step()
        engine.store_pending()
    prompt = shared + list(range(400, 460))
    hit = engine.cache.lookup(prompt)
    assert hit is not None and 0 < hit.tokens < 50
    engine.add("session", prompt, max_tokens=2, sampling=GREEDY, hit=hit, boundaries=[50])
    assert engine.step() == []          # the chunk up to the system message's end
    engine.store_pending()
    assert engine.cache.lookup(prompt[:50] + [999] * 10).tokens == 50  # type: ignore[union-attr]
    while engine.has_work:
        engine.step()


def steps_to_first_token(engine: Engine, request_id: str) -> int:
    steps = 0
    while not any(o.request_id == request_id for o in engine.step()):
        steps += 1
        assert steps < 50, "no first token"
    return steps + 1


def test_a_cached_turns_rest_takes_as_few_steps_as_a_cold_prompt_that_long(cache_home: Path) -> None:
    """Agents resend the whole conversation each turn: the part after the cached prefix,
    with the chat's message boundaries inside it, is prefilled in as many steps as a cold
    prompt of its length (a trimmable cache is served at those boundaries by trimming the
    finished row's entry, so nothing stops the chunk there)."""
    engine = cached_engine(cache_home, prefill_step_size=64)
    assert engine.can_trim
    turn1 = list(range(3, 83))
    engine.add("turn1", turn1, max_tokens=4, sampling=GREEDY, boundaries=[40, 70])
    while engine.has_work:
        engine.step()
        engine.store_pending()
    turn2 = turn1 + list(range(100, 140))  # answer, tool result and the next question
    hit = engine.cache.lookup(turn2)
    assert hit is not None and hit.tokens >= len(turn1)
    engine.add("turn2", turn2, max_tokens=2, sampling=GREEDY, hit=hit, boundaries=[40, 70, 95, 125])
    cached_steps = steps_to_first_token(engine, "turn2")
    while engine.has_work:
        engine.step()
    engine.add("cold", list(range(200, 200 + len(turn2) - hit.tokens)), max_tokens=2, sampling=GREEDY)
    assert cached_steps == steps_to_first_token(engine, "cold") == 1
    while engine.has_work:
        engine.step()


def kv_buffer_tokens(engine: Engine) -> int:
    """The generation batch's KV buffer length (mlx-lm's private layout, pinned here)."""
    batch = engine.generator._generation_batch
    caches = batch.prompt_cache if batch is not None else []
    return max((c.keys.shape[2] for c in caches if getattr(c, "keys", None) is not None), default=0)


def test_a_row_from_a_cached_prefix_grows_its_buffer_from_the_prefix(cache_home: Path) -> None:
    """The cost model's kv_reach_tokens: a reused prefix off the KV step makes the row's
    buffer exactly that long, and it grows in whole steps from there, past roundup(total)."""
    from common.costmodel import kv_reach_tokens, roundup
    engine = cached_engine(cache_home, prefill_step_size=512)
    first = list(range(3, 233))
    engine.add("first", first, max_tokens=5, sampling=GREEDY)
    while engine.has_work:
        engine.step()
        engine.store_pending()
    second = first + list(range(300, 306))
    hit = engine.cache.lookup(second)
    assert hit is not None and hit.tokens % 256 != 0
    engine.add("second", second, max_tokens=20, sampling=GREEDY, hit=hit)
    (reach,) = engine.totals()
    longest = 0
    while engine.has_work:
        engine.step()
        longest = max(longest, kv_buffer_tokens(engine))
    total = len(second) + 20
    assert reach == kv_reach_tokens(total, hit.tokens)
    assert roundup(total) < longest <= reach


# -- a prompt scored for its logprobs joins as a cache hit does ---------------------------

def test_a_scored_prompt_joins_from_its_scored_kv_and_answers_as_a_plain_one(engine: Engine) -> None:
    """Scored in its own cache, chunk by chunk beside the batch, then inserted with that
    cache as its prefix (``insert_segments(caches=, all_tokens=)``) and only its last token
    to feed: its tokens are the plain row's. One that asks for none ends with its scores."""
    from dataclasses import replace

    engine.set_prefill_step(64)
    engine.set_score_step(48)
    prompt = list(range(3, 203))
    engine.add("plain", prompt, max_tokens=4, sampling=GREEDY)
    engine.add("scored", prompt, max_tokens=4, sampling=replace(GREEDY, prompt_logprobs=2))
    engine.add("scores only", prompt[:30], max_tokens=0, sampling=replace(GREEDY, prompt_logprobs=0))
    engine.add("one token", [9], max_tokens=2, sampling=replace(GREEDY, prompt_logprobs=1))
    assert engine.running["scored"].uid == NOT_IN_GENERATOR and engine.scoring_context() == 200
    outputs: list[Output] = []
    while engine.has_work:
        outputs += engine.step()
        assert engine.last_scored_tokens <= 48
    tokens = {rid: [t for o in outputs if o.request_id == rid for t in o.token_ids]
              for rid in {o.request_id for o in outputs}}
    scores = {o.request_id: o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None}
    assert tokens["scored"] == tokens["plain"] and len(tokens["scored"]) == 4
    assert len(scores["scored"]) == 199 and all(len(row[1]) == 2 for row in scores["scored"])
    assert scores["scores only"][:29] == [row[:1] + [[], []] + row[3:] for row in scores["scored"][:29]]
    assert tokens["scores only"] == [] and scores["one token"] == [] and len(tokens["one token"]) == 2
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert finished == {"plain": "length", "scored": "length", "scores only": "length", "one token": "length"}
    assert len(engine.generator._generation_batch) == 0


def test_a_row_cancelled_while_scoring_leaves_nothing(engine: Engine) -> None:
    from dataclasses import replace

    engine.set_score_step(16)
    engine.add("scoring", list(range(3, 103)), max_tokens=2, sampling=replace(GREEDY, prompt_logprobs=0))
    engine.step()
    assert engine.running["scoring"].uid == NOT_IN_GENERATOR
    assert engine.cancel("scoring") and not engine.has_work and engine.scoring_context() == 0
    assert engine.step() == []
