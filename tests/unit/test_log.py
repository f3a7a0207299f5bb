"""common/log.py: every line carries its request and process context, in both formats."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest

from common.log import about, bind_model, bind_request, current_request_id, setup_logging

log = logging.getLogger("tests.log")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_json_lines_carry_process_and_request_fields(restore_root: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("debug", "json", process="mlx-worker", context={"incarnation": 7, "model": "demo"})
    log.info("no request")
    log.debug("about one", extra=about("r1"))
    token = bind_request("r2")
    try:
        log.info("bound")
        log.info("explicit wins", extra=about("r3", incarnation=8))
    finally:
        token.var.reset(token)
    plain, one, bound, explicit = (json.loads(line) for line in lines(capsys))
    assert plain["incarnation"] == 7 and plain["model"] == "demo" and "request_id" not in plain
    assert one["request_id"] == "r1" and one["level"] == "debug"
    assert bound["request_id"] == "r2" and bound["msg"] == "bound"
    assert explicit["request_id"] == "r3" and explicit["incarnation"] == 8


def test_a_request_line_names_its_own_model_not_the_process_list(restore_root: None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "json", process="mlx-router", context={"model": "alpha,beta"})
    token = bind_request("r1")
    try:
        bind_model("beta")
        log.info("for beta")
    finally:
        token.var.reset(token)
    bind_model("ignored")  # no request bound: nothing to tag
    log.info("process line")
    log.info("queued", extra=about("r2", model="alpha"))
    beta, process, alpha = (json.loads(line) for line in lines(capsys))
    assert (beta["model"], beta["request_id"]) == ("beta", "r1")
    assert process["model"] == "alpha,beta" and "request_id" not in process
    assert (alpha["model"], alpha["request_id"]) == ("alpha", "r2")


def test_text_lines_show_the_request_before_the_message(restore_root: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("info", "text", process="mlx-router")
    log.info("plain: with a colon")
    log.info("finished: %s", "stop", extra=about("abc"))
    plain, tagged = lines(capsys)
    assert plain.endswith("INFO tests.log: plain: with a colon")
    assert tagged.endswith("INFO tests.log: [abc] finished: stop")


async def test_the_bound_request_follows_the_task_and_stays_there() -> None:
    async def serve(request_id: str) -> str | None:
        token = bind_request(request_id)
        try:
            await asyncio.sleep(0)
            return current_request_id()
        finally:
            token.var.reset(token)

    assert await asyncio.gather(serve("a"), serve("b")) == ["a", "b"]
    assert current_request_id() is None


def test_a_config_error_is_one_json_line_when_json_logs_were_asked_for() -> None:
    import json

    from common.log import config_error_line

    assert config_error_line("mlx-worker", "bad", ["--log-format", "json"], {}).startswith("{")
    assert json.loads(config_error_line("mlx-router", "bad", [], {"MLX_ROUTER_LOG_FORMAT": "json"}))["msg"] == "bad"
    assert config_error_line("mlx-worker", "bad", ["--log-format", "text"], {}) == "mlx-worker: bad"
