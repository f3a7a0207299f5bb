"""worker/loader.fingerprint: what keys the calibration and the disk prompt cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from worker.loader import fingerprint


def model_folder(root: Path, name: str, seed: int) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((512, 512)).astype(np.float32)},
              str(folder / "model.safetensors"))
    return folder


def test_two_fine_tunes_of_one_shape_differ(tmp_path: Path) -> None:
    # Same config, same file names and sizes, different trained values: a disk prompt cache
    # shared between them would serve one model's KV as the other's.
    a, b = model_folder(tmp_path, "a", 1), model_folder(tmp_path, "b", 2)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert fingerprint(a) != fingerprint(b)


def test_a_copy_has_the_same_fingerprint(tmp_path: Path) -> None:
    a, again = model_folder(tmp_path, "a", 1), model_folder(tmp_path, "again", 1)
    assert fingerprint(a) == fingerprint(again)
    (again / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65}))
    assert fingerprint(a) != fingerprint(again)
