"""Why did the worker take, hold back or stop a request? The worker's memory gate.

The worker's twin of ``router/fleet/admission.py``: every memory decision the worker makes,
as plain code over numbers. It takes the device probe and the clock as arguments and sees
the engine only through an ``EngineView``; it never touches a socket or MLX. The core
(``worker/core.py``) asks the gate; the server (``worker/server.py``) does the IO.

- Admission is ask, then commit: ``can_admit`` answers without changing anything (it may
  clear MLX's buffer cache, which is reclaimable, before saying "no room"); ``reserve``
  records the batch's new worst case; ``rebase`` re-derives it when rows leave.
- ``chunk`` sizes the next prefill chunk within what is left of the budget.
- ``pressure`` handles memory that shrank under running work: stop admitting, shrink the
  chunk, then evict the newest requests.
- ``observe_step`` keeps the cost model honest: a step above its prediction grows the
  scale at once; steps below it let the scale decay back toward what is measured, never
  below the fitted model (``ScaleTracker``).
- ``memory_error`` handles a caught out-of-memory error; ``is_memory_error`` says which
  exceptions are one (anything else is a bug, not a reason to blame memory).

Memory classes: *fixed* (weights, baseline), *promised* (the running batch's reserved worst
case, and prefix-cache entries handed to a request that has not joined the batch yet),
*transient* (one step's working memory; the copy a cache hit makes when it joins the batch
is charged to that step) and *evictable* (prefix-cache entries no request holds, seen
through a ``CacheView``). Entries queued for the disk tier's writer are used and not
evictable until written (``CacheLedger.writing_bytes``, ``pending_bytes``). Evictable bytes are used memory, never counted as free for
promised work nor credited to admission; they are given back, least recently used first,
before a request would wait (``can_admit``: the entry handed to that request itself
included, and a disk read is not made that it would have to give back: ``can_restore``),
before a chunk is shrunk (``chunk``) and long before a running request is stopped under
pressure (``pressure``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from common import costmodel
from common.costmodel import CostModel
from common.protocol import RejectReason
from worker.memory import MemoryState, PressureAction, Reading, pressure_action

log = logging.getLogger(__name__)

# A step whose peak exceeds its prediction grows the scale to the overshoot and this margin.
GROWTH_MARGIN = 1.05
# A caught memory error grows the scale by this much (the step never finished: no measure).
CAUGHT_ERROR_GROWTH = 1.25
# This many caught errors within the window and the worker exits to be restarted clean.
CAUGHT_ERRORS_TO_EXIT = 3
CAUGHT_ERROR_WINDOW_S = 60.0
# The scale decays toward the worst ratio measured in this window (never below 1.0: the
# fitted model) with this half-life, and only moves when the change is at least this big,
# so early outliers (kernel compilation, allocator warm-up) do not shrink capacity for the
# worker's life, and a recent overshoot keeps its protection for the whole window.
SCALE_WINDOW_S = 60.0
# Pressure that comes and goes (under a tight limit it can flip every second with nothing
# stopped) is logged at WARNING at most this often; the lines between are DEBUG and
# counted into the next WARNING, and every change is counted in the status report.
PRESSURE_LOG_QUIET_S = 30.0
SCALE_HALF_LIFE_S = 20.0
SCALE_STEP = 0.02
# Scale changes kept for /v1/memory.
SCALE_HISTORY = 32
# The runtime's excess over MLX's count is set aside once it is at least this big, with
# this much more (so a transient that creeps up is charged a few times, not every step).
RUNTIME_MIN_BYTES = 4 << 20
RUNTIME_SET_ASIDE = 1.25

# What MLX raises (or prints in the error) when a device allocation fails: Metal's command
# buffer OOM, MLX's own allocator, CUDA's. Matched case-insensitively on the message.
_MEMORY_ERROR = re.compile(
    r"out of memory|outofmemory|kIOGPUCommandBufferCallbackErrorOutOfMemory|"
    r"\[METAL\] Command buffer execution failed|\[metal::malloc\]|\[malloc\]|"
    r"Attempting to allocate|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|"
    r"std::bad_alloc", re.IGNORECASE)


def is_memory_error(exc: BaseException) -> bool:
    """Only allocation failures are memory errors; any other exception in a step is a bug."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_MEMORY_ERROR.search(str(exc)))


@dataclass(frozen=True, slots=True)
class CacheLedger:
    """The prefix cache's bytes in memory, by class."""

    resident_bytes: int = 0         # every entry held in RAM
    promised_bytes: int = 0         # entries handed to requests not yet in the batch
    writing_bytes: int = 0          # unpromised entries queued for the disk writer
    pending_bytes: int = 0          # entries gone from RAM, alive until the writer is done

    @property
    def held_bytes(self) -> int:
        """Everything the cache keeps alive: used memory, never free, never a row's."""
        return self.resident_bytes + self.pending_bytes

    @property
    def evictable_bytes(self) -> int:
        """What eviction frees now (an entry being written frees nothing until written)."""
        return max(0, self.resident_bytes - self.promised_bytes - self.writing_bytes)


class CacheView(Protocol):
    """What the gate may ask of the prefix cache: its ledger, to give bytes back (least
    recently used, whole entries, never a promised one; returns the bytes freed), to let go
    of a reuse handed to a request (``release``: its entry is then evictable like any
    other), and to have the disk writer write now what it holds (``hurry``: it otherwise
    waits for an idle engine, and entries it holds cannot be given back until written)."""

    def ledger(self) -> CacheLedger: ...
    def evict(self, nbytes: int, reason: str) -> int: ...
    def release(self, hit: Any) -> None: ...
    def hurry(self) -> None: ...


class NoCache:
    """The ledger of a worker without a prefix cache."""

    def ledger(self) -> CacheLedger:
        return CacheLedger()

    def evict(self, nbytes: int, reason: str) -> int:
        return 0

    def release(self, hit: Any) -> None:
        pass

    def hurry(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the gate needs to know of the engine, as plain numbers."""

    running_totals: list[int]       # prompt + max_tokens of each running row, oldest first
    prefilling: int = 0             # rows whose prompt is not fully processed yet
    prefill_rows: int = 0           # rows the next step's prefill chunk covers
    joining_bytes: int = 0          # cache hits whose rows join the batch next step: their copy
    joining_assembled_bytes: int = 0  # of that, what is held beside the rows' own KV
    scoring_tokens: int = 0         # the longest prompt being scored (prompt logprobs); 0: none

    @property
    def rows(self) -> int:
        return len(self.running_totals)

    @property
    def longest(self) -> int:
        return max(self.running_totals, default=0)


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer to "may this request join now?"."""

    reason: RejectReason | None     # None: admit
    message: str = ""
    needed_bytes: int = 0           # never-fits: the idle cost; not-now: the batch worst case
    worst_bytes: int = 0            # admit: the batch's new worst case, to reserve
    cold: bool = False              # the reuse it was handed was given back: it runs without it

    @property
    def admit(self) -> bool:
        return self.reason is None


@dataclass(frozen=True, slots=True)
class ScaleChange:
    at: float
    scale: float
    why: str


class ScaleTracker:
    """The in-service correction of the fitted cost model: grows at once, decays slowly.

    Ratios are measured/predicted by the *fitted* model (scale 1), so the scale needed to
    cover a step is its ratio. Pure: the caller passes ``now``.
    """

    def __init__(self, now: float) -> None:
        self.scale = 1.0
        self.worst_ratio = 0.0          # worst measured / predicted-at-the-current-scale
        # The window's ratios as a monotonic queue (each older than and above the next):
        # its head is the window's largest, kept in O(1) per step (a scan of a minute of
        # steps would cost about 1% of each token at one stream on a fast GPU).
        self._window: deque[tuple[float, float]] = deque()
        self._decayed_at = now
        self.history: deque[ScaleChange] = deque([ScaleChange(now, 1.0, "fitted")], maxlen=SCALE_HISTORY)

    def observe(self, measured: int, predicted_fitted: int, now: float) -> bool:
        """One step's peak against the fitted prediction. True when the scale changed."""
        if predicted_fitted <= 0:
            return False
        ratio = measured / predicted_fitted
        self.worst_ratio = max(self.worst_ratio, ratio / self.scale)
        self._remember(now, ratio)
        if ratio > self.scale:
            # Said against the fitted prediction, the one compared: the growth is to this
            # ratio, never by it (a line per step "x1.2 over" the scaled one read as compounding).
            return self._set(ratio * GROWTH_MARGIN, now, f"step peak x{ratio:.2f} over the fitted prediction")
        return self._decay(now)

    def grow(self, factor: float, now: float, why: str) -> bool:
        """Grow by ``factor`` without a measured step (a caught memory error, a test hook);
        the growth is kept for the whole window, as a measured overshoot would be."""
        new = self.scale * factor
        self._remember(now, new / GROWTH_MARGIN)
        return self._set(new, now, why)

    def _remember(self, now: float, ratio: float) -> None:
        """Add a ratio to the window; one it outlasts and is not below is never its max again."""
        while self._window and self._window[-1][1] <= ratio:
            self._window.pop()
        self._window.append((now, ratio))

    def window_max(self, now: float) -> float:
        """The largest ratio of the last SCALE_WINDOW_S seconds (0 when none)."""
        while self._window and now - self._window[0][0] > SCALE_WINDOW_S:
            self._window.popleft()
        return self._window[0][1] if self._window else 0.0

    def _decay(self, now: float) -> bool:
        target = max(1.0, self.window_max(now) * GROWTH_MARGIN)
        if self.scale <= target:
            self._decayed_at = now
            return False
        decayed = target + (self.scale - target) * 0.5 ** ((now - self._decayed_at) / SCALE_HALF_LIFE_S)
        if self.scale - decayed < SCALE_STEP * self.scale and decayed - target > 1e-3:
            return False  # too small a move to publish yet; time keeps accruing
        return self._set(decayed, now, "decay toward measured")

    def _set(self, scale: float, now: float, why: str) -> bool:
        self._decayed_at = now
        if abs(scale - self.scale) < 1e-9:
            return False
        log.log(logging.WARNING if scale > self.scale else logging.INFO,
                "cost model scale %.3f -> %.3f (%s)", self.scale, scale, why)
        self.scale = scale
        self.history.append(ScaleChange(now, round(scale, 4), why))
        return True


def moved_budget(budget_bytes: int, old_limit: int, new_limit: int, reserved_bytes: int) -> int:
    """The budget when the router moves this worker's limit (its share of the host budget):
    it moves by as much as the limit, never below what is promised to running requests."""
    return max(reserved_bytes, budget_bytes + new_limit - old_limit)


class MemoryGate:
    """The worker's memory policy: admission, reservations, chunk, pressure, calibration."""

    def __init__(self, memory: MemoryState, *, fitted: CostModel, admission: bool,
                 max_running: int, now: float, cache: CacheView | None = None) -> None:
        self.memory = memory
        self.cache: CacheView = cache or NoCache()
        self._resident_at_step = 0
        self.fitted = dataclasses.replace(fitted, scale=1.0)
        self.admission = admission
        self.max_running = max_running
        self.tracker = ScaleTracker(now)
        self.under_pressure = False
        self.pressure_changes = 0           # began / ended / held-with-eviction, ever
        self._pressure_logged_at = -math.inf
        self._pressure_unlogged = 0
        self._pressure_open = False         # the last WARNING said "began" or "held"
        self._caught_errors: list[float] = []
        memory.model = self.fitted
        self.bound_pool()

    @property
    def model(self) -> CostModel:
        """The model admission uses now: the fitted one at the tracked scale."""
        return self.memory.model

    # -- admission: ask, then commit -------------------------------------------------

    def can_admit(self, view: EngineView, prompt_tokens: int, max_tokens: int,
                  reuse: Any = None, scoring: bool = False) -> Decision:
        """May this request join now? ``reuse``: the prefix-cache hit handed to it (held
        for it, so not evictable). ``scoring``: its prompt's logprobs are asked for (its
        scoring chunks, and the copy of its scored KV into the batch, are charged). Only
        memory the worker cannot give back (running rows, promises, another process) makes
        it wait.

        Not a pure question: before it answers "not now" it gives back what the worker
        holds only to save prefill, and so it may change
        - MLX's buffer cache: cleared (``probe.clear_cache``);
        - the prefix cache: prompts no request holds evicted (``cache.evict``) when that
          makes room; when it cannot, the request's own ``reuse`` released
          (``cache.release``): it runs cold, and ``Decision.cold`` says so (whether it is
          admitted or not) so that the caller never releases it again;
        - the disk writer: told to write now (``cache.hurry``) when the answer is "not now".
        It reads the device (``memory.refresh``) but promises nothing: ``reserve`` commits."""
        m = self.model
        if prompt_tokens + max_tokens > m.context_length:
            return Decision(RejectReason.NEVER_FITS, "prompt + max_tokens exceed the context")
        if view.rows >= self.max_running:
            return Decision(RejectReason.NOT_NOW, "running cap reached")
        if self.under_pressure:
            return Decision(RejectReason.NOT_NOW, "memory taken by another process")
        if not self.admission:
            return Decision(None)
        if costmodel.never_fits(m, prompt_tokens, max_tokens, scoring=scoring):
            return Decision(RejectReason.NEVER_FITS, "does not fit even on an idle worker",
                            costmodel.request_cost_bytes(m, prompt_tokens, max_tokens, scoring=scoring))
        # A row that starts from a reused prefix can hold up to a KV step more than its
        # length (costmodel.kv_reach_tokens): charged as that much more output; a scored
        # one as long as its scoring makes it (costmodel.scored_reach_tokens).
        reach = max_tokens + self._reuse_overhang(prompt_tokens + max_tokens,
                                                  reuse.tokens if reuse is not None else 0)
        if scoring:
            reach = costmodel.scored_reach_tokens(prompt_tokens, max_tokens) - prompt_tokens
        score = max(view.scoring_tokens, prompt_tokens if scoring else 0)
        fits, worst = self._fits(view, prompt_tokens, reach, score, reuse, scoring)
        last = self.memory.last
        if not fits and last is not None and last.cache_bytes > 0:
            # The buffer cache is reclaimable, not lost: clear it before saying "no room".
            self.memory.probe.clear_cache()
            fits, worst = self._fits(view, prompt_tokens, reach, score, reuse, scoring)
        old_worst = costmodel.batch_cost_bytes(m, view.rows, view.longest, 0, 0, 0) + view.joining_assembled_bytes
        cold = False
        while not fits and (worst <= m.budget_bytes or reuse is not None):
            shortfall = worst - old_worst - self.free_bytes()
            evictable = self.cache.ledger().evictable_bytes
            if reuse is not None and (worst > m.budget_bytes or shortfall > evictable):
                # The entry it would reuse is held for it, so never counted as evictable:
                # a request that fits cold must not wait for room its own reuse holds (with
                # nothing running it would wait for ever), nor for a budget its reuse's
                # overhang (kv_reach_tokens) alone passes. It lets go and runs cold.
                self.cache.release(reuse)
                reuse, cold, reach = None, True, max_tokens
                fits, worst = self._fits(view, prompt_tokens, reach, score, reuse, scoring)
                continue
            # Cached prompts no request holds go before any request waits for memory (only
            # when giving them back is enough: otherwise the request waits for running rows).
            if not 0 < shortfall <= evictable or self.cache.evict(shortfall, "admission") <= 0:
                break
            fits, worst = self._fits(view, prompt_tokens, reach, score, reuse, scoring)
        if not fits:
            self._hurry_writer()
            return Decision(RejectReason.NOT_NOW, "no room now", worst, cold=cold)
        return Decision(None, worst_bytes=worst, cold=cold)

    @staticmethod
    def _reuse_overhang(total_tokens: int, cached_tokens: int) -> int:
        """How far past its length a row that starts from a reused prefix can reach."""
        return costmodel.kv_reach_tokens(total_tokens, cached_tokens) - total_tokens

    def can_restore(self, nbytes: int, view: EngineView, prompt_tokens: int, max_tokens: int,
                    tokens: int = 0) -> bool:
        """May a disk read of ``nbytes`` be made for this request? Into free memory only
        (``can_hold``), and only if the request still fits beside it once what is evictable
        is given back: a read it would have to give back again to run is not made (the
        request runs cold), nor one that would leave it waiting with nothing running."""
        if not self.can_hold(nbytes):
            return False
        if not self.admission:
            return True
        free = self.free_bytes() - nbytes + self.cache.ledger().evictable_bytes
        # Charged as can_admit will charge it, with the restored prefix's reach
        # (``tokens``: kv_reach_tokens), so can_admit does not then let go of the read.
        reach = max_tokens + self._reuse_overhang(prompt_tokens + max_tokens, tokens)
        fits, _ = costmodel.fits_now(self.model, view.running_totals, prompt_tokens, reach,
                                     view.prefilling, free, joining_bytes=view.joining_assembled_bytes)
        return fits

    def restore_room(self, view: EngineView, prompt_tokens: int, max_tokens: int) -> Callable[[int], bool]:
        """``can_restore`` for one request, as the prefix cache's lookup asks it."""
        return functools.partial(self.can_restore, view=view, prompt_tokens=prompt_tokens,
                                 max_tokens=max_tokens)

    def reserve(self, decision: Decision) -> None:
        """Commit an admission: the batch's worst case is now promised."""
        if decision.admit and self.admission:
            self.memory.reserved_bytes = decision.worst_bytes
            self.bound_pool()

    def rebase(self, view: EngineView) -> None:
        """Rows left (finished, cancelled, evicted) or joined: promise what the rest still
        need, the copies of hits whose rows have not joined yet among it."""
        self.memory.reserved_bytes = (costmodel.batch_cost_bytes(self.model, view.rows, view.longest, 0, 0, 0)
                                      + view.joining_assembled_bytes if view.rows and self.admission else 0)
        self.bound_pool()

    def bound_pool(self) -> None:
        """MLX's buffer cache may keep only what is neither promised to a request nor held
        by the prefix cache: used memory then stays within the budget whatever MLX keeps.
        And MLX may hold no more than the weights, its idle baseline and the budget before
        it waits for the device (``DeviceProbe.bound_active``): kernels queued ahead of the
        device use free memory, never memory past the limit."""
        if self.admission:
            ledger = self.cache.ledger()
            self.memory.probe.bound_cache(self.model.budget_bytes - self.memory.reserved_bytes
                                          - ledger.held_bytes)
            self._follow_device()

    def _fits(self, view: EngineView, prompt_tokens: int, max_tokens: int,
              score_context: int = 0, reuse: Any = None, scoring: bool = False) -> tuple[bool, int]:
        return costmodel.fits_now(self.model, view.running_totals, prompt_tokens, max_tokens,
                                  view.prefilling, self.free_bytes(), score_context,
                                  joining_bytes=view.joining_assembled_bytes,
                                  own_join_bytes=reuse.assembled_bytes if reuse is not None else 0,
                                  scoring=scoring)

    def allocated_bytes(self) -> int:
        """What running rows already hold above weights, baseline and the prefix cache."""
        mem = self.memory
        r = mem.last or mem.refresh()
        return max(0, r.active_bytes - mem.idle_active_bytes - self.cache.ledger().held_bytes)

    def free_bytes(self) -> int:
        """Live headroom minus what is promised to running rows but not yet allocated
        (evictable cache bytes are used, not free: they are never credited)."""
        self.memory.refresh()
        promised = max(0, self.memory.reserved_bytes - self.allocated_bytes())
        return self.memory.headroom_bytes() - promised

    def can_hold(self, nbytes: int) -> bool:
        """May the prefix cache take ``nbytes`` more now (a store, a restore from disk)?
        Only from what is free beyond every promise and within the budget beside the
        batch's worst case; the cache never evicts a request's room to keep an entry."""
        if not self.admission:
            return True
        within_budget = (self.memory.reserved_bytes + self.cache.ledger().held_bytes + nbytes
                         <= self.model.budget_bytes)
        if not within_budget:
            return False
        if nbytes > self.free_bytes() and self.memory.last is not None and self.memory.last.cache_bytes:
            self.memory.probe.clear_cache()  # MLX's buffer cache is reclaimable: not a reason to skip
        return nbytes <= self.free_bytes()

    # -- the step ----------------------------------------------------------------------

    def chunk(self, view: EngineView, paced: int) -> int:
        """The next prefill chunk: the paced size, or the largest whose step stays within
        the budget beside the batch's cache (the chunk's transient replaces the one that
        admission assumed; it is not charged twice) and the smallest scoring chunk, which
        runs in the same step when a prompt is being scored (``score_chunk``)."""
        if not self.admission or not view.rows:
            return paced
        m, rows = self.model, max(view.prefill_rows, 1)
        scoring = costmodel.scoring_step_bytes(m, min(costmodel.MIN_CHUNK_TOKENS, view.scoring_tokens),
                                               view.scoring_tokens)

        def room() -> int:  # the budget beside the cache's entries, this step's join copies, a scoring chunk
            return m.budget_bytes - self.cache.ledger().held_bytes - view.joining_bytes - scoring

        chunk = costmodel.chunk_that_fits(m, view.rows, view.longest, rows, view.longest, room(), paced)
        if chunk < paced:
            self._hurry_writer()
        if chunk < paced and self.cache.ledger().evictable_bytes:
            # Cached prompts go before the chunk shrinks.
            need = costmodel.batch_cost_bytes(m, view.rows, view.longest, paced, rows, view.longest) - room()
            if self.cache.evict(max(need, 1), "chunk") > 0:
                chunk = costmodel.chunk_that_fits(m, view.rows, view.longest, rows, view.longest, room(), paced)
        return chunk

    def score_chunk(self, view: EngineView, chunk_tokens: int, paced: int) -> int:
        """The next scoring chunk (prompt logprobs): the paced size, or the largest whose
        forward and logprobs fit the budget beside the batch's step (its cache, its
        prefill chunk of ``chunk_tokens``, the prefix cache's entries, the join copies)."""
        if not self.admission or not view.scoring_tokens:
            return paced
        m = self.model
        batch = costmodel.batch_cost_bytes(m, view.rows, view.longest, chunk_tokens, view.prefill_rows,
                                           view.longest)
        room = m.budget_bytes - self.cache.ledger().held_bytes - view.joining_bytes - batch
        return costmodel.score_chunk_that_fits(m, view.scoring_tokens, room, paced)

    def pressure(self, view: EngineView, chunk_tokens: int, now: float) -> PressureAction:
        """Memory shrank under running work: stop admitting, shrink the chunk, then evict."""
        if not self.admission or not view.rows:
            ended = PressureAction(admit=True, chunk_tokens=chunk_tokens, evict=0)
            if self.under_pressure:  # the last rows left: that ends it too
                self._log_pressure(ended, 0, now)
            self.under_pressure = False
            return ended
        mem = self.memory
        action, allocated = self._pressure_now(view, chunk_tokens)
        if not action.admit:
            # Act only on what the device says now: a device figure read before the last
            # step's transients were freed (CUDA's per-process bytes are read every 0.25 s)
            # would make the worker stop requests of its own memory, as if another process
            # had taken it.
            mem.probe.invalidate()
            action, allocated = self._pressure_now(view, chunk_tokens)
            held = 0 if action.admit else self._reclaim_before_set_aside()
            if held:
                action, allocated = self._pressure_now(view, chunk_tokens)
                if mem.last is not None:  # which kind of memory it was: bench.runtime's question
                    log.debug("the process held %d MiB beyond MLX's count; after a clear %d MiB",
                              held >> 20, mem.runtime_excess(mem.last) >> 20)
            if not action.admit and self._set_aside_runtime():
                action, allocated = self._pressure_now(view, chunk_tokens)
        self._follow_device()
        if not action.admit:
            self._hurry_writer()
        last = mem.last
        if not action.admit and last is not None and last.cache_bytes:
            mem.probe.clear_cache()  # reclaimable: try that before anything drastic
            return PressureAction(admit=not self.under_pressure, chunk_tokens=chunk_tokens, evict=0)
        if not action.admit and self.cache.ledger().evictable_bytes:
            # Then cached prompts, before the chunk shrinks or any request is stopped.
            shortage = max(0, mem.reserved_bytes - allocated) - mem.headroom_bytes()
            if self.cache.evict(max(shortage, 1), "pressure") > 0:
                return PressureAction(admit=not self.under_pressure, chunk_tokens=chunk_tokens, evict=0)
        if action.admit != (not self.under_pressure) or action.evict:
            self._log_pressure(action, allocated, now)
        self.under_pressure = not action.admit
        return action

    def _follow_device(self) -> None:
        """MLX may hold no more than it holds now, its buffer cache (which it gives back
        before it allocates past its limit) and what the device or system has free: while
        another process (on a Mac, another app) holds memory the budget counted on, kernels
        queued ahead wait instead of taking memory that is no longer there."""
        self.memory.probe.bound_active(self._pool_limit())

    def _pool_limit(self) -> int:
        limit, r = self.memory.mlx_limit_bytes, self.memory.last
        if r is not None:
            limit = min(limit, r.active_bytes + r.cache_bytes + r.system_available_bytes)
        return limit

    def bound_step(self, predicted_fitted: int) -> None:
        """While a step runs, MLX may hold what the fitted model predicted for it and no
        more before its evaluation waits for the device (after the step, ``end_step``).

        The host queues kernels ahead of the device, and their buffers add up: under a
        limit at the whole budget a step's peak is whatever the queue reaches (up to 10x
        what the forward needs run in order), the scale learns that as an overshoot and
        admission then holds a fraction of the rows the budget holds (bench/README,
        "Run-ahead"). Bounded here, the queue stays within the prediction, so
        a peak above it is what the forward needs in order: a real error of the model,
        which the scale must learn. Fitted, not scaled: a limit that grew with the scale
        would let the queue grow the scale again."""
        if not self.admission or predicted_fitted <= 0:
            return
        held = self.memory.idle_active_bytes + self._resident_at_step
        self.memory.probe.bound_active(min(self._pool_limit(), held + predicted_fitted))

    def end_step(self) -> None:
        """Back to the pool's limit (the prefix cache's copies and disk reads between
        steps are charged elsewhere)."""
        if self.admission:
            self._follow_device()

    def _reclaim_before_set_aside(self) -> int:
        """The process holds more than MLX counts: before any of it is set aside for good,
        what is only kept for reuse is given back (MLX's buffer cache, and with it what the
        runtime's allocator may keep of freed buffers), and the device read again. Only what
        the process still holds then is its runtime's own. Returns the excess it cleared
        for (0: none, nothing cleared)."""
        mem = self.memory
        r = mem.last
        excess = mem.runtime_excess(r) if r is not None else 0
        if r is None or excess < RUNTIME_MIN_BYTES or self._device_binds(r):
            return 0
        mem.probe.clear_cache()  # and the next reading is fresh
        return excess

    def _device_binds(self, r: Reading) -> bool:
        """The device's free memory, not the limit, is what ran out: another process took it."""
        return self.memory.probe.limit_bytes - self.memory.used_bytes(r) >= r.system_available_bytes

    def _set_aside_runtime(self) -> bool:
        """The process itself holds more than MLX counts, still after a clear (kernel
        workspaces, the driver's own pools: on a GPU hundreds of MB during steps): that is
        this process's runtime, not another process, so it is set aside from the budget
        for good, once, instead of stopping admissions and requests each time it shows.
        Requests already running keep what they were promised. True when the budget moved."""
        mem = self.memory
        r = mem.last
        if r is None or self._device_binds(r):
            return False
        excess = mem.runtime_excess(r)
        old = self.fitted.budget_bytes
        # Never below what a minimal request needs: the worker would then refuse everything
        # (boot refuses to start there; in service it keeps serving what still fits).
        floor = costmodel.request_cost_bytes(self.model, costmodel.MIN_REQUEST_TOKENS - 1, 1)
        charge = min(int(excess * RUNTIME_SET_ASIDE), old - floor)
        if excess < RUNTIME_MIN_BYTES or charge <= 0:
            return False
        mem.runtime_bytes += charge
        self.fitted = dataclasses.replace(self.fitted, budget_bytes=max(0, old - charge))
        self._apply_scale()
        self.bound_pool()
        log.warning("this process holds %d MiB more than MLX counts while steps run (the runtime's "
                    "own memory: kernel workspaces, the driver's pools); setting aside %d MiB: "
                    "budget %d -> %d MiB (runtime set aside in all: %d MiB)", excess >> 20,
                    charge >> 20, old >> 20, self.fitted.budget_bytes >> 20, mem.runtime_bytes >> 20)
        return True

    def _hurry_writer(self) -> None:
        """Memory is short and the disk writer holds some of it (entries it has not written
        cannot be given back): it writes now instead of waiting for an idle engine."""
        ledger = self.cache.ledger()
        if ledger.writing_bytes or ledger.pending_bytes:
            self.cache.hurry()

    def _log_pressure(self, action: PressureAction, allocated: int, now: float) -> None:
        """A change of pressure: WARNING, unless one was logged in the last
        PRESSURE_LOG_QUIET_S (an eviction always is, and so is the end of a pressure whose
        start was, so the log never leaves one open); the ones between are counted in."""
        self.pressure_changes += 1
        loud = (bool(action.evict) or now - self._pressure_logged_at >= PRESSURE_LOG_QUIET_S
                or (action.admit and self._pressure_open))
        if not loud:
            self._pressure_unlogged += 1
        mem, r = self.memory, self.memory.last
        log.log(logging.WARNING if loud else logging.DEBUG,
                "memory pressure %s: headroom %d B, reserved %d B, allocated %d B "
                "(active %d B, cache %d B, device footprint %d B, device free %d B)%s%s",
                "ended" if action.admit else "began" if not self.under_pressure else "held",
                mem.headroom_bytes(), mem.reserved_bytes, allocated,
                r.active_bytes if r else 0, r.cache_bytes if r else 0,
                r.footprint_bytes if r else 0, r.system_available_bytes if r else 0,
                f"; stopping the {action.evict} newest" if action.evict else "",
                f"; {self._pressure_unlogged} more changes since the last such line"
                if loud and self._pressure_unlogged else "")
        if loud:
            self._pressure_logged_at, self._pressure_unlogged = now, 0
            self._pressure_open = not action.admit

    def _pressure_now(self, view: EngineView, chunk_tokens: int) -> tuple[PressureAction, int]:
        mem = self.memory
        mem.refresh()
        allocated = self.allocated_bytes()
        return pressure_action(self.model, headroom_bytes=mem.headroom_bytes(),
                               reserved_bytes=mem.reserved_bytes, allocated_bytes=allocated,
                               running_totals=view.running_totals, chunk_tokens=chunk_tokens), allocated

    def predict_step(self, view: EngineView, chunk_tokens: int, previous: EngineView | None,
                     score_tokens: int = 0) -> int:
        """The fitted model's bound for this step's peak above weights and baseline.

        Rows that finished last step are still being copied out of the batch cache in this
        one (mlx-lm filters lazily), so the previous step's batch is charged too; a scoring
        chunk of ``score_tokens`` runs in the same step.
        """
        m = self.fitted
        self._resident_at_step = self.cache.ledger().held_bytes
        if not view.rows:
            return 0
        now = costmodel.batch_cost_bytes(m, view.rows, view.longest, chunk_tokens if view.prefill_rows else 0,
                                         view.prefill_rows, view.longest)
        before = costmodel.batch_cost_bytes(m, previous.rows, previous.longest, 0, 0, 0) if previous else 0
        return (max(now, before) + view.joining_bytes
                + costmodel.scoring_transient_bytes(m, score_tokens, view.scoring_tokens))

    def observe_step(self, predicted_fitted: int, now: float) -> bool:
        """Compare the step's measured peak with the prediction. True: the model changed."""
        mem = self.memory
        # The prefix cache's entries are not the batch's: before the step, and any it stored.
        cached = max(self._resident_at_step, self.cache.ledger().held_bytes)
        measured = mem.probe.step_peak() - mem.idle_active_bytes - cached
        changed = self.tracker.observe(measured, predicted_fitted, now)
        mem.worst_measured_over_predicted = self.tracker.worst_ratio
        if changed:
            self._apply_scale()
        elif log.isEnabledFor(logging.DEBUG) and predicted_fitted > 0:
            # With the process's device footprint (NVML), what it held beyond MLX's count at
            # the latest reading: which steps bring the runtime memory that gets set aside.
            r = mem.last
            excess = f", runtime excess {mem.runtime_excess(r) >> 20} MiB" if r is not None and r.footprint_bytes else ""
            log.debug("step peak %d B, fitted prediction %d B (x%.2f)%s", measured, predicted_fitted,
                      measured / predicted_fitted, excess)
        return changed

    def memory_error(self, now: float) -> bool:
        """A caught memory error: nothing is promised any more (the rows were failed), the
        model grows if admission was on. True when the worker should exit and be restarted
        (it keeps happening: state that keeps failing is not trusted)."""
        self.memory.reserved_bytes = 0
        self.memory.probe.clear_cache()
        if not self.admission:  # without admission, overshooting is what was asked for
            return False
        self.tracker.grow(CAUGHT_ERROR_GROWTH, now, "caught memory error")
        self._apply_scale()
        self._caught_errors = [t for t in self._caught_errors if now - t < CAUGHT_ERROR_WINDOW_S] + [now]
        return len(self._caught_errors) >= CAUGHT_ERRORS_TO_EXIT

    def move_limit(self, limit_bytes: int) -> int | None:
        """A new limit from the router: the budget follows (``moved_budget``) and the probe's
        limit with it, so headroom is measured against the new share. Returns the new budget,
        or None when nothing changes."""
        probe = self.memory.probe
        old = probe.limit_bytes
        if limit_bytes <= 0 or limit_bytes == old:
            return None
        budget = moved_budget(self.fitted.budget_bytes, old, limit_bytes, self.memory.reserved_bytes)
        probe.limit_bytes = old + (budget - self.fitted.budget_bytes)
        self.set_fitted(dataclasses.replace(self.fitted, budget_bytes=budget))
        self.bound_pool()
        return budget

    def set_fitted(self, fitted: CostModel) -> None:
        """A new fitted model (e.g. a test hook, or a re-calibration); the scale stays."""
        self.fitted = dataclasses.replace(fitted, scale=1.0)
        self._apply_scale()
        self.bound_pool()

    def grow_scale(self, factor: float, now: float) -> None:
        """Test hook: grow the scale as an overshoot would (SIGUSR1 with --test-grow-scale)."""
        self.tracker.grow(factor, now, "test hook")
        self._apply_scale()

    def _apply_scale(self) -> None:
        self.memory.model = dataclasses.replace(self.fitted, scale=self.tracker.scale)

    def scale_report(self, now: float) -> dict[str, Any]:
        """The scale and its recent changes, each as [seconds ago, scale, why]."""
        return {"scale": round(self.tracker.scale, 4),
                "scale_history": [[round(now - c.at, 1), c.scale, c.why] for c in self.tracker.history],
                "pressure_changes": self.pressure_changes}
