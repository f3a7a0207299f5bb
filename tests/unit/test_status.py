"""router/ops/status.py: what the keyless status data may show."""

from __future__ import annotations

import pytest

from router.fleet.channel import ChannelMetrics
from router.fleet.dispatch import DispatchMetrics
from router.fleet.supervisor import SupervisorMetrics
from router.http.sse import StreamMetrics
from router.ops.curve_server import CurveMetrics
from router.ops.status import Metrics, _numbers, public_model_name


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


def test_prompt_cache_metrics_by_tier() -> None:
    from router.ops.status import PromptCacheMetrics

    cache = {
        "enabled": True, "hits": 5, "misses": 2, "cached_tokens": 900, "hits_by_kind": {"prefix": 3, "disk": 2},
        "faults": 1,
        "evictions": {"capacity": 1}, "tiers": {
            "ram": {"entries": 2, "bytes": 100},
            "disk": {"entries": 4, "bytes": 400, "hits": 2, "misses": 1, "writes": 6, "corrupt": 1,
                     "dropped": 0, "evictions": 3}}}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in PromptCacheMetrics(lambda: [cache]).collect() for s in family.samples}
    assert samples[("headroom_prompt_cache_hits_total", (("tier", "ram"),))] == 3
    assert samples[("headroom_prompt_cache_hits_total", (("tier", "disk"),))] == 2
    assert samples[("headroom_prompt_cache_misses_total", (("tier", "ram"),))] == 4  # two the disk served
    assert samples[("headroom_prompt_cache_evictions_total", (("reason", "capacity"), ("tier", "disk")))] == 3
    assert samples[("headroom_prompt_cache_corrupt_total", (("tier", "disk"),))] == 1
    assert samples[("headroom_prompt_cache_writes_total", (("tier", "disk"),))] == 6
    assert samples[("headroom_prompt_cache_bytes", (("tier", "disk"),))] == 400
    assert samples[("headroom_prompt_cache_cached_tokens_total", ())] == 900
    assert samples[("headroom_prompt_cache_faults_total", ())] == 1


def test_block_store_metrics() -> None:
    from router.ops.status import PromptCacheMetrics

    cache = {"enabled": True, "hits": 1, "misses": 0, "tiers": {
        "ram": {"entries": 2, "bytes": 100, "blocks": 5}, "disk": {"entries": 1, "bytes": 90, "blocks": 4}},
        "blocks": {"block_tokens": 256, "shared": 2, "shared_bytes": 40, "written": 4, "written_bytes": 90}}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in PromptCacheMetrics(lambda: [cache, cache]).collect() for s in family.samples}
    assert samples[("headroom_prompt_cache_blocks", (("tier", "ram"),))] == 10
    assert samples[("headroom_prompt_cache_blocks", (("tier", "disk"),))] == 8
    assert samples[("headroom_prompt_cache_shared_blocks", ())] == 4
    assert samples[("headroom_prompt_cache_shared_bytes", ())] == 80
    assert samples[("headroom_prompt_cache_written_bytes_total", (("tier", "disk"),))] == 180
    whole = {"enabled": True, "hits": 1, "tiers": {"ram": {"entries": 1, "bytes": 10}}}
    names = {f.name for f in PromptCacheMetrics(lambda: [whole]).collect()}
    assert "headroom_prompt_cache_blocks" not in names  # whole-sequence caches have no blocks


@pytest.mark.parametrize("protocol", [ChannelMetrics, DispatchMetrics, SupervisorMetrics, StreamMetrics,
                                      CurveMetrics], ids=lambda p: p.__name__)
def test_metrics_has_what_each_part_counts(protocol: type) -> None:
    metrics = Metrics()
    assert [name for name in protocol.__annotations__ if not hasattr(metrics, name)] == []


def test_a_worker_s_log_tail_is_left_out_for_callers_without_the_key() -> None:
    from router.ops.status import without_log_tail

    worker = {"pid": 7, "last_exit": {"code": 1, "reason": "exited", "stderr_tail": ["/home/me/model: x"]}}
    assert without_log_tail(worker) == {"pid": 7, "last_exit": {"code": 1, "reason": "exited"}}
    assert worker["last_exit"]["stderr_tail"]  # the description itself is not changed
    assert without_log_tail({"pid": 8, "last_exit": None}) == {"pid": 8, "last_exit": None}
