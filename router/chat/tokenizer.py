"""The model's tokenizer in the router: chat template, token counts, streaming detokenization.

The router tokenizes, as vLLM's and SGLang's front ends do, so that it can count prompt
tokens exactly and refuse a request before any GPU work. `transformers` is used once, in
`RouterTokenizer.load`, to read the model folder the way the model's authors configured
it; every call after that goes straight to the Rust `tokenizers` object, because
`encode` runs for each request (through a batch call, the one that releases the GIL when
router/http/api.py sends a long prompt to its thread pool) and detokenization runs on the
event loop for every token of every stream. Nothing here imports `mlx` or `mlx_lm`.
A rendered chat goes through `router/chat/tokencache.py`: what an earlier turn of the same
conversation encoded is reused, id for id, and only the new part is encoded.

Chat templates come from the model folder and are untrusted code. They are compiled once,
in a jinja2 `ImmutableSandboxedEnvironment` with the globals Hugging Face templates expect,
and any error while rendering one (a `raise_exception(...)` call, a sandbox violation, a
type error) becomes `BadRequest(param="messages")`. A folder without a chat template gets
the fallback format ``"{role}: {content}\\n"`` per message followed by ``"assistant:"``.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from common.errors import BadRequest, ConfigError
from common.protocol import BOUNDARIES_ALL, BOUNDARIES_FIRST, BOUNDARIES_NONE
from router.chat.tokencache import PrefixTokenCache

__all__ = [
    "RouterTokenizer",
    "IncrementalDetokenizer",
    "ByteLevelDetokenizer",
    "OffsetDetokenizer",
    "FALLBACK_GENERATION_PROMPT",
]

log = logging.getLogger(__name__)
# transformers' import-time advice that it found no PyTorch (or TensorFlow, Flax): the
# router needs only its tokenizers. Dropped by message, so its other warnings still show.
_NO_FRAMEWORK_ADVICE = ("PyTorch was not found", "None of PyTorch, TensorFlow")
logging.getLogger("transformers").addFilter(
    lambda record: not record.getMessage().startswith(_NO_FRAMEWORK_ADVICE))

FALLBACK_GENERATION_PROMPT = "assistant:"
# The prefix cache: a few agents' conversations (about 4 MB of ids, and their texts)
PREFIX_CACHE_ENTRIES = 64
PREFIX_CACHE_TOKENS = 1 << 20
# Recent system messages' renders kept for their boundary (``_prefix_text``), and how long.
SYSTEM_RENDERS = 64
SYSTEM_RENDER_TTL_S = 60.0
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _StrictUnsafeUndefined(jinja2.Undefined):
    """Lenient like jinja's default Undefined, except for blocked attribute access.

    The sandbox turns ``''.__class__`` into an Undefined that renders as "", so a probing
    template would pass silently; raising at once makes the attempt a visible 400.
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._undefined_exception is SecurityError:
            raise SecurityError(self._undefined_message)


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> tuple[jinja2.Template | None, str | None]:
    """Compile a chat template once; return (template, None) or (None, why it failed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=_StrictUnsafeUndefined,
        extensions=[_GenerationTag, loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source), None
    except jinja2.TemplateError as exc:
        log.warning("the model's chat template does not compile; chat requests will get 400: %s", exc)
        return None, f"the model's chat template is invalid: {exc}"


class RouterTokenizer:
    """One model's tokenizer: prompt encoding, chat template and detokenization."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        chat_template: str | None,
        template_vars: dict[str, Any],
        eos_token_ids: list[int],
        prefix_cache_entries: int = PREFIX_CACHE_ENTRIES,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
    ) -> None:
        # transformers sets truncation and padding per call; a tokenizer.json may carry its
        # own, which would silently cut long prompts here
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        # Tokenizer.encode holds the GIL for the whole call, which would stall the event loop
        # from the thread pool; the batch methods release it (and _fast skips offsets)
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # A rendered chat's ids reuse those of an earlier turn it extends (see tokencache)
        self._prefix_cache = PrefixTokenCache.for_backend(
            backend, self._encode_plain, max_entries=prefix_cache_entries, max_tokens=prefix_cache_tokens,
        ) if chat_template is not None else None
        self.eos_token_ids = eos_token_ids
        self._template_vars = template_vars
        # Boundary renders spared (``_prefix_text``): the generation prompt's text by
        # template arguments, and recent system messages' renders.
        self._suffixes: dict[str, str | None] = {}
        self._system_renders: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        self.chat_template_source = chat_template
        if chat_template is not None:
            self._template, self._template_error = _compile_template(chat_template)
        self._special_ids = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._byte_table = (
            _byte_level_table(backend, self._special_ids)
            if isinstance(backend.decoder, decoders.ByteLevel) else None
        )
        self._byte_run_ids = frozenset() if self._byte_table is not None else _byte_fallback_ids(backend)

    @staticmethod
    def import_backend() -> None:
        """Import transformers ahead of the first load: about a second of CPU that would
        otherwise start only at the worker's hello, after the worker's own boot."""
        import transformers  # noqa: F401
        transformers.AutoTokenizer  # noqa: B018 - resolves the lazy module

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False,
             prefix_cache_entries: int = PREFIX_CACHE_ENTRIES,
             prefix_cache_tokens: int = PREFIX_CACHE_TOKENS) -> RouterTokenizer:
        """Load the tokenizer of a local Hugging Face model folder, offline.

        A folder's own Python (a custom tokenizer class in ``auto_map``) runs only with
        ``trust_remote_code``; otherwise transformers refuses such a folder. The prefix
        cache (0 entries or tokens: none) bounds what earlier chats' ids keep.
        """
        folder = Path(path)
        if not folder.is_dir():  # else transformers takes the path for a hub repo id
            raise ConfigError(f"model folder {folder} does not exist", param="model")
        # Imported here: transformers takes about a second to import and only load needs it
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                               trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {folder}: {exc}", param="model") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ConfigError(f"{folder} has no fast tokenizer (tokenizer.json)", param="model")
        template = hf.chat_template
        if isinstance(template, dict):  # several named templates: the default is the chat one
            template = template.get("default")
        template_vars = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, (str, list))}
        eos_ids = _read_eos_ids(folder, backend, hf.eos_token)
        tok = cls(backend, chat_template=template, template_vars=template_vars, eos_token_ids=eos_ids,
                  prefix_cache_entries=prefix_cache_entries, prefix_cache_tokens=prefix_cache_tokens)
        log.info(
            "tokenizer loaded from %s: %d tokens, eos %s, chat template %s, detokenizer %s",
            folder, backend.get_vocab_size(), eos_ids,
            "none (fallback format)" if template is None else "yes",
            "byte-level" if tok._byte_table is not None else "offset",
        )
        return tok

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None or self._template_error is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt, with the special tokens the tokenizer adds (BOS)."""
        if not isinstance(text, str):
            raise BadRequest("prompt must be a string", param="prompt")
        return self._encode_batch([text], add_special_tokens=True)[0].ids

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a chat rendered with the generation prompt."""
        return self.encode_rendered(self.render_chat(messages, tools, template_kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a chat already rendered by ``render_chat``: the same ids as a full
        encoding, the part an earlier chat shares with it reused from the prefix cache."""
        return self._encode_rendered(text, remember=True)

    def _encode_rendered(self, text: str, *, remember: bool) -> list[int]:
        if not self.has_chat_template:
            return self.encode(text)
        if self._prefix_cache is None:
            return self._encode_plain(text)
        return self._prefix_cache.encode(text, remember=remember)

    def _encode_plain(self, text: str) -> list[int]:
        # The template writes BOS itself when the model wants one
        return self._encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def can_take_tools(self) -> bool:
        return self.chat_template_source is not None and "tools" in self.chat_template_source

    @property
    def think_markers(self) -> tuple[str, str] | None:
        """The template's thinking markers, when it declares them."""
        source = self.chat_template_source or ""
        return ("<think>", "</think>") if "</think>" in source else None

    def special_token_id(self, text: str) -> int | None:
        """The id of a special token spelled ``text``, or None if there is none."""
        token = self._backend.token_to_id(text)
        return token if token is not None and token in self._special_ids else None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, *,
                    add_generation_prompt: bool = True, continue_final: bool = False) -> str:
        """The chat as text: the model's template, or the fallback format without one.

        ``tools`` (OpenAI's function shapes) and ``template_kwargs`` (``enable_thinking``
        and the like) are passed to the template, never over the names it is given here.
        ``continue_final``: the text ends right after the final message's text (no end of
        turn, no generation prompt), so the model goes on writing it: a prefilled answer.
        """
        if continue_final:
            tagged = [*messages[:-1], _tagged(messages[-1])]
            return _cut_at_tag(self.render_chat(tagged, tools, template_kwargs,
                                                add_generation_prompt=False))
        chat = _plain_messages(messages)
        if self._template_error is not None:
            raise BadRequest(self._template_error, param="messages")
        if self._template is None:
            lines = [f"{m.get('role', '')}: {_content_text(m.get('content'))}\n" for m in chat]
            return "".join(lines) + (FALLBACK_GENERATION_PROMPT if add_generation_prompt else "")
        try:
            extra = {k: v for k, v in (template_kwargs or {}).items()
                     if k not in ("messages", "tools", "documents", "add_generation_prompt")}
            return self._template.render(
                **{**self._template_vars, **extra}, messages=chat, tools=tools or None,
                documents=None, add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # untrusted code: any failure is this request's problem
            log.debug("chat template failed: %r", exc)
            raise BadRequest(f"chat template error: {exc}", param="messages") from exc

    def message_boundaries(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                           template_kwargs: dict[str, Any] | None, text: str, ids: list[int],
                           wanted: str = BOUNDARIES_ALL) -> list[int]:
        """Token offsets in ``ids`` (the chat ``text`` encoded) where a prefix of the chat
        ends: the system message (with the tools the template puts beside it) and the last
        two messages. The worker keeps the prompt's KV there, so the next turn, a retried
        last turn or another chat with the same system prompt reuses it; earlier turns'
        ends were stored when they were the last. A prefix is kept only when its own
        rendering is a token prefix of the whole (templates may render a message
        differently once another follows it; BPE may merge across the cut).

        ``wanted`` (the worker's hello): "first", the system message's end only (a worker
        whose KV blocks are reused to the token cuts a cold prompt there and nowhere else);
        "none", nothing (no prompt cache)."""
        if wanted == BOUNDARIES_NONE:
            return []
        ends = {len(messages), len(messages) - 1} if wanted != BOUNDARIES_FIRST else set()
        if messages and isinstance(messages[0], dict) and messages[0].get("role") in ("system", "developer"):
            ends.add(1)
        found: set[int] = set()
        for k in sorted(e for e in ends if e >= 1):
            prefix = self._prefix_text(messages, k, tools, template_kwargs, text)
            if not prefix or not text.startswith(prefix):
                continue
            prefix_ids = self._encode_rendered(prefix, remember=False)  # the whole chat's entry serves it
            if 0 < len(prefix_ids) < len(ids) and ids[:len(prefix_ids)] == prefix_ids:
                found.add(len(prefix_ids))
        return sorted(found)

    def _prefix_text(self, messages: list[dict[str, Any]], k: int, tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any] | None, text: str) -> str | None:
        """``messages[:k]`` rendered without the generation prompt; None where the template
        refuses it. Two of the three renders a chat's boundaries took are spared, each as
        long as the chat's own on an agent's turn (0.6 ms for 80 messages, 8 tools and a
        Qwen template here): the whole chat's is its rendering less the generation prompt
        where the template only appends one (``_generation_suffix``), and the system
        message's (with the tools beside it) is the same every turn, kept a minute."""
        if k == len(messages):
            suffix = self._generation_suffix(tools, template_kwargs)
            if suffix is not None and text.endswith(suffix):
                return text[:len(text) - len(suffix)]
        key = None
        if k == 1:
            key = json.dumps([messages[0], tools, template_kwargs], sort_keys=True, default=str)
            hit = self._system_renders.get(key)
            # A minute: a template may write today's date (strftime_now) into it.
            if hit is not None and time.monotonic() - hit[0] < SYSTEM_RENDER_TTL_S:
                return hit[1]
        try:
            prefix = self.render_chat(messages[:k], tools, template_kwargs, add_generation_prompt=False)
        except BadRequest:
            return None  # a template may refuse a partial chat: no boundary there
        if key is not None:
            self._system_renders[key] = (time.monotonic(), prefix)
            self._system_renders.move_to_end(key)
            while len(self._system_renders) > SYSTEM_RENDERS:
                self._system_renders.popitem(last=False)
        return prefix

    def _generation_suffix(self, tools: list[dict[str, Any]] | None,
                           template_kwargs: dict[str, Any] | None) -> str | None:
        """What ``add_generation_prompt`` appends, when it only appends: found once per
        set of template arguments (and tools or none) on a one-message chat; None where it
        changes more than the end, or the template refuses that chat."""
        key = json.dumps([bool(tools), template_kwargs], sort_keys=True, default=str)
        if key not in self._suffixes:
            chat = [{"role": "user", "content": "Hi."}]
            try:
                bare = self.render_chat(chat, tools, template_kwargs, add_generation_prompt=False)
                full = self.render_chat(chat, tools, template_kwargs, add_generation_prompt=True)
            except BadRequest:
                bare = full = None
            self._suffixes[key] = full[len(bare):] if bare is not None and full is not None \
                and full.startswith(bare) else None
        return self._suffixes[key]

    def decode(self, ids: list[int]) -> str:
        """Text of ids, without special tokens; the detokenizers' deltas add up to this."""
        return self._backend.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a piece of a character for byte tokens), for logprobs."""
        if self._byte_table is not None and token_id in self._byte_table:
            return self._byte_table[token_id]
        piece = self._backend.id_to_token(token_id)
        if piece is not None and _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return self._backend.decode([token_id], skip_special_tokens=False).encode()

    def text_offsets(self, ids: list[int]) -> list[int]:
        """Each token's offset in ``decode(ids)``: the length of the text before it (the
        tokens of a character split over several all start where the character does)."""
        detokenizer = self.make_detokenizer()
        offsets, length = [], 0
        for token in ids:
            offsets.append(length)
            length += len(detokenizer.add([token]))
        return offsets

    def make_detokenizer(self, keep: Iterable[str] = ()) -> IncrementalDetokenizer:
        """A fresh detokenizer for one stream; the special tokens spelled in ``keep`` (tool
        and reasoning markers a parser needs) stay in the text."""
        if self._byte_table is not None:
            kept = {tid: text.encode() for text in keep
                    if (tid := self.special_token_id(text)) is not None}
            return ByteLevelDetokenizer({**self._byte_table, **kept} if kept else self._byte_table)
        return OffsetDetokenizer(
            self.decode, byte_run_ids=self._byte_run_ids, transparent_ids=self._special_ids,
            vocab_size=self._backend.get_vocab_size(with_added_tokens=True),
        )


def _plain_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape and drop None values, which templates handle worse than a missing key."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequest("each message must be an object", param="messages")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


# Hugging Face's ``continue_final_message``: the final message's text is tagged, the chat
# rendered, and the text cut where the tag is (its trailing whitespace kept where the
# template keeps the tag's own).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged(message: dict[str, Any]) -> dict[str, Any]:
    # A chat request's content is text by now (schema's _message joins a list of parts)
    content = message.get("content")
    if not isinstance(content, str):
        raise BadRequest("the final assistant message has no text to continue", param="messages")
    return {**message, "content": content + _CONTINUE_TAG}


def _cut_at_tag(text: str) -> str:
    i = text.rfind(_CONTINUE_TAG.strip())
    if i < 0:
        raise BadRequest("the final assistant message cannot be continued: the chat template "
                         "does not write its text", param="messages")
    return text[:i] if text[i:i + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:i].rstrip()


def _content_text(content: Any) -> str:
    """Message content as text for the fallback format (a string or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise BadRequest("message content must be a string or a list of parts", param="messages")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _int_list(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _read_eos_ids(folder: Path, backend: Tokenizer, eos_token: str | None) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order."""
    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        found += _int_list(_read_json(folder / name).get("eos_token_id"))
    if eos_token and (tid := backend.token_to_id(eos_token)) is not None:
        found.append(tid)
    return list(dict.fromkeys(found))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map that ByteLevel tokens are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return mapping


def _byte_level_table(backend: Tokenizer, special_ids: frozenset[int]) -> dict[int, bytes]:
    """Each decodable id's raw bytes, exactly as the Rust ByteLevel decoder computes them."""
    char_to_latin1 = {c: chr(b) for b, c in _bytes_to_unicode().items()}
    alphabet = frozenset(char_to_latin1)
    to_latin1 = str.maketrans(char_to_latin1)
    tokens = {tid: tok for tok, tid in backend.get_vocab(with_added_tokens=False).items()}
    # Added tokens win over the model vocab, as in the Rust decode
    tokens.update({tid: added.content for tid, added in backend.get_added_tokens_decoder().items()})
    table: dict[int, bytes] = {}
    for tid, tok in tokens.items():
        if tid in special_ids:
            continue  # skipped by decode(skip_special_tokens=True)
        if alphabet.issuperset(tok):
            table[tid] = tok.translate(to_latin1).encode("latin-1")
        else:  # the decoder keeps a token with any character outside the map verbatim
            table[tid] = tok.encode("utf-8")
    return table


def _byte_fallback_ids(backend: Tokenizer) -> frozenset[int]:
    """Ids of SentencePiece byte tokens (<0xE6>) when the decoder merges runs of them."""
    decoder_json = backend.decoder.__getstate__() if backend.decoder is not None else b""
    if b"ByteFallback" not in decoder_json:
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(tid for tok, tid in vocab.items() if _BYTE_TOKEN.fullmatch(tok))


class IncrementalDetokenizer(ABC):
    """Turns one stream of token ids into text deltas.

    The deltas of every ``add`` plus ``flush()`` concatenate to exactly ``decode(all ids)``,
    and what has been sent is always a prefix of it: a character is held back until no
    later token can change it, so a partial multi-byte character is never sent.
    """

    @abstractmethod
    def add(self, ids: list[int]) -> str:
        """Append ids; return the text that became final."""

    @abstractmethod
    def flush(self) -> str:
        """End the stream; return what was held back (call once, at the end)."""


class ByteLevelDetokenizer(IncrementalDetokenizer):
    """For byte-level BPE (GPT-2, Llama 3, Qwen): ids → bytes → an incremental UTF-8 decoder.

    The Rust decoder is `String::from_utf8_lossy` over the joined bytes; Python's "replace"
    handler substitutes the same maximal invalid subparts, and its incremental decoder holds
    back only an incomplete trailing sequence. O(1) per token, no window at all.
    """

    __slots__ = ("_bytes_of", "_utf8")

    def __init__(self, token_bytes: dict[int, bytes]) -> None:
        self._bytes_of = token_bytes.get
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: list[int]) -> str:
        get = self._bytes_of
        data = get(ids[0], b"") if len(ids) == 1 else b"".join([get(i, b"") for i in ids])
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class OffsetDetokenizer(IncrementalDetokenizer):
    """vLLM's prefix_offset/read_offset detokenizer, for any decoder.

    Each step decodes only the window from `prefix_offset`: the tokens since the last
    emission plus one step of context, so decoders that treat the first token specially
    (SentencePiece's leading space) see the same context as in a full decode. Text ending
    in U+FFFD is held back. A run of SentencePiece byte tokens is decoded as a whole (one
    invalid byte turns the whole run into U+FFFD), so it is held until a non-byte token
    ends it; ids that decode to nothing (`transparent_ids`, the skipped special tokens, and
    ids at or above `vocab_size`, as from a padded embedding) do not end a run.
    """

    __slots__ = ("_decode", "_byte_run_ids", "_transparent_ids", "_vocab_size", "_ids",
                 "_prefix_offset", "_read_offset", "_prefix_text", "_in_byte_run")

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        byte_run_ids: frozenset[int] = frozenset(),
        transparent_ids: frozenset[int] = frozenset(),
        vocab_size: int | None = None,
    ) -> None:
        self._decode = decode
        self._byte_run_ids = byte_run_ids
        self._transparent_ids = transparent_ids
        self._vocab_size = vocab_size
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._in_byte_run = False

    def add(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        if self._byte_run_ids:
            self._track_byte_run(ids)
            if self._in_byte_run:
                return ""  # skip the decode too: a long run costs one decode when it ends
        return self._advance(final=False)

    def flush(self) -> str:
        self._in_byte_run = False
        return self._advance(final=True)

    def _track_byte_run(self, ids: Iterable[int]) -> None:
        for tid in ids:
            if tid in self._byte_run_ids:
                self._in_byte_run = True
            elif tid not in self._transparent_ids and (
                self._vocab_size is None or tid < self._vocab_size
            ):
                self._in_byte_run = False

    def _advance(self, *, final: bool) -> str:
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or (not final and text.endswith(_REPLACEMENT)):
            return ""
        delta = text[len(self._prefix_text):]
        # Keep only the new context window, so the list and each decode stay small
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta
