"""The `--model demo` folder: cached, verified, atomic, deterministic, and loadable offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.demo import (
    DEMO_VERSION,
    ENDOFTEXT,
    IM_END,
    IM_START,
    default_cache_root,
    ensure_demo_model,
    verify,
)

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "manifest.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build shared by the read-only tests of this module."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))


def _mtimes(folder: Path) -> dict[str, int]:
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    stamps["."] = folder.stat().st_mtime_ns
    return stamps


@pytest.mark.integration
def test_default_cache_root_prefers_xdg_then_home() -> None:
    assert default_cache_root({"XDG_CACHE_HOME": "/x/cache", "HOME": "/h"}) == Path("/x/cache/mlx-headroom")
    assert default_cache_root({"HOME": "/h"}) == Path("/h/.cache/mlx-headroom")
    # An empty or relative XDG value is invalid per the spec and ignored.
    assert default_cache_root({"XDG_CACHE_HOME": "", "HOME": "/h"}) == Path("/h/.cache/mlx-headroom")
    assert default_cache_root({"XDG_CACHE_HOME": "rel", "HOME": "/h"}) == Path("/h/.cache/mlx-headroom")


@pytest.mark.integration
def test_build_layout_and_verify(demo_dir: Path) -> None:
    assert demo_dir.name == f"demo-v{DEMO_VERSION}"
    assert verify(demo_dir)
    assert {p.name for p in demo_dir.iterdir()} == EXPECTED_FILES
    manifest = json.loads((demo_dir / "manifest.json").read_text())
    assert set(manifest["files"]) == EXPECTED_FILES - {"manifest.json"}
    # No temp or trash siblings are left behind; only the folder and its lock.
    assert {p.name for p in demo_dir.parent.iterdir()} == {demo_dir.name, f"demo-v{DEMO_VERSION}.lock"}

    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 4096
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert kv_bytes_per_token == 64 * 1024

    vocab = json.loads((demo_dir / "tokenizer.json").read_text())["model"]["vocab"]
    eos = [vocab[IM_END], vocab[ENDOFTEXT]]
    assert cfg["eos_token_id"] == eos
    assert json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"] == eos
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == IM_END and tok_cfg["pad_token"] == ENDOFTEXT
    assert tok_cfg["bos_token"] is None and tok_cfg["add_bos_token"] is False


@pytest.mark.integration
def test_second_ensure_is_a_noop(demo_dir: Path) -> None:
    before = _mtimes(demo_dir)
    assert ensure_demo_model(demo_dir.parent) == demo_dir
    assert _mtimes(demo_dir) == before


@pytest.mark.integration
def test_corrupt_or_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    folder = ensure_demo_model(tmp_path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different hash
    weights.write_bytes(bytes(data))
    assert not verify(folder)
    assert ensure_demo_model(tmp_path) == folder
    assert verify(folder)

    # A folder without its manifest (e.g. a build killed before the rename
    # could not produce this, but a hand-edited cache could) is rebuilt too.
    (folder / "manifest.json").unlink()
    assert not verify(folder)
    assert ensure_demo_model(tmp_path) == folder
    assert verify(folder)

    (folder / "tokenizer.json").unlink()
    assert not verify(folder)
    assert ensure_demo_model(tmp_path) == folder
    assert verify(folder)
    assert {p.name for p in folder.iterdir()} == EXPECTED_FILES
    assert {p.name for p in tmp_path.iterdir()} == {folder.name, f"demo-v{DEMO_VERSION}.lock"}


@pytest.mark.integration
def test_build_is_deterministic(tmp_path: Path, demo_dir: Path) -> None:
    other = ensure_demo_model(tmp_path / "other")
    assert (other / "manifest.json").read_bytes() == (demo_dir / "manifest.json").read_bytes()


_CHILD = textwrap.dedent(
    """
    import logging, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s:%(message)s")
    from worker.demo import ensure_demo_model
    import mlx.core, tokenizers, filelock  # pay import costs before the barrier
    root, me, peer = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (root.parent / me).touch()
    deadline = time.monotonic() + 60
    while not (root.parent / peer).exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    print(ensure_demo_model(root))
    """
)


@pytest.mark.integration
def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Each child waits at a file barrier for the other, so both call
    # ensure_demo_model at (nearly) the same moment.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root), me, peer],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for me, peer in (("ready-a", "ready-b"), ("ready-b", "ready-a"))
    ]
    results = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in results}
    assert paths == {str(root / f"demo-v{DEMO_VERSION}")}
    builds = sum(err.count("built demo model") for _, err in results)
    assert builds == 1, [err for _, err in results]
    folder = Path(paths.pop())
    assert verify(folder)
    assert {p.name for p in root.iterdir()} == {folder.name, f"demo-v{DEMO_VERSION}.lock"}


@pytest.mark.integration
def test_mlx_lm_loads_and_greedy_generation_reaches_max_tokens(demo_dir: Path) -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    model, tokenizer = load(str(demo_dir))
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    vocab = tokenizer.get_vocab()
    assert set(tokenizer.eos_token_ids) == {vocab[IM_END], vocab[ENDOFTEXT]}

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=True
    )
    # Greedy is mlx-lm's default sampler. The EOS logits are pinned at 0
    # while the others are random, so greedy must run to max_tokens.
    last = None
    pieces = []
    for last in stream_generate(model, tokenizer, prompt, max_tokens=16):
        pieces.append(last.text)
    assert last is not None
    assert last.generation_tokens == 16
    assert last.finish_reason == "length"
    assert "".join(pieces)  # decodes to something


@pytest.mark.integration
def test_transformers_tokenizer_and_chat_template(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may wrap the ids in a BatchEncoding
        ids = ids["input_ids"]
    assert all(isinstance(i, int) for i in ids)
    vocab = tok.get_vocab()
    # Special tokens are atomic ids, never split into bytes.
    assert ids[0] == vocab[IM_START]
    assert ids.count(vocab[IM_END]) == 2
    assert tok.decode(ids) == text
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT and tok.bos_token is None
    assert IM_END not in tok.decode(ids, skip_special_tokens=True)


@pytest.mark.integration
def test_multibyte_round_trip(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    text = "café naïve 日本語 😀🚀 Straße — done. a . b"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Byte-level BPE: a multi-byte character may be split over several ids
    # whose individual decodes are not valid text, but the whole round-trips.
    assert len(ids) < len(text.encode("utf-8"))
