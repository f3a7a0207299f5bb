"""Tests for common/config.py: precedence CLI > env > file > defaults, and validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.config import RouterConfig, WorkerConfig, default_config_path, load
from common.errors import ConfigError


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment whose default config path is inside tmp_path (no real user config)."""
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def load_router(argv: list[str], env: dict[str, str]) -> RouterConfig:
    return load(RouterConfig, argv, env, "mlx-router")


def load_worker(argv: list[str], env: dict[str, str]) -> WorkerConfig:
    return load(WorkerConfig, argv, env, "mlx-worker")


# -- defaults and precedence ---------------------------------------------------------


def test_router_defaults(env: dict[str, str]) -> None:
    cfg = load_router(["--model", "demo"], env)
    assert cfg == RouterConfig(model="demo")
    assert (cfg.host, cfg.port, cfg.max_queue, cfg.default_max_tokens) == ("127.0.0.1", 8080, 256, None)
    assert cfg.api_key is None and cfg.worker_mode == "spawn" and cfg.unsafe_no_admission is False


def test_worker_defaults(env: dict[str, str]) -> None:
    cfg = load_worker(["--model", "demo", "--router", "ipc:///tmp/x"], env)
    assert cfg == WorkerConfig(model="demo", router="ipc:///tmp/x")
    assert cfg.memory_limit_mb is None and cfg.oom_guard is None and cfg.incarnation is None


# (field, TOML key and value, env name and value, CLI flag and value, expected per layer)
ROUTER_CASES = [
    ("port", "port = 1001", ("MLX_ROUTER_PORT", "1002"), ["--port", "1003"], (8080, 1001, 1002, 1003)),
    ("queue_timeout_s", "queue_timeout = 1.5", ("MLX_ROUTER_QUEUE_TIMEOUT", "2.5"),
     ["--queue-timeout", "3.5"], (300.0, 1.5, 2.5, 3.5)),
    ("log_level", 'log_level = "debug"', ("MLX_ROUTER_LOG_LEVEL", "warning"),
     ["--log-level", "error"], ("info", "debug", "warning", "error")),
    ("api_key", 'api_key = "f"', ("MLX_ROUTER_API_KEY", "e"), ["--api-key", "c"],
     (None, "f", "e", "c")),
    ("memory_limit_mb", "memory_limit_mb = 100", ("MLX_ROUTER_MEMORY_LIMIT_MB", "200"),
     ["--memory-limit-mb", "300"], (None, 100, 200, 300)),
]
WORKER_CASES = [
    ("prefill_step_size", "prefill_step_size = 64", ("MLX_WORKER_PREFILL_STEP_SIZE", "128"),
     ["--prefill-step-size", "256"], (0, 64, 128, 256)),
    ("max_running_requests", "max_running_requests = 2", ("MLX_WORKER_MAX_RUNNING_REQUESTS", "3"),
     ["--max-running-requests", "4"], (None, 2, 3, 4)),
    ("oom_guard", 'oom_guard = "off"', ("MLX_WORKER_OOM_GUARD", "raise"),
     ["--oom-guard", "abort"], (None, "off", "raise", "abort")),
]


def layered(cls: type, section: str, required: list[str], case: tuple[Any, ...],
            env: dict[str, str], tmp_path: Path) -> list[Any]:
    """The field's value with defaults only, + file, + env, + CLI."""
    name, toml_line, (env_name, env_value), cli, _ = case
    path = write(tmp_path / "c.toml", f"[{section}]\n{toml_line}\n")
    runs = [
        (required, env),
        (required + ["--config", str(path)], env),
        (required + ["--config", str(path)], {**env, env_name: env_value}),
        (required + ["--config", str(path)] + cli, {**env, env_name: env_value}),
    ]
    return [getattr(load(cls, argv, e, "prog"), name) for argv, e in runs]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: c[0])
def test_router_precedence(case: tuple[Any, ...], env: dict[str, str], tmp_path: Path) -> None:
    assert layered(RouterConfig, "router", ["--model", "m"], case, env, tmp_path) == list(case[4])


@pytest.mark.parametrize("case", WORKER_CASES, ids=lambda c: c[0])
def test_worker_precedence(case: tuple[Any, ...], env: dict[str, str], tmp_path: Path) -> None:
    required = ["--model", "m", "--router", "ipc:///tmp/w.sock"]
    assert layered(WorkerConfig, "worker", required, case, env, tmp_path) == list(case[4])


def test_env_beats_file_and_cli_beats_env_for_required_fields(env: dict[str, str],
                                                              tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", '[worker]\nmodel = "file"\nrouter = "ipc://file-addr"\n')
    e = {**env, "MLX_WORKER_CONFIG": str(path), "MLX_WORKER_MODEL": "env"}
    cfg = load_worker(["--router", "ipc://cli-addr"], e)
    assert (cfg.model, cfg.router) == ("env", "ipc://cli-addr")


def test_bool_flag_from_every_layer(env: dict[str, str], tmp_path: Path) -> None:
    assert load_router(["--model", "m"], env).unsafe_no_admission is False
    path = write(tmp_path / "c.toml", "[router]\nunsafe_no_admission = true\n")
    assert load_router(["--model", "m", "--config", str(path)], env).unsafe_no_admission is True
    assert load_router(["--model", "m"], {**env, "MLX_ROUTER_UNSAFE_NO_ADMISSION": "1"}).unsafe_no_admission
    assert load_router(["--model", "m", "--unsafe-no-admission"], env).unsafe_no_admission is True
    path = write(tmp_path / "c.toml", "[router]\nunsafe_no_admission = true\n")
    e = {**env, "MLX_ROUTER_UNSAFE_NO_ADMISSION": "off"}
    assert load_router(["--model", "m", "--config", str(path)], e).unsafe_no_admission is False


def test_repeatable_worker_arg(env: dict[str, str]) -> None:
    cfg = load_router(["--model", "m", "--worker-arg=--a", "--worker-arg", "b"], env)
    assert cfg.worker_arg == ("--a", "b")
    cfg = load_router(["--model", "m"], {**env, "MLX_ROUTER_WORKER_ARG": "x y"})
    assert cfg.worker_arg == ("x", "y")


def test_process_environment_is_not_read(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_ROUTER_PORT", "1234")
    monkeypatch.setenv("MLX_ROUTER_MODEL", "from-os-environ")
    cfg = load_router(["--model", "m"], env)
    assert (cfg.model, cfg.port) == (("m",), 8080)


# -- the config file -----------------------------------------------------------------


def test_default_config_path(tmp_path: Path) -> None:
    assert default_config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == \
        tmp_path / "mlx-headroom" / "config.toml"
    assert default_config_path({"HOME": str(tmp_path)}) == \
        tmp_path / ".config" / "mlx-headroom" / "config.toml"


def test_file_at_default_path_is_read(env: dict[str, str]) -> None:
    write(default_config_path(env), '[router]\nmodel = "from-default"\nport = 4242\n')
    cfg = load_router([], env)
    assert (cfg.model, cfg.port) == (("from-default",), 4242)


def test_file_at_default_path_under_home(tmp_path: Path) -> None:
    e = {"HOME": str(tmp_path)}
    write(tmp_path / ".config" / "mlx-headroom" / "config.toml", '[router]\nmodel = "h"\n')
    assert load_router([], e).model == ("h",)


def test_config_flag_overrides_default_path(env: dict[str, str], tmp_path: Path) -> None:
    write(default_config_path(env), "[router]\nport = 1\n")
    path = write(tmp_path / "other.toml", "[router]\nport = 2\n")
    assert load_router(["--model", "m", "--config", str(path)], env).port == 2


def test_config_from_env(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "e.toml", "[router]\nport = 7\n")
    assert load_router(["--model", "m"], {**env, "MLX_ROUTER_CONFIG": str(path)}).port == 7


def test_one_file_two_tables(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", '[router]\nmodel = "r"\nport = 9\n'
                 '[worker]\nmodel = "w"\nrouter = "ipc://addr"\nmax_batch_size = 3\n')
    assert load_router(["--config", str(path)], env).model == ("r",)
    cfg = load_worker(["--config", str(path)], env)
    assert (cfg.model, cfg.max_batch_size) == ("w", 3)


def test_missing_explicit_file(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="absent.toml"):
        load_router(["--model", "m", "--config", str(path)], env)


def test_missing_default_file_is_fine(env: dict[str, str]) -> None:
    assert not default_config_path(env).exists()
    assert load_router(["--model", "m"], env).port == 8080


def error_of(call: Any) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


def test_unknown_key_names_key_and_file(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[router]\nprot = 1\n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "prot" in msg and str(path) in msg


def test_field_name_is_not_a_key_when_flag_differs(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[router]\nqueue_timeout_s = 5\n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "queue_timeout_s" in msg and str(path) in msg


def test_worker_key_in_router_table_is_unknown(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[router]\nprefill_step_size = 64\n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "prefill_step_size" in msg and str(path) in msg


def test_unknown_table_names_table_and_file(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[routr]\nport = 1\n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "routr" in msg and str(path) in msg


def test_unknown_table_in_default_file(env: dict[str, str]) -> None:
    path = write(default_config_path(env), "[extra]\n")
    msg = error_of(lambda: load_router(["--model", "m"], env))
    assert "extra" in msg and str(path) in msg


def test_section_not_a_table(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "router = 5\n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "[router]" in msg and str(path) in msg


def test_toml_syntax_error_names_file(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[router\nport = \n")
    msg = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert str(path) in msg


@pytest.mark.parametrize(("line", "key"), [
    ('port = "eighty"', "port"),
    ("port = true", "port"),
    ("port = 80.5", "port"),
    ('queue_timeout = "soon"', "queue_timeout"),
    ('unsafe_no_admission = "maybe"', "unsafe_no_admission"),
    ("max_queue = [1]", "max_queue"),
])
def test_bad_file_value_names_key_and_file(line: str, key: str, env: dict[str, str],
                                           tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", f"[router]\nmodel = \"m\"\n{line}\n")
    msg = error_of(lambda: load_router(["--config", str(path)], env))
    assert key in msg and str(path) in msg


@pytest.mark.parametrize("line", ['host = ["a", "b"]', "model = { name = \"x\" }"])
def test_non_string_for_string_key_is_refused(line: str, env: dict[str, str], tmp_path: Path) -> None:
    """A TOML list or table is not a string: it must not be silently str()-ed."""
    key = line.split(" ")[0]
    body = "[router]\n" + ("" if key == "model" else 'model = "m"\n') + line + "\n"
    path = write(tmp_path / "c.toml", body)
    msg = error_of(lambda: load_router(["--config", str(path)], env))
    assert key in msg and str(path) in msg


def test_validation_applies_to_file_values(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", '[router]\nmodel = "m"\nport = 70000\n')
    assert "--port" in error_of(lambda: load_router(["--config", str(path)], env))


# -- environment ---------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_bool_env_parsing(raw: str, value: bool, env: dict[str, str]) -> None:
    cfg = load_router(["--model", "m"], {**env, "MLX_ROUTER_UNSAFE_NO_ADMISSION": raw})
    assert cfg.unsafe_no_admission is value


@pytest.mark.parametrize("raw", ["maybe", "", "2", "tru"])
def test_bad_bool_env_names_variable(raw: str, env: dict[str, str]) -> None:
    msg = error_of(lambda: load_router(["--model", "m"],
                                       {**env, "MLX_ROUTER_UNSAFE_NO_ADMISSION": raw}))
    assert "MLX_ROUTER_UNSAFE_NO_ADMISSION" in msg


@pytest.mark.parametrize(("name", "raw"), [
    ("MLX_ROUTER_PORT", "http"), ("MLX_ROUTER_PORT", "80.0"), ("MLX_ROUTER_QUEUE_TIMEOUT", "x"),
    ("MLX_ROUTER_MEMORY_LIMIT_MB", ""),
])
def test_bad_env_value_names_variable(name: str, raw: str, env: dict[str, str]) -> None:
    assert name in error_of(lambda: load_router(["--model", "m"], {**env, name: raw}))


def test_env_names_follow_the_flag(env: dict[str, str]) -> None:
    cfg = load_router(["--model", "m"], {**env, "MLX_ROUTER_DRAIN_TIMEOUT": "4",
                                         "MLX_ROUTER_DRAIN_TIMEOUT_S": "99"})
    assert cfg.drain_timeout_s == 4.0


# -- the command line ----------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["--port", "abc"], "port"),
    (["--port", "1.5"], "port"),
    (["--max-queue", "many"], "max-queue"),
    (["--queue-timeout", "soon"], "queue-timeout"),
    (["--memory-limit-mb", "lots"], "memory-limit-mb"),
])
def test_bad_cli_value_names_flag(argv: list[str], flag: str, env: dict[str, str]) -> None:
    msg = error_of(lambda: load_router(["--model", "m", *argv], env))
    assert flag in msg and argv[1] in msg


@pytest.mark.parametrize(("argv", "flag"), [
    (["--log-level", "loud"], "--log-level"),
    (["--worker-mode", "thread"], "--worker-mode"),
    (["--oom-guard", "ignore"], "--oom-guard"),
])
def test_bad_cli_choice_raises_config_error(argv: list[str], flag: str, env: dict[str, str]) -> None:
    """load() promises ConfigError on bad input; argparse's choices check exits instead."""
    msg = error_of(lambda: load_router(["--model", "m", *argv], env))
    assert flag.lstrip("-") in msg and argv[1] in msg


@pytest.mark.parametrize(("argv", "flag"), [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--queue-timeout", "0"], "--queue-timeout"),
    (["--default-max-tokens", "0"], "--default-max-tokens"),
    (["--drain-timeout", "-1"], "--drain-timeout"),
    (["--stall-timeout", "0"], "--stall-timeout"),
    (["--sse-keepalive", "0"], "--sse-keepalive"),
    (["--memory-limit-mb", "0"], "--memory-limit-mb"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--worker-mode", "external"], "--worker-mode"),
])
def test_router_validation(argv: list[str], flag: str, env: dict[str, str]) -> None:
    assert flag in error_of(lambda: load_router(["--model", "m", *argv], env))


@pytest.mark.parametrize("flag", ["--queue-timeout", "--drain-timeout", "--stall-timeout",
                                  "--sse-keepalive"])
def test_nan_timeouts_are_refused(flag: str, env: dict[str, str]) -> None:
    """NaN compares false with everything, so a NaN deadline would never expire."""
    assert flag in error_of(lambda: load_router(["--model", "m", flag, "nan"], env))


def test_external_mode_with_addr(env: dict[str, str]) -> None:
    cfg = load_router(["--model", "m", "--worker-mode", "external", "--worker-addr",
                       "tcp://*:5555", "--curve-secret-key", "k", "--curve-authorized-keys", "d"], env)
    assert (cfg.worker_mode, cfg.worker_addr) == ("external", "tcp://*:5555")


def test_tcp_needs_curve_on_both_sides(env: dict[str, str]) -> None:
    message = error_of(lambda: load_router(["--model", "m", "--worker-addr", "tcp://*:5555"], env))
    assert "CURVE" in message and "--curve-secret-key" in message
    message = error_of(lambda: load_worker(["--model", "m", "--router", "tcp://h:5555"], env))
    assert "CURVE" in message and "--curve-server-key" in message


@pytest.mark.parametrize("flag, value", [
    ("--max-messages", "0"), ("--max-tools", "-1"), ("--max-schema-bytes", "0"),
    ("--max-header-bytes", "0"), ("--stream-buffer-bytes", "0"), ("--max-prompt-tokens", "0"),
    ("--max-tokens-limit", "-5"), ("--request-timeout", "nan"), ("--idle-timeout", "0"),
    ("--slow-reader-timeout", "-1"), ("--api-key", " ")])
def test_limits_must_be_positive(flag: str, value: str, env: dict[str, str]) -> None:
    assert flag in error_of(lambda: load_router(["--model", "m", flag, value], env))


def test_model_is_required(env: dict[str, str]) -> None:
    assert "--model" in error_of(lambda: load_router([], env))
    assert "--model" in error_of(lambda: load_worker(["--router", "ipc://a"], env))


@pytest.mark.parametrize(("argv", "flag"), [
    (["--model", "m"], "--router"),
    (["--model", "m", "--router", "ipc://a", "--prefill-step-size", "8"], "--prefill-step-size"),
    (["--model", "m", "--router", "ipc://a", "--max-batch-size", "0"], "--max-batch-size"),
    (["--model", "m", "--router", "ipc://a", "--memory-limit-mb", "-5"], "--memory-limit-mb"),
])
def test_worker_validation(argv: list[str], flag: str, env: dict[str, str]) -> None:
    assert flag in error_of(lambda: load_worker(argv, env))


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match="--port"):
        RouterConfig(model="m", port=65536)
    with pytest.raises(ConfigError, match="--log-level"):
        WorkerConfig(model="m", router="ipc://a", log_level="verbose")


# -- frozen --------------------------------------------------------------------------


def test_router_config_is_frozen(env: dict[str, str]) -> None:
    cfg = load_router(["--model", "m"], env)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_worker_config_is_frozen(env: dict[str, str]) -> None:
    cfg = load_worker(["--model", "m", "--router", "ipc://a"], env)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = "other"  # type: ignore[misc]


def test_every_field_has_help() -> None:
    for cls in (RouterConfig, WorkerConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_a_model_path_with_spaces_is_one_model_and_a_toml_list_several(env: dict[str, str],
                                                                      tmp_path: Path) -> None:
    e = dict(env, MLX_ROUTER_MODEL="/Users/me/My Models/qwen")
    assert load_router([], e).model == ("/Users/me/My Models/qwen",)
    path = write(tmp_path / "c.toml", '[router]\nmodel = ["chat=demo", "/m/b c"]\n')
    assert load_router(["--config", str(path)], env).model == ("chat=demo", "/m/b c")
    assert load_router(["--model", "a", "--model", "b=demo"], env).model == ("a", "b=demo")


def test_prompt_cache_flags_pass_through_to_the_spawned_worker() -> None:
    from router.app import worker_argv

    cfg = load(RouterConfig, ["--model", "demo", "--prompt-cache-bytes", "1000",
                              "--prompt-cache-entries", "4", "--no-prompt-cache"], {}, "mlx-router")
    argv = worker_argv(cfg, "ipc:///tmp/w")
    worker = load(WorkerConfig, argv[argv.index("--model"):], {}, "mlx-worker")
    assert (worker.prompt_cache_bytes, worker.prompt_cache_entries, worker.no_prompt_cache) == (1000, 4, True)
    assert worker.prompt_cache_disk_bytes is None and worker.prompt_cache_dir is None
    cfg = load(RouterConfig, ["--model", "demo", "--prompt-cache-disk-bytes", "0"],
               {"MLX_ROUTER_PROMPT_CACHE_DIR": "/tmp/pc"}, "mlx-router")
    argv = worker_argv(cfg, "ipc:///tmp/w")
    worker = load(WorkerConfig, argv[argv.index("--model"):], {}, "mlx-worker")
    assert (worker.prompt_cache_disk_bytes, worker.prompt_cache_dir) == (0, "/tmp/pc")
    with pytest.raises(ConfigError, match="--prompt-cache-dir"):
        load(WorkerConfig, ["--model", "demo", "--router", "ipc:///x", "--prompt-cache-dir", " "], {}, "w")
    with pytest.raises(ConfigError, match="--prompt-cache-bytes"):
        load(WorkerConfig, ["--model", "demo", "--router", "ipc:///x", "--prompt-cache-bytes", "-1"], {}, "w")


def test_models_dir_is_a_source_of_models_for_the_router(env: dict[str, str]) -> None:
    assert load_router(["--models-dir", "/srv/models"], env).models_dir == "/srv/models"
    assert "--model" in error_of(lambda: load_router([], env))


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_body_bytes_must_be_positive(value: str, env: dict[str, str]) -> None:
    assert "--max-body-bytes" in error_of(lambda: load_router(["--model", "m", "--max-body-bytes", value], env))


@pytest.mark.parametrize("addr", ["foo://bar", "ipc://" + "x" * 200])
def test_a_worker_s_router_address_is_checked_before_anything_loads(addr: str, env: dict[str, str]) -> None:
    assert "--router" in error_of(lambda: load_worker(["--model", "m", "--router", addr], env))


def test_a_runtime_dir_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    from router.ops import ipc

    (tmp_path / "f").write_text("a file where a folder should be")
    with pytest.raises(ConfigError, match="runtime dir"):
        ipc.runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path / "f")})
    with pytest.raises(ConfigError, match="--worker-addr"):
        ipc.lock_addr(f"ipc://{tmp_path}/f/r.sock")


def test_a_bad_value_from_a_file_or_the_environment_says_where_it_came_from(
        env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", "[router]\nport = 70000\n")
    message = error_of(lambda: load_router(["--model", "m", "--config", str(path)], env))
    assert "--port" in message and str(path) in message
    message = error_of(lambda: load_router(["--model", "m"], {**env, "MLX_ROUTER_LOG_LEVEL": "trace"}))
    assert "--log-level" in message and "MLX_ROUTER_LOG_LEVEL" in message
    assert "from" not in error_of(lambda: load_router(["--model", "m", "--port", "70000"], env))


@pytest.mark.parametrize("text", [None, "not json", "[]", '[["127.0.0.1:5000"]]', '{"a": 1}'])
def test_a_distributed_hostfile_is_checked_before_the_model_loads(
        text: str | None, env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    if text is not None:
        path.write_text(text)
    argv = ["--model", "m", "--router", "ipc://a", "--distributed", str(path), "--rank", "0"]
    assert "--distributed" in error_of(lambda: load_worker(argv, env))


def test_a_ring_hostfile_is_taken(env: dict[str, str], tmp_path: Path) -> None:
    path = write(tmp_path / "hosts.json", '[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    argv = ["--model", "m", "--router", "ipc://a", "--distributed", str(path), "--rank", "1"]
    assert load_worker(argv, env).rank == 1


def test_a_value_is_blamed_only_for_the_flag_its_error_starts_with(env: dict[str, str]) -> None:
    """A tcp:// --router from the command line without its secret key: the error names
    --router, which came from the command line, not the server key from the environment."""
    message = error_of(lambda: load_worker(["--model", "m", "--router", "tcp://10.0.0.2:5555"],
                                           {**env, "MLX_WORKER_CURVE_SERVER_KEY": "k"}))
    assert message.startswith("--router") and "from environment" not in message
