"""One model sharded over an ``mx.distributed`` group, its ranks' engines in lockstep.

Rank 0 is the worker the router sees; the other ranks (followers) only compute. Every rank
holds a slice of the weights (mlx-lm's ``Model.shard``: attention heads and MLP columns),
and every forward pass ends in collectives (``all_sum``) that all ranks must enter, so all
ranks must run the very same ``BatchGenerator`` steps on the very same rows. The
generator's scheduling is deterministic given its inputs, so it is enough that each rank
applies the same engine inputs in the same order before each step: rank 0 records them
(``LockstepEngine``: add, cancel, the next prefill chunk, cancel all) and broadcasts them
with the step; a follower (``follow``) applies them to its own ``Engine`` and steps.

Determinism across ranks: the logits are the same on every rank (the last ``all_sum``
gives every rank the same sum, and the LM head is not sharded), greedy rows agree by
construction, and a sampled row without a seed is given one by rank 0 before it is
recorded (the global PRNG is not shared). Not supported yet: the prefix cache (each
rank would keep its own slice of each entry, with rank 0's decisions broadcast too).

The wire between ranks is a msgpack frame (``encode_inputs``/``decode_inputs``, pure),
carried by ``broadcast``: ``mx.distributed`` has no broadcast, so rank 0's length and
bytes are summed with zeros from every other rank. A rank that dies fails the others' next
collective (``[ring] connection to a peer was lost``), but only that one: MLX's socket
thread gives up for good, and every later collective on that socket waits for ever. A
forward queues several (one or two per layer), so a rank whose peer died mid-step hangs in
MLX, out of Python's reach. ``PeerWatch`` sees the ring's sockets close instead and ends
the rank, bounded: the group exits as one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgpack

from common.protocol import ExitCode, SamplingParams
from worker.engine import Engine, Output
from worker.lockstep import (
    MAX_INPUTS_BYTES, Add, Cancel, CancelAll, Chunk, EngineShape, LockstepError, Op, ScoreChunk, StepInputs,
    apply, decode_inputs, decode_shape, dropped_alone, encode_inputs, encode_shape, with_seed,
)
from worker.prefix_cache import Reuse
from worker.shape import make_grammars

log = logging.getLogger(__name__)

# --distributed's value when mlx.launch set MLX_HOSTFILE and MLX_RANK itself.
LAUNCHED = "launch"
# How often an idle rank 0 checks that its peers are there.
IDLE_PING_S = 1.0
# How often every rank looks at its ring sockets, and how long it lets a failed collective
# end the rank by itself (a log and a clean exit) before ending it from the watch.
PEER_CHECK_S = 0.5
PEER_LOST_GRACE_S = 2.0


# -- the collectives ---------------------------------------------------------------------

def broadcast(group: Any, payload: bytes | None) -> bytes:
    """Rank 0's bytes on every rank: its length, then its bytes, each summed with zeros."""
    import mlx.core as mx
    import numpy as np

    # On the generator's stream: BatchGenerator leaves the next step's forward (and its
    # all_sums) in flight after a step, and collectives on two streams could reach the
    # ranks' sockets in different orders (seen: a follower decoding the wrong bytes).
    from mlx_lm.generate import generation_stream

    with mx.stream(generation_stream):
        return _broadcast(mx, np, group, payload)


def _broadcast(mx: Any, np: Any, group: Any, payload: bytes | None) -> bytes:
    lead = group.rank() == 0
    if lead and (payload is None or len(payload) > MAX_INPUTS_BYTES):
        raise LockstepError("rank 0 must broadcast a payload within MAX_INPUTS_BYTES")
    size = mx.distributed.all_sum(mx.array([len(payload) if lead and payload else 0], dtype=mx.int32),
                                  group=group).item()
    if not 0 <= size <= MAX_INPUTS_BYTES:
        raise LockstepError(f"broadcast of {size} bytes")
    if size == 0:
        return b""
    buf = mx.array(np.frombuffer(payload, dtype=np.uint8)) if lead and payload else mx.zeros((size,), mx.uint8)
    return np.array(mx.distributed.all_sum(buf, group=group), copy=False).tobytes()


class LockstepEngine(Engine):
    """Rank 0's engine: records every input and broadcasts them before each step."""

    def __init__(self, group: Any, model: Any, eos_token_ids: list[int], *, prefill_step_size: int,
                 prefill_batch_size: int, max_batch_size: int, **kwargs: Any) -> None:
        super().__init__(model, eos_token_ids, prefill_step_size=prefill_step_size,
                         prefill_batch_size=prefill_batch_size, max_batch_size=max_batch_size, **kwargs)
        self.group = group
        self._ops: list[Op] = []
        self._pinged_at = time.monotonic()
        self.lost: BaseException | None = None  # a collective failed: the group is gone
        broadcast(group, encode_shape(EngineShape(list(eos_token_ids), prefill_step_size,
                                                  prefill_batch_size, max_batch_size)))

    def add(self, request_id: str, prompt_ids: list[int], *, max_tokens: int,
            sampling: SamplingParams = SamplingParams(), hit: Reuse | None = None,
            boundaries: list[int] | None = None, compiled: Future[Any] | None = None) -> None:
        if hit is not None:
            raise LockstepError("the prefix cache is not supported over a distributed group")
        sampling = with_seed(sampling)
        super().add(request_id, prompt_ids, max_tokens=max_tokens, sampling=sampling,
                    boundaries=boundaries, compiled=compiled)
        self._ops.append(Add(request_id, list(prompt_ids), max_tokens, sampling, list(boundaries or [])))

    def cancel(self, request_id: str) -> bool:
        gone = super().cancel(request_id)
        if gone:
            self._ops.append(Cancel(request_id))
        return gone

    def set_prefill_step(self, tokens: int) -> None:
        super().set_prefill_step(tokens)
        self._ops.append(Chunk(tokens))

    def set_score_step(self, tokens: int) -> None:
        super().set_score_step(tokens)
        self._ops.append(ScoreChunk(tokens))

    def cancel_all(self) -> list[str]:
        ids = super().cancel_all()
        self._ops.append(CancelAll())
        return ids

    def step(self) -> list[Output]:
        self._flush(step=True)
        try:
            return super().step()
        except BaseException as exc:
            self.lost = exc
            raise

    def idle(self) -> None:
        """Nothing to step: every IDLE_PING_S, a frame without a step, so a lost rank is
        seen (the collective fails) while idle, not at the next request."""
        now = time.monotonic()
        if now - self._pinged_at >= IDLE_PING_S:
            self._pinged_at = now
            self._flush(step=False)

    def finish(self) -> None:
        """Rank 0 is leaving: the followers apply what is left and exit. Not after a failed
        collective: the ring is gone (another collective would wait for ever), and so
        are the followers, whose own collectives failed too."""
        if self.lost is None:
            self._flush(step=False, stop=True)

    def _flush(self, *, step: bool, stop: bool = False) -> None:
        ops, self._ops = self._ops, []
        try:
            broadcast(self.group, encode_inputs(StepInputs(ops=ops, step=step, stop=stop)))
        except BaseException as exc:
            self.lost = exc
            raise


def make_follower(group: Any, model: Any, **kwargs: Any) -> Engine:
    """A follower's engine, shaped by rank 0's first broadcast."""
    shape = decode_shape(broadcast(group, None))
    return Engine(model, shape.eos_token_ids, prefill_step_size=shape.prefill_step_size,
                  prefill_batch_size=shape.prefill_batch_size, max_batch_size=shape.max_batch_size,
                  **kwargs)


def follow(group: Any, engine: Engine, on_outputs: Callable[[list[Output]], None] | None = None) -> int:
    """A follower's loop: apply rank 0's inputs, step, until rank 0 says stop. Its
    outputs are dropped (rank 0 publishes the same tokens) unless ``on_outputs`` wants
    them (a check that the ranks agree). Returns the steps run."""
    steps = 0
    failed: set[str] = set()   # rows this rank's last step ended for their own failure
    while True:
        inputs = decode_inputs(broadcast(group, None))
        apply(inputs.ops, engine)
        alone = dropped_alone(failed, inputs.ops)
        if alone:  # rank 0 kept a row this rank dropped: the batches part here
            raise LockstepError(f"rank {group.rank()} failed rows rank 0 did not: {sorted(alone)}")
        if inputs.stop:
            log.info("rank %d: rank 0 stopped the group after %d steps", group.rank(), steps)
            return steps
        if inputs.step:
            outputs = engine.step()
            failed = {o.request_id for o in outputs if o.failure is not None}
            engine.store_pending()
            if on_outputs is not None:
                on_outputs(outputs)
            steps += 1


# -- joining the group, and a follower's life ----------------------------------------------

# -- a lost peer, seen on the ring's sockets ------------------------------------------------

def peer_gone(sock: socket.socket) -> str | None:
    """Why ``sock``'s peer is gone (its end closed or reset), or None while it is there.
    A peek: nothing is taken from what MLX's socket thread reads."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None  # nothing to read: the peer is quiet, not gone
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if data else "closed by the peer"


def _exit_lost(reason: str) -> None:
    # os._exit: the main thread may be stuck in MLX, where no exception or signal reaches.
    log.error("a peer of the group is gone (%s): leaving the group", reason)
    sys.stderr.flush()
    os._exit(ExitCode.ENGINE_ERROR)


class PeerWatch:
    """Ends this rank, bounded, once a peer's ring socket closes: a failed collective leaves
    MLX waiting for ever on the next one (see the module's docstring). ``stand_down`` when
    the group stops on purpose (its peers then close their sockets, rightly)."""

    def __init__(self, sockets: list[socket.socket], on_lost: Callable[[str], None] = _exit_lost,
                 interval_s: float = PEER_CHECK_S, grace_s: float = PEER_LOST_GRACE_S) -> None:
        self.sockets = sockets
        self._on_lost = on_lost
        self._interval_s = interval_s
        self._grace_s = grace_s
        self._standing_down = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stand_down(self) -> None:
        self._standing_down.set()

    def _run(self) -> None:
        while not self._standing_down.wait(self._interval_s):
            reason = next((r for r in map(peer_gone, self.sockets) if r), None)
            if reason is None:
                continue
            # The rank's own failed collective may end it cleanly first; if not, it hangs.
            if not self._standing_down.wait(self._grace_s):
                self._on_lost(reason)
            return


def ring_sockets(before: set[tuple[int, int, int]]) -> list[socket.socket]:
    """The connected stream sockets opened since ``before`` (``open_files()`` then): the
    ring's, when taken around ``mx.distributed.init``. Each a dup: MLX keeps its own."""
    found = []
    for fd, _, _ in sorted(open_files() - before):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket (or closed since the listing)
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername():
                found.append(sock)
                continue
        except OSError:
            pass  # not connected
        sock.close()
    return found


def open_files() -> set[tuple[int, int, int]]:
    """(fd, device, inode) of each open fd: a number closed and reused is a new file (the
    listing's own fd is one: it is in the listing, and closed)."""
    files = set()
    for name in os.listdir("/dev/fd"):  # Linux and macOS alike
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        files.add((int(name), st.st_dev, st.st_ino))
    return files


def join(hostfile: str, rank: int | None, model: Any) -> tuple[Any, PeerWatch]:
    """Join the ring group of ``hostfile`` (MLX's JSON, one ``["ip:port"]`` list per rank)
    and keep this rank's slice of ``model``; the group, and the watch on its peers (running).
    ``rank`` None: ``$MLX_RANK``. ``hostfile`` ``launch``: started by ``mlx.launch``, which
    sets both variables."""
    import mlx.core as mx

    if hostfile != LAUNCHED:
        os.environ["MLX_HOSTFILE"] = hostfile
    if rank is not None:
        os.environ["MLX_RANK"] = str(rank)
    before = open_files()
    group = mx.distributed.init(strict=True, backend="ring")
    sockets = ring_sockets(before)
    if not sockets:
        log.warning("no ring sockets found: a peer's death mid-step may leave this rank hanging")
    watch = PeerWatch(sockets).start()
    if not hasattr(model, "shard"):
        raise LockstepError(f"{type(model).__module__} has no shard(): mlx-lm cannot split it")
    model.shard(group)
    mx.eval(model.parameters())
    mx.clear_cache()  # the slices the other ranks keep
    log.info("rank %d of %d: holding my shard of the model (watching %d ring sockets)",
             group.rank(), group.size(), len(sockets))
    return group, watch


def lead_probe(group: Any, stretch: int, mlx_limit_bytes: int | None = None) -> None:
    """Rank 0 is about to run the calibration probe: the followers run the same forwards,
    under the MLX memory limit rank 0 set for itself (ranks hold alike shards), so their
    kernels queued ahead of the device wait at it too. They keep that boot-time limit: rank
    0's budget only shrinks after it, by memory the runtime takes on each rank alike."""
    broadcast(group, msgpack.packb({"probe_stretch": stretch, "mlx_limit_bytes": mlx_limit_bytes}))


def follow_mlx_limit(boot: dict[str, Any]) -> None:
    """A follower sets the MLX memory limit rank 0 sent (none: MLX's default stays)."""
    import mlx.core as mx

    limit = boot.get("mlx_limit_bytes")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        mx.set_memory_limit(limit)


def run_follower(group: Any, loaded: Any) -> int:
    """A follower's whole life: the calibration probe, the engine shaped as rank 0's, then
    every step until rank 0 stops the group. A lost peer ends it with an engine error: the
    supervisor restarts the group."""
    from worker.calibrate import probe

    model = loaded.model
    try:
        boot = msgpack.unpackb(broadcast(group, None))
        follow_mlx_limit(boot)
        probe(model, int(boot["probe_stretch"]))  # same forwards, same collectives as rank 0's
        steps = follow(group, make_follower(group, model, grammars=make_grammars(loaded)))
    except (RuntimeError, LockstepError, KeyError, ValueError) as exc:
        log.error("rank %d leaves the group: %s", group.rank(), exc)
        return ExitCode.ENGINE_ERROR
    log.info("rank %d: done after %d steps", group.rank(), steps)
    return ExitCode.OK
