"""One config file for both processes: the router's ``--config`` reaches the workers it spawns."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.integration.conftest import Router


def test_the_worker_table_of_the_router_s_config_file_reaches_its_worker(
        fresh_router: Callable[..., Router], tmp_path: Path) -> None:
    config = tmp_path / "headroom.toml"
    config.write_text("[router]\nmax_queue = 7\n\n[worker]\nmax_batch_size = 3\n")
    router = fresh_router("--config", str(config))
    report = router.memory()["workers"][0]
    assert report["max_running_requests"] == 3, report  # the worker read [worker]
