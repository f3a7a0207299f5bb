"""Which process and which thread burns the CPU, and where: for ``gpu_run cpuprofile``.

On the H200 Headroom's processes used 6.4-6.8 ms of CPU per generated token on long
prompts against mlx_lm.server's 2.2-2.8, while the worker's loop around the engine step
measured under 1 ms a step: the CPU goes somewhere a Python profile that skips idle
threads does not look (a thread that waits on the device by spinning holds no GIL and
looks idle to py-spy). So this counts each thread's CPU time from the kernel
(``/proc/PID/task/TID``, through psutil) over a workload, names the threads from a py-spy
profile taken with ``--idle --native`` (its frames carry ``thread (TID): NAME``), and
summarizes that profile per thread: the native and Python frames the busiest threads sit in.

    python -m bench.cpusplit RAW [--threads N]     # summarize a py-spy raw profile
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\): ?(.*)$")
_PROCESS = re.compile(r'^process (\d+):"(.*)"$')


def role(cmdline: list[str]) -> str:
    """What a process of the bench is, from its command line."""
    if "-m" in cmdline:
        module = cmdline[cmdline.index("-m") + 1] if cmdline.index("-m") + 1 < len(cmdline) else ""
        if module == "worker":
            return "standby" if "--standby" in cmdline else "worker"
        if module in ("router", "mlx_lm.server", "bench"):
            return {"router": "router", "mlx_lm.server": "mlx_lm.server", "bench": "bench"}[module]
    return "other"


@dataclass
class ThreadClock:
    """CPU seconds of every thread of a process tree, between the first and last look."""

    first: dict[tuple[int, int], float] = field(default_factory=dict)
    last: dict[tuple[int, int], float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    # The kernel's name of each thread: native threads that py-spy cannot see are named
    # there (the CUDA driver's, e.g. "cuda-EvtHandlr"; a Python thread shows its process's).
    comms: dict[tuple[int, int], str] = field(default_factory=dict)

    def look(self, root_pid: int) -> dict[int, float]:
        """Read every thread now; returns each process's CPU seconds so far."""
        import psutil

        totals: dict[int, float] = {}
        try:
            root = psutil.Process(root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return totals
        for p in procs:
            try:
                if p.pid not in self.roles:
                    self.roles[p.pid] = role(p.cmdline())
                for t in p.threads():
                    key, cpu = (p.pid, t.id), t.user_time + t.system_time
                    if key not in self.comms:
                        self.comms[key] = _comm(p.pid, t.id)
                    self.first.setdefault(key, cpu)
                    self.last[key] = cpu
                    totals[p.pid] = totals.get(p.pid, 0.0) + cpu
            except psutil.Error:
                continue
        return totals

    def restart(self) -> None:
        """Count from now: what ran before (processes starting, kernels compiling) is left out;
        a thread first seen later counts from then."""
        self.first = dict(self.last)

    def rows(self, names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """One row per thread that used CPU, the busiest first."""
        names = names or {}
        out = []
        for (pid, tid), cpu in self.last.items():
            used = cpu - self.first.get((pid, tid), cpu)
            if used > 0:
                out.append({"role": self.roles.get(pid, "?"), "pid": pid, "tid": tid,
                            "thread": names.get(tid, "main" if tid == pid else ""),
                            "comm": self.comms.get((pid, tid), ""), "cpu_s": round(used, 2)})
        return sorted(out, key=lambda r: -r["cpu_s"])


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class ThreadProfile:
    samples: int = 0
    leaves: collections.Counter[str] = field(default_factory=collections.Counter)
    frames: collections.Counter[str] = field(default_factory=collections.Counter)


def parse_raw(lines: Iterable[str]) -> tuple[dict[int, str], dict[int, ThreadProfile]]:
    """py-spy's raw format (``frame;frame;... count``): thread names by native id, and each
    thread's samples by leaf frame and by any frame on the stack."""
    names: dict[int, str] = {}
    profiles: dict[int, ThreadProfile] = {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        tid = None
        body: list[str] = []
        for frame in frames:
            m = _THREAD.match(frame)
            if m:
                tid = int(m.group(1), 0)
                names[tid] = m.group(2).strip()
                body = []
            elif not _PROCESS.match(frame):
                body.append(frame)
        if tid is None or not body:
            continue
        prof = profiles.setdefault(tid, ThreadProfile())
        prof.samples += n
        prof.leaves[body[-1]] += n
        for frame in set(body):
            prof.frames[frame] += n
    return names, profiles


def summary(profiles: dict[int, ThreadProfile], names: dict[int, str], tids: Iterable[int],
            top: int = 12) -> str:
    lines = []
    for tid in tids:
        prof = profiles.get(tid)
        if prof is None:
            continue
        lines.append(f"thread {tid} ({names.get(tid, '?')}): {prof.samples} samples")
        lines.append("  leaf frames:")
        lines += [f"    {n / prof.samples:6.1%}  {frame[:160]}" for frame, n in prof.leaves.most_common(top)]
        lines.append("  on the stack:")
        lines += [f"    {n / prof.samples:6.1%}  {frame[:160]}" for frame, n in prof.frames.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpusplit", description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="a py-spy profile in raw format (--format raw)")
    ap.add_argument("--threads", type=int, default=4, help="the threads with the most samples")
    args = ap.parse_args(argv)
    names, profiles = parse_raw(args.raw.read_text(errors="replace").splitlines())
    busiest = sorted(profiles, key=lambda t: -profiles[t].samples)[:args.threads]
    print(summary(profiles, names, busiest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
