"""Rank 1 leaves after one all_sum; rank 0 reports what its next all_sum does.

Run each rank by hand: MLX_HOSTFILE=hf.json MLX_RANK=0|1 python death.py, with hf.json
[["127.0.0.1:35501"], ["127.0.0.1:35502"]].
"""

from __future__ import annotations

import os
import time

import mlx.core as mx

group = mx.distributed.init(strict=True, backend="ring")
first = mx.distributed.all_sum(mx.array([1.0]), group=group)
print(f"rank {group.rank()} first all_sum ok {first.item()}", flush=True)
if group.rank() == 1:
    os._exit(3)
time.sleep(1)
started = time.monotonic()
try:
    second = mx.distributed.all_sum(mx.array([1.0]), group=group)
    print(f"rank 0 second all_sum returned {second.item()}", flush=True)
except RuntimeError as exc:
    print(f"rank 0 second all_sum raised {exc} after {time.monotonic() - started:.1f}s", flush=True)
