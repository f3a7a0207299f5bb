"""Which models exist: ``--model [ALIAS=]PATH|REPO|demo`` (repeatable) and ``--models-dir``.

Pure bookkeeping from the command line and the files of each model folder: its alias,
what the worker is told to load, and the figures the host budget needs before any worker
has loaded it (the safetensors sizes, the KV cache per token and the context from
config.json). No mlx here: the router never loads weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One servable model."""

    alias: str                        # the name requests use (and /v1/models lists)
    source: str                       # what the worker's --model gets: a folder, a repo id, demo
    folder: Path | None = None        # a local folder (its tokenizer is there before any load)
    weights_bytes: int | None = None  # the safetensors on disk
    kv_bytes_per_token: int | None = None
    context_length: int | None = None

    def names(self) -> set[str]:
        """Every name a request or a worker's hello may use for this model."""
        names = {self.alias, self.source}
        if self.folder is not None:
            names |= {str(self.folder), self.folder.name}
        return names


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def parse_model_arg(arg: str) -> tuple[str | None, str]:
    """``ALIAS=SOURCE`` or ``SOURCE`` (an alias never contains a slash)."""
    head, sep, tail = arg.partition("=")
    if sep and head and "/" not in head and tail:
        return head, tail
    return None, arg


def default_alias(source: str) -> str:
    path = Path(source).expanduser()
    if source.startswith(("/", ".", "~")) or path.is_dir():
        return path.resolve().name
    return source  # a repo id or demo, as given


def is_repo_id(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith(("/", ".", "~"))


def cached_snapshot(repo: str) -> Path | None:
    """A repo id already in the Hugging Face cache: its folder, without any network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or no hub library: learned at the first hello
        return None


def spec_for(alias: str | None, source: str) -> ModelSpec:
    """A model's spec; a folder (or a cached repo) gives its figures and tokenizer at once."""
    path = Path(source).expanduser()
    if path.is_dir():
        folder: Path | None = path.resolve()
        source = str(folder)
    else:
        folder = cached_snapshot(source) if is_repo_id(source) and not path.exists() else None
    figures = folder_figures(folder) if folder is not None else {}
    return ModelSpec(alias=alias or default_alias(source), source=source, folder=folder,
                     **figures)


def folder_figures(folder: Path) -> dict[str, Any]:
    """Weights, KV bytes per token and context from the files alone (best effort)."""
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {"weights_bytes": weights}
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    try:
        heads = int(text.get("num_attention_heads", 1))
        head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
        kv_heads = int(text.get("num_key_value_heads", heads))
        layers = int(text.get("num_hidden_layers", 0))
        dtype = DTYPE_BYTES.get(str(text.get("torch_dtype", "float16")), 2)
        kv = 2 * layers * kv_heads * head_dim * dtype or None
    except (TypeError, ValueError):
        kv = None
    context = next((int(text[k]) for k in ("max_position_embeddings", "max_sequence_length",
                                           "n_positions", "seq_length")
                    if isinstance(text.get(k), int) and text[k] > 0), None)
    return {"weights_bytes": weights, "kv_bytes_per_token": kv, "context_length": context}


def scan_models_dir(root: Path) -> list[ModelSpec]:
    """Every mlx-lm model folder (config.json and *.safetensors) under ``root``."""
    if not root.is_dir():
        raise ConfigError(f"--models-dir {root} is not a folder")
    found = sorted({p.parent for p in root.rglob("config.json") if is_model_folder(p.parent)})
    return [spec_for(str(p.relative_to(root)).replace("/", "--") if p != root else p.name, str(p))
            for p in found]


def check_pins(catalog: Sequence[ModelSpec], pins: Sequence[str]) -> None:
    """Every ``--pin`` names a model of the catalog."""
    aliases = {s.alias for s in catalog}
    for alias in pins:
        if alias not in aliases:
            raise ConfigError(f"--pin {alias}: no model has that alias")


def build_catalog(models: tuple[str, ...], models_dir: str | None) -> list[ModelSpec]:
    """The models this router serves, in order; aliases must be unique."""
    specs = [spec_for(*parse_model_arg(arg)) for arg in models]
    if models_dir:
        specs += scan_models_dir(Path(models_dir).expanduser())
    seen: set[str] = set()
    for spec in specs:
        if spec.alias in seen:
            raise ConfigError(f"two models are named {spec.alias!r}: give one an alias "
                              "(--model ALIAS=PATH)")
        seen.add(spec.alias)
    if not specs:
        raise ConfigError("no model to serve: give --model (repeatable) or --models-dir with "
                          "mlx-lm model folders in it")
    return specs


def resolve(catalog: list[ModelSpec], name: str) -> ModelSpec | None:
    """The model a request (or a worker's hello) names. With one model any name is it:
    clients hard-code model names."""
    if len(catalog) == 1:
        return catalog[0]
    for spec in catalog:
        if name == spec.alias:
            return spec
    for spec in catalog:
        if name in spec.names():
            return spec
    return None
