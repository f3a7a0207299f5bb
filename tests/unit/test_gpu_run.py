"""bench/gpu_run.py's arithmetic for the runtime-based tight limit (the GPU runs themselves
happen on the lent machine, never in CI)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.gpu_run import MIB, make_parser, runtime_limit_mb
from worker.memory import safety_margin


@settings(max_examples=200, deadline=None)
@given(st.integers(1 << 20, 64 << 30), st.integers(0, 4 << 30), st.integers(16 << 20, 16 << 30))
def test_the_runtime_limit_gives_the_worker_the_asked_budget(weights: int, baseline: int, budget: int) -> None:
    # The worker's own rule: budget = limit - weights - baseline - margin. The limit is in
    # whole MiB (rounded up), so the budget lands within a MiB above the one asked for.
    limit = runtime_limit_mb(weights, baseline, budget) * MIB
    got = limit - weights - baseline - safety_margin(limit, weights)
    assert budget <= got < budget + MIB


def test_tight_over_defaults_to_the_weights() -> None:
    args = make_parser().parse_args(["memory"])
    assert args.tight_over == "weights"
    assert make_parser().parse_args(["memory", "--tight-over", "runtime"]).tight_over == "runtime"


def test_the_runtime_and_cpuprofile_parts_are_known_with_their_arguments() -> None:
    args = make_parser().parse_args(["runtime", "cpuprofile", "--runtime-arg=--rows=8", "--runtime-arg=--passes=3"])
    assert args.parts == ["runtime", "cpuprofile"]
    assert args.runtime_arg == ["--rows=8", "--passes=3"]


def test_cpuprofile_counts_a_worker_only_once_it_said_it_serves(tmp_path: Path) -> None:
    """A worker's start burns a core too (NVRTC's compiles on a fresh GPU machine): the
    profile begins at the worker's own "serving" line, not at its first busy interval."""
    from bench.gpu_run import _serving_pids

    logs = tmp_path / "headroom-bench-x"
    logs.mkdir()
    (logs / "headroom.log").write_text(
        "2026-12-05 12:05:28,125 mlx-worker[795] INFO worker.calibrate: calibration (probe, 74.46s)\n")
    assert _serving_pids(tmp_path) == set()
    with open(logs / "headroom.log", "a") as f:
        f.write("2026-12-05 12:06:02,488 mlx-worker[795] INFO worker.server: worker 795 "
                "(incarnation 3029587906568410518) serving\n")
    assert _serving_pids(tmp_path) == {795}
