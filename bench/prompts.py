"""Unique prompts of a chosen token length, so no prompt cache can help any system.

Each prompt starts with its own tag (repetition and index), so even the first tokens
differ and a longest-prefix cache (mlx_lm.server keeps one) finds nothing to reuse; the
rest is random words from an unseeded generator. Every system gets the same list of
prompts in a repetition (each system sees each prompt exactly once), so their prefill
work is identical.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

# Plain words the demo's byte-level BPE splits into a few tokens each.
WORDS: tuple[str, ...] = (
    "apple", "river", "stone", "garden", "window", "yellow", "engine", "quiet", "market",
    "silver", "paper", "forest", "candle", "bridge", "orange", "planet", "little", "winter",
    "coffee", "letter", "rocket", "teacher", "morning", "station", "notebook", "travel",
    "memory", "budget", "careful", "machine", "sunset", "harbor", "valley", "thunder",
    "pencil", "island", "button", "shadow", "pocket", "mirror", "basket", "ladder",
)

# Target prompt lengths, in tokens of the served model's tokenizer.
PROMPT_TOKENS: dict[str, int] = {"short": 32, "long": 512}


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    token_ids: list[int]


def make_prompt(encode: Callable[[str], list[int]], tag: str, target_tokens: int,
                rng: random.Random) -> Prompt:
    """A prompt of about target_tokens tokens (never more), starting with tag."""
    words: list[str] = [tag]
    ids = encode(tag)
    # Grow in word batches sized from the remaining gap (few encode calls even for long
    # prompts); halve the batch when it overshoots, stop when a single word would.
    batch = max(1, (target_tokens - len(ids)) // 3)
    while len(ids) < target_tokens:
        candidate = words + [rng.choice(WORDS) for _ in range(batch)]
        candidate_ids = encode(" ".join(candidate))
        if len(candidate_ids) > target_tokens:
            if batch == 1:
                break
            batch = max(1, batch // 2)
            continue
        words, ids = candidate, candidate_ids
        batch = max(1, (target_tokens - len(ids)) // 3)
    text = " ".join(words)
    return Prompt(text=text, token_ids=encode(text))


def make_prompts(encode: Callable[[str], list[int]], label: str, num_prompts: int,
                 target_tokens: int) -> list[Prompt]:
    """num_prompts distinct prompts tagged with label and their index."""
    rng = random.Random()  # deliberately unseeded: nothing should depend on which words
    prompts = [make_prompt(encode, f"{label}-{i}:", target_tokens, rng) for i in range(num_prompts)]
    if len({p.text for p in prompts}) != len(prompts):
        raise RuntimeError("prompt generator produced a duplicate prompt")
    return prompts
