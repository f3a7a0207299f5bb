"""`--model bench-shaped`: a random-weight llama whose decode step is slow enough to matter.

The demo model decodes a batch of 8 in a few milliseconds, so any server's fixed cost per
step dominates its tokens/s. Real models take tens of milliseconds per step; this one is
shaped so a decode step at batch 8 takes >= 20 ms on the 2-core x86_64 CPU this bench was
written on (MLX CPU backend, float32), and a server's overhead shows as it would there.

Shape, chosen by measuring candidates with BatchGenerator at batch 8 (see bench/README.md):
hidden 256, 6 layers, MLP 768, 4 heads x head_dim 64 (no GQA), float32, ~5.4 M parameters;
measured 30-36 ms per decode step at batch 8 and ~6.6 ms at batch 1. Tokenizer files are
copied from the demo model (same vocabulary), and the EOS rows of lm_head are zero, as in
the demo, so greedy decoding practically never stops early.

Built once, under a file lock, into `<cache root>/bench-shaped-v<VERSION>` with an atomic
rename (the same recipe as worker/demo.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION = 1
SEED = 20261203
SHAPE: dict[str, int] = {"hidden_size": 256, "num_hidden_layers": 6, "intermediate_size": 768,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64}
LOGIT_STD = 2.0  # as the demo: ordinary logits ~N(0, 4), EOS exactly 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
MANIFEST = "bench-manifest.json"
LOCK_TIMEOUT_S = 300.0


def ensure_shaped_model(cache_root: Path) -> Path:
    """The folder of the bench-shaped model, building it on first use."""
    from filelock import FileLock

    from worker.demo import ensure_demo_model

    folder = Path(cache_root) / f"bench-shaped-v{VERSION}"
    if (folder / MANIFEST).is_file():
        return folder
    demo = ensure_demo_model(cache_root)
    Path(cache_root).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(cache_root) / f"bench-shaped-v{VERSION}.lock"), timeout=LOCK_TIMEOUT_S):
        if (folder / MANIFEST).is_file():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".bench-shaped-v{VERSION}.tmp-", dir=cache_root))
        try:
            _build(demo, tmp)
            if folder.exists():  # half-built by an older crash: no manifest, so not trusted
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("built bench-shaped model at %s", folder)
    return folder


def _build(demo: Path, out: Path) -> None:
    demo_config = json.loads((demo / "config.json").read_text())
    config: dict[str, Any] = dict(demo_config)  # vocab, EOS ids, rope, dtype from the demo
    config.update(SHAPE)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo / name, out / name)
    _write_weights(out / "model.safetensors", config)
    step_ms = measure_decode_step_ms(out, batch=8)
    (out / MANIFEST).write_text(json.dumps({"version": VERSION, "shape": SHAPE,
                                            "decode_step_ms_batch8_at_build": step_ms}, indent=2))


def _write_weights(path: Path, config: dict[str, Any]) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    # mlx-lm's own llama gives exactly the parameter names and shapes mlx_lm.load expects.
    shapes = {n: tuple(p.shape) for n, p in tree_flatten(Model(ModelArgs.from_dict(config)).parameters())}
    eos = config["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    rng = np.random.RandomState(SEED)
    weights: dict[str, Any] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            arr = np.ones(shape, dtype=np.float32)  # RMSNorm gains
        elif name.endswith("embed_tokens.weight"):
            arr = rng.standard_normal(shape).astype(np.float32)
        else:
            std = (LOGIT_STD if name == "lm_head.weight" else 1.0) / np.sqrt(shape[1])
            arr = (rng.standard_normal(shape) * std).astype(np.float32)
        if name == "lm_head.weight":
            arr[eos_ids, :] = 0.0
        weights[name] = mx.array(arr)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def measure_decode_step_ms(folder: Path, batch: int = 8, prompt_tokens: int = 32,
                           num_steps: int = 16) -> float:
    """Median time of BatchGenerator.next() with `batch` rows decoding (prefill excluded)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model = load(str(folder))[0]
    gen = BatchGenerator(model, completion_batch_size=max(batch, 8), prefill_batch_size=batch)
    try:
        prompts = [[(7 * b + i) % 200 + 3 for i in range(prompt_tokens)] for b in range(batch)]
        gen.insert(prompts, max_tokens=[num_steps + 64] * batch)
        while len(gen._generation_batch) < batch:  # prefill until every row decodes
            gen.next()
        for _ in range(3):
            gen.next()  # warm
        times = []
        for _ in range(num_steps):
            t = time.perf_counter()
            gen.next()
            times.append(time.perf_counter() - t)
    finally:
        gen.close()
    times.sort()
    return round(times[len(times) // 2] * 1e3, 2)
