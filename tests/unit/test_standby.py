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
