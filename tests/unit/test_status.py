"""router/status.py: what the keyless status data may show."""

from __future__ import annotations

from router.status import _numbers, public_model_name


def test_a_model_folder_is_shown_by_its_name_only() -> None:
    assert public_model_name("/Users/me/models/Qwen3-4B-4bit/") == "Qwen3-4B-4bit"
    assert public_model_name("~/models/m") == "m"
    assert public_model_name("./m") == "m"
    assert public_model_name("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"
    assert public_model_name("demo") == "demo"


def test_a_prompt_cache_report_keeps_numbers_only() -> None:
    report = {"hits": 3, "ratio": 0.5, "dir": "/Users/me/.cache/x", "enabled": True,
              "tiers": {"ram_bytes": 10, "path": "/tmp/y"}, "keys": ["a"]}
    assert _numbers(report) == {"hits": 3, "ratio": 0.5, "tiers": {"ram_bytes": 10}}
