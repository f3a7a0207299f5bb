"""A standby worker: the imports paid in advance, the model not touched until it is told.

``mlx-worker --standby [ARGS]`` (the supervisor spawns ``python -m worker --standby`` with
the arguments it expects to give, so ``ps`` shows what it is for) imports what a worker
needs that touches no device, then waits on stdin for one line, a JSON map: the
arguments it is to run with and when it was told (``{"args": [...], "told_at": seconds}``). The supervisor writes that line only once the worker it
replaces has exited, so two copies of the weights never coexist; until then this process
holds no model and no device memory, and about 100 MB of host memory. Stdin closing first
(the router stopped) ends it quietly. A standby told to go before its imports are done
finishes them first; its start is counted from when it was told (its log line's "imports"
is then what was left of them).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def prepare() -> None:
    """Import what a worker's start imports, short of mlx-lm, at idle priority.

    On 2 CPU cores 0.9 of a worker's 1.0 s of imports are transformers' and numpy's, 0.1 s
    mlx-lm's own and ours. mlx-lm is left to the go because its import makes an array
    (``mx.random.state``, read by ``sample_utils``' decorators), and on CUDA MLX's first
    array creates the device context: hundreds of MB of GPU memory beside the worker still
    running. The imports run in a thread of idle priority, so they take only CPU that the
    serving worker (or anything else) leaves; numpy comes first, in this thread, because
    its BLAS threads are made by its import and outlive it."""
    import numpy  # noqa: F401

    failed: list[BaseException] = []

    def run() -> None:
        _lower_this_thread()
        try:
            _import_the_rest()
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="standby-imports")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _lower_this_thread() -> None:
    """Idle priority for the calling thread only (Linux: SCHED_IDLE; macOS: background)."""
    try:
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        elif hasattr(os, "PRIO_DARWIN_THREAD"):
            os.setpriority(os.PRIO_DARWIN_THREAD, 0, os.PRIO_DARWIN_BG)  # type: ignore[attr-defined]
    except OSError:  # not allowed here: the imports run at normal priority
        pass


def _import_the_rest() -> None:
    import msgpack  # noqa: F401
    import psutil  # noqa: F401
    import zmq  # noqa: F401

    import mlx.core  # noqa: F401  (loads the library; no device context, no array)
    import mlx.nn  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import common.config  # noqa: F401
    import common.costmodel  # noqa: F401
    import common.protocol  # noqa: F401


def wait_for_arguments() -> tuple[list[str], float] | None:
    """The worker's arguments and when it was told (wall clock), or None when stdin closed
    first. Read byte by byte: the rest of stdin is the parent's pipe, which the worker goes
    on watching. The line is ``{"args": [...], "told_at": seconds}`` (router/fleet/standby.py)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = os.read(sys.stdin.fileno(), 1)
        if not chunk:
            return None
        line += chunk
    told = json.loads(line)
    args = told.get("args") if isinstance(told, dict) else None
    told_at = told.get("told_at") if isinstance(told, dict) else None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) \
            or not isinstance(told_at, (int, float)):
        raise SystemExit(f"mlx-worker standby: expected {{\"args\": [...], \"told_at\": seconds}}, got {line!r}")
    # Never later than now (a clock step back would otherwise count negative imports).
    return args, min(float(told_at), time.time())


def stand_by() -> tuple[list[str], float] | None:
    """Import, wait, and return the worker's arguments and when they were given: a start
    told to go while its imports were still running counts those that were left."""
    prepare()
    return wait_for_arguments()
