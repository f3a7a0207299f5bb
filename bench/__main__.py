"""`python -m bench serve ...`: compare Headroom, mlx_lm.server and in-process mlx-lm.

Prints the table to stdout and writes the JSON document (default under bench/results/,
which git ignores). Progress goes to stderr through logging.

`python -m bench faults ...` and `python -m bench memory ...` are handed to the modules of
those names (each parses its own arguments).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from datetime import datetime
from pathlib import Path
from types import FrameType

from bench.prompts import PROMPT_TOKENS
from bench.systems import SYSTEMS

log = logging.getLogger("bench")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _kinds(text: str) -> list[str]:
    kinds = [x.strip() for x in text.split(",") if x.strip()]
    if not kinds or any(k not in PROMPT_TOKENS for k in kinds) or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"choose distinct names from {','.join(PROMPT_TOKENS)}; got {text!r}")
    return kinds


def _systems(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"choose distinct names from {','.join(SYSTEMS)}; got {text!r}")
    return names


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True,
                                description=f"also: {', '.join(DELEGATED)} (see their --help)")
    p = sub.add_parser("serve", help="throughput and latency of the serving systems, side by side")
    p.add_argument("--model", default="demo", help="demo | bench-shaped | PATH to an mlx-lm folder")
    p.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], help="e.g. 1,8,32")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per workload repetition (default: max(32, 2 x concurrency))")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of each workload")
    p.add_argument("--max-tokens", type=int, default=64, help="exact output length of every request")
    p.add_argument("--prompt-tokens", type=_kinds, default=["short"], metavar="KIND[,KIND]",
                   help="prompt kinds, each run at every concurrency: "
                        + ", ".join(f"{k} ~{v} tokens" for k, v in PROMPT_TOKENS.items()))
    p.add_argument("--paired", type=int, default=32, metavar="N",
                   help="short prompts sent to every system back to back at c=1, for the added "
                        "TTFT and overhead figures (0: skip)")
    p.add_argument("--no-mixed", dest="mixed", action="store_false",
                   help="skip the mixed workload (one long prompt, then short ones while it prefills)")
    p.add_argument("--mixed-long-tokens", type=int, default=1024, help="the mixed workload's long prompt")
    p.add_argument("--mixed-shorts", type=int, default=8, help="short prompts sent after the long one")
    p.add_argument("--mixed-max-tokens", type=int, default=16, help="output length in the mixed workload")
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS), help=",".join(SYSTEMS))
    p.add_argument("--json", type=Path, default=None, help="output file (default bench/results/serve-<time>.json)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds per server to get healthy")
    p.add_argument("--workload-timeout", type=float, default=300.0, help="seconds per workload run")
    p.add_argument("--headroom-arg", action="append", default=[], metavar="ARG",
                   help="extra mlx-router argument (repeat; e.g. --headroom-arg=--log-level=warning)")
    p.add_argument("--mlx-lm-arg", action="append", default=[], metavar="ARG",
                   help="extra mlx_lm.server argument (repeat; e.g. --mlx-lm-arg=--prompt-cache-size=10)")
    p.add_argument("--peer-memory-limit-mb", type=int, default=None,
                   help="bound the in-process peer's MLX memory (and a quarter of it for its "
                        "buffer cache): on a shared GPU, give it Headroom's --memory-limit-mb")
    p.add_argument("--touch", action="store_true",
                   help="send every system one 2-token request right before each measured workload "
                        "(keeps idle-time effects, e.g. a worker restart, out of the figures)")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="keep the servers' logs under DIR (default: removed after a clean run)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so every `finally` (and ExitStack) stops the servers.
    raise SystemExit(128 + signum)


# Subcommands that own their argument parsing: bench/<name>.py main(argv).
DELEGATED: dict[str, str] = {"faults": "faults", "memory": "memory", "router": "routeronly",
                             "agents": "agents",
                             "grammar": "grammar", "structured": "structured", "apis": "apis",
                             "multiturn": "multiturn", "models": "models", "before-queue": "beforequeue"}


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw and raw[0] in DELEGATED:
        import importlib

        return int(importlib.import_module(f"bench.{DELEGATED[raw[0]]}").main(raw[1:]))
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counts = [args.repeats, args.max_tokens, args.mixed_long_tokens, args.mixed_shorts,
              args.mixed_max_tokens] + ([args.requests] if args.requests is not None else [])
    if min(counts) < 1 or args.paired < 0:
        log.error("--requests, --repeats, --max-tokens and the --mixed-* counts must be >= 1, "
                  "--paired >= 0")
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)

    from bench import report
    from bench.procs import StartError
    from bench.runner import ServeConfig, run_serve

    cfg = ServeConfig(model=args.model, concurrency=args.concurrency, num_requests=args.requests,
                      repeats=args.repeats, max_tokens=args.max_tokens,
                      prompt_kinds=args.prompt_tokens, mixed=args.mixed, paired=args.paired,
                      mixed_long_tokens=args.mixed_long_tokens, mixed_shorts=args.mixed_shorts,
                      mixed_max_tokens=args.mixed_max_tokens, systems=args.systems,
                      startup_timeout_s=args.startup_timeout, workload_timeout_s=args.workload_timeout,
                      headroom_args=args.headroom_arg, mlx_lm_args=args.mlx_lm_arg,
                      peer_memory_limit_mb=args.peer_memory_limit_mb, touch=args.touch, log_dir=args.keep_logs,
                      command=shlex.join(["python", "-m", "bench", *raw]))
    try:
        doc = run_serve(cfg)
    except StartError as exc:
        log.error("%s", exc)  # the servers already stopped; their logs were kept
        return 1
    out = args.json or RESULTS_DIR / f"serve-{datetime.now():%Y%m%d-%H%M%S}.json"
    report.write_json(doc, out)
    print(report.render(doc))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
