"""router/fleet/standby.py: which commands a standby can stand in for."""

from __future__ import annotations

from router.fleet.standby import worker_args


def test_a_worker_command_gives_its_arguments() -> None:
    assert worker_args(["/py", "-m", "worker", "--model", "demo"]) == ["--model", "demo"]
    assert worker_args(["/py", "-m", "worker"]) == []


def test_another_program_has_no_standby() -> None:
    assert worker_args(["/py", "-m", "tests.integration.faulty_worker", "grammar"]) is None
    assert worker_args(["mlx-worker", "--model", "demo"]) is None
    assert worker_args(["/py"]) is None


def _told(monkeypatch, line: bytes):
    import os
    import sys

    from worker.standby import wait_for_arguments

    r, w = os.pipe()
    os.write(w, line)
    os.close(w)
    with open(r, "rb", buffering=0) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        return wait_for_arguments()


def test_a_standby_reads_its_arguments_and_when_it_was_told(monkeypatch) -> None:
    import json
    import time

    told_at = time.time() - 3.0  # told while its imports still ran: those count
    args, at = _told(monkeypatch, json.dumps({"args": ["--model", "demo"], "told_at": told_at}).encode() + b"\n")
    assert args == ["--model", "demo"] and at == told_at
    # A clock that stepped back never makes a start begin in the future.
    _, at = _told(monkeypatch, json.dumps({"args": [], "told_at": time.time() + 60}).encode() + b"\n")
    assert at <= time.time()
    assert _told(monkeypatch, b"") is None  # the router went first


def test_a_standby_refuses_a_line_it_cannot_read(monkeypatch) -> None:
    import pytest

    for line in (b'["--model", "demo"]\n', b'{"args": [1], "told_at": 0}\n', b'{"args": []}\n'):
        with pytest.raises(SystemExit, match="expected"):
            _told(monkeypatch, line)


def test_the_worker_command_ignores_the_folder_it_is_started_in() -> None:
    """-P: a common.py in the router's working folder never shadows the worker's imports."""
    from common.config import RouterConfig
    from router.app import worker_argv

    argv = worker_argv(RouterConfig(model=("demo",)), "ipc:///tmp/x")
    assert argv[1:4] == ["-P", "-m", "worker"] and worker_args(argv)[:2] == ["--model", "demo"]  # type: ignore[index]
