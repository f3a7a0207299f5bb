"""The launchd and systemd job definitions: shape, keys and types, and the dry run."""

from __future__ import annotations

import configparser
import dataclasses
import os
import plistlib
import pwd
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import permanent_exit
from router.ops import service
from router.ops.service import (
    JOBS, PERMANENT_EXIT_CODES, STOP_MARGIN_S, example_multi_spec, example_spec, label,
    launchd_plist, make_dirs, render, run_command, systemd_unit,
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
    assert int(service["TimeoutStopSec"]) == DEFAULT_DRAIN_S + STOP_MARGIN_S
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


def unit_section(text: str) -> configparser.SectionProxy:
    unit = configparser.ConfigParser(interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(text)
    return unit["Service"]


def dry_run(capsys: pytest.CaptureFixture[str], env: dict[str, str], *flags: str) -> tuple[int, str]:
    """`mlx-router service install --dry-run FLAGS`, in this process: (exit code, output)."""
    rc = run_command(["service", "install", "--dry-run", *flags], env)
    out = capsys.readouterr()
    return rc, out.out + out.err


def written(output: str) -> dict[str, str]:
    """What a dry run prints for each file it would write, by job."""
    files = {}
    for block in output.split("# write ")[1:]:
        path, text = block.split("\n", 1)
        files[path.rsplit(".", 2)[-2]] = text.split("# run ")[0]
    return files


def written_units(output: str) -> dict[str, configparser.SectionProxy]:
    """The [Service] section of each unit a linux dry run prints, by job."""
    return {job: unit_section(text) for job, text in written(output).items()}


def fake_user(monkeypatch: pytest.MonkeyPatch, home: Path, euid: int = 0) -> None:
    """Run as ``euid``, with one other account on the machine: alice, whose home is ``home``."""
    def getpwnam(name: str) -> pwd.struct_passwd:
        if name != "alice":
            raise KeyError(name)
        return pwd.struct_passwd(("alice", "x", 501, 20, "", str(home), "/bin/zsh"))

    monkeypatch.setattr(service.os, "geteuid", lambda: euid)
    monkeypatch.setattr(service.pwd, "getpwnam", getpwnam)


def test_worker_job_loads_the_source_of_an_aliased_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"HOME": str(tmp_path), "USER": "tester"}
    rc, out = dry_run(capsys, env, "--model", "chat=/tmp/m/tiny", "--platform", "linux")
    assert rc == 0, out
    units = written_units(out)
    router, worker = (shlex.split(units[job]["ExecStart"]) for job in JOBS)
    assert router[router.index("--model") + 1] == "chat=/tmp/m/tiny"  # requests name it chat
    assert worker[worker.index("--model") + 1] == "/tmp/m/tiny"       # the worker loads the path
    assert not any(tmp_path.iterdir())


def test_system_install_under_sudo_runs_as_the_sudo_user(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_user(monkeypatch, tmp_path / "alice")
    env = {"HOME": "/var/root", "USER": "root", "SUDO_USER": "alice"}
    rc, out = dry_run(capsys, env, "--system", "--platform", "darwin")
    assert rc == 0, out
    for text in written(out).values():
        plist = plistlib.loads(text.encode())
        assert plist["UserName"] == "alice"
        assert plist["EnvironmentVariables"]["HOME"] == plist["WorkingDirectory"] == str(tmp_path / "alice")
    rc, out = dry_run(capsys, env, "--system", "--platform", "linux")
    assert rc == 0, out
    assert {u["User"] for u in written_units(out).values()} == {"alice"}


def test_system_install_as_root_without_sudo_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_user(monkeypatch, tmp_path / "alice")
    env = {"HOME": "/var/root", "USER": "root"}
    rc, out = dry_run(capsys, env, "--system", "--platform", "linux")
    assert rc == 2
    assert out.count("\n") == 1 and "--user NAME" in out and "# write" not in out
    rc, out = dry_run(capsys, env, "--system", "--platform", "linux", "--user", "alice")
    assert rc == 0, out
    assert {u["User"] for u in written_units(out).values()} == {"alice"}
    assert dry_run(capsys, env, "--system", "--platform", "linux", "--user", "bob")[0] == 2


def test_root_gives_the_folders_it_makes_to_the_system_jobs_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "alice"
    (home / "Library").mkdir(parents=True)
    fake_user(monkeypatch, home)
    chowned: list[tuple[Path, int, int]] = []
    monkeypatch.setattr(service.os, "chown", lambda p, uid, gid: chowned.append((Path(p), uid, gid)))
    spec = dataclasses.replace(example_spec(system=True), home=home, user="alice",
                               runtime_dir=home / ".local" / "run" / "mlx-headroom")
    make_dirs(spec, euid=0)
    made = {home / ".local", home / ".local" / "run", spec.runtime_dir,
            home / "Library" / "Logs", spec.log_dir}
    assert {p for p, _, _ in chowned} == made  # what existed (home, Library) is left alone
    assert {(uid, gid) for _, uid, gid in chowned} == {(501, 20)}
    assert spec.runtime_dir.stat().st_mode & 0o777 == 0o700


def test_router_unit_stops_its_main_process_first() -> None:
    for spec in (example_spec(), example_multi_spec()):
        # SIGTERM to the router alone: it drains, then stops the workers it spawned.
        assert unit_section(systemd_unit(spec, "router"))["KillMode"] == "mixed"
    # The worker's unit holds the worker alone: the default (its whole group) is right.
    assert "KillMode" not in unit_section(systemd_unit(example_spec(), "worker"))


@pytest.mark.parametrize("flags, drain", [
    ([], DEFAULT_DRAIN_S), (["--drain-timeout=60"], 60), (["--drain-timeout", "90.5"], 91),
    (["--pin", "chat", "--drain-timeout=0"], 0)])
def test_stop_timeout_follows_the_drain_timeout(flags: list[str], drain: int) -> None:
    for spec in (dataclasses.replace(example_spec(), flags=flags),
                 dataclasses.replace(example_multi_spec(), flags=flags)):
        for job in spec.jobs:
            assert launchd_plist(spec, job)["ExitTimeOut"] == drain + STOP_MARGIN_S
            assert int(unit_section(systemd_unit(spec, job))["TimeoutStopSec"]) == drain + STOP_MARGIN_S


def test_install_reads_the_drain_timeout_from_router_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"HOME": str(tmp_path), "USER": "tester"}
    rc, out = dry_run(capsys, env, "--platform", "linux", "--router-flag=--drain-timeout=60")
    assert rc == 0, out
    assert {u["TimeoutStopSec"] for u in written_units(out).values()} == {"75"}
    for bad in ("abc", "-1", "inf"):
        rc, out = dry_run(capsys, env, "--platform", "linux", f"--router-flag=--drain-timeout={bad}")
        assert rc == 2 and out.count("\n") == 1 and "--drain-timeout" in out
