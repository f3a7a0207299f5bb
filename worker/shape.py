"""What the worker reads off a loaded model: its shape, and the grammar compiler sized to it.

Rank 0's boot (``worker/boot.py``) and every follower of a distributed group
(``worker/distributed.py``) need the same ones; here neither of those imports the other.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from worker.grammar import GrammarCompiler
from worker.loader import LoadedModel, context_length, load_hf_tokenizer
from worker.memory import ModelShape


def model_shape(loaded: LoadedModel) -> ModelShape:
    cfg = loaded.config.get("text_config", loaded.config)
    params = tree_flatten(loaded.model.parameters())
    weights = sum(v.nbytes for _, v in params)
    heads = int(cfg.get("num_attention_heads", 1))
    hidden = int(cfg.get("hidden_size", 0))
    head_dim = int(cfg.get("head_dim") or (hidden // max(heads, 1)))
    dtype_bytes = max((v.dtype.size for _, v in params if v.dtype in (mx.float16, mx.bfloat16, mx.float32)),
                      default=2)
    return ModelShape(
        num_layers=int(cfg.get("num_hidden_layers", len(getattr(loaded.model, "layers", [])) or 1)),
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        num_heads=heads,
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
        vocab_size=int(cfg.get("vocab_size", 0)),
        dtype_bytes=dtype_bytes,
        context_length=context_length(loaded.config),
        weights_bytes=weights,
    )


def make_grammars(loaded: LoadedModel) -> GrammarCompiler:
    """Every rank of a distributed group needs the same one: a row's grammar mask decides
    its token, which every rank feeds back."""
    trust = loaded.trust_remote_code
    vocab = model_shape(loaded).vocab_size or \
        load_hf_tokenizer(loaded.path, trust_remote_code=trust).vocab_size  # a config without one
    return GrammarCompiler(str(loaded.path), vocab, list(loaded.eos_token_ids), trust_remote_code=trust)
