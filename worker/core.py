"""The worker's core: every decision of one serving iteration, with no socket.

``handle(message) -> messages`` takes what the router sent (a request, a cancel, a trim, a
new limit); ``step() -> messages`` runs one iteration (admit what waited for its grammar,
relieve memory pressure, size the chunk, step the engine, triage its errors, apply the OOM
guard) and says what to publish (tokens, failed rows, a throttled status). The loop around
it (``worker/server.py``) only moves frames between ZeroMQ and these two calls, as vLLM's
EngineCoreProc does around its EngineCore; memory decisions are the gate's
(``worker/gate.py``). Tests drive it with no socket, on an injected clock.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from common import costmodel
from common.log import about
from common.protocol import (
    Cancel, ExitCode, FinishReason, Generate, Limit, Message, Reject, RejectReason, Status, TokenRow,
    Tokens, Trim,
)
from worker.engine import Engine, Output
from worker.gate import EngineView, MemoryGate, is_memory_error
from worker.grammar import GrammarCompiler
from worker.memory import MemoryState
from worker.pacer import ChunkPacer
from worker.prefix_cache import CacheTiers, Reuse

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25
# A step's prefill work is sized to take about this long: short enough that decode keeps
# flowing beside a long prompt and that no healthy step nears the router's stall timeout.
STEP_BUDGET_S = 0.5
# A step this much longer than the budget is logged with its shape (a fresh worker's first
# long prompt on the H200 took 4x a warm one's time: which step, and what shape, says why).
SLOW_STEP_S = 1.5 * STEP_BUDGET_S
# A grammar the router's llguidance compiled in milliseconds: one still compiling here after
# this long is refused rather than left waiting (no step or deadline would end its wait).
COMPILE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class LoopTiming:
    """Where the loop's time goes while it has work: inside the engine's step (model and
    sampling), in the prefix cache's copies after it, or around it (sockets, the gate,
    publishing). At one stream on a fast GPU a decode step can be bound by the host thread
    that launches it, so time spent around the step adds to every token; ``/v1/memory``
    shows all three (``loop``)."""

    steps: int = 0
    engine_s: float = 0.0    # inside Engine.step
    busy_s: float = 0.0      # whole loop iterations that stepped the engine
    store_s: float = 0.0     # the prefix cache's copies after steps (device work, not the loop's)

    def overhead_us_per_step(self) -> float:
        return (self.busy_s - self.engine_s - self.store_s) / self.steps * 1e6 if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "engine_s": round(self.engine_s, 4), "busy_s": round(self.busy_s, 4),
                "store_s": round(self.store_s, 4),
                "overhead_us_per_step": round(self.overhead_us_per_step(), 1)}


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the next engine step runs (``WorkerCore.schedule``)."""

    evict: tuple[str, ...] = ()     # running requests stopped first: their memory was taken
    chunk_tokens: int = 0           # the prefill chunk the step may use
    prefill_rows: int = 0           # rows that chunk covers (mlx-lm's choice, mirrored)
    why: str = ""                   # what sized the chunk: pressure, paced, memory, ...
    score_tokens: int = 0           # the scoring chunk of a prompt whose logprobs were asked for


@dataclass(frozen=True, slots=True)
class CoreOptions:
    incarnation: int
    oom_guard: str              # abort | raise | off (resolved)
    admission: bool
    max_running: int
    vocab_size: int


class WorkerCore:
    """Admission, steps, error triage and what to publish; knows nothing of sockets."""

    def __init__(self, opts: CoreOptions, engine: Engine, memory: MemoryState,
                 clock: Callable[[], float] = time.monotonic, cache: CacheTiers | None = None) -> None:
        self.opts = opts
        self.engine = engine
        self.memory = memory
        self.clock = clock
        self.gate = MemoryGate(memory, fitted=memory.model, admission=opts.admission,
                               max_running=opts.max_running, now=clock(), cache=cache)
        self.cache = cache
        if cache is not None:  # the cache keeps only what the gate has room for
            cache.room = self.gate.can_hold
            engine.cache = cache
            engine.kv_bytes_per_token = memory.model.kv_bytes_per_token
        self.stop_reason: str | None = None
        self.exit_code = ExitCode.OK
        self.broken = False          # a step raised a non-memory error: no more steps
        self.num_bad_frames = 0      # counted by the loop that reads the socket
        self.received_at = 0.0       # the last frame's arrival (perf_counter), set by that loop
        self.timing = LoopTiming()
        self.stepped = False         # the last ``step`` stepped the engine
        self._out: list[Message] = []
        self._status_sent_at = 0.0
        self._changed = False
        self._held = False           # the last iteration held its status back (a first token)
        self._worst_step_s = 0.0
        self._previous: EngineView | None = None
        self._admitted_at: dict[str, float] = {}   # at DEBUG: admission times, for the TTFT split
        # Requests whose grammar is compiling: admitted (or refused) once it has.
        self._compiling: dict[str, tuple[Generate, Future[Any], float]] = {}   # ..., its deadline
        self.pacer = ChunkPacer(STEP_BUDGET_S, memory.model.prefill_step_tokens)
        self.chunk_tokens = memory.model.prefill_step_tokens

    @property
    def is_compiling(self) -> bool:
        return bool(self._compiling)

    def _take(self) -> list[Message]:
        out, self._out = self._out, []
        return out

    def view(self) -> EngineView:
        e = self.engine
        return EngineView(running_totals=e.totals(), prefilling=e.num_prefilling(),
                          prefill_rows=e.prefill_rows(), joining_bytes=e.joining_bytes(),
                          joining_assembled_bytes=e.joining_assembled_bytes(),
                          scoring_tokens=e.scoring_context())

    # -- input -----------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Message]:
        """A message from the router; what to send back (a refusal, at once)."""
        if isinstance(msg, Generate):
            self._admit_guarded(msg)
        elif isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        elif isinstance(msg, Trim):
            self.trim()
        elif isinstance(msg, Limit):
            self.set_limit(msg.limit_bytes)
        return self._take()

    def _admit_guarded(self, msg: Generate, compiled: Future[Any] | None = None) -> None:
        running = msg.request_id in self.engine.running  # a duplicate id's row is not this one's
        try:
            self.admit(msg, compiled)
        except Exception as exc:  # one request's failure to start is its own, never the worker's
            if not running:
                self.cancel(msg.request_id)  # whatever of it started
            self._admit_failed(msg, exc)

    def _admit_failed(self, msg: Generate, exc: Exception) -> None:
        """An admission that raised (its sampler or processors could not be built, a value
        the decoder let through, a memory error while its row or a cached prefix was
        made): refused, to be queued again when memory ran out, else for good."""
        if is_memory_error(exc):  # no room after all: give MLX's cache back, ask again later
            log.warning("could not start (%s); re-queued", exc, extra=about(msg.request_id))
            self.memory.probe.clear_cache()
            self._out.append(self._reject(msg, RejectReason.NOT_NOW, f"no room now: {exc}"))
            return
        log.warning("could not start: %s: %s", type(exc).__name__, exc, exc_info=True, extra=about(msg.request_id))
        self._out.append(self._reject(msg, RejectReason.REQUEST_FAILED,
                                      f"the request could not start: {type(exc).__name__}: {exc}"))

    def cancel(self, request_id: str) -> None:
        self._admitted_at.pop(request_id, None)  # no first output will come for it
        self._compiling.pop(request_id, None)
        if self.engine.cancel(request_id):
            self.gate.rebase(self.view())  # its promise goes with it
            self._changed = True
            log.debug("cancelled", extra=about(request_id))

    def trim(self) -> None:
        """Another model needs room: give back what is evictable (the prompt cache's RAM
        entries no request holds, MLX's buffer cache) and report the result."""
        if self.cache is not None:
            self.cache.evict(self.cache.ledger().resident_bytes, "trim")
        self.memory.probe.clear_cache()
        self._changed = True
        log.info("trimmed on the router's request")

    def set_limit(self, limit_bytes: int) -> None:
        """A new share of the host budget: the budget moves with the limit (never below
        what is promised now), and the next Status carries the new cost model."""
        old = self.memory.probe.limit_bytes
        budget = self.gate.move_limit(limit_bytes)
        if budget is None:
            return
        if self.cache is not None:
            self.cache.follow_budget(budget)
        self._changed = True
        log.info("memory limit %d → %d MiB on the router's request", old >> 20,
                 self.memory.probe.limit_bytes >> 20)

    def admit_compiled(self) -> None:
        """Admit (or refuse) the requests whose grammar has finished compiling; one whose
        compile outlasts COMPILE_TIMEOUT_S is refused (nothing else would end its wait)."""
        now = self.clock()
        for request_id, (msg, compiled, deadline) in list(self._compiling.items()):
            if compiled.done():
                del self._compiling[request_id]
                self._admit_guarded(msg, compiled)
            elif now > deadline:
                del self._compiling[request_id]
                self._out.append(self._reject(msg, RejectReason.BAD_GRAMMAR,
                                              f"the grammar did not compile within {COMPILE_TIMEOUT_S:.0f} s"))

    def _grammar_refusal(self, msg: Generate, compiled: Future[Any] | None) -> Reject | None:
        """A grammar is checked before any GPU work: refused when this worker cannot build it."""
        if msg.sampling.grammar is None:
            return None
        if compiled is None:
            return self._reject(msg, RejectReason.BAD_GRAMMAR, "this worker cannot enforce grammars")
        error = GrammarCompiler.error_of(compiled)
        if error is None:
            return None
        log.info("refused: its grammar cannot be built here: %s", error, extra=about(msg.request_id))
        return self._reject(msg, RejectReason.BAD_GRAMMAR, f"this grammar cannot be enforced: {error}")

    def _lookup(self, msg: Generate, view: EngineView) -> Reuse | None:
        """The prompt cache's reuse for ``msg``. The cache only saves work: a fault inside it
        (a bug) costs this request its reuse, never the worker and the batch beside it."""
        assert self.cache is not None
        try:
            return self.cache.lookup(msg.prompt_ids,
                                     self.gate.restore_room(view, len(msg.prompt_ids), msg.max_tokens))
        except Exception as exc:
            self.cache.fault("lookup", exc)
            return None

    def admit(self, msg: Generate, compiled: Future[Any] | None = None) -> None:
        """The worker is authoritative: it takes only what the gate has room for. A request
        with a grammar first waits (here, never inside a step) for its compile: ``compiled``."""
        at = [time.perf_counter()]  # the parts' times, for the DEBUG line (a few perf_counter calls)
        if self.stop_reason is not None:  # leaving: the router gives it to another worker
            self._out.append(self._reject(msg, RejectReason.NOT_NOW, "the worker is stopping"))
            return
        reject = self._validate(msg)
        grammars = self.engine.grammars
        if reject is None and compiled is None and msg.sampling.grammar is not None and grammars is not None:
            compiled = grammars.compile(msg.sampling.grammar)
            if not compiled.done():
                self._compiling[msg.request_id] = (msg, compiled, self.clock() + COMPILE_TIMEOUT_S)
                return
        reject = reject or self._grammar_refusal(msg, compiled)
        # Taken (promised) before admission may evict: the entry this request reuses stays,
        # unless the request fits only without it (the gate then lets go of it: ``cold``).
        # A prompt to score takes none: every position it scores must be run.
        n, view = len(msg.prompt_ids), self.view()
        scoring = msg.sampling.prompt_logprobs is not None
        hit = self._lookup(msg, view) if reject is None and self.cache is not None and not scoring else None
        at.append(time.perf_counter())
        if reject is None:
            decision = self.gate.can_admit(view, n, msg.max_tokens, reuse=hit, scoring=scoring)
            hit = None if decision.cold else hit
            at.append(time.perf_counter())
            if not decision.admit:
                assert decision.reason is not None
                log.debug("%s: %s (%d bytes)", decision.reason, decision.message,
                          decision.needed_bytes, extra=about(msg.request_id))
                reject = self._reject(msg, decision.reason, decision.message, decision.needed_bytes)
        if reject is not None:
            if hit is not None and self.cache is not None:
                self.cache.release(hit)
            self._out.append(reject)
            return
        try:  # its sampler and processors are built here: a failure is this request's own
            self.engine.add(msg.request_id, msg.prompt_ids, max_tokens=msg.max_tokens,
                            sampling=msg.sampling, hit=hit, boundaries=msg.boundaries, compiled=compiled)
        except Exception:
            if hit is not None and self.cache is not None:
                self.cache.release(hit)
            raise  # refused by _admit_failed
        if self.cache is not None:
            self.cache.record(hit)
        debug = log.isEnabledFor(logging.DEBUG)
        if debug:
            self._admitted_at[msg.request_id] = time.perf_counter()
        at.append(time.perf_counter())
        self.gate.reserve(decision)
        self._changed = True
        if debug:
            at.append(time.perf_counter())
            ms = [(b - a) * 1e3 for a, b in zip([self.received_at, *at], at)]
            log.debug("admitted %.2f ms after its frame arrived (decode %.2f, checks and prefix "
                      "cache %.2f, gate %.2f, insert %.2f, commit %.2f): %d prompt tokens (%d "
                      "cached), max_tokens %d", sum(ms), *ms, len(msg.prompt_ids),
                      hit.tokens if hit else 0, msg.max_tokens, extra=about(msg.request_id))

    def _validate(self, msg: Generate) -> Reject | None:
        """What no worker could run, memory aside (the router checks these first)."""
        n, vocab = len(msg.prompt_ids), self.opts.vocab_size
        scored = msg.sampling.prompt_logprobs
        # max_tokens 0 asks for the prompt's scores alone
        least = 1 if scored is None else 0
        if n == 0 or msg.max_tokens < least or (scored or 0) < 0 or msg.request_id in self.engine.running \
                or msg.request_id in self._compiling:
            return self._reject(msg, RejectReason.BAD_REQUEST,
                                "empty prompt, bad max_tokens or prompt_logprobs, or duplicate id")
        s = msg.sampling
        if any(len(pair) != 2 for pair in s.logit_bias):
            return self._reject(msg, RejectReason.BAD_REQUEST, "logit_bias entries must be [token_id, bias]")
        if min(msg.prompt_ids) < 0 or max(msg.prompt_ids) >= vocab \
                or any(not 0 <= t < vocab for t, _ in s.logit_bias):
            return self._reject(msg, RejectReason.BAD_REQUEST, f"token ids must be in [0, {vocab})")
        # Values the router never sends: mlx-lm's compiled samplers raise on some of them
        # while tracing, which leaves MLX's global random state unusable for every row after.
        if not (0.0 <= s.temperature < math.inf and 0.0 < s.top_p <= 1.0 and 0.0 <= s.min_p <= 1.0
                and s.top_k >= 0):
            return self._reject(msg, RejectReason.BAD_REQUEST,
                                "temperature, top_p, min_p or top_k out of range")
        return None

    def _reject(self, msg: Generate, reason: RejectReason, text: str, needed: int = 0) -> Reject:
        return Reject(incarnation=self.opts.incarnation, request_id=msg.request_id, reason=reason,
                      message=text, needed_bytes=needed,
                      max_request_tokens=costmodel.max_request_tokens(self.gate.model))

    # -- step ------------------------------------------------------------------------

    def step(self, started: float | None = None) -> list[Message]:
        """One iteration after the input: admit what waited for its grammar, relieve
        pressure, step the engine, and what publishes it. ``started`` (perf_counter): when
        the iteration's work began, for the loop's own timing (``loop`` in the report)."""
        started = time.perf_counter() if started is None else started
        steps = self.timing.steps
        self.engine.remove_cancelled()  # every Cancel this input brought, in one filter
        if self._compiling:
            self.admit_compiled()
        if self.cache is not None:  # the disk tier writes while the engine is quiet
            self.cache.engine_busy(self.engine.has_work)
        plan = self.schedule()
        outputs = self._apply(plan)
        outputs += self._step_engine(plan.score_tokens)
        self.stepped = self.timing.steps != steps
        if self.stepped:  # counted before the status it publishes, and its publishing after
            self.timing.busy_s += time.perf_counter() - started
            started = time.perf_counter()
        self._publish(outputs)
        if self.stepped:
            self.timing.busy_s += time.perf_counter() - started
        return self._take()

    def published(self) -> None:
        """The loop sent what ``step`` returned: after a step, the engine's quiet starts now."""
        if self.stepped and self.cache is not None:
            self.cache.engine_busy(self.engine.has_work)

    def grow_scale(self, factor: float) -> None:
        """Test hook (SIGUSR1): grow the cost model's scale as a measured overshoot would."""
        self.gate.grow_scale(factor, self.clock())
        self._changed = True

    def stop_all(self) -> None:
        """Shutting down: what still runs is dropped here and answered by the router when
        the worker's exit (or its Shutdown) is seen: re-queued when it had produced nothing,
        a retryable ``worker_lost`` otherwise (a memory error's ``error`` would misname it)."""
        if not self.broken:
            self.engine.cancel_all()
        self._compiling.clear()

    def schedule(self) -> Schedule:
        """What the next engine step runs, decided top to bottom in this one place.

        1. Memory taken by another process (the gate's ``pressure``, which also sets the
           runtime's own excess aside from the budget): admission stops and the chunk
           shrinks; only when that is not enough are the newest running requests stopped.
        2. Otherwise the prefill chunk: as many tokens as the step-time budget allows (the
           pacer, from measured prefill speed), no more than memory holds beside the running
           rows (the gate), and a whole number of KV steps unless it ends the prompts.
        3. Which rows the chunk covers is mlx-lm's rule (the prompt batch's rows, then the
           oldest waiting prompts while the prefill and decode batches have room; mirrored
           in ``Engine._next_prefill``); every decoding row decodes one token.
        4. Then the oldest prompt being scored (prompt logprobs) gets a scoring chunk: paced
           as a prefill chunk is, no more than memory holds beside the batch's step (the
           gate), the smallest under pressure, and on whole KV steps unless it ends the prompt.
        """
        view = self.view()
        plan = self._batch_schedule(view)
        if not view.scoring_tokens:
            return plan
        left = self.engine.score_left()
        paced = self.pacer.chunk(1, left)
        if plan.why == "pressure" or self.gate.under_pressure:
            paced = min(paced, costmodel.MIN_CHUNK_TOKENS)
        chunk = self.gate.score_chunk(view, plan.chunk_tokens if plan.prefill_rows else 0, paced)
        return replace(plan, score_tokens=chunk if chunk >= left else costmodel.kv_aligned_chunk(chunk))

    def _batch_schedule(self, view: EngineView) -> Schedule:
        """Steps 1 to 3 of ``schedule``: the generator's part."""
        budget = self.gate.fitted.budget_bytes
        action = self.gate.pressure(view, self.chunk_tokens, self.clock())
        if self.gate.fitted.budget_bytes != budget:  # the runtime's own memory was set aside
            if self.cache is not None:
                self.cache.follow_budget(self.gate.fitted.budget_bytes)
            self._changed = True  # the router re-checks its queue against the new model
        if not action.admit:
            running = list(self.engine.running)
            evict = tuple(running[len(running) - action.evict:]) if action.evict else ()
            return Schedule(evict=evict, chunk_tokens=action.chunk_tokens, why="pressure")
        if view.prefill_rows == 0 or self.gate.under_pressure:
            return Schedule(chunk_tokens=self.chunk_tokens, why="no prefill")
        left = self.engine.longest_prefill_left()
        paced = self.pacer.chunk(view.prefill_rows, left)
        chunk = self.gate.chunk(view, paced)
        if chunk >= left:  # it ends the prompts: any length
            return Schedule(chunk_tokens=chunk, prefill_rows=view.prefill_rows, why="rest of the prompts")
        # One that does not keeps the KV buffer's growths on whole steps, as the cost model
        # charges them.
        return Schedule(chunk_tokens=costmodel.kv_aligned_chunk(chunk), prefill_rows=view.prefill_rows,
                        why="paced" if chunk == paced else "memory")

    def _apply(self, plan: Schedule) -> list[Output]:
        """Carry out the schedule's stops and chunk before the engine steps."""
        if plan.chunk_tokens != self.chunk_tokens or plan.why == "pressure" or plan.prefill_rows:
            self.chunk_tokens = plan.chunk_tokens
            self.engine.set_prefill_step(plan.chunk_tokens)
        if plan.score_tokens != self.engine.score_step:
            self.engine.set_score_step(plan.score_tokens)
        for request_id in plan.evict:
            log.warning("evicting: memory taken by another process", extra=about(request_id))
            self.engine.cancel(request_id)
        if plan.evict:
            self.gate.rebase(self.view())
            self._changed = True
        return [Output(rid, [], FinishReason.EVICTED) for rid in plan.evict]

    def _step_engine(self, score_tokens: int = 0) -> list[Output]:
        if not self.engine.has_work or self.broken:
            if self.memory.reserved_bytes and not self.engine.has_work:
                self.gate.rebase(self.view())  # nothing runs: nothing is promised
                self._changed = True
            if not self.broken:
                try:
                    self.engine.idle()
                except Exception as exc:  # a distributed group lost a rank
                    return self._crash(exc)
            return []
        self.memory.probe.reset_peak()
        view = self.view()
        predicted = self.gate.predict_step(view, self.chunk_tokens, self._previous, score_tokens)
        self._previous = view
        self.gate.bound_step(predicted)
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.gate.end_step()
            return self._failed(exc)
        try:
            self._guard(lambda: f"a step of {view.rows} rows ({view.prefill_rows} prefilling, chunk "
                        f"{self.chunk_tokens}, scoring {score_tokens}), longest {view.longest} tokens, "
                        f"predicted {predicted} B over the idle and the prompt cache")
        except Exception as exc:  # the step's outputs are sent: rows it finished are out of the batch
            self.gate.end_step()
            return outputs + self._failed(exc)
        elapsed = time.perf_counter() - started
        self.gate.end_step()
        self.timing.steps += 1
        self.timing.engine_s += elapsed
        if self.gate.observe_step(predicted, self.clock()):
            self._changed = True
        self._worst_step_s = max(self._worst_step_s, elapsed)
        if elapsed > SLOW_STEP_S:
            log.info("slow step %d: %.3f s, %d rows (%d prefilling %d tokens in a chunk of %d), "
                     "longest %d tokens", self.engine.num_steps, elapsed, view.rows, view.prefill_rows,
                     self.engine.last_prefilled_tokens, self.chunk_tokens, view.longest)
        # The calls made for first tokens are a decode's work, not the chunk's.
        self.pacer.observe(self.engine.last_prefilled_tokens, elapsed - self.engine.last_chained_s)
        if any(o.finish_reason is not None for o in outputs):
            self._changed = True
            self.gate.rebase(self.view())
        elif view.joining_bytes and self.engine.joining_bytes() < view.joining_bytes:
            self.gate.rebase(self.view())  # a hit's row joined: its copy is no longer promised
        stored_at = time.perf_counter()
        failure: Exception | None = None
        try:
            self.engine.store_pending()  # the prefix cache's copies: after the measure and the rebase
            self._guard(lambda: "the prompt cache's store after a step")
        except Exception as exc:
            failure = exc
        self.timing.store_s += time.perf_counter() - stored_at  # not the failure's handling below
        return outputs + self._failed(failure) if failure is not None else outputs

    def _failed(self, exc: BaseException) -> list[Output]:
        return self._recover(exc) if is_memory_error(exc) else self._crash(exc)

    def _guard(self, during: Callable[[], str]) -> None:
        """--oom-guard: make a peak above the limit as fatal as Metal makes it. ``during``:
        what ran, for the message (which charge fell short is the first question); only
        called then: every step passes here."""
        if self.opts.oom_guard == "off":
            return
        peak = self.memory.probe.step_peak()
        limit = self.memory.probe.limit_bytes
        if peak <= limit:
            return
        held = self.cache.ledger().held_bytes if self.cache is not None else 0
        reason = (f"OOM guard: step peak {peak} bytes above the limit {limit} bytes during {during()}; "
                  f"MLX idle {self.memory.idle_active_bytes} B, prompt cache {held} B, "
                  f"promised {self.memory.reserved_bytes} B")
        if self.opts.oom_guard == "abort":
            print(f"mlx-worker: {reason}; aborting as Metal would", file=sys.stderr, flush=True)
            os.abort()
        # As MLX >= 0.32 does on Metal: a RuntimeError at the next sync point.
        raise RuntimeError(f"[METAL] Command buffer execution failed: {reason}")

    def _recover(self, exc: BaseException) -> list[Output]:
        """A caught memory error: fail the running requests, drop their caches, clear the
        MLX cache, grow the cost model, report it; exit for a restart if it keeps happening
        (the step's outputs could not be trusted, and neither can state that keeps failing)."""
        log.error("engine step ran out of memory (%s); failing %d running requests", exc,
                  len(self.engine.running))
        failed = self.engine.cancel_all()
        self._previous = None
        if self.gate.memory_error(self.clock()):
            self.stop_reason = "repeated caught memory errors: state no longer trusted"
            self.exit_code = ExitCode.UNTRUSTED_STATE
        self._changed = True
        return [Output(rid, [], FinishReason.ERROR) for rid in failed]

    def _crash(self, exc: BaseException) -> list[Output]:
        """Anything but a memory error in a step is a bug, not the cost model's fault: exit
        at once and let the supervisor start a clean worker (the engine is not stepped or
        touched again)."""
        log.exception("engine step failed with a non-memory error; exiting for a restart")
        self.broken = True
        self.stop_reason = f"engine error: {type(exc).__name__}: {exc}"
        self.exit_code = ExitCode.ENGINE_ERROR
        return []  # the router answers (or retries once) what was running when we exit

    # -- publish ---------------------------------------------------------------------

    def _publish(self, outputs: list[Output]) -> None:
        if outputs:
            self._send_outputs(outputs)
        # A status right behind a first token would be read by the router before the
        # token's stream is woken (one drain of the socket handles both): while the engine
        # has work it goes out with the next iteration, a step later (never twice in a row:
        # with first tokens in every step it would never go); an idle engine sends it now,
        # for its next iteration first waits for a message.
        hold = (not self._held and self.engine.has_work
                and any(o.cached_tokens is not None for o in outputs))
        self._held = hold
        if not hold:
            self._publish_status()

    def status(self, force: bool = False) -> list[Message]:
        """The status report, when it is due (or ``force``)."""
        self._publish_status(force)
        return self._take()

    def _send_outputs(self, outputs: list[Output]) -> None:
        failed = [o for o in outputs if o.failure is not None]
        if failed:  # rows whose own work failed: their request's error, after its tokens so far
            outputs = [o for o in outputs if o.failure is None]
            if outputs:
                self._send_outputs(outputs)
            for o in failed:
                self._admitted_at.pop(o.request_id, None)
                self._out.append(Reject(incarnation=self.opts.incarnation, request_id=o.request_id,
                                 reason=RejectReason.REQUEST_FAILED, message=o.failure or ""))
            return
        rows = [TokenRow(o.request_id, o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs)
                for o in outputs]
        if log.isEnabledFor(logging.DEBUG):
            for o in outputs:
                admitted = self._admitted_at.pop(o.request_id, None) if o.cached_tokens is not None else None
                if admitted is not None:  # its first output: the worker's share of its TTFT
                    log.debug("first token %.2f ms after admission", (time.perf_counter() - admitted) * 1e3,
                              extra=about(o.request_id))
                if o.finish_reason is not None:
                    self._admitted_at.pop(o.request_id, None)
                    log.debug("finished: %s", o.finish_reason, extra=about(o.request_id))
        cached = {o.request_id: o.cached_tokens for o in outputs if o.cached_tokens}
        self._out.append(Tokens(incarnation=self.opts.incarnation, step=self.engine.num_steps, outputs=rows,
                         cached_tokens=cached))

    def _publish_status(self, force: bool = False) -> None:
        now = self.clock()
        if not (force or self._changed or now - self._status_sent_at >= STATUS_INTERVAL_S):
            return
        self._changed = False
        self._status_sent_at = now
        report = replace(
            self.memory.report(running=len(self.engine.running), max_running=self.opts.max_running),
            **self.gate.scale_report(self.clock()),
            bad_frames=self.num_bad_frames,
            worst_step_s=round(self._worst_step_s, 4),
            loop=self.timing.to_dict(),
            safe_prefill_chunk=self.chunk_tokens,
            # What MLX may hold before its evaluation waits for the device, read back from MLX.
            mlx_limit_bytes=self.memory.probe.memory_limit(),
            prompt_cache=self.cache.report() if self.cache is not None else {"enabled": False})
        self._out.append(Status(incarnation=self.opts.incarnation, report=report))
