"""router/ops/access.py: the key comparison, the Host check and CORS, as pure decisions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.config import RouterConfig
from common.errors import ConfigError
from router.ops.access import AccessPolicy, exposure_warnings, host_name, load_api_keys, read_key_file


def loopback(**kw: object) -> AccessPolicy:
    return AccessPolicy.build(kw.get("keys", ()), "127.0.0.1", kw.get("hosts", ()),  # type: ignore[arg-type]
                              kw.get("origins", ()))  # type: ignore[arg-type]


def test_no_key_lets_everyone_in() -> None:
    assert loopback().is_authorized(None, None)


@pytest.mark.parametrize("authorization, x_api_key, ok", [
    ("Bearer s3cret", None, True), ("bearer s3cret", None, True), ("Bearer  s3cret ", None, True),
    (None, "s3cret", True), (None, "other", True),  # the second key
    ("Bearer wrong", None, False), ("Bearer", None, False), ("Basic s3cret", None, False),
    (None, None, False), (None, "", False), ("Bearer s3cre", None, False),
    ("Bearer s3cret-and-more", None, False), ("Bearer wrong", "s3cret", False),
])
def test_key_from_either_header(authorization: str | None, x_api_key: str | None, ok: bool) -> None:
    policy = loopback(keys=["s3cret", "other"])
    assert policy.is_authorized(authorization, x_api_key) is ok


@pytest.mark.parametrize("host, ok", [
    ("localhost", True), ("localhost:8080", True), ("LOCALHOST:1", True), ("127.0.0.1", True),
    ("127.0.0.1:8080", True), ("[::1]", True), ("[::1]:8080", True), ("::1", True),
    ("my.box:8080", True), ("evil.example.com", False), ("evil.example.com:8080", False),
    ("127.0.0.1.evil.com", False), ("localhost.evil.com:80", False), ("", False),
    ("[::2]:80", False), ("10.0.0.1", False),
])
def test_host_check_on_loopback(host: str, ok: bool) -> None:
    assert loopback(hosts=["My.Box"]).is_host_allowed(host) is ok


def test_host_check_is_off_when_bound_elsewhere_unless_hosts_are_listed() -> None:
    assert AccessPolicy.build((), "0.0.0.0", (), ()).is_host_allowed("anything.example")
    listed = AccessPolicy.build((), "0.0.0.0", ["llm.lan"], ())
    assert listed.is_host_allowed("llm.lan:8080") and not listed.is_host_allowed("evil.example")


def test_who_may_see_a_workers_log_tail_and_paths() -> None:
    local, exposed = AccessPolicy.build((), "127.0.0.1", (), ()), AccessPolicy.build((), "0.0.0.0", (), ())
    keyed = AccessPolicy.build(["k"], "0.0.0.0", (), ())
    assert local.may_see_details(True)           # no key, this Mac only
    assert not exposed.may_see_details(True)     # no key, the whole network: never
    assert keyed.may_see_details(True) and not keyed.may_see_details(False)


def test_host_name() -> None:
    assert host_name("[::1]:80") == "[::1]" and host_name("a.b:1") == "a.b"
    assert host_name("a.b.") == "a.b"


def test_origins_exact_or_same_origin() -> None:
    policy = loopback(origins=["https://app.example.com"])
    assert policy.is_origin_allowed("https://app.example.com", "127.0.0.1:8080")
    assert policy.is_origin_allowed("https://app.example.com/", "127.0.0.1:8080")
    assert policy.is_origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080")  # same origin
    for origin in ("https://app.example.com.evil.io", "http://app.example.com", "null",
                   "https://evil.example", "http://127.0.0.1:9999"):
        assert not policy.is_origin_allowed(origin, "127.0.0.1:8080"), origin
    assert policy.cors_headers("https://app.example.com")["Access-Control-Allow-Origin"] == \
        "https://app.example.com"
    assert policy.cors_headers("https://evil.example") == {}
    assert loopback().cors_headers("https://app.example.com") == {}


def test_key_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("# the key\n\nk1\nk2  \n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_key_file(path)
    path.chmod(0o600)
    assert read_key_file(path) == ["k1", "k2"]
    cfg = RouterConfig(model="m", api_key="k0", api_key_file=str(path))
    assert load_api_keys(cfg) == ["k0", "k1", "k2"]


def test_key_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_key_file(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    os.chmod(empty, 0o600)
    with pytest.raises(ConfigError, match="no key"):
        read_key_file(empty)


def test_warning_when_exposed_without_a_key() -> None:
    open_cfg = RouterConfig(model="m", host="0.0.0.0")
    [warning] = exposure_warnings(open_cfg, AccessPolicy.build((), "0.0.0.0", (), ()))
    assert "0.0.0.0" in warning and "API key" in warning
    assert exposure_warnings(open_cfg, AccessPolicy.build(["k"], "0.0.0.0", (), ())) == []
    local = RouterConfig(model="m")
    assert exposure_warnings(local, AccessPolicy.build((), "127.0.0.1", (), ())) == []


def test_the_spawned_worker_does_not_inherit_the_api_key() -> None:
    from router.app import worker_env

    assert worker_env({"MLX_ROUTER_API_KEY": "k", "PATH": "/bin"}) == {"PATH": "/bin"}
