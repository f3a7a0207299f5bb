"""Feasibility probe: one llama model tensor-sharded over a ring group, BatchGenerator in lockstep.

Run:  mlx.launch --backend ring -n 2 python bench/distributed/feasibility.py [MODEL_DIR]
Every rank loads the whole model lazily, keeps its shard (Model.shard), then runs the same
BatchGenerator steps on the same prompts. Rank 0 broadcasts the prompts (all_sum of a buffer
that only rank 0 filled) so the ranks' inputs come from one place, as a worker's would.
Each rank prints its greedy tokens; rank 0 also compares them with the other ranks'
(all_gather) and with an unsharded load of the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model

MODEL = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/mlx-headroom/demo-v3"
PROMPTS = [[1, 5, 9, 33, 7], [3, 300, 42], [11, 12, 13, 14, 15, 16, 17]]
MAX_TOKENS = 16


def broadcast_prompts(group: mx.distributed.Group) -> list[list[int]]:
    """Rank 0's prompts reach every rank: a fixed-size buffer summed, zeros elsewhere."""
    width = 1 + max(len(p) for p in PROMPTS)
    buf = mx.zeros((len(PROMPTS), width), dtype=mx.int32)
    if group.rank() == 0:
        rows = [[len(p), *p] + [0] * (width - 1 - len(p)) for p in PROMPTS]
        buf = mx.array(rows, dtype=mx.int32)
    buf = mx.distributed.all_sum(buf, group=group).tolist()
    return [row[1:1 + row[0]] for row in buf]


def generate(model, prompts: list[list[int]]) -> list[list[int]]:
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS, stop_tokens=[])
    uids = gen.insert(prompts)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    rank, size = group.rank(), group.size()
    prompts = broadcast_prompts(group)
    model, _ = load_model(Path(MODEL), lazy=True)
    model.shard(group)
    mx.eval(model.parameters())
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    tokens = generate(model, prompts)
    print(f"rank {rank}/{size} weights={nbytes} tokens={tokens}", flush=True)
    flat = mx.array([t for row in tokens for t in row], dtype=mx.int32)
    gathered = mx.distributed.all_gather(flat, group=group).reshape(size, -1).tolist()
    if rank == 0:
        same = all(g == gathered[0] for g in gathered)
        full, _ = load_model(Path(MODEL))
        reference = generate(full, prompts)
        print(f"ranks agree: {same}; equal to unsharded: {reference == tokens}", flush=True)
        if reference != tokens:
            print(f"unsharded tokens={reference}", flush=True)


if __name__ == "__main__":
    main()
