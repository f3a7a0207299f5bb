"""router/__main__.py: when a worker that cannot start ends the router. Pure: no processes."""

from __future__ import annotations

import pytest

from common.config import RouterConfig
from router.__main__ import exits_on_permanent_failure


@pytest.mark.parametrize(("terminal", "num_models", "mode", "exits"), [
    (True, 1, "spawn", True),        # a newcomer's foreground run: the error, then exit
    (False, 1, "spawn", False),      # launchd, systemd, a pipe: stay up, /health says why
    (True, 2, "spawn", False),       # several models: the others still serve
    (True, 1, "external", False),    # external workers come and go on their own
])
def test_only_a_terminal_run_of_one_spawned_model_exits(terminal: bool, num_models: int, mode: str,
                                                        exits: bool) -> None:
    cfg = RouterConfig(model="demo", worker_mode=mode,
                       worker_addr="ipc:///tmp/x.sock" if mode == "external" else None)
    assert exits_on_permanent_failure(cfg, num_models, terminal) is exits
