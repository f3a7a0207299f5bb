"""Find and load the model: `demo` (built locally), a local folder, or a repo id."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from worker.memory import wait_for_memory

log = logging.getLogger(__name__)

# When a config names no context length, assume this (the common llama-family default).
DEFAULT_CONTEXT_LENGTH = 4096


class LoadError(RuntimeError):
    """The model could not be found or loaded. Will fail again: not worth restarting."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any            # mlx-lm's TokenizerWrapper
    path: Path
    model_id: str
    config: dict[str, Any]
    fingerprint: str


def resolve_path(model: str, env: Mapping[str, str]) -> Path:
    """demo → the cached demo folder; a folder → itself; else a repo id via mlx-lm."""
    if model == "demo":
        from worker.demo import default_cache_root, ensure_demo_model

        return ensure_demo_model(default_cache_root(env))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise LoadError(f"{path} is not an mlx-lm model folder (no config.json)")
        return path
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise LoadError(f"model path {model} does not exist")
    try:
        from mlx_lm.utils import _download

        return Path(_download(model))
    except Exception as exc:
        raise LoadError(
            f"could not fetch {model!r} (no network or no such repo?): {exc}; "
            "download it once with network access, or pass a local folder") from None


# Blocks hashed from each weight file: two fine-tunes of one architecture have the same
# config and file sizes, and must not share a calibration or, worse, a disk prompt cache
# (another model's KV would be served as this one's). Any trained difference shows in
# every block, so a few evenly spaced ones tell them apart without reading gigabytes.
FINGERPRINT_BLOCKS = 8
FINGERPRINT_BLOCK_BYTES = 64 << 10


def fingerprint(path: Path) -> str:
    """Identity of the weights: config, each weight file's name and size, its safetensors
    header, and a few blocks sampled across its content (about 0.5 MiB read per file)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            step = max(1, size // FINGERPRINT_BLOCKS)
            for offset in sorted({0, *range(0, size, step)})[:FINGERPRINT_BLOCKS + 1]:
                fh.seek(offset)
                h.update(fh.read(FINGERPRINT_BLOCK_BYTES))
    return h.hexdigest()[:16]


def weights_on_disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def load_model(model: str, env: Mapping[str, str], *, wait_for_memory_s: float = 30.0,
               trust_remote_code: bool = False) -> LoadedModel:
    """Load weights and tokenizer. A model folder is data: its own Python (a ``model_file``
    in config.json, a tokenizer class in ``auto_map``) runs only with ``trust_remote_code``."""
    path = resolve_path(model, env)
    needed = int(weights_on_disk_bytes(path) * 1.1)
    if not wait_for_memory(lambda: psutil.virtual_memory().available, needed, wait_for_memory_s):
        log.warning("only %d MiB available for %d MiB of weights after waiting %.0fs; loading anyway",
                    psutil.virtual_memory().available >> 20, needed >> 20, wait_for_memory_s)
    try:
        # mlx_lm.load's two steps, side by side: the tokenizer (1.6-2.3 s for a 152k
        # vocabulary on the H200's host, mostly transformers' Python and tokenizers' parse)
        # loads in a thread while the weights load (1.2-1.4 s there, mostly MLX's own code).
        from mlx_lm.utils import load_config, load_model as load_weights, load_tokenizer

        started = time.monotonic()
        eos = load_config(path).get("eos_token_id", None)  # what load_weights' config says
        tokenizing = _Background(lambda: load_tokenizer(path, {"trust_remote_code": trust_remote_code},
                                                        eos_token_ids=eos), "load-tokenizer")
        try:
            loaded, _ = load_weights(path, trust_remote_code=trust_remote_code)
        finally:
            weights_s = time.monotonic() - started
            tokenizer = tokenizing.result()
    except Exception as exc:
        raise LoadError(f"mlx-lm could not load {path}: {exc}") from None
    config = json.loads((path / "config.json").read_text())
    log.info("loaded %s from %s: weights %.2f s, tokenizer %.2f s (beside the weights; both in %.2f s)",
             model, path, weights_s, tokenizing.seconds, time.monotonic() - started)
    return LoadedModel(loaded, tokenizer, path, model, config, fingerprint(path))


class _Background:
    """One call in a thread of its own; ``result`` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._fn = fn
        self._out: Any = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self._out = self._fn()
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self._error = exc
        self.seconds = time.monotonic() - started

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


def context_length(config: dict[str, Any]) -> int:
    text = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(text.get(key), int) and text[key] > 0:
            return int(text[key])
    return DEFAULT_CONTEXT_LENGTH
