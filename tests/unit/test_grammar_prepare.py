"""worker/grammar.py: the worker builds llguidance's tokenizer once it serves (``prepare``),
on the compile thread, so that the first grammar after a start does not wait for it; the
grammars compiled after it use the one it built."""

from __future__ import annotations

import os

from worker.demo import default_cache_root, ensure_demo_model
from worker.grammar import GrammarCompiler
from worker.loader import load_model

GRAMMAR = '%llguidance {}\nstart: "yes" | "no"'


def test_prepare_builds_the_tokenizer_on_the_compile_thread_and_compiles_queue_behind_it() -> None:
    ensure_demo_model(default_cache_root(os.environ))
    loaded = load_model("demo", os.environ, wait_for_memory_s=0)
    compiler = GrammarCompiler(str(loaded.path), int(loaded.config["vocab_size"]), list(loaded.eos_token_ids))
    try:
        assert compiler._tokenizer is None  # nothing at construction: boot does not pay for it
        compiler.prepare()
        compiler._pool.submit(lambda: None).result(timeout=60)  # the thread is past the build
        built = compiler._tokenizer
        assert built is not None  # by prepare alone, before any grammar
        compiled = compiler.compile(GRAMMAR)
        assert not compiled.result(timeout=60).is_error() and compiler.error_of(compiled) is None
        assert compiler._tokenizer is built  # built once
    finally:
        compiler.close()
