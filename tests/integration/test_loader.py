"""worker/loader.py: a model folder is data; its own Python runs only with --trust-remote-code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.loader import LoadError, load_model


def test_a_model_file_in_the_folder_does_not_run(cache_home: Path, tmp_path: Path) -> None:
    from worker.demo import ensure_demo_model

    folder = tmp_path / "evil-model"
    shutil.copytree(ensure_demo_model(cache_home / "mlx-headroom"), folder)
    marker = tmp_path / "pwned"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_file": "evil.py"}))
    with pytest.raises(LoadError, match="trust_remote_code"):
        load_model(str(folder), {"XDG_CACHE_HOME": str(cache_home)}, wait_for_memory_s=0)
    assert not marker.exists()


def test_a_config_that_is_not_json_is_a_load_error(cache_home: Path, tmp_path: Path) -> None:
    from worker.demo import ensure_demo_model

    folder = tmp_path / "broken-config"
    shutil.copytree(ensure_demo_model(cache_home / "mlx-headroom"), folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="could not load"):
        load_model(str(folder), {"XDG_CACHE_HOME": str(cache_home)}, wait_for_memory_s=0)
