"""Tests for bench/gpumodel.py: the tiktoken-ranks tokenizer conversion and a micro build.

A handful of ranks stands in for qwen.tiktoken (the real file is 151,643 ranks, converted
the same way); the build uses the tiny shape and a 300-token vocabulary, then loads the
folder with mlx_lm.load as the worker does.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from bench import gpumodel

# All 256 bytes, then merges in rank order; " the" is reachable only through "th" + "e" = "the".
MERGES = [b"th", b"he", b"the", b" t", b" the", b"ap", b"pl", b"le", b"ple", b"apple"]
ENDOFTEXT, IM_START, IM_END = 266, 267, 268  # the specials follow the ranks


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    ranks = [bytes([b]) for b in range(256)] + tokens
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    return path


@pytest.fixture(scope="module")
def ranks_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ranks(tmp_path_factory.mktemp("ranks") / "mini.tiktoken", MERGES)


def test_ranks_become_an_equal_bpe_with_specials(ranks_file: Path) -> None:
    from tokenizers import Tokenizer

    ranks = gpumodel.load_ranks(ranks_file)
    tok = Tokenizer.from_str(gpumodel.tokenizer_json(ranks, 300))
    assert tok.get_vocab_size() == 300  # every id the model can emit is a token
    assert tok.encode("the the apple").ids == [256 + MERGES.index(b"the"), 256 + MERGES.index(b" the"),
                                                ord(" "), 256 + MERGES.index(b"apple")]
    assert tok.token_to_id("<|im_end|>") == IM_END
    assert tok.encode("<|im_start|>x<|im_end|>").ids == [IM_START, ord("x"), IM_END]
    text = "Größe 😀 naïve\n\tthe"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: every string round-trips


def test_a_rank_no_merges_reach_is_refused(tmp_path: Path) -> None:
    ranks = gpumodel.load_ranks(write_ranks(tmp_path / "bad.tiktoken", [b"abc"]))  # no "ab" or "bc"
    with pytest.raises(ValueError, match="not reachable"):
        gpumodel.tokenizer_json(ranks, 300)


def test_micro_build_loads_with_zero_eos_logits(ranks_file: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load

    out = tmp_path / "model"
    manifest = gpumodel.build(out, tiny=True, ranks_path=ranks_file, vocab_size=300)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["vocab_size"] == 300 and manifest["eos_ids"] == [IM_END, ENDOFTEXT]
    model, tokenizer = load(str(out))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the apple"}], add_generation_prompt=True)
    assert prompt[:2] == [IM_START, tokenizer.encode("user")[0]]
    logits = model(mx.array([prompt]))[0, -1].astype(mx.float32)
    assert logits[IM_END].item() == 0.0 and logits[ENDOFTEXT].item() == 0.0  # EOS rows are zero
    assert mx.max(logits).item() > 1.0  # ordinary logits ~N(0, 4): greedy never picks EOS
