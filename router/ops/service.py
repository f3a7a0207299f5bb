"""`mlx-router service install|uninstall|status`.

Two jobs, as on a production Mac: the router (`--worker-mode external`) and the worker,
which connects to it over an ipc:// socket in a runtime directory only the user can read.
With several models (``--model`` twice or more, or ``--models-dir``) there is one job: the
router, which spawns each model's worker on demand and stops it when idle (a launchd job
per model would hold every model's memory for ever).
On macOS they are launchd agents (or daemons with --system); on Linux, systemd units.
The job definitions are built here as data (plistlib / unit text); `deploy/` holds
renderings of them with placeholder values, checked against this code by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import RouterConfig
from common.errors import ConfigError
from router.fleet.models import parse_model_arg

LABEL_PREFIX = "org.mlx-headroom"
JOBS = ("router", "worker")
# launchd's minimum respawn interval; also the gap between restarts of a crashing worker.
THROTTLE_S = 10
# The stop timeout (launchd's ExitTimeOut, systemd's TimeoutStopSec) is the router's drain
# plus this, so the service manager never SIGKILLs a router that is still draining.
STOP_MARGIN_S = 15
DEFAULT_DRAIN_S: float = next(f.default for f in dataclasses.fields(RouterConfig)
                              if f.name == "drain_timeout_s")
# Worker exits that will fail again (config, load, memory, protocol): systemd must not
# restart on them. launchd cannot filter by code, so under it they exit 0 instead.
PERMANENT_EXIT_CODES = (2, 3, 4, 6)


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """Everything a rendering needs; built from the command line and the environment."""

    model: str
    host: str
    port: int
    home: Path
    bin_dir: Path
    runtime_dir: Path
    system: bool = False
    user: str = ""
    flags: list[str] = field(default_factory=list)      # extra router flags
    worker_flags: list[str] = field(default_factory=list)
    models: tuple[str, ...] = ()                         # several: the router spawns on demand
    models_dir: str | None = None

    @property
    def is_multi(self) -> bool:
        return len(self.models) > 1 or self.models_dir is not None

    @property
    def jobs(self) -> tuple[str, ...]:
        return ("router",) if self.is_multi else JOBS

    @property
    def stop_timeout_s(self) -> int:
        return math.ceil(drain_timeout_s(self.flags)) + STOP_MARGIN_S

    @property
    def addr(self) -> str:
        return f"ipc://{self.runtime_dir / f'router-{self.port}.sock'}"

    @property
    def log_dir(self) -> Path:
        return self.home / "Library" / "Logs" / "mlx-headroom"

    def argv(self, job: str, manager: str) -> list[str]:
        if job == "router" and self.is_multi:
            models = [a for m in self.models for a in ("--model", m)]
            models += ["--models-dir", self.models_dir] if self.models_dir else []
            return [str(self.bin_dir / "mlx-router"), *models, "--host", self.host, "--port",
                    str(self.port), "--worker-addr", self.addr, "--service-manager", manager,
                    *self.flags, *(f"--worker-arg={f}" for f in self.worker_flags)]
        if job == "router":
            return [str(self.bin_dir / "mlx-router"), "--model", self.model, "--host", self.host,
                    "--port", str(self.port), "--worker-mode", "external", "--worker-addr",
                    self.addr, "--service-manager", manager, *self.flags]
        # The alias is the router's name for the model; the worker loads the source alone.
        source = parse_model_arg(self.model)[1]
        return [str(self.bin_dir / "mlx-worker"), "--model", source, "--router", self.addr,
                "--service-manager", manager, *self.worker_flags]

    def environment(self) -> dict[str, str]:
        # launchd starts jobs with a bare environment: give what Python and the cache need.
        return {"PATH": f"{self.bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(self.home),
                "XDG_RUNTIME_DIR": str(self.runtime_dir.parent), "PYTHONUNBUFFERED": "1"}


def drain_timeout_s(router_flags: Sequence[str]) -> float:
    """The router's --drain-timeout among the flags its job gets (its default when absent)."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S)
    try:
        drain = p.parse_known_args(list(router_flags))[0].drain_timeout
    except argparse.ArgumentError as exc:
        raise ConfigError(f"--router-flag: {exc}") from None
    if not 0 <= drain < math.inf:  # also refuses NaN: a stop timeout must be a number
        raise ConfigError(f"--router-flag: --drain-timeout must be a finite number >= 0, "
                          f"got {drain}")
    return float(drain)


def label(job: str) -> str:
    return f"{LABEL_PREFIX}.{job}"


def launchd_plist(spec: ServiceSpec, job: str) -> dict[str, Any]:
    """A launchd job: restarted when it crashes (non-zero exit), not when it exits 0."""
    plist: dict[str, Any] = {
        "Label": label(job),
        "ProgramArguments": spec.argv(job, "launchd"),
        "EnvironmentVariables": spec.environment(),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_S,
        "ExitTimeOut": spec.stop_timeout_s,
        "ProcessType": "Interactive",
        "StandardOutPath": str(spec.log_dir / f"{job}.out.log"),
        "StandardErrorPath": str(spec.log_dir / f"{job}.err.log"),
        "WorkingDirectory": str(spec.home),
    }
    if spec.system:
        plist["UserName"] = spec.user
    return plist


def systemd_unit(spec: ServiceSpec, job: str) -> str:
    """A systemd unit: restarted on failure, except for exits that will fail again."""
    env = " ".join(f'"{k}={v}"' for k, v in sorted(spec.environment().items()))
    after = "" if job == "router" else f"After={label('router')}.service\nWants={label('router')}.service\n"
    user = f"User={spec.user}\n" if spec.system else ""
    # The router drains on SIGTERM, then stops the workers it spawned: they must not get
    # SIGTERM with it (control-group, the default); mixed SIGKILLs them only at the timeout.
    kill_mode = "KillMode=mixed\n" if job == "router" else ""
    target = "multi-user.target" if spec.system else "default.target"
    return (
        f"[Unit]\nDescription=Headroom {job} (mlx-headroom)\n{after}\n"
        f"[Service]\nType=simple\n{user}ExecStart={_quote(spec.argv(job, 'systemd'))}\n"
        f"Environment={env}\nRestart=on-failure\nRestartSec=1\n"
        f"RestartPreventExitStatus={' '.join(map(str, PERMANENT_EXIT_CODES))}\n"
        f"TimeoutStopSec={spec.stop_timeout_s}\nKillSignal=SIGTERM\n{kill_mode}\n"
        f"[Install]\nWantedBy={target}\n")


def _quote(argv: Sequence[str]) -> str:
    return " ".join(a if a and all(c.isalnum() or c in "-_./:=@" for c in a) else json.dumps(a)
                    for a in argv)


def destination(spec: ServiceSpec, job: str, platform: str) -> Path:
    if platform == "darwin":
        folder = Path("/Library/LaunchDaemons") if spec.system else spec.home / "Library" / "LaunchAgents"
        return folder / f"{label(job)}.plist"
    folder = Path("/etc/systemd/system") if spec.system else spec.home / ".config" / "systemd" / "user"
    return folder / f"{label(job)}.service"


def render(spec: ServiceSpec, job: str, platform: str) -> bytes:
    if platform == "darwin":
        return plistlib.dumps(launchd_plist(spec, job))
    return systemd_unit(spec, job).encode()


def commands(spec: ServiceSpec, verb: str, platform: str) -> list[list[str]]:
    """The service-manager commands for install / uninstall / status."""
    if platform == "darwin":
        domain = "system" if spec.system else f"gui/{os.getuid()}"
        paths = [str(destination(spec, job, platform)) for job in spec.jobs]
        if verb == "install":
            return [["launchctl", "bootstrap", domain, p] for p in paths]
        if verb == "uninstall":
            return [["launchctl", "bootout", f"{domain}/{label(job)}"] for job in JOBS]
        return [["launchctl", "print", f"{domain}/{label(job)}"] for job in JOBS]
    ctl = ["systemctl"] if spec.system else ["systemctl", "--user"]
    units = [f"{label(job)}.service" for job in (spec.jobs if verb == "install" else JOBS)]
    if verb == "install":
        return [[*ctl, "daemon-reload"], [*ctl, "enable", "--now", *units]]
    if verb == "uninstall":
        return [[*ctl, "disable", "--now", *units], [*ctl, "daemon-reload"]]
    return [[*ctl, "status", "--no-pager", *units]]


def example_spec(system: bool = False) -> ServiceSpec:
    """The placeholder values of the renderings under deploy/ (regenerated by the tests)."""
    home = Path("/Users/YOU")
    return ServiceSpec(model=str(home / "models" / "MODEL"), host="127.0.0.1", port=8080,
                       home=home, bin_dir=home / "headroom" / ".venv" / "bin",
                       runtime_dir=home / ".local" / "run" / "mlx-headroom", system=system,
                       user="YOU" if system else "")


def example_multi_spec() -> ServiceSpec:
    """The multi-model rendering under deploy/*/multi-model/ (regenerated by the tests)."""
    home = Path("/Users/YOU")
    return dataclasses.replace(
        example_spec(), model="", models=(f"chat={home}/models/CHAT", f"code={home}/models/CODE"),
        flags=["--pin", "chat", "--keep-alive", "10m", "--host-memory-mb", "24000"])


def _absolute(model: str) -> str:
    """launchd and systemd neither expand ~ nor start in this directory."""
    alias, source = parse_model_arg(model)
    if source != "demo" and (source.startswith(("~", ".", "/")) or Path(source).exists()):
        source = str(Path(source).expanduser().resolve())
    return f"{alias}={source}" if alias else source


def account(ns: argparse.Namespace, env: Mapping[str, str], euid: int) -> tuple[str, Path]:
    """Who a --system job runs as, and their home: under sudo, the user who ran it, not root."""
    home = Path(env.get("HOME", str(Path.home())))
    if not ns.system or ns.verb != "install":  # only an installed job runs as someone
        return env.get("USER", ""), home
    name = ns.user or (env.get("SUDO_USER", "") if euid == 0 else env.get("USER", ""))
    if not name or (name == "root" and not ns.user):
        raise ConfigError("--system: the jobs would run as root; run it with sudo from your "
                          "own account, or give --user NAME")
    if not ns.user and euid != 0:
        return name, home
    try:
        return name, Path(pwd.getpwnam(name).pw_dir)
    except KeyError:
        raise ConfigError(f"--user {name}: no such user") from None


def make_spec(ns: argparse.Namespace, env: Mapping[str, str]) -> ServiceSpec:
    user, home = account(ns, env, os.geteuid())
    models = tuple(_absolute(m) for m in (ns.model or ["demo"]))
    model = models[0]
    models_dir = str(Path(ns.models_dir).expanduser().resolve()) if ns.models_dir else None
    runtime = Path(ns.runtime_dir) if ns.runtime_dir else home / ".local" / "run" / "mlx-headroom"
    bin_dir = Path(ns.bin_dir) if ns.bin_dir else Path(sys.executable).parent
    return ServiceSpec(model=model, host=ns.host, port=ns.port, home=home, bin_dir=bin_dir,
                       runtime_dir=runtime, system=ns.system, user=user,
                       flags=list(ns.router_flag or []), worker_flags=list(ns.worker_flag or []),
                       models=models, models_dir=models_dir)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-router service",
                                description="Install the router and worker as login services.")
    p.add_argument("verb", choices=("install", "uninstall", "status"))
    p.add_argument("--model", action="append",
                   help="[ALIAS=]PATH|REPO|demo (repeatable; several: one router job that loads "
                   "them on demand)")
    p.add_argument("--models-dir", help="Serve every mlx-lm model folder under this folder.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--system", action="store_true",
                   help="A LaunchDaemon / system unit that serves after a reboot without a login (sudo).")
    p.add_argument("--user", help="The account --system jobs run as (default: you; under sudo, "
                   "the user who ran sudo).")
    p.add_argument("--dry-run", action="store_true", help="Print what would be written and run.")
    p.add_argument("--router-flag", action="append", help="An extra router flag (repeatable).")
    p.add_argument("--worker-flag", action="append", help="An extra worker flag (repeatable).")
    p.add_argument("--bin-dir", help="Where mlx-router and mlx-worker are (default: this Python's).")
    p.add_argument("--runtime-dir", help="The 0700 directory for the ipc socket.")
    p.add_argument("--platform", choices=("darwin", "linux"), default=sys.platform,
                   help=argparse.SUPPRESS)
    return p


def run_command(args: Sequence[str], env: Mapping[str, str]) -> int:
    ns = parser().parse_args(list(args[1:]))
    platform = "darwin" if ns.platform == "darwin" else "linux"
    try:
        spec = make_spec(ns, env)
        drain_timeout_s(spec.flags)  # a bad --drain-timeout: one line here, not a traceback
    except ConfigError as exc:
        print(f"mlx-router service: {exc.message}", file=sys.stderr)
        return 2
    if ns.verb == "install":
        for job in spec.jobs:
            path = destination(spec, job, platform)
            print(f"# write {path}\n{render(spec, job, platform).decode()}")
            if not ns.dry_run:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(render(spec, job, platform))
        if not ns.dry_run:
            make_dirs(spec, os.geteuid())
    rc = 0
    for cmd in commands(spec, ns.verb, platform):
        print("# run " + " ".join(cmd))
        if not ns.dry_run:
            rc = _run(cmd) or rc
    if ns.verb == "uninstall" and not ns.dry_run:
        for job in JOBS:
            destination(spec, job, platform).unlink(missing_ok=True)
    return rc


def make_dirs(spec: ServiceSpec, euid: int) -> None:
    """The runtime and log folders. Made by root for a --system job, they are given to its
    user: a root-owned folder in their home would stop the router binding its socket."""
    owner = pwd.getpwnam(spec.user) if spec.system and euid == 0 else None
    for path, mode in ((spec.runtime_dir, 0o700), (spec.log_dir, 0o777)):
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        for made in missing if owner else []:
            os.chown(made, owner.pw_uid, owner.pw_gid)


def _run(cmd: list[str]) -> int:
    if shutil.which(cmd[0]) is None:
        print(f"mlx-router: {cmd[0]} is not available on this machine", file=sys.stderr)
        return 1
    done = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode
