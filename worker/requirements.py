"""The versions of MLX, mlx-lm and llguidance this worker needs, checked before it loads.

pip enforces pyproject's floors, but a wheel installed with ``--no-deps`` (or an old one
left in an environment) is not checked by anyone: an llguidance older than ours rejected
the worker's EOS list and failed every grammar request inside the engine step. So the
worker refuses to start, with one clear line, when one of these is older. The floors are
pyproject's own (a unit test holds them equal); read from no file at run time, since a
checkout run with ``python -m worker`` has no installed metadata of its own.
"""

from __future__ import annotations

import re
from importlib import metadata

# distribution name → the lowest version pyproject allows
FLOORS: dict[str, str] = {"mlx": "0.32", "mlx-lm": "0.32.2", "llguidance": "1.9"}


def version_key(version: str) -> tuple[int, ...]:
    """A release's numbers (``1.9.1`` → (1, 9, 1)); pre-release and local tags ignored."""
    release = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in release.group(0).split(".")) if release else ()


def is_older(installed: str, floor: str) -> bool:
    a, b = version_key(installed), version_key(floor)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def too_old(floors: dict[str, str] = FLOORS) -> list[str]:
    """One line for each required distribution that is missing or older than its floor."""
    problems = []
    for name, floor in floors.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed (needs >= {floor})")
            continue
        if is_older(installed, floor):
            problems.append(f"{name} {installed} is older than required (>= {floor})")
    return problems
