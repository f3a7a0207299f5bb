"""bench/cpusplit.py (which thread burns the CPU) and bench/runtime.py (what a process holds
beyond MLX's count) on this machine: the GPU runs that use them happen on the lent
machine, never in CI, so their parsing and bookkeeping are checked here, on real processes
and real MLX (the demo model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import runtime
from bench.cpusplit import ThreadClock, parse_raw, role, summary
from worker.demo import default_cache_root, ensure_demo_model

RAW = """\
process 10:"python -m bench serve";process 11:"python -m worker --model m";thread (11): MainThread;run (worker/server.py:148);step (worker/core.py:313);poll (libc.so.6) 30
process 10:"python -m bench serve";process 11:"python -m worker --model m";thread (11): MainThread;run (worker/server.py:148);next (mlx_lm/generate.py:1478) 10
process 10:"python -m bench serve";process 11:"python -m worker --model m";thread (0x1f): prompt-cache-blocks;_run (worker/disk_writer.py:152);wait (threading.py:327) 5
not a stack line
"""


def test_a_raw_profile_is_split_by_thread_with_its_names() -> None:
    names, profiles = parse_raw(RAW.splitlines())
    assert names == {11: "MainThread", 0x1f: "prompt-cache-blocks"}
    assert profiles[11].samples == 40
    assert profiles[11].leaves == {"poll (libc.so.6)": 30, "next (mlx_lm/generate.py:1478)": 10}
    assert profiles[11].frames["run (worker/server.py:148)"] == 40
    # Process frames are where a stack came from, not a frame of it.
    assert not any(frame.startswith("process ") for frame in profiles[11].frames)
    text = summary(profiles, names, [11, 0x1f, 99])
    assert "thread 11 (MainThread): 40 samples" in text and "75.0%  poll (libc.so.6)" in text
    assert "thread 31 (prompt-cache-blocks): 5 samples" in text


def test_roles_follow_the_command_line() -> None:
    assert role(["python", "-m", "worker", "--model", "m"]) == "worker"
    assert role(["python", "-m", "worker", "--standby", "--model", "m"]) == "standby"
    assert role(["python", "-m", "router", "--model", "m"]) == "router"
    assert role(["python", "-m", "mlx_lm.server"]) == "mlx_lm.server"
    assert role(["python", "-m"]) == "other"
    assert role(["sleep", "1"]) == "other"


def test_every_thread_of_a_process_tree_is_counted_from_the_kernel() -> None:
    # A child whose second thread spins until told to stop on stdin: that thread, not
    # its main one, is the busy one, and the clock names it from the kernel.
    code = ("import sys, threading\n"
            "stop = threading.Event()\n"
            "def spin():\n"
            "    n = 0\n"
            "    while not stop.is_set(): n += 1\n"
            "t = threading.Thread(target=spin); t.start()\n"
            "print('up', t.native_id, flush=True)\n"
            "sys.stdin.readline(); stop.set(); t.join()\n")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            spinner = int(child.stdout.readline().split()[1])
            clock = ThreadClock()
            clock.look(os.getpid())
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # until the kernel has counted some of its CPU
                time.sleep(0.1)
                clock.look(os.getpid())
                if any(r["tid"] == spinner for r in clock.rows()):
                    break
            rows = clock.rows()
        finally:
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(10)
    restarted = ThreadClock(first={(1, 1): 1.0}, last={(1, 1): 5.0}, roles={1: "worker"})
    restarted.restart()  # counted from now: what ran before is left out
    assert restarted.rows() == []
    busy = [r for r in rows if r["tid"] == spinner]
    assert busy, f"the spinning thread was not counted: {rows}"
    assert busy[0]["pid"] == child.pid and busy[0]["role"] == "other" and busy[0]["comm"] == "python"
    assert busy[0]["cpu_s"] > 0


@pytest.fixture(scope="module")
def model() -> object:
    from mlx_lm import load

    model, _ = load(str(ensure_demo_model(default_cache_root(os.environ))))
    return model


def test_the_runtime_bench_reads_every_step_twice_and_summarizes_each_pass(model: object) -> None:
    doc = runtime.run(model, rows_list=[1, 2], context=64, chunks=[24, 16], decode_steps=1, passes=2)
    assert doc["source"] == "rss"  # no CUDA here: the resident set stands in
    # Per pass and rows value: chunks of 24 and 16 in turn to 64 tokens, one decode step,
    # then "rows gone"; every pass runs the same shapes.
    assert len(doc["points"]) == 2 * 2 * 5
    first = [p for p in doc["points"] if p["run_pass"] == 0 and p["rows"] == 2]
    assert [(p["tokens"], p["context"]) for p in first] == [(24, 24), (16, 40), (24, 64), (1, 65), (0, 0)]
    again = [p for p in doc["points"] if p["run_pass"] == 1 and p["rows"] == 2]
    assert [(p["tokens"], p["context"]) for p in again] == [(p["tokens"], p["context"]) for p in first]
    assert first[-1]["note"] == "rows gone"
    for p in doc["points"]:  # each figure is rounded to 0.1 MiB on its own
        parts = p["footprint_mib"] - p["active_mib"] - p["cache_mib"] - doc["baseline_mib"]
        assert abs(p["outside_mib"] - parts) < 0.5
    summary_ = doc["summary"]
    assert set(summary_) == {"pass0", "pass1", "growth_in_later_pass_mib"}
    assert len(summary_["pass0"]["outside_with_no_rows_mib"]) == 2
    assert summary_["growth_in_later_pass_mib"] == round(
        summary_["pass1"]["outside_cleared_max_mib"] - summary_["pass0"]["outside_cleared_max_mib"], 1)
    assert "footprint from rss" in runtime.table(doc)
