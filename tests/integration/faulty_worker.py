"""A real mlx-worker with one test double inside: a row's grammar matcher or sampler that
raises mid-run, for requests the test marks, or (``llguidance``) a grammar library that
cannot build any grammar, as an llguidance older than ours failed on our EOS list. Run as
``python -m tests.integration.faulty_worker grammar|sampler|sampler_start|llguidance|loop <args>``
(``loop``: handling the frame of a request whose prompt starts with POISON_TOKEN raises,
outside any step).

The product has no fault flag: the double replaces the one callable the engine builds for
a marked row (a grammar naming ``POISON``, or a sampler seeded with ``POISON_SEED``), so
everything else (the batch, the socket, the router) is the real thing.
"""

from __future__ import annotations

import sys
from typing import Any

POISON = "poison_field"     # a response_format schema property that marks the faulty row
POISON_SEED = 4242          # a sampling seed that marks the faulty row
POISON_TOKEN = 499          # a prompt's first token id that marks the faulty request ("loop")
# The grammar after two tokens; the sampler at its first call; "sampler_start" as it is built.
FAULT_AT_CALL = {"grammar": 3, "sampler": 1, "sampler_start": 0}


def install(kind: str) -> None:
    if kind == "loop":  # a bug in the loop outside any step: handling a marked prompt's frame raises
        from worker import core

        real_handle = core.WorkerCore.handle

        def handle(self: core.WorkerCore, msg: Any) -> Any:
            if getattr(msg, "prompt_ids", [])[:1] == [POISON_TOKEN]:
                raise RuntimeError("injected fault in the worker's loop")
            return real_handle(self, msg)

        core.WorkerCore.handle = handle  # type: ignore[method-assign]
        return
    if kind == "llguidance":
        from worker import grammar

        def skewed(self: grammar.GrammarCompiler) -> Any:
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

        grammar.GrammarCompiler._llg_tokenizer = skewed  # type: ignore[method-assign]
        return
    at = FAULT_AT_CALL[kind]
    if kind == "grammar":
        from worker import grammar

        class FaultyGrammar(grammar.GrammarProcessor):
            calls = 0

            def __call__(self, tokens: Any, logits: Any) -> Any:
                self.calls += 1
                if self.calls == at:
                    raise RuntimeError("injected fault in the grammar matcher")
                return super().__call__(tokens, logits)

        real_processor = grammar.GrammarCompiler.processor

        def processor(self: grammar.GrammarCompiler, text: str,
                      compiled: Any = None) -> grammar.GrammarProcessor:
            if POISON in text:
                return FaultyGrammar(compiled or self.compile(text), self._eos)
            return real_processor(self, text, compiled)

        grammar.GrammarCompiler.processor = processor  # type: ignore[method-assign]
    else:
        from worker import engine

        real_make = engine.make_sampler

        def make_sampler(p: Any) -> Any:
            sampler = real_make(p)
            if p.seed != POISON_SEED:
                return sampler
            if at == 0:
                raise ValueError("injected fault in the sampler's construction")
            calls = [0]

            def faulty(logprobs: Any) -> Any:
                calls[0] += 1
                if calls[0] == at:
                    raise ValueError("injected fault in the sampler")
                return sampler(logprobs)

            return faulty

        engine.make_sampler = make_sampler  # type: ignore[assignment]


if __name__ == "__main__":
    install(sys.argv[1])
    from worker.__main__ import main

    sys.exit(main(sys.argv[2:]))
