"""The worker's dependency floors: pyproject's own, and an older install is refused."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common.protocol import ExitCode
from worker.requirements import FLOORS, is_older, too_old

ROOT = Path(__file__).resolve().parents[2]


def test_floors_are_pyprojects() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared: dict[str, str] = {}
    for dep in deps:
        m = re.match(r"([A-Za-z0-9_-]+)(?:\[[^]]*])?>=([0-9.]+)", dep)
        if m and m.group(1) in FLOORS:
            declared.setdefault(m.group(1), m.group(2))
    assert declared == FLOORS


@pytest.mark.parametrize(("installed", "floor", "older"), [
    ("1.6.1", "1.9", True), ("1.9", "1.9", False), ("1.9.0", "1.9", False), ("1.10.0", "1.9", False),
    ("0.32.1", "0.32.2", True), ("0.32.4", "0.32", False), ("0.33.0.dev20260101", "0.32.2", False),
    ("2.0rc1", "1.9", False),
])
def test_is_older(installed: str, floor: str, older: bool) -> None:
    assert is_older(installed, floor) is older


def fake_distribution(where: Path, name: str, version: str) -> None:
    info = where / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_this_environment_passes() -> None:
    assert too_old() == []


def test_an_older_llguidance_is_refused_at_start(tmp_path: Path) -> None:
    """As a ``pip install --no-deps`` of an old wheel leaves it: the worker says so in one
    line and exits with the code a supervisor does not retry, before loading anything."""
    fake_distribution(tmp_path / "site", "llguidance", "1.6.1")
    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "worker", "--model", "demo", "--router", "ipc:///nonexistent"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == ExitCode.CONFIG_ERROR, done.stderr
    lines = [line for line in done.stderr.splitlines() if "llguidance" in line]
    assert len(lines) == 1 and "llguidance 1.6.1 is older than required (>= 1.9)" in lines[0], done.stderr
