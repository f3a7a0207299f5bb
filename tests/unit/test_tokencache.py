"""Tests for router/chat/tokencache.py: a chat's ids reused from earlier turns equal a full encoding.

The property is checked with hypothesis on conversations that grow turn by turn, go back
to an earlier turn and are edited in the middle, on three tokenizers: the demo model's
(byte-level BPE, ChatML markers, its tool-taking template), a SentencePiece-style one
(Metaspace with ``prepend_scheme="first"``, markers that strip the whitespace around them)
and one that emits ``<unk>`` (an added token's id) for characters it does not know.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from common.errors import BadRequest
from router.chat.tokencache import PrefixTokenCache
from router.chat.tokenizer import RouterTokenizer
from tests.unit.test_tokenizer import CHATML
from worker.demo import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, _train_tokenizer

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. user assistant system tool",
    "Le café est très bon. Ça va? Naïve façade, jalapeño, crème brûlée.",
    "def main(argv: list[str]) -> int:\n    return 0\n  indented\ttab",
]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"Does {name}.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "Where: 日本 🙂"}}}}}
    for name in ("read_file", "run", "search")
]
# Pieces that look like the template's own markup, whole or cut
TRICKY = [IM_START, IM_END, ENDOFTEXT, "<|im_", "<|", "|>", "im_end|>", "<|im_start|", "<|im_end",
          "<think>", "</think>", "<tool_call>", "\n", "\n\n", " ", "\t", "<unk>", "<s>", "</s>",
          "user", "assistant", "\n<|im_start|>"]


def _backend_with(pre_tokenizer: Any, decoder: Any, *, markers: list[AddedToken],
                  unk: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>") if unk else models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    alphabet = [] if unk else pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=["<unk>"] if unk else [])
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.add_special_tokens(markers)
    return tok


@pytest.fixture(scope="module")
def demo() -> RouterTokenizer:
    """The demo model's tokenizer and template, built as worker/demo.py builds them (no weights)."""
    tokenizer_json, _ = _train_tokenizer()
    return RouterTokenizer(Tokenizer.from_str(tokenizer_json), chat_template=CHAT_TEMPLATE,
                           template_vars={}, eos_token_ids=[])


@pytest.fixture(scope="module")
def metaspace() -> RouterTokenizer:
    markers = [AddedToken(IM_START, special=True, normalized=False),
               AddedToken(IM_END, special=True, normalized=False, lstrip=True, rstrip=True),
               AddedToken(ENDOFTEXT, special=True, normalized=False)]
    backend = _backend_with(pre_tokenizers.Metaspace(prepend_scheme="first"), decoders.Metaspace(),
                            markers=markers, unk=False)
    return RouterTokenizer(backend, chat_template=CHATML, template_vars={}, eos_token_ids=[])


@pytest.fixture(scope="module")
def nested() -> RouterTokenizer:
    """A marker that begins before another and ends past it: the split at <|im_start|>
    depends on what follows it, which a cut must not take for granted."""
    markers = [AddedToken(IM_START, special=True, normalized=False),
               AddedToken(IM_END, special=True, normalized=False),
               AddedToken("\n<|im_start|>user", special=False, normalized=False)]
    backend = _backend_with(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                            markers=markers, unk=False)
    return RouterTokenizer(backend, chat_template=CHATML, template_vars={}, eos_token_ids=[])


@pytest.fixture(scope="module")
def with_unk() -> RouterTokenizer:
    markers = [AddedToken(t, special=True, normalized=False) for t in (IM_START, IM_END, "<unk>")]
    backend = _backend_with(pre_tokenizers.Whitespace(), decoders.BPEDecoder(), markers=markers, unk=True)
    return RouterTokenizer(backend, chat_template=CHATML, template_vars={}, eos_token_ids=[])


def fresh(tok: RouterTokenizer, **sizes: int) -> RouterTokenizer:
    """The same tokenizer and template with an empty prefix cache (or none: sizes 0)."""
    return RouterTokenizer(tok._backend, chat_template=tok.chat_template_source, template_vars={},
                           eos_token_ids=[], **sizes)


def full_ids(tok: RouterTokenizer, text: str) -> list[int]:
    return tok._backend.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- conversations

texts = st.lists(
    st.one_of(st.sampled_from(TRICKY), st.text(max_size=12),
              st.text(alphabet="abc éü日本🙂\n\t ", max_size=20), st.sampled_from(CORPUS)),
    max_size=5,
).map("".join)


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "system"]))
    m: dict[str, Any] = {"role": role, "content": draw(texts)}
    if role == "assistant" and draw(st.booleans()):
        m["tool_calls"] = [{"type": "function", "function": {
            "name": draw(st.sampled_from(["read_file", "run"])),
            "arguments": json.dumps({"path": draw(texts)})}}]
    if role == "assistant" and draw(st.booleans()):
        m["reasoning_content"] = draw(texts)
    return m


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    first = [{"role": "system", "content": draw(texts)}] if draw(st.booleans()) else []
    messages = first + draw(st.lists(message(), min_size=1, max_size=6))
    tools = draw(st.sampled_from([None, TOOLS[:1], TOOLS]))
    return messages, tools


def edited(draw: st.DrawFn, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat with one message's content changed in the middle (an insert, a cut or a swap)."""
    out = [dict(m) for m in messages]
    i = draw(st.integers(0, len(out) - 1))
    content = out[i]["content"]
    at = draw(st.integers(0, len(content)))
    cut = draw(st.integers(0, len(content) - at))
    out[i]["content"] = content[:at] + draw(texts) + content[at + cut:]
    return out


def rendered_boundaries(tok: RouterTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        kwargs: dict[str, Any] | None, text: str, ids: list[int]) -> list[int]:
    """The boundaries by their definition: every prefix rendered without the generation
    prompt, kept where it is a text and a token prefix of the whole."""
    ends = {len(messages), len(messages) - 1} | ({1} if messages[0]["role"] == "system" else set())
    found = []
    for k in sorted(e for e in ends if e >= 1):
        try:
            prefix = tok.render_chat(messages[:k], tools, kwargs, add_generation_prompt=False)
        except BadRequest:
            continue
        prefix_ids = full_ids(tok, prefix)
        if prefix and text.startswith(prefix) and 0 < len(prefix_ids) < len(ids) and ids[:len(prefix_ids)] == prefix_ids:
            found.append(len(prefix_ids))
    return sorted(set(found))


def check_turn(cached: RouterTokenizer, plain: RouterTokenizer, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None) -> None:
    """Ids and boundaries through the cache equal a full encoding's, as router/http/api.py
    asks them, and the boundaries (two of their renders spared) their definition's."""
    text = cached.render_chat(messages, tools, kwargs)
    ids = cached.encode_rendered(text)
    assert ids == full_ids(cached, text)
    want = plain.message_boundaries(messages, tools, kwargs, text, full_ids(plain, text))
    assert cached.message_boundaries(messages, tools, kwargs, text, ids) == want
    assert want == rendered_boundaries(plain, messages, tools, kwargs, text, full_ids(plain, text))


@pytest.mark.parametrize("name", ["demo", "metaspace", "nested", "with_unk"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), data=st.data())
def test_incremental_ids_and_boundaries_equal_a_full_encoding(
    name: str, request: pytest.FixtureRequest, conv: tuple[list[dict[str, Any]], list[dict[str, Any]] | None],
    data: st.DataObject,
) -> None:
    base = request.getfixturevalue(name)
    cached, plain = fresh(base), fresh(base, prefix_cache_entries=0)
    messages, tools = conv
    kwargs = {"enable_thinking": True} if data.draw(st.booleans()) else None
    for turn in range(1, len(messages) + 1):  # grown turn by turn
        check_turn(cached, plain, messages[:turn], tools, kwargs)
    for _ in range(2):  # edited in the middle, then a retry of an earlier turn
        messages = edited(data.draw, messages)
        check_turn(cached, plain, messages, tools, kwargs)
        check_turn(cached, plain, messages[:data.draw(st.integers(1, len(messages)))], tools, kwargs)


@pytest.mark.parametrize("name", ["demo", "nested"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=texts, suffixes=st.lists(texts, min_size=1, max_size=4))
def test_any_text_sharing_a_prefix_encodes_exactly(name: str, request: pytest.FixtureRequest, prefix: str,
                                                   suffixes: list[str]) -> None:
    """Raw texts, not only rendered chats: markers anywhere, cut anywhere."""
    backend = request.getfixturevalue(name)._backend
    cache = make_cache(backend)
    for suffix in suffixes:
        for text in (prefix + suffix, prefix + IM_START + suffix, prefix + "\n" + IM_START + suffix,
                     prefix[: len(prefix) // 2] + suffix):
            assert cache.encode(text) == backend.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- the cache itself


def make_cache(backend: Tokenizer, encoded: list[str] | None = None, **sizes: int) -> PrefixTokenCache:
    def encode(text: str) -> list[int]:
        if encoded is not None:
            encoded.append(text)
        return backend.encode(text, add_special_tokens=False).ids

    cache = PrefixTokenCache.for_backend(backend, encode, max_entries=sizes.get("max_entries", 8),
                                         max_tokens=sizes.get("max_tokens", 1 << 16))
    assert cache is not None
    return cache


def agent_turns(demo: RouterTokenizer, num_turns: int, tag: str = "") -> list[str]:
    """Rendered turns of one agent's chat: each resends the one before plus two messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {tag}. " + CORPUS[0] * 8},
                                      {"role": "user", "content": CORPUS[1]}]
    out = []
    for turn in range(num_turns):
        out.append(demo.render_chat(messages, TOOLS))
        messages += [{"role": "assistant", "content": f"Step {turn}.", "tool_calls": [
            {"type": "function", "function": {"name": "run", "arguments": '{"path": "x"}'}}]},
                     {"role": "tool", "content": CORPUS[2] * 3}]
    return out


def test_a_later_turn_encodes_only_what_is_new(demo: RouterTokenizer) -> None:
    encoded: list[str] = []
    cache = make_cache(demo._backend, encoded)
    turns = agent_turns(demo, 4)
    for before, text in zip([""] + turns, turns):
        encoded.clear()
        assert cache.encode(text) == full_ids(demo, text)
        new = len(text) - len(before)
        # the new messages and the generation prompt before them, nothing of the rest
        assert len(encoded) == 1 and len(encoded[0]) <= (len(text) if not before else new + 30)
    encoded.clear()
    assert cache.encode(turns[-1]) == full_ids(demo, turns[-1]) and encoded == []  # a retry: nothing


def test_an_append_only_chat_keeps_one_entry_and_a_prefix_none(demo: RouterTokenizer) -> None:
    cache = make_cache(demo._backend)
    turns = agent_turns(demo, 5)
    for text in turns:
        cache.encode(text)
    assert cache.num_entries == 1
    assert cache.encode(turns[-1][:-40], remember=False) == full_ids(demo, turns[-1][:-40])
    assert cache.num_entries == 1


def test_bounded_by_entries_and_by_tokens(demo: RouterTokenizer) -> None:
    chats = [agent_turns(demo, 1, tag=str(i))[0] for i in range(6)]
    sizes = [len(full_ids(demo, text)) for text in chats]
    cache = make_cache(demo._backend, max_entries=3)
    for text in chats:
        cache.encode(text)
    assert cache.num_entries == 3 and cache.num_tokens == sum(sizes[-3:])
    cache = make_cache(demo._backend, max_tokens=sizes[0] + sizes[1] + sizes[2] - 1)
    for text in chats[:3]:
        cache.encode(text)
    assert cache.num_entries == 2 and cache.num_tokens <= cache.max_tokens
    cache = make_cache(demo._backend, max_tokens=sizes[0] - 1)
    assert cache.encode(chats[0]) == full_ids(demo, chats[0]) and cache.num_entries == 0


def test_least_recently_used_goes_first(demo: RouterTokenizer) -> None:
    chats = [agent_turns(demo, 1, tag=str(i))[0] for i in range(3)]
    cache = make_cache(demo._backend, max_entries=2)
    cache.encode(chats[0])
    cache.encode(chats[1])
    cache.encode(chats[0] + "<|im_start|>user\nmore", remember=False)  # a use of chats[0]
    cache.encode(chats[2])
    encoded: list[str] = []
    cache._encode = lambda text: encoded.append(text) or full_ids(demo, text)  # type: ignore[method-assign]
    cache.encode(chats[0])
    assert encoded == [] and chats[1] not in cache._entries  # chats[0] still there; chats[1] went


def test_threads_share_one_cache(demo: RouterTokenizer) -> None:
    cache = make_cache(demo._backend, max_entries=4)
    chats = [agent_turns(demo, 4, tag=str(i)) for i in range(4)]
    failures: list[str] = []

    def agent(turns: list[str]) -> None:
        for _ in range(3):
            for text in turns:
                if cache.encode(text) != full_ids(demo, text):
                    failures.append(text)

    threads = [threading.Thread(target=agent, args=(turns,)) for turns in chats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and cache.num_entries <= 4


@pytest.mark.parametrize("why", ["single_word", "no cache", "dropout"])
def test_no_cache_where_the_split_cannot_be_replayed(why: str) -> None:
    backend = Tokenizer.from_str(_train_tokenizer()[0])
    sizes = {"max_entries": 0 if why == "no cache" else 8, "max_tokens": 1 << 16}
    if why == "single_word":
        backend.add_tokens([AddedToken("<|tool|>", single_word=True, normalized=False)])
    if why == "dropout":
        backend.model.dropout = 0.1
    assert PrefixTokenCache.for_backend(backend, lambda text: [], **sizes) is None


def test_a_tokenizer_without_a_template_encodes_as_before(demo: RouterTokenizer) -> None:
    plain = RouterTokenizer(demo._backend, chat_template=None, template_vars={}, eos_token_ids=[])
    messages = [{"role": "user", "content": "hi <|im_start|> there"}]
    text = plain.render_chat(messages)
    assert plain.encode_rendered(text) == demo._backend.encode(text).ids


def test_markers_the_model_emits_itself_mean_no_cut(with_unk: RouterTokenizer) -> None:
    cache = make_cache(with_unk._backend)
    text = "<|im_start|>user\nhi ☃ there<|im_end|>\n<|im_start|>assistant\n"
    assert cache.encode(text) == full_ids(with_unk, text)
    assert 0 in full_ids(with_unk, text)  # ☃ is <unk>: an added token's id without its text
    (entry,) = cache._entries.values()
    assert len(entry.cut_chars) == 0
    longer = text + "ok<|im_end|>\n"
    assert cache.encode(longer) == full_ids(with_unk, longer)


def test_boundaries_with_the_cache_are_the_full_ones(demo: RouterTokenizer) -> None:
    plain = fresh(demo, prefix_cache_entries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    for turn in (2, 4):
        check_turn(demo, plain, messages[:turn], TOOLS, None)

