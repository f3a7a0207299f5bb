"""Step-time pacing of prefill chunks. Pure: no MLX, no clocks (callers pass durations)."""

from __future__ import annotations


class ChunkPacer:
    """Caps prefill work per step by time, so a healthy slow step never looks like a hang.

    Learns prefill throughput (tokens/s) from the steps it sees and sizes the next chunk to
    take about ``budget_s``. Until it has a measurement it starts small.
    """

    def __init__(self, budget_s: float, max_chunk: int, first_chunk: int = 64) -> None:
        self.budget_s = budget_s
        self.max_chunk = max_chunk
        self.first_chunk = min(first_chunk, max_chunk)
        self.tokens_per_s: float | None = None

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        if prefill_tokens <= 0 or seconds <= 0:
            return
        rate = prefill_tokens / seconds
        # Weight the slow side: a slower step shrinks the chunk at once, halfway in log
        # (the geometric mean), so a real slowdown is followed within two or three steps
        # while one outlier (a new kernel compiled, a pause) does not collapse the chunk
        # for many steps; a faster one grows it gradually.
        if self.tokens_per_s is None:
            self.tokens_per_s = rate
        elif rate < self.tokens_per_s:
            self.tokens_per_s = (self.tokens_per_s * rate) ** 0.5
        else:
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * rate

    def chunk(self, rows: int, longest_left: int = 0) -> int:
        """Tokens per row for the next prefill chunk.

        ``longest_left`` is the most prompt any of those rows still has to prefill. When
        it is within twice the paced chunk, the chunk takes all of it: one forward pass
        instead of two or three is cheaper (each pass has a fixed cost, and short prompts
        padded beside each other pay it per row), and the rows start decoding steps
        earlier. A step then takes at most about twice the budget.
        """
        if self.tokens_per_s is None:
            paced = self.first_chunk
        else:
            per_row = int(self.tokens_per_s * self.budget_s / max(rows, 1))
            paced = max(16, min(self.max_chunk, per_row))
        if 0 < longest_left <= 2 * paced:
            return min(longest_left, self.max_chunk)
        return paced
