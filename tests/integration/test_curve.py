"""A tcp:// worker link under CURVE: peers without the right keys never reach the router's
logic nor /health; a worker with the right keys serves."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import zmq

from common.curve import read_keypair, read_public_key
from common.protocol import Hello, encode
from tests.conftest import free_port, wait_until
from tests.integration.conftest import NO_EOS, ROOT, Proc, Router, isolated_env
from tests.integration.test_stream_cancel import metric

READY_S = 90.0


def generate(folder: Path, name: str) -> None:
    subprocess.run([sys.executable, "-m", "router", "keys", "generate", name, "--dir", str(folder)],
                   check=True, cwd=ROOT, capture_output=True, timeout=60)


def impostor_hello(pid: int) -> bytes:
    return encode(Hello(incarnation=777, pid=pid, package_version="0", model_id="evil",
                        fingerprint="x", context_length=4096, tokenizer_path="/etc",
                        eos_token_ids=[0], admission=True))


def refused(router: Router) -> float:
    text = router.http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("headroom_refused_handshakes_total"))


def knock(router: Router, addr: str, pid: int, **keys: bytes) -> None:
    """A peer that connects with these keys (or none) and sends a hello; it must be refused."""
    before_refused, before_bad = refused(router), metric(router, "headroom_bad_frames_total")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in keys.items():
        setattr(sock, name, value)
    sock.connect(addr)
    try:
        sock.send(impostor_hello(pid), zmq.NOBLOCK) if keys else sock.send(impostor_hello(pid))
    except zmq.Again:
        pass  # a CURVE client queues nothing before its handshake succeeds
    try:
        wait_until(lambda: refused(router) > before_refused, 20, f"peer {pid} to be refused",
                   on_fail=router.log)
    finally:
        sock.close(0)
        ctx.term()
    assert metric(router, "headroom_bad_frames_total") == before_bad  # never reached decode
    assert all(w.get("pid") != pid for w in router.health()["workers"])
    assert router.health()["status"] != "ok"


def test_curve_link(tmp_path: Path, cache_home: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "authorized"
    for name in ("router", "worker", "stranger", "fake-router"):
        generate(keys, name)
    for path in keys.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    allowed.mkdir()
    shutil.copy(keys / "worker.key", allowed / "worker.key")
    addr = f"tcp://127.0.0.1:{free_port()}"
    router = Router(tmp_path, cache_home, "--worker-mode", "external", "--worker-addr", addr,
                    "--curve-secret-key", str(keys / "router.key_secret"),
                    "--curve-authorized-keys", str(allowed))
    worker: Proc | None = None
    try:
        router.wait_answering()
        server_public = read_public_key(keys / "router.key")
        stranger = read_keypair(keys / "stranger.key_secret")
        fake = read_keypair(keys / "fake-router.key_secret")
        ok = read_keypair(keys / "worker.key_secret")
        knock(router, addr, 4001)  # no CURVE at all
        knock(router, addr, 4002, curve_serverkey=fake.public, curve_publickey=ok.public,
              curve_secretkey=ok.secret)  # the wrong server key
        knock(router, addr, 4003, curve_serverkey=server_public, curve_publickey=stranger.public,
              curve_secretkey=stranger.secret)  # a key the router does not know
        worker = Proc([sys.executable, "-m", "worker", "--model", "demo", "--router", addr,
                       "--curve-server-key", str(keys / "router.key"),
                       "--curve-secret-key", str(keys / "worker.key_secret")],
                      isolated_env(cache_home, tmp_path), tmp_path / "worker.log")
        health = router.wait_ready(READY_S)
        assert [w["pid"] for w in health["workers"]] == [worker.pid]
        with router.client() as client:
            r = client.completions.create(model="m", prompt="sealed", max_tokens=3, extra_body=NO_EOS)
        assert r.usage is not None and r.usage.completion_tokens == 3
    finally:
        router.stop()
        if worker is not None:
            worker.stop()
