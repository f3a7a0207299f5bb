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


def test_a_pin_that_names_no_model_is_a_configuration_error(tmp_path, monkeypatch, capsys) -> None:
    """Checked with the other arguments: it once raised inside the server, a traceback and
    exit code 1, which a service manager restarts for ever."""
    from common.protocol import ExitCode
    from router.__main__ import main

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code = main(["--model", "demo", "--pin", "nope", "--port", "18931"])
    assert code == ExitCode.CONFIG_ERROR
    assert "--pin nope: no model has that alias" in capsys.readouterr().err
