"""common/curve.py and router/ops/keys.py: key files written private, read back, checked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from common.curve import (
    format_key_file, load_client_keys, load_server_keys, read_authorized_keys, read_keypair,
    read_public_key,
)
from common.errors import ConfigError
from router.ops.keys import generate, run_command


def test_generate_writes_private_files_readable_by_zmq(tmp_path: Path) -> None:
    public_path, secret_path = generate("w1", tmp_path / "k")
    for path in (public_path, secret_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pair = read_keypair(secret_path)
    assert read_public_key(public_path) == pair.public == read_public_key(secret_path)
    import zmq.auth

    assert zmq.auth.load_certificate(secret_path) == (pair.public, pair.secret)
    assert zmq.curve_public(pair.secret) == pair.public
    with pytest.raises(FileExistsError):
        generate("w1", tmp_path / "k")


def test_keys_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(["generate", "router", "--dir", str(tmp_path)], {}) == 0
    assert "router.key_secret" in capsys.readouterr().out
    assert run_command(["generate", "../evil", "--dir", str(tmp_path)], {}) == 2


def test_a_secret_file_must_be_private(tmp_path: Path) -> None:
    _, secret_path = generate("r", tmp_path)
    secret_path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_keypair(secret_path)


def test_key_files_and_the_authorized_folder_must_be_ours(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, secret_path = generate("r", tmp_path / "keys")
    folder = tmp_path / "keys"
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        read_authorized_keys(folder)
    folder.chmod(0o700)
    assert read_authorized_keys(folder)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(folder).st_uid + 1)  # as another user
    with pytest.raises(ConfigError, match="belongs to another user"):
        read_keypair(secret_path)
    with pytest.raises(ConfigError, match="belongs to another user"):
        read_authorized_keys(folder)


def test_bad_key_files_are_clear_errors(tmp_path: Path) -> None:
    public, _ = zmq.curve_keypair()
    (tmp_path / "pub.key").write_text(format_key_file(public, None))
    with pytest.raises(ConfigError, match="no secret-key"):
        read_keypair(tmp_path / "pub.key")
    (tmp_path / "bad.key").write_text('public-key = "short"\n')
    with pytest.raises(ConfigError, match="Z85"):
        read_public_key(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="cannot read"):
        read_public_key(tmp_path / "missing.key")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.key"):
        read_authorized_keys(tmp_path / "empty")
    with pytest.raises(ConfigError, match="both"):
        load_client_keys("x", None)
    with pytest.raises(ConfigError, match="both"):
        load_server_keys(None, "x")
    assert load_client_keys(None, None) is None and load_server_keys(None, None) is None


def test_authorized_folder(tmp_path: Path) -> None:
    a, _ = generate("a", tmp_path / "keys")
    b, _ = generate("b", tmp_path / "keys")
    keys = read_authorized_keys(tmp_path / "keys")  # *.key only, not the secrets
    assert keys == {read_public_key(a), read_public_key(b)}


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(("MLX_ROUTER_", "MLX_WORKER_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


def test_router_refuses_tcp_without_curve_keys(clean_env: None, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from router.__main__ import main

    assert main(["--model", "demo", "--worker-addr", "tcp://127.0.0.1:5555"]) == 2
    assert "CURVE" in capsys.readouterr().err
    _, secret = generate("r", tmp_path / "loose")
    secret.chmod(0o644)
    generate("w", tmp_path / "ok")
    assert main(["--model", "demo", "--worker-addr", "tcp://127.0.0.1:5555", "--curve-secret-key",
                 str(secret), "--curve-authorized-keys", str(tmp_path / "ok")]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_worker_refuses_a_secret_key_others_can_read(clean_env: None, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from worker.__main__ import main

    public, secret = generate("w", tmp_path)
    secret.chmod(0o604)
    assert main(["--model", "demo", "--router", "tcp://127.0.0.1:5555", "--curve-server-key",
                 str(public), "--curve-secret-key", str(secret)]) == 2
    assert "chmod 600" in capsys.readouterr().err
