"""bench/restart.py reads a worker's start by phase from its log, from this checkout's log
line and from an older one's (two checkouts are timed back to back)."""

from __future__ import annotations

from bench.restart import phases

START = ("2026-12-05 09:00:00,000 mlx-worker[12] INFO worker: start to ready in 7.70 s (from a standby): "
         "imports 0.20 s, model loaded in 1.40 s, calibration and boot 0.15 s, warm start 4.50 s")
NOW = ("2026-12-05 09:00:00,000 mlx-worker[12] INFO worker.loader: loaded m from /p: weights 1.20 s, "
       "EOS [151643, 151645] from the folder's files (0.31 s, beside the weights)")
BEFORE = ("2026-12-05 09:00:00,000 mlx-worker[12] INFO worker.loader: loaded m from /p: weights 1.20 s, "
          "tokenizer 2.30 s (beside the weights; both in 2.31 s)")


def test_the_start_is_read_by_phase_from_this_and_an_older_checkouts_log() -> None:
    now = phases([START, NOW, BEFORE.replace("[12]", "[13]")], 12)
    assert now == {"start": "from a standby", "worker_ready_s": 7.7, "imports_s": 0.2, "load_s": 1.4,
                   "boot_s": 0.15, "warm_start_s": 4.5, "weights_s": 1.2, "eos_s": 0.31,
                   "eos_from": "the folder's files"}
    assert phases([BEFORE], 12) == {"weights_s": 1.2, "eos_s": 2.3, "eos_from": "its tokenizer"}
