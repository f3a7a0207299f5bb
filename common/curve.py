"""CURVE keys for a tcp:// worker link: read and check key files, apply them to a socket.

A key file is ZeroMQ's certificate format (what ``zmq.auth`` reads and
``mlx-router keys generate`` writes): ``public-key = "<Z85>"``, plus ``secret-key`` in
the secret file. A secret file must be private to its owner (0600); a public key file may
be a secret file too (its public half is read). No zmq import here (``common`` stays free
of it): keys are applied through pyzmq's socket attributes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.files import require_private

__all__ = ["KeyPair", "ClientKeys", "ServerKeys", "load_server_keys", "load_client_keys",
           "read_public_key", "read_keypair", "read_authorized_keys", "format_key_file"]

Z85_KEY_CHARS = 40
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_LINE = re.compile(r'^\s*(public-key|secret-key)\s*=\s*"([^"]*)"\s*$')


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes     # Z85, 40 bytes
    secret: bytes


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a worker needs to connect: the router's public key and its own pair."""

    server_public: bytes
    own: KeyPair

    def apply(self, sock: Any) -> None:
        """Make a (pyzmq) socket a CURVE client; call before ``connect``."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.own.public
        sock.curve_secretkey = self.own.secret


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The router's pair and the worker public keys it lets in."""

    own: KeyPair
    authorized: frozenset[bytes]


def _read(path: Path, what: str) -> dict[str, bytes]:
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.__class__.__name__})") from None
    keys: dict[str, bytes] = {}
    for line in text.splitlines():
        if match := _LINE.match(line):
            if not _Z85.match(match.group(2)):
                raise ConfigError(f"{what} {path}: {match.group(1)} is not a "
                                  f"{Z85_KEY_CHARS}-character Z85 key")
            keys[match.group(1)] = match.group(2).encode()
    if "public-key" not in keys:
        raise ConfigError(f"{what} {path}: no public-key line (make one with: mlx-router keys generate)")
    return keys


def read_public_key(path: str | Path, what: str = "public key file") -> bytes:
    return _read(Path(path).expanduser(), what)["public-key"]


def read_keypair(path: str | Path, what: str = "secret key file") -> KeyPair:
    path = Path(path).expanduser()
    keys = _read(path, what)
    if "secret-key" not in keys:
        raise ConfigError(f"{what} {path} holds no secret-key (is it the public .key file?)")
    require_private(path, what)
    return KeyPair(public=keys["public-key"], secret=keys["secret-key"])


def read_authorized_keys(folder: str | Path) -> frozenset[bytes]:
    """The public keys of the workers allowed in: every ``*.key`` file in the folder."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--curve-authorized-keys {folder} is not a folder")
    # Whoever can add a file here can let a worker in: it must be ours, and ours alone to write.
    require_private(folder, "--curve-authorized-keys", others_may_read=True)
    keys = frozenset(read_public_key(p, "authorized key") for p in sorted(folder.glob("*.key")))
    if not keys:
        raise ConfigError(f"--curve-authorized-keys {folder} holds no *.key file: no worker could connect")
    return keys


def _both_or_neither(first: tuple[str, str | None], second: tuple[str, str | None]) -> bool:
    """True when both flags are given, False when neither; one alone is a ConfigError."""
    if bool(first[1]) != bool(second[1]):
        raise ConfigError(f"give both {first[0]} and {second[0]}, or neither")
    return bool(first[1])


def load_client_keys(server_key: str | None, secret_key: str | None) -> ClientKeys | None:
    """A worker's CURVE keys from its flags, or None when it has none (ipc://)."""
    if not _both_or_neither(("--curve-server-key", server_key), ("--curve-secret-key", secret_key)):
        return None
    assert server_key and secret_key
    return ClientKeys(server_public=read_public_key(server_key, "--curve-server-key"),
                      own=read_keypair(secret_key, "--curve-secret-key"))


def load_server_keys(secret_key: str | None, authorized: str | None) -> ServerKeys | None:
    """The router's CURVE keys from its flags, or None when it has none."""
    if not _both_or_neither(("--curve-secret-key", secret_key),
                            ("--curve-authorized-keys", authorized)):
        return None
    assert secret_key and authorized
    return ServerKeys(own=read_keypair(secret_key, "--curve-secret-key"),
                      authorized=read_authorized_keys(authorized))


def format_key_file(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate (mlx-headroom)",
             "#   Exchange securely, or stay protected.", "", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"
