"""Two ranks: an all_sum of rank + 1 (mlx.launch --backend ring -n 2 python allsum.py)."""

from __future__ import annotations

import mlx.core as mx

group = mx.distributed.init(strict=True, backend="ring")
total = mx.distributed.all_sum(mx.array([group.rank() + 1.0]), group=group)
print(f"rank {group.rank()}/{group.size()} all_sum={total.item()}", flush=True)
