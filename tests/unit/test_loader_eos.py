"""The worker reads a model's EOS ids from its folder's files instead of loading the tokenizer
(worker/loader.py, ``folder_eos_token_ids``): wherever it answers, the answer is the set
mlx-lm's own ``load_tokenizer`` gives (config.json's ``eos_token_id`` and the tokenizer's
``eos_token``), checked against mlx-lm on real tokenizer folders built with ``tokenizers``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from worker.demo import default_cache_root, ensure_demo_model
from worker.loader import folder_eos_token_ids, load_model

WORDS = ["<unk>", "hello", "world", "end", "stop", "again"]
SPECIALS = ["<eos>", "<|im_end|>"]


def _added(token: str) -> dict[str, Any]:
    return {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True, "__type": "AddedToken"}


def build(folder: Path, *, eos: str | None, form: str, special_map: str, config_eos: Any) -> dict[str, Any]:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if form == "null":
        tokenizer_config["eos_token"] = None
    elif eos is not None and form != "absent":
        tokenizer_config["eos_token"] = eos if form == "string" else _added(eos)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if special_map != "none" and eos is not None:
        other = "stop" if eos != "stop" else "again"
        named = eos if special_map == "same" else other
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": named}))
    config: dict[str, Any] = {"model_type": "llama"}
    if config_eos is not None:
        config["eos_token_id"] = config_eos
    (folder / "config.json").write_text(json.dumps(config))
    return config


@settings(max_examples=60, deadline=None)
@given(eos=st.sampled_from([*SPECIALS, "end", "missing-token", None]),
       form=st.sampled_from(["string", "dict", "absent", "null"]),
       special_map=st.sampled_from(["none", "same", "other"]),
       config_eos=st.sampled_from([None, 7, [6, 7], [3]]))
def test_the_folders_eos_ids_are_mlx_lms_wherever_the_files_say_them(
        eos: str | None, form: str, special_map: str, config_eos: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = build(folder, eos=eos, form=form, special_map=special_map, config_eos=config_eos)
        fast = folder_eos_token_ids(folder, config)
        plainly_named = (eos is not None and eos != "missing-token"
                         and ((form in ("string", "dict") and special_map in ("none", "same"))
                              or (form == "absent" and special_map == "same")))
        if plainly_named:
            assert fast is not None, "the files name the EOS once: no tokenizer load is needed"
        if fast is not None:
            wrapper = load_tokenizer(folder, {}, eos_token_ids=config.get("eos_token_id"))
            assert fast == sorted(wrapper.eos_token_ids)


def test_the_demo_model_loads_with_mlx_lms_eos_ids_and_no_tokenizer() -> None:
    path = ensure_demo_model(default_cache_root(os.environ))
    config = json.loads((path / "config.json").read_text())
    fast = folder_eos_token_ids(path, config)
    assert fast == sorted(load_tokenizer(path, {}, eos_token_ids=config.get("eos_token_id")).eos_token_ids)
    loaded = load_model("demo", os.environ)
    assert list(loaded.eos_token_ids) == fast


def test_a_tokenizer_with_its_own_code_is_loaded_not_read(tmp_path: Path) -> None:
    config = build(tmp_path, eos="<eos>", form="string", special_map="none", config_eos=None)
    spec = json.loads((tmp_path / "tokenizer_config.json").read_text())
    spec["auto_map"] = {"AutoTokenizer": ["tok.MyTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(spec))
    # Loading it runs its code (trusted) or refuses the folder, as mlx-lm's load did.
    assert folder_eos_token_ids(tmp_path, config) is None


def test_where_the_files_disagree_the_worker_loads_the_tokenizer_for_its_eos_ids(tmp_path: Path) -> None:
    """The two files name different EOS tokens: only the tokenizer says which one wins, so
    the load takes its ids from the tokenizer, as mlx-lm's load does."""
    import shutil

    folder = tmp_path / "demo-copy"
    shutil.copytree(ensure_demo_model(default_cache_root(os.environ)), folder)
    special = json.loads((folder / "special_tokens_map.json").read_text())
    special["eos_token"] = "<|endoftext|>"
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    config = json.loads((folder / "config.json").read_text())
    assert folder_eos_token_ids(folder, config) is None
    loaded = load_model(str(folder), os.environ, wait_for_memory_s=0)
    want = sorted(load_tokenizer(folder, {}, eos_token_ids=config.get("eos_token_id")).eos_token_ids)
    assert list(loaded.eos_token_ids) == want
