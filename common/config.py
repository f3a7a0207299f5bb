"""RouterConfig and WorkerConfig: one frozen dataclass per process, built once in main().

Each field's metadata carries its help text; the argparse parser, the environment name
(``MLX_ROUTER_<FLAG>`` / ``MLX_WORKER_<FLAG>``) and the TOML key (the flag with
underscores, in a ``[router]`` or ``[worker]`` table) are all derived from the fields.
Precedence: CLI > environment > config file > defaults. Nothing reads ``os.environ``
after ``load()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from common.errors import ConfigError

__all__ = ["RouterConfig", "WorkerConfig", "PromptCacheOptions", "load", "default_config_path",
           "opt", "permanent_exit", "parse_duration"]

LOG_LEVELS = ("debug", "info", "warning", "error")
# Tool-call families router/chat/tools.py parses (kept here: common never imports the router).
TOOL_PARSERS = ("auto", "none", "hermes", "qwen3_coder", "llama3_json", "mistral", "harmony")
OOM_GUARDS = ("abort", "raise", "off")
SERVICE_MANAGERS = ("none", "launchd", "systemd")


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(value: Any, what: str = "keep_alive") -> float:
    """Seconds from a duration as Ollama takes it: a number of seconds, or text such as
    ``30s``, ``5m``, ``1h``, ``1h30m``; any negative value means for ever (-1)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        negative = text.startswith("-")
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ConfigError(f"{what}: {value!r} is not a duration (e.g. 30s, 5m, 1h, "
                                  "0, -1)") from None
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
        seconds = -seconds if negative else seconds
    else:
        raise ConfigError(f"{what}: expected a duration, got {type(value).__name__}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ConfigError(f"{what}: {value!r} is not a duration")
    return -1.0 if seconds < 0 else seconds


def opt(default: Any, help: str, *, flag: str | None = None, choices: Sequence[str] = (),
        hidden: bool = False) -> Any:
    """A config field: its default, help text, and optional flag name and choices."""
    meta = {"help": help, "flag": flag, "choices": tuple(choices), "hidden": hidden}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCacheOptions:
    """The prompt cache: the worker's options, passed on by a router that spawns it."""

    prompt_cache_bytes: int | None = opt(
        None, "Most bytes of prompt KV the worker keeps in RAM for reuse (default: half the "
        "memory budget above the weights; cached bytes are always given back before a request "
        "waits).")
    prompt_cache_entries: int = opt(32, "Most prompts the worker keeps in RAM for reuse.")
    prompt_cache_disk_bytes: int | None = opt(
        None, "Most bytes of prompt KV kept on disk, under the user's cache directory (default: "
        "16 GiB, or a quarter of the free disk if less; 0 turns the disk tier off).")
    prompt_cache_dir: str | None = opt(
        None, "Where the disk tier keeps its files (default: "
        "$XDG_CACHE_HOME/mlx-headroom/prompt-cache, else ~/.cache/mlx-headroom/prompt-cache).")
    no_prompt_cache: bool = opt(False, "Turn prompt reuse off.")


# sockaddr_un.sun_path is 104 bytes on macOS, including the terminating NUL.
MAX_IPC_PATH_BYTES = 103


def check_addr(addr: str, flag: str) -> None:
    """A ZeroMQ address the router binds or a worker connects to: ipc:// (short enough for
    macOS), tcp:// or inproc://."""
    if addr.startswith("ipc://"):
        if len(addr[len("ipc://"):].encode()) > MAX_IPC_PATH_BYTES:
            raise ConfigError(f"{flag} {addr}: the socket path is longer than "
                              f"{MAX_IPC_PATH_BYTES} bytes (macOS's limit); use a shorter one")
    elif not addr.startswith(("tcp://", "inproc://")):
        raise ConfigError(f"{flag} {addr}: expected ipc://PATH or tcp://HOST:PORT")


def _check_common(cfg: Any) -> None:
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {LOG_LEVELS}, got {cfg.log_level!r}")
    if cfg.log_format not in ("text", "json"):
        raise ConfigError(f"--log-format must be text or json, got {cfg.log_format!r}")
    if cfg.memory_limit_mb is not None and cfg.memory_limit_mb <= 0:
        raise ConfigError(f"--memory-limit-mb must be > 0, got {cfg.memory_limit_mb}")
    if cfg.max_running_requests is not None and cfg.max_running_requests <= 0:
        raise ConfigError(f"--max-running-requests must be > 0, got {cfg.max_running_requests}")
    if cfg.oom_guard is not None and cfg.oom_guard not in OOM_GUARDS:
        raise ConfigError(f"--oom-guard must be one of {OOM_GUARDS}, got {cfg.oom_guard!r}")
    if cfg.service_manager not in SERVICE_MANAGERS:
        raise ConfigError(f"--service-manager must be one of {SERVICE_MANAGERS}, got {cfg.service_manager!r}")
    for name in ("prompt_cache_bytes", "prompt_cache_disk_bytes"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.prompt_cache_entries < 0:
        raise ConfigError(f"--prompt-cache-entries must be >= 0, got {cfg.prompt_cache_entries}")
    if cfg.prompt_cache_dir is not None and not cfg.prompt_cache_dir.strip():
        raise ConfigError("--prompt-cache-dir must not be empty")
    if not cfg.model and not getattr(cfg, "models_dir", None):  # the router's other source
        raise ConfigError("--model is required (a local mlx-lm model folder, a repo id, or demo)")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig(PromptCacheOptions):
    """mlx-router: the HTTP front end. Other commands: `mlx-router status` (what a running
    router says of itself), `mlx-router service install|uninstall|status` (login or system
    services), `mlx-router keys generate` (CURVE keys for tcp:// workers); each takes --help."""

    model: tuple[str, ...] = opt(
        (), "A model to serve, [ALIAS=]PATH|REPO|demo: a local mlx-lm folder, a Hugging Face "
        "repo id, or 'demo' (repeatable; requests pick one by its alias).")
    models_dir: str | None = opt(
        None, "Serve every mlx-lm model folder (config.json + *.safetensors) under this folder.")
    keep_alive: str | None = opt(
        None, "How long a model stays loaded after its last request: seconds, or 30s, 5m, 1h; "
        "-1 for ever, 0 unloads right after each request. Default: for ever with one model "
        "(started at once, as a single-model server), 5m with several (loaded on demand).")
    pin: tuple[str, ...] = opt(
        (), "A model alias that is loaded at start and never unloaded (repeatable).")
    host_memory_mb: int | None = opt(
        None, "Memory in MiB that all spawned workers may hold together; each gets a share as "
        "its limit. Default: unlimited with one model (its worker sizes itself), 75%% of RAM "
        "with several.")
    replicas: int = opt(1, "Workers spawned per loaded model (they share its requests).")
    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(8080, "Port to listen on.")
    api_key: str | None = opt(
        None, "Require this key on every route but /health, /metrics, /openapi.json and the "
        "status page ('Authorization: Bearer KEY' or 'x-api-key: KEY'); prefer "
        "MLX_ROUTER_API_KEY or --api-key-file, a flag shows in ps.")
    api_key_file: str | None = opt(
        None, "File with the API key (one key a line; # comments); must not be readable by "
        "group or others.")
    allowed_host: tuple[str, ...] = opt(
        (), "A Host name besides localhost, 127.0.0.1 and [::1] that requests may carry "
        "(repeatable); turns the Host check on when bound off loopback.")
    cors_origin: tuple[str, ...] = opt(
        (), "A browser origin allowed to call the API, exactly as sent "
        "(e.g. https://app.example.com; repeatable). Default: no cross-origin access.")
    max_prompt_tokens: int | None = opt(
        None, "Longest prompt in tokens; more gets 400 (default: the model's context).")
    max_tokens_limit: int | None = opt(
        None, "Largest max_tokens a request may ask for; more gets 400 (default: the context).")
    max_messages: int = opt(2048, "Most messages in one chat request; more gets 400.")
    max_tools: int = opt(128, "Most tools in one request; more gets 400.")
    max_schema_bytes: int = opt(
        64 * 1024, "Largest JSON schema (a tool's parameters, a response_format) in bytes.")
    max_header_bytes: int = opt(
        8190, "Longest request line or header field; more gets 400 before any handler runs.")
    request_timeout_s: float = opt(
        60.0, "Seconds a client has to send its request body; slower gets 408.",
        flag="request-timeout")
    idle_timeout_s: float = opt(
        75.0, "Seconds a connection may stay open without a complete request.",
        flag="idle-timeout")
    stream_buffer_bytes: int = opt(
        256 * 1024, "Output a stream may hold for a client that is not reading.")
    sse_keepalive_s: float = opt(
        5.0, "Seconds a stream with nothing to say waits before sending an SSE comment (a "
        "vanished client is then noticed during a long prefill or a wait in the queue).",
        flag="sse-keepalive")
    slow_reader_timeout_s: float = opt(
        30.0, "Seconds a stream's output buffer may stay full before the request is cancelled "
        "and its worker row freed.", flag="slow-reader-timeout")
    trust_remote_code: bool = opt(
        False, "Allow Python code shipped in a model folder to run (tokenizer, model class).")
    curve_secret_key: str | None = opt(
        None, "This router's CURVE secret key file (mlx-router keys generate); required for "
        "a tcp:// --worker-addr.")
    curve_authorized_keys: str | None = opt(
        None, "Folder of worker public key files (*.key) allowed to connect over tcp://.")
    max_queue: int = opt(256, "Most requests that may wait in the queue; more get 429.")
    queue_timeout_s: float = opt(
        300.0, "Seconds a request may wait in the queue before a 503.", flag="queue-timeout")
    default_max_tokens: int | None = opt(
        None, "max_tokens when a request gives none (Responses' max_output_tokens, chat and text "
        "completions' max_tokens). Default: the room left in the context after the prompt, at "
        "most what the worker's memory holds for one request; a number reserves less per request.")
    max_n: int = opt(8, "Most answers (n) one request may ask for; each is a row in the batch.")
    tool_parser: str = opt(
        "auto", "Tool-call format of the model: auto (from the chat template's markers), none, "
        "or one of " + ", ".join(TOOL_PARSERS[2:]) + ".", choices=TOOL_PARSERS)
    drain_timeout_s: float = opt(
        30.0, "On SIGTERM, seconds to let in-flight requests finish.", flag="drain-timeout")
    stall_timeout_s: float = opt(
        10.0, "Seconds a worker's step counter may stand still while it has work (or 5 times "
        "its slowest step, if more) before it is treated as wedged: killed and restarted, or "
        "marked down if external.", flag="stall-timeout")
    standby_delay_s: float = opt(
        10.0, "Seconds a spawned worker is ready before a standby process (imports done, no "
        "model) is started beside it for its next restart; 0: at once.", flag="standby-delay")
    max_body_bytes: int = opt(8 * 1024 * 1024, "Largest request body; more gets 413.")
    log_level: str = opt("info", "Log level.", choices=LOG_LEVELS)
    log_format: str = opt("text", "Log format.", choices=("text", "json"))
    worker_mode: str = opt(
        "spawn", "spawn: start and supervise a worker; external: wait for one to connect.",
        choices=("spawn", "external"))
    worker_addr: str | None = opt(
        None, "ZeroMQ address the router binds for workers (default: ipc:// in a 0700 runtime dir).")
    memory_limit_mb: int | None = opt(None, "Worker memory limit in MiB (spawned worker).")
    max_running_requests: int | None = opt(None, "Cap on requests running at once (spawned worker).")
    oom_guard: str | None = opt(
        None, "Spawned worker's OOM guard: abort|raise|off.", choices=OOM_GUARDS)
    unsafe_no_admission: bool = opt(
        False, "Turn memory admission off (tests and benchmarks only).")
    service_manager: str = opt(
        "none", "Who restarts this process: under launchd, exits that would fail again exit 0 "
        "(launchd cannot filter exit codes).", choices=SERVICE_MANAGERS)
    worker_arg: tuple[str, ...] = opt(
        (), "Extra argument passed to the spawned worker (repeatable).", hidden=True)

    def __post_init__(self) -> None:
        if isinstance(self.model, str):  # RouterConfig(model="demo"): one model
            object.__setattr__(self, "model", (self.model,) if self.model else ())
        _check_common(self)
        if self.keep_alive is not None:
            parse_duration(self.keep_alive, "--keep-alive")
        if self.host_memory_mb is not None and self.host_memory_mb <= 0:
            raise ConfigError(f"--host-memory-mb must be > 0, got {self.host_memory_mb}")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not self.queue_timeout_s > 0:  # also refuses NaN
            raise ConfigError(f"--queue-timeout must be > 0, got {self.queue_timeout_s}")
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ConfigError(f"--default-max-tokens must be > 0, got {self.default_max_tokens}")
        if self.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-parser must be one of {TOOL_PARSERS}, got {self.tool_parser!r}")
        if self.max_n < 1:
            raise ConfigError(f"--max-n must be >= 1, got {self.max_n}")
        if not self.drain_timeout_s >= 0:  # also refuses NaN
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if self.worker_mode not in ("spawn", "external"):
            raise ConfigError(f"--worker-mode must be spawn or external, got {self.worker_mode!r}")
        if self.worker_mode == "external" and not self.worker_addr:
            raise ConfigError("--worker-mode external needs --worker-addr (the address workers connect to)")
        for name in ("max_messages", "max_tools", "max_schema_bytes", "max_header_bytes",
                     "max_body_bytes", "stream_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.standby_delay_s >= 0:  # also refuses NaN
            raise ConfigError(f"--standby-delay must be >= 0, got {self.standby_delay_s}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for flag, value in (("request-timeout", self.request_timeout_s),
                            ("idle-timeout", self.idle_timeout_s),
                            ("slow-reader-timeout", self.slow_reader_timeout_s),
                            ("stall-timeout", self.stall_timeout_s),
                            ("sse-keepalive", self.sse_keepalive_s)):
            if not value > 0:  # also refuses NaN
                raise ConfigError(f"--{flag} must be > 0, got {value}")
        if (self.max_tokens_limit is not None and self.default_max_tokens is not None
                and self.default_max_tokens > self.max_tokens_limit):
            raise ConfigError(f"--default-max-tokens {self.default_max_tokens} is above "
                              f"--max-tokens-limit {self.max_tokens_limit}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if (self.worker_addr or "").startswith("tcp://") and not (
                self.curve_secret_key and self.curve_authorized_keys):
            raise ConfigError(
                f"--worker-addr {self.worker_addr}: a tcp:// worker link needs CURVE: give "
                "--curve-secret-key and --curve-authorized-keys (see: mlx-router keys generate)")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig(PromptCacheOptions):
    """mlx-worker: owns the model and the memory."""

    model: str = opt("", "Model: a local mlx-lm folder, a Hugging Face repo id, or 'demo'.")
    router: str = opt("", "ZeroMQ address of the router to connect to.")
    memory_limit_mb: int | None = opt(None, "Memory limit in MiB (caps any device).")
    max_running_requests: int | None = opt(None, "Cap on requests running at once.")
    oom_guard: str | None = opt(
        None, "abort|raise|off; default abort when not on Metal and --memory-limit-mb is set.",
        choices=OOM_GUARDS)
    unsafe_no_admission: bool = opt(
        False, "Turn memory admission off (tests and benchmarks only).")
    prefill_step_size: int = opt(
        0, "Largest prefill chunk in tokens (0: 2048 on a GPU, as mlx_lm.server; 512 on the CPU "
        "backend). Chunks are also sized by measured speed and by memory.")
    max_batch_size: int = opt(32, "Most sequences decoded together.")
    log_level: str = opt("info", "Log level.", choices=LOG_LEVELS)
    log_format: str = opt("text", "Log format.", choices=("text", "json"))
    service_manager: str = opt(
        "none", "Who restarts this process: under launchd, exits that would fail again exit 0 "
        "(launchd cannot filter exit codes).", choices=SERVICE_MANAGERS)
    trust_remote_code: bool = opt(
        False, "Allow Python code shipped in a model folder to run (tokenizer, model class).")
    curve_server_key: str | None = opt(
        None, "The router's CURVE public key file; required for a tcp:// --router.")
    curve_secret_key: str | None = opt(
        None, "This worker's CURVE secret key file (mlx-router keys generate).")
    distributed: str | None = opt(
        None, "Serve one model sharded over several processes or Macs: MLX's ring hostfile "
        "(JSON, one list of ip:port per rank), or 'launch' when started by mlx.launch. Every rank "
        "runs the same command; rank 0 speaks to the router, the others follow it. Turns the "
        "prompt cache off.")
    rank: int | None = opt(None, "This process's rank in --distributed (default: $MLX_RANK).")
    incarnation: int | None = opt(None, "Set by a spawning router.", hidden=True)
    parent_pipe: bool = opt(False, "Exit when stdin closes (spawned by a router).", hidden=True)
    test_wedge_after_steps: int | None = opt(
        None, "Test only: wedge the engine loop after N serving steps (the warm start not counted).", hidden=True)
    test_grow_scale: float | None = opt(
        None, "Test only: SIGUSR1 grows the cost model's scale by this factor.", hidden=True)

    def __post_init__(self) -> None:
        _check_common(self)
        if not self.router:
            raise ConfigError("--router is required (the router's ZeroMQ address)")
        check_addr(self.router, "--router")  # before the model loads, not after
        if self.prefill_step_size != 0 and self.prefill_step_size < 16:
            raise ConfigError(f"--prefill-step-size must be 0 (by device) or >= 16, got {self.prefill_step_size}")
        if self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.rank is not None and (self.rank < 0 or not self.distributed):
            raise ConfigError(f"--rank {self.rank} needs --distributed and must be >= 0")
        if self.distributed and self.distributed != "launch":
            _check_hostfile(self.distributed)
        if self.router.startswith("tcp://") and not (self.curve_server_key and self.curve_secret_key):
            raise ConfigError(
                f"--router {self.router}: a tcp:// link needs CURVE: give --curve-server-key "
                "(the router's public key) and --curve-secret-key (this worker's keys)")


C = TypeVar("C", RouterConfig, WorkerConfig)
_SECTION = {RouterConfig: "router", WorkerConfig: "worker"}


def default_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")) / ".config")
    return Path(base).expanduser() / "mlx-headroom" / "config.toml"


def _flag(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or f.name.replace("_", "-")


def _base_type(f: dataclasses.Field[Any], cls: type) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return tuple
    return args[0] if args else hint


def _coerce(value: Any, f: dataclasses.Field[Any], cls: type, where: str) -> Any:
    kind = _base_type(f, cls)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is tuple:
            if isinstance(value, str):
                # A model path may hold spaces: one string is one model (a TOML list, several).
                return (value,) if f.name == "model" else tuple(value.split())
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(value)
            return tuple(value)
        if kind is int and isinstance(value, float):
            raise ValueError(value)
        if kind is str and not isinstance(value, str):
            raise ValueError(value)
        if isinstance(value, bool) and kind is not bool:
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where}: bad value {value!r} for {_flag(f)} (expected {kind.__name__})"
        ) from None


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so main() owns the exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def _parser(cls: type, prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=cls.__doc__, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="TOML config file ([router] / [worker] tables).")
    # The shared options are a base class's fields, so dataclasses lists them first: --help
    # shows them last, in their own section, after the process's own (--model first).
    cache = parser.add_argument_group("prompt cache", PromptCacheOptions.__doc__)
    shared = {f.name for f in dataclasses.fields(PromptCacheOptions)}
    for f in sorted(dataclasses.fields(cls), key=lambda field_: field_.name in shared):
        kind = _base_type(f, cls)
        flag = "--" + _flag(f)
        help_text = argparse.SUPPRESS if f.metadata.get("hidden") else f.metadata["help"]
        where = cache if f.name in shared else parser
        if kind is bool:
            where.add_argument(flag, dest=f.name, action="store_true", help=help_text)
        elif kind is tuple:
            where.add_argument(flag, dest=f.name, action="append", help=help_text,
                               metavar=_flag(f).upper().replace("-", "_"))
        else:
            where.add_argument(flag, dest=f.name, type=str, help=help_text,
                               choices=f.metadata.get("choices") or None,
                               metavar=_flag(f).upper().replace("-", "_"))
    return parser


def load(cls: type[C], argv: Sequence[str], env: Mapping[str, str], prog: str) -> C:
    """Build the config from CLI > env > file > defaults. Raise ConfigError on bad input."""
    section = _SECTION[cls]
    args = vars(_parser(cls, prog).parse_args(list(argv)))
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}

    args.pop("config", None)
    config_path = explicit_config(argv, env, section)
    path = Path(config_path).expanduser() if config_path else default_config_path(env)
    if config_path or path.exists():
        values.update(_read_file(cls, path, section, explicit=bool(config_path)))

    sources = {name: f"config file {path}" for name in values}
    for name, f in fields.items():
        env_name = f"MLX_{section.upper()}_{_flag(f).upper().replace('-', '_')}"
        if env_name in env:
            values[name] = _coerce(env[env_name], f, cls, f"environment {env_name}")
            sources[name] = f"environment {env_name}"
    for name, raw in args.items():
        values[name] = _coerce(raw, fields[name], cls, "command line")
        sources.pop(name, None)
    try:
        return cls(**values)
    except ConfigError as exc:  # a range check names the flag: say where its value came from
        named = [sources[n] for n in sources if (exc.message + " ").startswith(f"--{_flag(fields[n])} ")]
        if not named:
            raise
        raise ConfigError(f"{exc.message} (from {named[0]})") from None


def _read_file(cls: type, path: Path, section: str, *, explicit: bool) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {path} does not exist") from None
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    unknown_tables = set(data) - {"router", "worker"}
    if unknown_tables:
        raise ConfigError(f"config file {path}: unknown table(s) {sorted(unknown_tables)}")
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [{section}] must be a table")
    by_key = {_flag(f).replace("-", "_"): f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        f = by_key.get(key)
        if f is None:
            raise ConfigError(f"config file {path}: unknown key {key!r} in [{section}]")
        values[f.name] = _coerce(raw, f, cls, f"config file {path} [{section}] {key}")
    return values


def _check_hostfile(path: str) -> None:
    """MLX's ring hostfile: a JSON list with one list of "ip:port" per rank (checked before
    the model loads; MLX's own error comes after, as a traceback)."""
    try:
        hosts = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--distributed {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not (isinstance(hosts, list) and len(hosts) >= 2 and all(isinstance(h, list) and h for h in hosts)):
        raise ConfigError(f"--distributed {path}: expected a JSON list of two or more ranks, "
                          'each a list of "ip:port"')


def explicit_config(argv: Sequence[str], env: Mapping[str, str], section: str) -> str | None:
    """The config file named by ``--config`` or ``MLX_<SECTION>_CONFIG`` (as ``load`` reads
    it), None for the default path: a router hands it to the workers it spawns, whose
    ``[worker]`` table is in the same file."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    known, _ = parser.parse_known_args(list(argv))
    return known.config or env.get(f"MLX_{section.upper()}_CONFIG")


def env_snapshot() -> dict[str, str]:
    """The one read of the environment, for main()."""
    return dict(os.environ)


def permanent_exit(code: int, argv: Sequence[str], service_manager: str | None = None) -> int:
    """The exit code for a failure that will repeat: 0 under launchd, so it is not respawned.

    launchd's KeepAlive can only tell success from failure; systemd filters the real code
    (RestartPreventExitStatus), and a spawning router reads it too.
    """
    manager = service_manager
    if manager is None:  # the config did not parse: look for the flag by hand
        args = list(argv)
        for i, arg in enumerate(args):
            if arg == "--service-manager" and i + 1 < len(args):
                manager = args[i + 1]
            elif arg.startswith("--service-manager="):
                manager = arg.split("=", 1)[1]
    return 0 if manager == "launchd" else code
