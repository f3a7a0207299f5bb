"""mlx-lm driven in-process with a prompt cache: the floor of the multi-turn workload.

The same reuse as `mlx_lm.server`: its `LRUPromptCache` (10 entries, its default), the
nearest entry handed to `BatchGenerator.insert(caches=...)`, the finished sequence's
cache stored under its prompt + generated ids. (The server also stores at message
boundaries inside a prompt; with append-only turns the end-of-generation entry is the one
the next turn extends.) Prompts come from the model's chat template with the tools, as a
server renders them. Batched like Headroom's worker and bench/inprocess.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.conversations import TOOLS, Conversation, TurnResult
from bench.inprocess import MAX_BATCH_SIZE, PREFILL_BATCH_SIZE, PREFILL_STEP_SIZE

log = logging.getLogger(__name__)

MODEL_KEY = "inprocess"
PROMPT_CACHE_SIZE = 10


@dataclass(slots=True)
class _Chat:
    index: int
    conversation: Conversation
    replies: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    result: TurnResult | None = None
    sent: float = 0.0


class InProcessChat:
    def __init__(self, folder: Path) -> None:
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import LRUPromptCache

        self.model, self.tokenizer = load(str(folder))[:2]
        self.generator: Any = BatchGenerator(
            self.model, completion_batch_size=MAX_BATCH_SIZE,
            prefill_batch_size=PREFILL_BATCH_SIZE, prefill_step_size=PREFILL_STEP_SIZE)
        self.cache: Any = LRUPromptCache(PROMPT_CACHE_SIZE)

    def close(self) -> None:
        self.generator.close()

    def run(self, conversations: list[Conversation], *, turns: int, max_tokens: int,
            timeout_s: float, concurrency: int) -> list[TurnResult]:
        """Every conversation at once, each turn sent when the previous one ends."""
        chats = [_Chat(i, c) for i, c in enumerate(conversations)]
        live: dict[int, _Chat] = {}
        done: list[TurnResult] = []
        started = time.perf_counter()
        while any(len(c.replies) < turns for c in chats):
            if time.perf_counter() - started > timeout_s:
                self.generator.remove(list(live))
                for chat in live.values():
                    assert chat.result is not None
                    chat.result.error = f"timed out after {timeout_s:.0f} s"
                    done.append(chat.result)
                break
            for chat in chats:
                if chat.result is None and len(chat.replies) < turns:
                    uid = self._send(chat, max_tokens, concurrency)
                    live[uid] = chat
            done.extend(self._step(live))
        return done

    def _send(self, chat: _Chat, max_tokens: int, concurrency: int) -> int:
        turn = len(chat.replies)
        prompt = self.tokenizer.apply_chat_template(
            chat.conversation.messages(turn, chat.replies),
            tools=TOOLS[:chat.conversation.num_tools] or None, add_generation_prompt=True)
        chat.sent = time.perf_counter()
        uid, cached = self.insert(prompt, max_tokens)
        chat.result = TurnResult("inprocess", concurrency, chat.index, turn,
                                 prompt_tokens=len(prompt), cached_tokens=cached)
        chat.generated = []
        return uid

    def insert(self, prompt: list[int], max_tokens: int) -> tuple[int, int]:
        """Insert ``prompt`` from its nearest cached prefix (as mlx_lm.server does): the
        generator's row id and how many prompt tokens came from the cache."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        cache, rest = self.cache.fetch_nearest_cache(MODEL_KEY, prompt)
        if cache is not None and not rest:  # the generator needs one token to start from
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:
                cache, rest = None, prompt
        cached = len(prompt) - len(rest)
        (uid,) = self.generator.insert([rest], max_tokens=[max_tokens],
                                       caches=[cache] if cache is not None else None,
                                       all_tokens=[prompt[:cached]])
        return int(uid), cached

    def _step(self, live: dict[int, _Chat]) -> list[TurnResult]:
        _, responses = self.generator.next()
        now = time.perf_counter()
        finished = []
        for r in responses:
            chat = live.get(r.uid)
            if chat is None or chat.result is None:
                continue
            if chat.result.ttft_s is None:
                chat.result.ttft_s = now - chat.sent
            chat.generated.append(r.token)
            if r.finish_reason is None:
                continue
            self.cache.insert_cache(MODEL_KEY, list(r.all_tokens), r.prompt_cache)
            r.prompt_cache = None
            chat.replies.append(self.tokenizer.decode(chat.generated))
            chat.result.ok = True
            finished.append(chat.result)
            chat.result = None
            del live[r.uid]
        return finished
