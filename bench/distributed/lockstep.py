"""Two ranks, one sharded model, worker.distributed's lockstep: do the ranks agree?

Run:  mlx.launch --backend ring -n 2 python bench/distributed/lockstep.py [MODEL_DIR]
Rank 0 drives a LockstepEngine (adds, a cancel, a chunk size change, sampled rows with
and without a seed); rank 1 follows. Each rank prints a digest of every output it made;
rank 0 also runs the greedy rows on an unsharded Engine and compares.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

from common.protocol import SamplingParams
from worker.distributed import LockstepEngine, follow, make_follower
from worker.engine import Engine

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/mlx-headroom/demo-v3")
SHAPE = dict(prefill_step_size=4, prefill_batch_size=2, max_batch_size=4)
REQUESTS = [
    ("greedy-a", [1, 5, 9, 33, 7, 8, 9, 10, 11], 12, SamplingParams()),
    ("greedy-b", [3, 300, 42], 12, SamplingParams()),
    ("sampled", [11, 12, 13], 12, SamplingParams(temperature=1.0)),
    ("seeded", [11, 12, 13], 12, SamplingParams(temperature=0.8, top_k=20, seed=7)),
    ("cancelled", [20, 21, 22, 23, 24, 25], 12, SamplingParams()),
]


def drive(engine: Engine) -> list[tuple]:
    log: list[tuple] = []
    for rid, prompt, n, sampling in REQUESTS[:3]:
        engine.add(rid, prompt, max_tokens=n, sampling=sampling)
    for i in range(200):
        if not engine.has_work:
            break
        if i == 2:
            for rid, prompt, n, sampling in REQUESTS[3:]:
                engine.add(rid, prompt, max_tokens=n, sampling=sampling)
            engine.set_prefill_step(3)
        if i == 5:
            engine.cancel("cancelled")
        log += [(o.request_id, o.token_ids, o.finish_reason) for o in engine.step()]
    return log


def digest(log: list[tuple]) -> str:
    return hashlib.sha256(repr(log).encode()).hexdigest()[:16]


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = load_model(MODEL, lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    if group.rank() == 0:
        engine = LockstepEngine(group, model, [2, 0], **SHAPE)
        log = drive(engine)
        engine.finish()
    else:
        log = []
        steps = follow(group, make_follower(group, model),
                       on_outputs=lambda outs: log.extend((o.request_id, o.token_ids, o.finish_reason) for o in outs))
        print(f"rank 1 followed {steps} steps", flush=True)
    print(f"rank {group.rank()} outputs={len(log)} digest={digest(log) if log else '-'}", flush=True)
    if group.rank() == 0:
        full, _ = load_model(MODEL)
        plain = Engine(full, [2, 0], **SHAPE)
        ref = drive(plain)
        greedy = lambda lg: [x for x in lg if x[0].startswith("greedy") or x[0] == "cancelled"]
        seeded = lambda lg: [x for x in lg if x[0] == "seeded"]
        print(f"greedy rows equal to unsharded: {greedy(log) == greedy(ref)}", flush=True)
        print(f"seeded row equal to unsharded: {seeded(log) == seeded(ref)}", flush=True)
        print("rank 0 log:", [(r, t) for r, t, _ in log if t][:6], flush=True)


if __name__ == "__main__":
    main()
