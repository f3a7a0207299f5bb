"""Tests for router/chat/tokenizer.py on small tokenizers built in the test, offline.

Two tokenizer folders are built once per session: a byte-level BPE (as in GPT-2, Llama 3,
Qwen) with a ChatML template, and a SentencePiece-style BPE with byte fallback (as in
Llama 2, Mistral, Gemma), which exercises the offset detokenizer's byte-run rule.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from common.errors import BadRequest, ConfigError
from router.chat.tokenizer import (
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    OffsetDetokenizer,
    RouterTokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Le café est très bon. Ça va? Naïve façade, jalapeño, crème brûlée.",
    "日本語のテキストです。東京と大阪。中文也可以。한국어 문장.",
    "Emoji: 🙂 👍🏽 👨‍👩‍👧 🎉 ❤️ 🚀 and math ∑ ∫ √ π ≈ ≠.",
    "def main(argv: list[str]) -> int:\n    return 0\n",
]


def write_folder(folder: Path, tokenizer_json: Path, tokenizer_config: dict[str, Any], **files: Any) -> Path:
    """A model folder: tokenizer.json, tokenizer_config.json and any extra JSON files."""
    folder.mkdir(parents=True)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / f"{name}.json").write_text(text)
    return folder


@pytest.fixture(scope="session")
def byte_level_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS, show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def make_tokenizer(
    byte_level_json: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., RouterTokenizer]:
    """Build a byte-level model folder with the given config and files, and load it."""

    def make(tokenizer_config: dict[str, Any] | None = None, **files: Any) -> RouterTokenizer:
        folder = tmp_path_factory.mktemp("model") / "m"
        write_folder(folder, byte_level_json, tokenizer_config or {"eos_token": "<|im_end|>"}, **files)
        return RouterTokenizer.load(folder)

    return make


@pytest.fixture(scope="session")
def chatml_dir(byte_level_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chatml") / "m"
    return write_folder(folder, byte_level_json, {"eos_token": "<|im_end|>", "chat_template": CHATML})


@pytest.fixture(scope="session")
def tok(chatml_dir: Path) -> RouterTokenizer:
    return RouterTokenizer.load(chatml_dir)


@pytest.fixture(scope="session")
def spm_tok(tmp_path_factory: pytest.TempPathFactory) -> RouterTokenizer:
    """SentencePiece-style: Metaspace spaces, <0xNN> byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "é", "日", "▁a", "▁b", "ab", "▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    base = tmp_path_factory.mktemp("spm")
    tok.save(str(base / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}
    return RouterTokenizer.load(write_folder(base / "m", base / "tokenizer.json", config))


def vocab_size(tok: RouterTokenizer) -> int:
    return tok._backend.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------- encode and eos


def test_encode_matches_transformers(tok: RouterTokenizer, chatml_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chatml_dir), local_files_only=True)
    for text in CORPUS + ["", " leading space", "<|im_start|>inline special"]:
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_encode_adds_bos_once_and_chat_does_not_add_a_second(spm_tok: RouterTokenizer) -> None:
    ids = spm_tok.encode("ab")
    assert ids[0] == 1 and ids.count(1) == 1
    ids = spm_tok.encode_chat([{"role": "user", "content": "ab"}])
    assert ids[0] == 1 and ids.count(1) == 1  # the template wrote BOS; encoding added none


def test_encode_ignores_truncation_in_tokenizer_json(
    byte_level_json: Path, tmp_path: Path
) -> None:
    data = json.loads(byte_level_json.read_text())
    data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    truncating = tmp_path / "tokenizer.json"
    truncating.write_text(json.dumps(data))
    tok = RouterTokenizer.load(write_folder(tmp_path / "m", truncating, {"eos_token": "<|im_end|>"}))
    assert len(tok.encode(CORPUS[0])) > 4


def test_encode_releases_the_gil_so_a_huge_prompt_does_not_stall_the_loop(tok: RouterTokenizer) -> None:
    text = "\n".join(CORPUS) * 4000  # about a million characters
    worker = threading.Thread(target=tok.encode, args=(text,))
    start = last = time.perf_counter()
    longest_gap = 0.0
    worker.start()
    while worker.is_alive():  # stands in for the event loop: how long was it kept from running?
        now = time.perf_counter()
        longest_gap, last = max(longest_gap, now - last), now
    # Holding the GIL shows as one stall as long as the whole encode (about 1 s here)
    assert longest_gap < max((last - start) / 2, 0.05)


def test_missing_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RouterTokenizer.load(tmp_path / "nowhere")


def test_encode_rejects_non_string(tok: RouterTokenizer) -> None:
    with pytest.raises(BadRequest):
        tok.encode(["not", "text"])  # type: ignore[arg-type]


def test_eos_ids_from_generation_config_config_and_tokenizer(
    make_tokenizer: Callable[..., RouterTokenizer],
) -> None:
    tok = make_tokenizer(generation_config={"eos_token_id": [2, 0]}, config={"eos_token_id": 1})
    assert tok.eos_token_ids == [2, 0, 1]
    assert make_tokenizer().eos_token_ids == [2]
    assert make_tokenizer(generation_config="{not json", config={"eos_token_id": 0}).eos_token_ids == [0, 2]


# ---------------------------------------------------------------- chat template


def test_chat_template_renders_chatml(tok: RouterTokenizer, chatml_dir: Path) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "café 日本語 🙂"},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ncafé 日本語 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages) == want
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(2) == 2
    hf = AutoTokenizer.from_pretrained(str(chatml_dir), local_files_only=True)
    hf_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == hf_ids


@pytest.mark.parametrize("prefill", ['{"answer": ', "Sure, here  ", "日本"])
def test_a_final_assistant_message_is_continued_as_transformers_does(
        tok: RouterTokenizer, chatml_dir: Path, prefill: str) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "JSON?"}, {"role": "assistant", "content": prefill}]
    text = tok.render_chat(messages, continue_final=True)
    assert text == f"<|im_start|>user\nJSON?<|im_end|>\n<|im_start|>assistant\n{prefill}"
    hf = AutoTokenizer.from_pretrained(str(chatml_dir), local_files_only=True)
    assert text == hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)


def test_a_final_message_the_template_does_not_write_cannot_be_continued(
        make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    quiet = make_tokenizer({"eos_token": "<|im_end|>",
                            "chat_template": "{% for m in messages %}{{ m['role'] }}{% endfor %}"})
    with pytest.raises(BadRequest) as info:
        quiet.render_chat([{"role": "assistant", "content": "x"}], continue_final=True)
    assert info.value.param == "messages" and "continued" in info.value.message


def test_hf_template_features_render_like_transformers(
    make_tokenizer: Callable[..., RouterTokenizer], chatml_dir: Path
) -> None:
    from transformers import AutoTokenizer

    template = (
        "{%- set ns = namespace(n=0) -%}"
        "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
        "{%- if m.role == 'tool' %}{% continue %}{% endif -%}"
        "{{ eos_token if loop.first }}[{{ m.role }}] {{ m.content | tojson }}"
        "{% generation %}!{% endgeneration %}\n"
        "{%- endfor -%}"
        "{{ ns.n }}{{ tools is none }}{{ strftime_now('%Y') | length }}"
        "{{ not_passed }}{% if not_passed is not defined and not not_passed %}u{% endif %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    messages = [{"role": "user", "content": "<b>é</b>"}, {"role": "tool", "content": "x"}]
    assert tok.render_chat(messages) == '<|im_end|>[user] "<b>é</b>"!2True4u>'
    hf = AutoTokenizer.from_pretrained(str(chatml_dir), local_files_only=True)
    rendered = hf.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert tok.render_chat(messages) == rendered


MALICIOUS = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ (messages | attr('__class__')) }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ messages.append(1) }}",
]


@pytest.mark.parametrize("template", MALICIOUS)
def test_sandbox_violation_is_bad_request_and_does_not_run(
    make_tokenizer: Callable[..., RouterTokenizer], tmp_path: Path, template: str
) -> None:
    marker = tmp_path / "pwned"
    template = template.replace("{marker}", str(marker))
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    with pytest.raises(BadRequest) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"
    assert "unsafe" in info.value.message or "not safely callable" in info.value.message
    assert not marker.exists()


def test_template_raise_exception_is_bad_request(make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    with pytest.raises(BadRequest, match="roles must alternate") as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"


def test_template_type_error_is_bad_request(make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0].content + 1 }}"})
    with pytest.raises(BadRequest):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_template_that_does_not_compile_fails_each_chat_not_the_load(
    make_tokenizer: Callable[..., RouterTokenizer],
) -> None:
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": "{% for %}"})
    with pytest.raises(BadRequest, match="chat template is invalid"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.encode("still works")


def test_no_template_uses_the_fallback_format(make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    tok = make_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    text = "system: Be brief.\nuser: hi there\nassistant: \nassistant:"
    assert tok.render_chat(messages) == text
    assert tok.encode_chat(messages) == tok.encode(text)


@pytest.mark.parametrize("messages", [[], "hi", [["role", "user"]], None])
def test_malformed_messages_are_bad_requests(tok: RouterTokenizer, messages: Any) -> None:
    with pytest.raises(BadRequest) as info:
        tok.encode_chat(messages)
    assert info.value.param == "messages"


# ---------------------------------------------------------------- detokenizer


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts})
    return [ids[a:b] for a, b in zip([0, *points], [*points, len(ids)])]


def check_stream(
    tok: RouterTokenizer, detok: IncrementalDetokenizer, chunks: list[list[int]], *, is_eager: bool = True
) -> None:
    """The invariants: the text sent so far is always a prefix of decode(all ids), so a
    delta holds U+FFFD only where the final text does; the deltas plus flush() are exactly
    decode(all ids); and (when `is_eager`) once the text so far ends in a whole character,
    all of it has been sent."""
    full = tok.decode([i for chunk in chunks for i in chunk])
    sent, seen = "", []
    for chunk in chunks:
        sent += detok.add(chunk)
        seen += chunk
        so_far = tok.decode(seen)
        assert full.startswith(sent) and so_far.startswith(sent)
        if is_eager and not so_far.endswith("\ufffd"):
            assert sent == so_far
    assert sent + detok.flush() == full
    assert detok.flush() == ""


def offset_detokenizer(tok: RouterTokenizer) -> OffsetDetokenizer:
    return OffsetDetokenizer(
        tok.decode, byte_run_ids=tok._byte_run_ids, transparent_ids=tok._special_ids,
        vocab_size=vocab_size(tok),
    )


text_with_emoji_and_cjk = st.lists(
    st.one_of(
        st.text(max_size=6),
        st.sampled_from(["café", "日本語", "🙂", "👍🏽", "👨‍👩‍👧", " ", "\n", "é"]),
    ),
    max_size=12,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=text_with_emoji_and_cjk, cuts=st.lists(st.integers(0, 200), max_size=8), byte_path=st.booleans())
def test_detokenizer_streams_arbitrary_text_exactly(
    tok: RouterTokenizer, text: str, cuts: list[int], byte_path: bool
) -> None:
    ids = tok.encode(text)
    if "<|" not in text:
        assert tok.decode(ids) == text
    detok = tok.make_detokenizer() if byte_path else offset_detokenizer(tok)
    check_stream(tok, detok, split(ids, cuts))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 100), max_size=10), byte_path=st.booleans())
def test_detokenizer_streams_arbitrary_ids_exactly(
    tok: RouterTokenizer, data: st.DataObject, cuts: list[int], byte_path: bool
) -> None:
    # Lead and continuation bytes come often, so characters form, complete and break;
    # out-of-vocabulary ids (a padded embedding) decode to nothing, as in decode()
    byte_ids = st.sampled_from([_single_byte_id(tok, b) for b in b"\xe6\x97\xa5\xf0\x9f\x99\x82\x80A"])
    ids = data.draw(st.lists(st.one_of(byte_ids, st.integers(0, vocab_size(tok) + 2)), max_size=40))
    detok = tok.make_detokenizer() if byte_path else offset_detokenizer(tok)
    check_stream(tok, detok, split(ids, cuts))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 100), max_size=10))
def test_offset_detokenizer_on_byte_fallback_ids(
    spm_tok: RouterTokenizer, data: st.DataObject, cuts: list[int]
) -> None:
    # Ids 3..258 are byte tokens: 'A', 日's three bytes and a stray continuation byte come
    # often, so runs form, complete and break; 259.. are pieces, some with a leading "▁"
    byte_ids = st.sampled_from([3 + 0x41, 3 + 0xE6, 3 + 0x97, 3 + 0xA5, 3 + 0x80])
    piece_ids = st.integers(259, vocab_size(spm_tok) - 1)
    # Specials and out-of-vocabulary ids decode to nothing, so they must not end a run
    transparent = st.sampled_from([0, 1, 2, vocab_size(spm_tok), vocab_size(spm_tok) + 7])
    any_id = st.one_of(byte_ids, piece_ids, transparent, st.integers(0, vocab_size(spm_tok) - 1))
    ids = data.draw(st.lists(any_id, max_size=30))
    check_stream(spm_tok, spm_tok.make_detokenizer(), split(ids, cuts), is_eager=False)


def test_detokenizer_kinds(tok: RouterTokenizer, spm_tok: RouterTokenizer) -> None:
    assert isinstance(tok.make_detokenizer(), ByteLevelDetokenizer)
    assert isinstance(spm_tok.make_detokenizer(), OffsetDetokenizer)


def test_partial_character_is_held_back(tok: RouterTokenizer) -> None:
    ids = [_single_byte_id(tok, b) for b in "🙂".encode()]  # four single-byte tokens
    for detok in (tok.make_detokenizer(), offset_detokenizer(tok)):
        deltas = [detok.add([i]) for i in ids]
        assert deltas == ["", "", "", "🙂"]
        assert detok.add([]) == ""


def test_incomplete_tail_is_flushed_as_decode_does(tok: RouterTokenizer) -> None:
    ids = [_single_byte_id(tok, b) for b in "日".encode()[:2]]
    for detok in (tok.make_detokenizer(), offset_detokenizer(tok)):
        assert detok.add(ids) == ""
        assert detok.flush() == tok.decode(ids) == "\ufffd"


def test_byte_fallback_leading_space_and_runs(spm_tok: RouterTokenizer) -> None:
    detok = spm_tok.make_detokenizer()
    ids = spm_tok.encode("ab ab 日€")[1:]  # drop BOS; '€' is spelled in byte tokens
    deltas = [detok.add([i]) for i in ids]
    assert deltas == ["ab", " ab", " ", "日", "", "", ""]  # the first space is stripped, as in decode
    assert detok.flush() == "€"
    assert spm_tok.decode(ids) == "ab ab 日€"


def _single_byte_id(tok: RouterTokenizer, byte: int) -> int:
    table = tok._byte_table or {}
    return next(i for i, b in table.items() if b == bytes([byte]))


# ---------------------------------------------------------------- import hygiene


def test_router_tokenizer_never_imports_mlx(chatml_dir: Path) -> None:
    code = (
        "import sys\n"
        "from router.chat.tokenizer import RouterTokenizer\n"
        "tok = RouterTokenizer.load(sys.argv[1])\n"
        "ids = tok.encode_chat([{'role': 'user', 'content': 'hi 日本'}])\n"
        "d = tok.make_detokenizer(); d.add(ids); d.flush(); tok.decode(ids)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(chatml_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr



# -- tools, template kwargs, markers, token bytes -------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %} CALL {{ tc['function']['arguments'] | tojson }}"
    "{% endfor %}\n{% endfor %}assistant:{% if enable_thinking %}<think>{% endif %}</think>"
)


def test_tools_and_template_kwargs_reach_the_template(make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    t = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": TOOLS_TEMPLATE})
    assert t.can_take_tools and t.think_markers == ("<think>", "</think>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]
    text = t.render_chat(messages, tools, {"enable_thinking": True, "messages": "ignored"})
    # (trim_blocks drops the newline after each block tag, as in transformers)
    assert text == 'TOOLS:f;user: hiassistant:  CALL {"a": 1}assistant:<think></think>'
    assert t.render_chat(messages[:1]) == "user: hiassistant:</think>"
    assert t.encode_chat(messages[:1]) == t.encode_rendered(t.render_chat(messages[:1]))


def test_a_template_without_tools(tok: RouterTokenizer) -> None:
    assert not tok.can_take_tools and tok.think_markers is None


def test_special_markers_kept_only_when_asked(tok: RouterTokenizer) -> None:
    im_end = tok.special_token_id("<|im_end|>")
    assert im_end is not None and tok.special_token_id("hello") is None
    ids = tok.encode("ab") + [im_end]
    plain, keeping = tok.make_detokenizer(), tok.make_detokenizer(keep=["<|im_end|>"])
    assert plain.add(ids) + plain.flush() == "ab"
    assert keeping.add(ids) + keeping.flush() == "ab<|im_end|>"


def test_token_bytes_add_up_to_the_text(tok: RouterTokenizer) -> None:
    text = "café 🚀 ok"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text


@pytest.mark.parametrize("template", MALICIOUS)
def test_transformers_apply_chat_template_is_sandboxed_too(
    chatml_dir: Path, tmp_path: Path, template: str
) -> None:
    """The other renderer in reach (mlx-lm's TokenizerWrapper delegates to it) also refuses."""
    import jinja2
    from transformers import AutoTokenizer

    marker = tmp_path / "pwned"
    hf = AutoTokenizer.from_pretrained(str(chatml_dir), local_files_only=True)
    try:
        out = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     chat_template=template.replace("{marker}", str(marker)))
    except jinja2.exceptions.TemplateError:  # SecurityError among them
        out = ""
    assert "<class" not in out and "<function" not in out and "<module" not in out, out
    assert not marker.exists()


@pytest.mark.parametrize("template", [
    "{% include '/etc/passwd' %}", "{% import '/etc/passwd' as p %}",
    "{% extends '/etc/passwd' %}", "{% for i in range(10**9) %}x{% endfor %}",
])
def test_templates_cannot_read_files_or_loop_without_bound(
    make_tokenizer: Callable[..., RouterTokenizer], template: str
) -> None:
    tok = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    with pytest.raises(BadRequest) as info:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert "root:" not in info.value.message


def test_remote_code_in_a_model_folder_does_not_run(byte_level_json: Path, tmp_path: Path) -> None:
    """A folder's own tokenizer class (auto_map) runs only with --trust-remote-code."""
    marker = tmp_path / "pwned"
    folder = write_folder(tmp_path / "m", byte_level_json, {
        "eos_token": "<|im_end|>", "tokenizer_class": "EvilTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}})
    (folder / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    with pytest.raises(ConfigError):
        RouterTokenizer.load(folder)
    assert not marker.exists()


# -- message boundaries (where the worker keeps the prompt's KV) --------------------------


def boundaries_of(t: RouterTokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    text = t.render_chat(messages)
    ids = t.encode_rendered(text)
    return t.message_boundaries(messages, None, None, text, ids), ids


def test_boundaries_are_the_system_message_and_the_last_two_turns(tok: RouterTokenizer) -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"},
            {"role": "assistant", "content": "The quick fox."}, {"role": "user", "content": "Ça va?"}]
    found, ids = boundaries_of(tok, chat)
    prefixes = [tok.encode_rendered(tok.render_chat(chat[:k], add_generation_prompt=False))
                for k in (1, 3, 4)]
    assert found == [len(p) for p in prefixes] and found[-1] < len(ids)
    assert all(ids[:len(p)] == p for p in prefixes)  # each a real token prefix of the prompt


def test_a_prefix_that_is_not_a_token_prefix_is_dropped(make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    # A message rendered differently once it is last is not a text prefix of the whole.
    template = ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    t = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    chat = [{"role": "system", "content": "brown fox"}, {"role": "user", "content": "lazy dog"}]
    found, ids = boundaries_of(t, chat)
    assert found == [len(t.encode_rendered(t.render_chat(chat, add_generation_prompt=False)))]
    # A text prefix whose last word merges with what follows is not a token prefix.
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}lo{% endif %}"
    t = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    chat = [{"role": "user", "content": "Hel"}]  # "Hel" + "lo": He|l, He|ll|o
    text = t.render_chat(chat)
    assert text.startswith(t.render_chat(chat, add_generation_prompt=False))
    assert boundaries_of(t, chat)[0] == []


def test_a_template_that_refuses_a_partial_chat_gives_no_boundary_there(
        make_tokenizer: Callable[..., RouterTokenizer]) -> None:
    template = ("{% if messages[-1].role != 'user' %}{{ raise_exception('last must be user') }}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = make_tokenizer({"eos_token": "<|im_end|>", "chat_template": template})
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    found, ids = boundaries_of(t, chat)
    assert found == [len(t.encode_rendered(t.render_chat(chat, add_generation_prompt=False)))]


# ---------------------------------------------------------------- echo's text offsets


@pytest.mark.parametrize("text", ["hello world", "café naïve 日本語 😀 end", "a"])
def test_text_offsets_are_where_each_token_starts_in_the_decoded_text(tok: RouterTokenizer, text: str) -> None:
    ids = tok.encode(text)
    offsets = tok.text_offsets(ids)
    assert len(offsets) == len(ids) and offsets[0] == 0 and offsets == sorted(offsets)
    decoded = tok.decode(ids)
    assert decoded == text
    for i, at in enumerate(offsets):  # the text before a token is the decode of the ones before it
        assert decoded[:at] == tok.decode(ids[:i]).rstrip("\ufffd")


def test_text_offsets_skip_a_bos_the_text_does_not_show(spm_tok: RouterTokenizer) -> None:
    ids = spm_tok.encode("ab é")
    assert ids[0] == 1  # <s>
    offsets = spm_tok.text_offsets(ids)
    assert offsets[:2] == [0, 0] and offsets[-1] < len(spm_tok.decode(ids))


def test_a_worker_that_uses_the_first_boundary_only_is_sent_that_one(tok: RouterTokenizer) -> None:
    from common.protocol import BOUNDARIES_FIRST, BOUNDARIES_NONE
    from worker.boot import boundaries_used

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"},
            {"role": "assistant", "content": "The quick fox."}, {"role": "user", "content": "Ça va?"}]
    text = tok.render_chat(chat)
    ids = tok.encode_rendered(text)
    every = tok.message_boundaries(chat, None, None, text, ids)
    assert tok.message_boundaries(chat, None, None, text, ids, BOUNDARIES_FIRST) == every[:1]
    assert tok.message_boundaries(chat[1:], None, None, tok.render_chat(chat[1:]),
                                  tok.encode_rendered(tok.render_chat(chat[1:])), BOUNDARIES_FIRST) == []
    assert tok.message_boundaries(chat, None, None, text, ids, BOUNDARIES_NONE) == []
    # What a worker says it uses: blocks (cut by tokens) the first, whole sequences all.
    assert boundaries_used(object(), can_trim=True) == BOUNDARIES_FIRST  # type: ignore[arg-type]
    assert boundaries_used(object(), can_trim=False) == "all"  # type: ignore[arg-type]
    assert boundaries_used(None, can_trim=True) == BOUNDARIES_NONE
