"""Constrained decoding: an llguidance grammar as one row's logits processor.

The router turns ``response_format`` and forced tool calls into an llguidance grammar and
has already refused any its llguidance cannot enforce; here each grammar is compiled once,
on a thread (llguidance drops the GIL while compiling), and kept in a small LRU cache so a
repeated schema costs only a matcher copy. The core admits a request only once its
grammar has compiled here (this worker's llguidance may differ from the router's): one
that cannot is refused before any GPU work, never found failing inside a step. Per step the
processor advances the row's matcher by the token it sampled last, asks for the bitmask
of allowed next tokens and sets every other logit to -inf.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

log = logging.getLogger(__name__)

CACHE_ENTRIES = 64


class GrammarCompiler:
    """llguidance grammars for one model's tokenizer, compiled off the step loop and cached."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], *,
                 trust_remote_code: bool = False) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._tokenizer_path = tokenizer_path
        self._trust_remote_code = trust_remote_code  # a tokenizer with its own code, as the model was loaded
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, Future[LLMatcher]] = OrderedDict()

    def prepare(self) -> None:
        """Build the tokenizer llguidance needs now, on the compile thread, so that the first
        grammar after a start does not wait for it (2.4 s for a 152k vocabulary on this
        project's 2-core box). The worker calls it once it serves and its engine is idle:
        it is no part of the start. A failure shows again at the first grammar, as that
        request's refusal."""
        self._pool.submit(self._llg_tokenizer)

    def _llg_tokenizer(self) -> LLTokenizer:
        # Only ever on the compile thread (one worker): built once, by prepare or the first grammar.
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer
            from transformers import AutoTokenizer

            started = time.monotonic()
            hf = AutoTokenizer.from_pretrained(self._tokenizer_path, local_files_only=True,
                                               trust_remote_code=self._trust_remote_code)
            self._tokenizer = from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            log.info("grammar tokenizer built in %.2f s", time.monotonic() - started)
        return self._tokenizer

    def _compile(self, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def compile(self, grammar: str) -> Future[LLMatcher]:
        """A future of the compiled grammar (a template: copy it for each row)."""
        future = self._compiled.get(grammar)
        if future is None:
            future = self._pool.submit(self._compile, grammar)
            self._compiled[grammar] = future
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return future

    @staticmethod
    def error_of(compiled: Future[LLMatcher]) -> str | None:
        """Why a finished compile cannot be used (None: it can): the grammar, or this
        worker's llguidance and tokenizer, refused it."""
        exc = compiled.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def processor(self, grammar: str, compiled: Future[LLMatcher] | None = None) -> GrammarProcessor:
        """``compiled``: the compile an admission already waited for. Looked up again, it
        may have left the cache meanwhile, and a new compile queued behind others would
        be waited for inside a step, the whole batch with it."""
        return GrammarProcessor(compiled if compiled is not None else self.compile(grammar), self._eos)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarProcessor:
    """One row's matcher as a BatchGenerator logits processor ``(tokens, logits) → logits``."""

    def __init__(self, template: Future[LLMatcher], eos_token_ids: list[int]) -> None:
        self._template = template
        self._eos = eos_token_ids
        self._matcher: LLMatcher | None = None
        self._warned = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._matcher is None:
            # First call: the context ends with the prompt's last token, nothing to consume
            self._matcher = self._template.result().deep_copy()
        else:
            self._matcher.consume_token(int(tokens[-1].item()))
        return apply_mask(logits, self.bitmask())

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens, one bit each (llguidance's int32 words)."""
        m = self._matcher
        assert m is not None
        if m.is_error() and not self._warned:
            self._warned = True
            log.warning("grammar matcher error: %s", m.get_error())
        words = np.frombuffer(m.compute_bitmask(), dtype=np.int32)
        if not words.any():  # nothing allowed (a lost matcher): end the row rather than sample NaN
            bits = np.zeros(len(words), dtype=np.uint32)
            for eos in self._eos:
                bits[eos // 32] |= np.uint32(1 << (eos % 32))
            words = bits.view(np.int32)
        return words


def apply_mask(logits: mx.array, words: np.ndarray) -> mx.array:
    """Keep the logits whose bit is set; every other one becomes -inf.

    The bits are unpacked on the host (one pass over vocab/8 bytes) and sent as one bool
    array: cheaper than unpacking them with a chain of MLX ops.
    """
    vocab = logits.shape[-1]
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")
    if allowed.shape[0] < vocab:
        allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=np.uint8)])
    mask = mx.array(allowed[:vocab].view(np.bool_))
    return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))
