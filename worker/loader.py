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
    eos_token_ids: tuple[int, ...]  # what mlx-lm's TokenizerWrapper would end a row on
    path: Path
    model_id: str
    config: dict[str, Any]
    fingerprint: str
    trust_remote_code: bool = False  # what loaded it: the grammar's tokenizer is loaded alike


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
        config = json.loads((path / "config.json").read_text())
        # The worker needs of the tokenizer only its EOS ids (the router tokenizes; the
        # grammar compiler loads its own at the first grammar), and loading it took
        # longer than the weights (a 152k vocabulary: 1.6-2.3 s on the H200's host against
        # 1.2-1.4 s of weights): they are read from the folder's files where those say
        # them plainly, else taken from the tokenizer as mlx-lm loads it; either beside
        # the weights.
        from mlx_lm.utils import load_model as load_weights

        def eos_ids() -> tuple[list[int], str]:
            eos = folder_eos_token_ids(path, config)
            if eos is not None:
                return eos, "the folder's files"
            tokenizer = load_hf_tokenizer(path, trust_remote_code=trust_remote_code,
                                          eos_token_ids=config.get("eos_token_id"))
            return sorted(tokenizer.eos_token_ids), "its tokenizer"

        started = time.monotonic()
        finding = _Background(eos_ids, "eos-ids")
        try:
            loaded, _ = load_weights(path, trust_remote_code=trust_remote_code)
        finally:
            weights_s = time.monotonic() - started
            eos, source = finding.result()
    except Exception as exc:
        raise LoadError(f"mlx-lm could not load {path}: {exc}") from None
    log.info("loaded %s from %s: weights %.2f s, EOS %s from %s (%.2f s, beside the weights)", model, path,
             weights_s, eos, source, finding.seconds)
    return LoadedModel(loaded, tuple(eos), path, model, config, fingerprint(path), trust_remote_code)


def folder_eos_token_ids(path: Path, config: dict[str, Any]) -> list[int] | None:
    """The EOS ids mlx-lm's ``load`` gives a model (config.json's ``eos_token_id`` and the
    tokenizer's own ``eos_token``), read from the folder's JSON files; None wherever only
    loading the tokenizer can say (no tokenizer.json, a tokenizer with its own code, an
    EOS named nowhere or in two places that disagree, a token not in the vocabulary)."""
    ids = config.get("eos_token_id")
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)):
        return None
    try:
        tokenizer_config = _json(path / "tokenizer_config.json")
        special = _json(path / "special_tokens_map.json")
        spec = _json(path / "tokenizer.json")
    except (OSError, ValueError):
        return None
    if spec is None or tokenizer_config is None or "auto_map" in tokenizer_config:
        return None  # a tokenizer with its own code: loading it runs it (trusted) or refuses it
    if "eos_token" in tokenizer_config and not tokenizer_config["eos_token"]:
        return None  # named "none" here: whether the other file's name wins is transformers' call
    named = {_content(d.get("eos_token")) for d in (tokenizer_config, special or {}) if d.get("eos_token")}
    if len(named) != 1 or None in named:
        return None  # the tokenizer class's default, or two names: only loading it says
    token_id = _token_id(spec, named.pop())
    if token_id is None:
        return None
    return sorted({*(ids or []), token_id})


def _json(file: Path) -> Any:
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def _content(token: Any) -> str | None:
    """A special token as the tokenizer files write it: a string, or an AddedToken's dict."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _token_id(spec: dict[str, Any], token: str) -> int | None:
    """``token``'s id in a tokenizer.json: an added token's, else the model vocabulary's."""
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and type(added.get("id")) is int:
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and type(vocab.get(token)) is int:
        return int(vocab[token])
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the index
        for i, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == token:
                return i
    return None


def load_hf_tokenizer(path: Path, *, trust_remote_code: bool = False, eos_token_ids: Any = None) -> Any:
    """mlx-lm's tokenizer for the folder, for what the worker rarely needs of it (EOS ids its
    files do not say plainly, a vocabulary size its config does not give)."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path, {"trust_remote_code": trust_remote_code}, eos_token_ids=eos_token_ids)


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
