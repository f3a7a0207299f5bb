"""Tests for router/fleet/models.py: the model list from --model and --models-dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ConfigError
from router.fleet.models import build_catalog, parse_model_arg, resolve, scan_models_dir


def model_folder(path: Path, *, layers: int = 2, weights: int = 1000) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "torch_dtype": "bfloat16", "max_position_embeddings": 2048}))
    (path / "model.safetensors").write_bytes(b"\0" * weights)
    return path


@pytest.mark.parametrize(("arg", "parsed"), [
    ("demo", (None, "demo")), ("chat=demo", ("chat", "demo")),
    ("chat=/m/a=b", ("chat", "/m/a=b")), ("/m/a=b", (None, "/m/a=b")),
    ("org/repo", (None, "org/repo")), ("x=org/repo", ("x", "org/repo")),
])
def test_parse_model_arg(arg: str, parsed: tuple[str | None, str]) -> None:
    assert parse_model_arg(arg) == parsed


def test_a_folder_gives_its_figures_and_is_named_by_its_folder(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "Qwen-small")
    (spec,) = build_catalog((str(folder),), None)
    assert spec.alias == "Qwen-small" and spec.folder == folder and spec.source == str(folder)
    assert spec.weights_bytes == 1000 and spec.context_length == 2048
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head dim, bf16


def test_models_dir_finds_every_model_folder(tmp_path: Path) -> None:
    model_folder(tmp_path / "a")
    model_folder(tmp_path / "org" / "b")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "config.json").write_text("{}")  # no weights
    assert [s.alias for s in scan_models_dir(tmp_path)] == ["a", "org--b"]


def test_duplicate_aliases_and_nothing_to_serve_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="two models"):
        build_catalog(("x=demo", "x=org/repo"), None)
    with pytest.raises(ConfigError, match="no model"):
        build_catalog((), None)
    with pytest.raises(ConfigError, match="not a folder"):
        build_catalog((), str(tmp_path / "missing"))


def test_resolve_by_alias_folder_or_source_and_any_name_with_one_model(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "b")
    catalog = build_catalog(("demo", f"beta={folder}"), None)
    assert resolve(catalog, "beta").alias == "beta"  # type: ignore[union-attr]
    assert resolve(catalog, str(folder)).alias == "beta"  # type: ignore[union-attr]
    assert resolve(catalog, "b").alias == "beta"  # type: ignore[union-attr]
    assert resolve(catalog, "demo").alias == "demo"  # type: ignore[union-attr]
    assert resolve(catalog, "gpt-4o") is None
    assert resolve(build_catalog(("demo",), None), "gpt-4o").alias == "demo"  # type: ignore[union-attr]
