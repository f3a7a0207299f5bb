"""The `--model demo` model: a small random-weight llama built offline.

Tests and first-time users need a model that loads with `mlx_lm.load` like a
real checkpoint but needs no download. The recipe is deterministic from fixed
seeds, so every process (and every machine) that builds it gets the same
bytes, and the folder is cached under `<cache_root>/demo-v<DEMO_VERSION>`.

Shape: compute is cheap (hidden 64, 4 layers) but the KV cache is large per
token (16 KV heads x head_dim 128, float32 = 64 KiB/token), so memory-admission
tests can fill a budget with few tokens. The end-of-sequence rows of `lm_head`
are zero, so their logit is always exactly 0 while the others are ~N(0, 4):
greedy decoding practically never stops early, which tests rely on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Bump whenever anything below changes the built bytes: it is part of the
# folder name, so old caches are simply ignored rather than half-reused.
DEMO_VERSION: int = 3

_LOCK_TIMEOUT_S: float = 300.0
_WEIGHT_SEED: int = 20240601

# Model shape (see module docstring for why these numbers).
_HIDDEN: int = 64
_LAYERS: int = 4
_HEADS: int = 16
_KV_HEADS: int = 16
_HEAD_DIM: int = 128
_INTERMEDIATE: int = 256
_VOCAB: int = 512
_MAX_POSITIONS: int = 4096
_RMS_EPS: float = 1e-5
# Logit std for ordinary tokens; EOS logits are exactly 0, so a larger spread
# makes sampling at temperature 1 stop early less often (p(eos) ~ 2/(510*e^2)).
_LOGIT_STD: float = 2.0

ENDOFTEXT: str = "<|endoftext|>"
IM_START: str = "<|im_start|>"
IM_END: str = "<|im_end|>"
_SPECIAL_TOKENS: list[str] = [ENDOFTEXT, IM_START, IM_END]

# A Qwen-style template (Hermes <tool_call> JSON, its instructions cut short: prompts on the
# CPU test machines cost a lot per token) that takes tools, renders tool calls and
# tool results in the history, and declares <think> markers: with enable_thinking the
# generation prompt opens a thinking block, as Qwen3 and DeepSeek-R1 templates do. Without
# tools or thinking it renders exactly as the plain ChatML template of demo v2.
CHAT_TEMPLATE: str = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first and tools %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}"
    "{% if not loop.first or m['content'] %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ tc["function"]["name"] }}", "arguments": '
    '{{ tc["function"]["arguments"] | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)

_MANIFEST: str = "manifest.json"
# verify() insists on these so a manifest from a broken build cannot vouch
# for a folder that lacks a file mlx-lm or transformers needs.
_REQUIRED_FILES: frozenset[str] = frozenset(
    {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }
)


def default_cache_root(env: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/mlx-headroom`, else `$HOME/.cache/mlx-headroom`.

    Takes the environment as an argument (never reads os.environ) so callers
    and tests control it explicitly.
    """
    xdg = env.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "mlx-headroom"
    home = env.get("HOME", "")
    if not home:
        raise ValueError("cannot pick a cache directory: neither XDG_CACHE_HOME nor HOME is set")
    return Path(home) / ".cache" / "mlx-headroom"


def demo_folder(cache_root: Path) -> Path:
    return Path(cache_root) / f"demo-v{DEMO_VERSION}"


def ensure_demo_model(cache_root: Path) -> Path:
    """Return the demo model folder, building it if it is missing or corrupt.

    Safe to call from several processes at once: the build runs under a file
    lock and lands with an atomic rename, so readers only ever see either no
    folder or a complete one.
    """
    from filelock import FileLock

    cache_root = Path(cache_root)
    folder = demo_folder(cache_root)
    # Fast path without the lock: a complete folder is never modified in place.
    if verify(folder):
        return folder

    cache_root.mkdir(parents=True, exist_ok=True)
    lock_path = cache_root / f"demo-v{DEMO_VERSION}.lock"
    with FileLock(str(lock_path), timeout=_LOCK_TIMEOUT_S):
        # Another process may have finished the build while we waited.
        if verify(folder):
            return folder
        _remove_stale(cache_root, folder)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".demo-v{DEMO_VERSION}.tmp-", dir=cache_root))
        try:
            _build_into(tmp)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built demo model at %s in %.2f s", folder, time.monotonic() - started)
    if not verify(folder):
        # Would mean the recipe itself is broken; fail loudly rather than loop.
        raise RuntimeError(f"demo model at {folder} failed verification right after building")
    return folder


def verify(folder: Path) -> bool:
    """True iff `manifest.json` exists and every listed file matches its size and sha256."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / _MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("demo_version") != DEMO_VERSION or not isinstance(files, dict):
            return False
        if not _REQUIRED_FILES.issubset(files):
            return False
        for name, entry in files.items():
            path = folder / name
            # Cheap size check first so a truncated file fails without hashing.
            if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
                log.warning("demo model file %s does not match its manifest", path)
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def _remove_stale(cache_root: Path, folder: Path) -> None:
    """Clear a corrupt folder and leftovers of crashed builds (caller holds the lock)."""
    for leftover in cache_root.glob(f".demo-v{DEMO_VERSION}.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if folder.exists():
        log.warning("demo model at %s is incomplete or corrupt; rebuilding", folder)
        # Rename first so a lock-free reader never sees a half-deleted folder
        # under the real name, then delete at leisure.
        trash = Path(tempfile.mkdtemp(prefix=f".demo-v{DEMO_VERSION}.trash-", dir=cache_root))
        os.replace(folder, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    # Stable formatting so identical inputs give identical bytes.
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_into(out: Path) -> None:
    tokenizer_json, token_ids = _train_tokenizer()
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    vocab_size = len(token_ids)
    eos_ids = [token_ids[IM_END], token_ids[ENDOFTEXT]]
    pad_id = token_ids[ENDOFTEXT]

    config = _model_config(vocab_size, eos_ids)
    _write_json(out / "config.json", config)
    _write_weights(out / "model.safetensors", config, eos_ids)

    added_tokens_decoder = {
        str(token_ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in _SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "model_max_length": _MAX_POSITIONS,
            # Byte-level BPE round-trips exactly; transformers' space cleanup
            # ("a ." -> "a.") would break that.
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": None, "eos_token_id": eos_ids, "pad_token_id": pad_id},
    )

    # Manifest last: its presence means every other file is complete.
    files = {
        p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
        for p in sorted(out.iterdir())
        if p.is_file()
    }
    _write_json(out / _MANIFEST, {"demo_version": DEMO_VERSION, "files": files})


def _model_config(vocab_size: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "intermediate_size": _INTERMEDIATE,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "rms_norm_eps": _RMS_EPS,
        "vocab_size": vocab_size,
        "max_position_embeddings": _MAX_POSITIONS,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": eos_ids[-1],
    }


def _write_weights(path: Path, config: dict[str, Any], eos_ids: list[int]) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    # Instantiate mlx-lm's own llama so parameter names and shapes are exactly
    # what mlx_lm.load expects. Its random init is lazy and never evaluated.
    model = Model(ModelArgs.from_dict(config))
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}

    # numpy's legacy RandomState is bit-stable across versions and platforms,
    # unlike backend-dependent kernels; draw in sorted-name order so the
    # stream assignment never depends on dict iteration order.
    rng = np.random.RandomState(_WEIGHT_SEED)
    weights: dict[str, Any] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            # RMSNorm gains: identity, so activations stay unit-scale.
            arr = np.ones(shape, dtype=np.float32)
        elif name.endswith("embed_tokens.weight"):
            arr = rng.standard_normal(shape).astype(np.float32)
        else:
            # (out, in) Linear weights: std 1/sqrt(fan_in) keeps activations ~unit.
            std = (_LOGIT_STD if name == "lm_head.weight" else 1.0) / np.sqrt(shape[1])
            arr = (rng.standard_normal(shape) * std).astype(np.float32)
        if name == "lm_head.weight":
            arr[eos_ids, :] = 0.0
        weights[name] = mx.array(arr)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _corpus() -> Iterator[str]:
    """A few hundred deterministic lines of English plus some multi-byte text.

    Generated by index arithmetic (no RNG) so it can never drift between
    Python versions.
    """
    subjects = [
        "The cat", "A small robot", "My neighbour", "The old teacher", "Every student",
        "The river", "Our team", "A curious child", "The engineer", "This machine",
        "The barista at the café", "A naïve traveller", "The baker", "Her friend",
    ]
    verbs = [
        "reads", "builds", "watches", "carries", "writes about", "remembers",
        "cleans", "paints", "measures", "explains", "follows", "finds",
    ]
    objects = [
        "a blue notebook", "the morning news", "seven green apples", "a long letter",
        "the quiet garden", "an old map of Tokyo", "the memory budget", "a cup of coffee",
        "the last train home", "a résumé", "the jalapeño sauce", "a small wooden boat",
        "the results of the test", "a recipe for crème brûlée",
    ]
    tails = [
        "before breakfast.", "every single day.", "with great care!", "in the rain.",
        "while the sun sets.", "and then goes to sleep.", "without saying a word.",
        "because it is Monday?", "at 9:30 in the evening.", "for the 3rd time.",
        "— and smiles 😀", "as fast as a rocket 🚀", "near the station in 東京.",
    ]
    extras = [
        "日本語のテキストも少し含まれています。",
        "Привет, как дела? Всё хорошо.",
        "Ελληνικά γράμματα: α β γ δ.",
        "Straße, Größe, über, schön.",
        "Emoji: 😀 😃 🚀 🌍 ❤️ 👍",
        "def add(a, b):\n    return a + b",
        "x = [1, 2, 3]; y = {\"key\": \"value\"}",
        "The quick brown fox jumps over the lazy dog.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
        "Q: What time is it? A: It is half past noon.",
    ]
    for i in range(400):
        yield (
            f"{subjects[i % len(subjects)]} {verbs[(i * 5 + 1) % len(verbs)]} "
            f"{objects[(i * 7 + 3) % len(objects)]} {tails[(i * 11 + 2) % len(tails)]}"
        )
        if i % 8 == 0:
            yield extras[(i // 8) % len(extras)]


def _train_tokenizer() -> tuple[str, dict[str, int]]:
    """Train the byte-level BPE; returns (tokenizer.json text, full vocab incl. specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIAL_TOKENS,
        show_progress=False,
    )
    lines = list(_corpus())
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    # Register them as *special* added tokens so transformers skips them when
    # asked to and never splits them during encoding.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return tokenizer.to_str(pretty=True), vocab
