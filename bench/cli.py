"""What the delegated subcommands (`python -m bench faults|memory|router`) share."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Add --json, parse, and start progress logging (httpx's per-request lines off)."""
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return ns
