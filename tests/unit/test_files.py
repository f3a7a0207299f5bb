"""common/files.py: a file that holds a secret, or a folder that decides who gets in, is ours alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.files import require_private


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_file_open_to_group_or_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text("x")
    path.chmod(mode)
    with pytest.raises(ConfigError, match=f"key file {path} is readable by group or others "
                       rf"\(mode {mode:04o}\); run: chmod 600"):
        require_private(path, "key file")
    path.chmod(0o600)
    require_private(path, "key file")
    require_private(path, "key file", st=path.stat())


def test_a_folder_others_may_read_must_still_be_ours_alone_to_write(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    require_private(tmp_path, "keys", others_may_read=True)
    tmp_path.chmod(0o775)
    with pytest.raises(ConfigError, match="writable by group or others .*chmod go-w"):
        require_private(tmp_path, "keys", others_may_read=True)
    tmp_path.chmod(0o700)


def test_another_users_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    path.write_text("x")
    path.chmod(0o600)
    monkeypatch.setattr(os, "getuid", lambda: path.stat().st_uid + 1)
    with pytest.raises(ConfigError, match="belongs to another user"):
        require_private(path, "key file")
