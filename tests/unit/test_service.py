"""The launchd and systemd job definitions: shape, keys and types, and the dry run."""

from __future__ import annotations

import configparser
import os
import plistlib
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import permanent_exit
from router.ops.service import (
    EXIT_TIMEOUT_S, JOBS, PERMANENT_EXIT_CODES, example_multi_spec, example_spec, label,
    launchd_plist, render, systemd_unit,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DRAIN_S = 30


@pytest.mark.parametrize("job", JOBS)
def test_deploy_files_are_current_renderings(job: str) -> None:
    spec = example_spec()
    assert (ROOT / "deploy" / "launchd" / f"{label(job)}.plist").read_bytes() == render(spec, job, "darwin")
    assert (ROOT / "deploy" / "systemd" / f"{label(job)}.service").read_bytes() == render(spec, job, "linux")


def test_multi_model_deploy_files_are_current_renderings() -> None:
    spec = example_multi_spec()
    assert spec.jobs == ("router",)
    folder = ROOT / "deploy"
    assert (folder / "launchd" / "multi-model" / f"{label('router')}.plist").read_bytes() == \
        render(spec, "router", "darwin")
    assert (folder / "systemd" / "multi-model" / f"{label('router')}.service").read_bytes() == \
        render(spec, "router", "linux")
    argv = launchd_plist(spec, "router")["ProgramArguments"]
    assert "--worker-mode" not in argv and argv.count("--model") == 2


@pytest.mark.parametrize("job", JOBS)
def test_plist_has_the_keys_launchd_needs(job: str) -> None:
    plist = plistlib.loads(render(example_spec(), job, "darwin"))
    assert plist["Label"] == f"org.mlx-headroom.{job}"
    assert isinstance(plist["ProgramArguments"], list)
    assert all(isinstance(a, str) for a in plist["ProgramArguments"])
    assert plist["ProgramArguments"][0].endswith(f"mlx-{job}")
    assert plist["RunAtLoad"] is True
    # Restart a crash (non-zero exit); permanent failures exit 0 under launchd.
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert "--service-manager" in plist["ProgramArguments"]
    assert plist["ProgramArguments"][plist["ProgramArguments"].index("--service-manager") + 1] == "launchd"
    assert isinstance(plist["ThrottleInterval"], int) and plist["ThrottleInterval"] >= 10
    assert isinstance(plist["ExitTimeOut"], int) and plist["ExitTimeOut"] > DEFAULT_DRAIN_S
    assert plist["ProcessType"] == "Interactive"
    assert plist["StandardOutPath"] != plist["StandardErrorPath"]
    assert isinstance(plist["EnvironmentVariables"], dict)
    assert all(isinstance(v, str) for v in plist["EnvironmentVariables"].values())
    assert "UserName" not in plist


def test_router_and_worker_meet_on_one_private_ipc_socket() -> None:
    spec = example_spec()
    router = launchd_plist(spec, "router")["ProgramArguments"]
    worker = launchd_plist(spec, "worker")["ProgramArguments"]
    assert router[router.index("--worker-mode") + 1] == "external"
    addr = router[router.index("--worker-addr") + 1]
    assert addr.startswith("ipc://") and len(addr) - len("ipc://") <= 103
    assert worker[worker.index("--router") + 1] == addr


def test_system_daemon_runs_as_the_user() -> None:
    plist = launchd_plist(example_spec(system=True), "worker")
    assert plist["UserName"] == "YOU"
    assert "User=YOU" in systemd_unit(example_spec(system=True), "worker")


@pytest.mark.parametrize("job", JOBS)
def test_systemd_unit_parses_and_names_the_right_command(job: str) -> None:
    unit = configparser.ConfigParser(interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(systemd_unit(example_spec(), job))
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith(f"mlx-{job}")
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"].split() == [str(c) for c in PERMANENT_EXIT_CODES]
    assert int(service["TimeoutStopSec"]) == EXIT_TIMEOUT_S > DEFAULT_DRAIN_S
    assert unit["Install"]["WantedBy"] == "default.target"


def test_launchd_turns_permanent_failures_into_exit_zero() -> None:
    assert permanent_exit(3, [], "launchd") == 0
    assert permanent_exit(3, [], "systemd") == 3
    assert permanent_exit(2, ["--service-manager", "launchd"]) == 0
    assert permanent_exit(2, ["--service-manager=launchd"]) == 0
    assert permanent_exit(2, ["--model", "x"]) == 2


@pytest.mark.parametrize("platform, manager", [("linux", "systemctl --user"), ("darwin", "launchctl")])
def test_dry_run_prints_and_writes_nothing(tmp_path: Path, platform: str, manager: str) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "USER": "tester", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "router", "service", "install", "--dry-run", "--platform", platform,
         "--model", "demo", "--port", "9123"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("# write ") == 2
    assert f"# run {manager}" in out.stdout
    assert "--worker-mode external" in out.stdout or "<string>external</string>" in out.stdout
    assert "router-9123.sock" in out.stdout
    assert not any(tmp_path.rglob("*.plist")) and not any(tmp_path.rglob("*.service"))
