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


def test_a_trusted_folder_s_own_tokenizer_serves_grammars_too(cache_home: Path, tmp_path: Path) -> None:
    """With --trust-remote-code, the grammar compiler loads the folder's own tokenizer class
    as the model was loaded, and a config without a vocab_size takes the tokenizer's."""
    from worker.demo import ensure_demo_model
    from worker.shape import make_grammars

    folder = tmp_path / "own-tokenizer"
    shutil.copytree(ensure_demo_model(cache_home / "mlx-headroom"), folder)
    marker = tmp_path / "ran"
    (folder / "tokenization_own.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    spec = json.loads((folder / "tokenizer_config.json").read_text())
    spec.update(tokenizer_class="OwnTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_own.OwnTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(spec))
    config = json.loads((folder / "config.json").read_text())
    loaded = load_model(str(folder), {"XDG_CACHE_HOME": str(cache_home)}, wait_for_memory_s=0,
                        trust_remote_code=True)
    loaded.config.pop("vocab_size")  # the rarer path: only the tokenizer says the vocabulary's size
    grammars = make_grammars(loaded)
    matcher = grammars.compile('start: "yes" | "no"').result(timeout=60)
    assert not matcher.is_error() and marker.exists()
    assert grammars.vocab_size == config["vocab_size"]
