"""The service definitions run for real: their exact command lines, restarted as launchd would.

`systemctl --user` needs a user service manager (a D-Bus session and systemd as init); where
there is none, as in containers, this runs the command lines the units and plists hold,
kills the worker, restarts it the way the service manager would, and checks that the
router recovers and serves without a restart of its own.
"""

from __future__ import annotations

import plistlib
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from router.ops.service import ServiceSpec, launchd_plist, systemd_unit
from tests.conftest import free_port, wait_until
from tests.integration.conftest import Proc, isolated_env

READY_S = 90.0


def unit_argv(spec: ServiceSpec, job: str) -> list[str]:
    line = next(l for l in systemd_unit(spec, job).splitlines() if l.startswith("ExecStart="))
    return shlex.split(line[len("ExecStart="):])


def health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


# An ALIAS=PATH model: the router serves it by its alias, the worker loads the path alone.
@pytest.mark.parametrize("model", ["demo", "chat=demo"])
def test_unit_command_lines_serve_and_recover(tmp_path: Path, cache_home: Path, model: str) -> None:
    port = free_port()
    spec = ServiceSpec(model=model, host="127.0.0.1", port=port, home=tmp_path,
                       bin_dir=Path(sys.executable).parent, runtime_dir=tmp_path / "run")
    router_argv, worker_argv = unit_argv(spec, "router"), unit_argv(spec, "worker")
    # The plist holds the same command lines as the unit, but for the manager's name.
    plist_router = plistlib.loads(plistlib.dumps(launchd_plist(spec, "router")))["ProgramArguments"]
    assert plist_router[:-2] == [a for a in router_argv if a != "systemd"][:-1]
    env = {**isolated_env(cache_home, tmp_path), **{k: v for k, v in spec.environment().items()
                                                     if k not in ("HOME", "XDG_RUNTIME_DIR")}}
    url = f"http://127.0.0.1:{port}"
    router = Proc(router_argv, env, tmp_path / "router.log")
    workers = [Proc(worker_argv, env, tmp_path / "worker-1.log")]
    try:
        wait_until(lambda: health(url).get("status") == "ok", READY_S, "the router to be ready",
                   on_fail=router.log)
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
        assert ok.json()["model"] == model.split("=")[0]
        workers[0].popen.send_signal(signal.SIGABRT)  # as a Metal OOM would
        assert workers[0].popen.wait(10) == -signal.SIGABRT  # non-zero: launchd/systemd restart it
        workers.append(Proc(worker_argv, env, tmp_path / "worker-2.log"))
        # The restarted worker takes the dead one's place (its connection was gone), as
        # launchd or systemd restarting one external worker should look.
        wait_until(lambda: [(w.get("pid"), w.get("state")) for w in health(url).get("workers", [])]
                   == [(workers[1].pid, "ready")] and health(url).get("status") == "ok",
                   READY_S, "the restarted worker", on_fail=router.log)
        again = httpx.post(url + "/v1/completions", json={"prompt": "again", "max_tokens": 3}, timeout=60)
        assert again.status_code == 200
        assert router.popen.poll() is None
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_permanent_failure_exits_zero_under_launchd(tmp_path: Path, cache_home: Path) -> None:
    env = isolated_env(cache_home, tmp_path)
    argv = [sys.executable, "-m", "worker", "--model", str(tmp_path / "missing"), "--router",
            f"ipc://{tmp_path}/x.sock"]
    launchd = subprocess.run([*argv, "--service-manager", "launchd"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert launchd.returncode == 0, "launchd must not respawn a worker that cannot load"
    assert "failed to load" in launchd.stderr
    systemd = subprocess.run([*argv, "--service-manager", "systemd"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert systemd.returncode == 3  # RestartPreventExitStatus lists it
