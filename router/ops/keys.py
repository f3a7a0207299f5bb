"""``mlx-router keys generate NAME [--dir DIR]``: a CURVE keypair for a tcp:// worker link.

Writes ``NAME.key`` (the public key, to hand out) and ``NAME.key_secret`` (stays on its
host), both 0600 in a 0700 folder, created with those modes (never widened afterwards)
and never over an existing file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import zmq

from common.config import default_config_path
from common.curve import format_key_file


def default_keys_dir(env: Mapping[str, str]) -> Path:
    return default_config_path(env).parent / "keys"


def generate(name: str, folder: Path) -> tuple[Path, Path]:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it first or choose another name")
    _write_private(secret_path, format_key_file(public, secret))
    _write_private(public_path, format_key_file(public, None))
    return public_path, secret_path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(text)


def run_command(args: Sequence[str], env: Mapping[str, str]) -> int:
    parser = argparse.ArgumentParser(prog="mlx-router keys", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="make a CURVE keypair (NAME.key, NAME.key_secret)")
    gen.add_argument("name", help="e.g. router, or worker-1")
    gen.add_argument("--dir", default=None, help=f"folder (default {default_keys_dir(env)})")
    ns = parser.parse_args(list(args))
    folder = Path(ns.dir).expanduser() if ns.dir else default_keys_dir(env)
    if not ns.name.replace("-", "").replace("_", "").isalnum():
        print(f"mlx-router keys: NAME must be letters, digits, - or _, got {ns.name!r}", file=sys.stderr)
        return 2
    try:
        public_path, secret_path = generate(ns.name, folder)
    except (OSError, zmq.ZMQError) as exc:
        print(f"mlx-router keys: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public_path}\nsecret key: {secret_path} (keep it on this host)")
    return 0
