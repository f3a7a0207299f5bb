"""Several models under one router: by name, on demand, within a host budget, idle unload.

Two tiny random-weight models are made from the demo model: ``alpha`` is the demo's own
weights, ``beta`` the same with its output head negated, so greedy decoding of one prompt
tells them apart. Each router here starts real workers; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.conftest import wait_until
from tests.integration.conftest import Proc, Router, isolated_env

LOAD_S = 90.0
PROMPT = "Say something."


def make_models(root: Path, cache_home: Path) -> tuple[Path, Path]:
    import mlx.core as mx

    from worker.demo import demo_folder

    demo = demo_folder(cache_home / "mlx-headroom")
    alpha, beta = root / "alpha", root / "beta"
    for folder in (alpha, beta):
        if not folder.exists():
            shutil.copytree(demo, folder)
    weights = mx.load(str(beta / "model.safetensors"))
    weights["lm_head.weight"] = -weights["lm_head.weight"]  # EOS rows are 0: they stay 0
    mx.save_safetensors(str(beta / "model.safetensors"), weights, metadata={"format": "mlx"})
    return alpha, beta


def worker_pids(router: Router) -> dict[str, int]:
    """The router's live worker processes by the model folder they were started with."""
    out: dict[str, int] = {}
    # A standby (``--standby``) holds no model until it is told to become a worker, and
    # then /health lists it as one.
    workers = {w.get("pid") for w in router.health().get("workers", [])}
    # Direct children only: a worker's own short-lived child (a library's fork before its
    # exec) carries the worker's argv, and CI once saw one as a second "alpha".
    try:
        children = psutil.Process(router.pid).children(recursive=False)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            argv = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE or "worker" not in argv \
                    or ("--standby" in argv and child.pid not in workers):
                continue
        except psutil.Error:
            continue
        out[Path(argv[argv.index("--model") + 1]).name] = child.pid
    return out


def loads(router: Router, model: str) -> int:
    """Workers the router started for ``model``, by its log (the whole file)."""
    return router.log_path.read_text(errors="replace").count(f"router.fleet.fleet: loading {model} ")


def states(router: Router) -> dict[str, str]:
    return {m["id"]: m["state"] for m in router.http.get("/v1/models").json()["data"]}


def complete(router: Router, model: str, **extra: Any) -> str:
    r = router.client().completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                           temperature=0.0, extra_body=extra or None)
    assert r.model == model
    return r.choices[0].text


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> tuple[Path, Path]:
    return make_models(tmp_path_factory.mktemp("models"), cache_home)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, cache_home: Path,
        models: tuple[Path, Path]) -> Iterator[Router]:
    """alpha pinned (loaded at start, never unloaded), beta on demand with a 1 s keep-alive."""
    alpha, beta = models
    router = Router(tmp_path_factory.mktemp("two"), cache_home, "--model", f"beta={beta}",
                    "--pin", "alpha", "--keep-alive", "1s", model=f"alpha={alpha}")
    router.wait_ready(LOAD_S)
    yield router
    router.stop()


def test_two_models_answer_by_name_and_are_listed(two: Router) -> None:
    assert states(two) == {"alpha": "loaded", "beta": "unloaded"}
    a, b = complete(two, "alpha"), complete(two, "beta")
    assert a != b, "two different models must answer differently"
    assert complete(two, "alpha") == a and complete(two, "beta") == b
    # Read at once: beta's worker may exit 1 s (its keep-alive) after its answer.
    page = two.http.get("/status").json()
    listed = {m["id"]: m for m in two.http.get("/v1/models").json()["data"]}
    assert set(listed) == {"alpha", "beta"} and listed["alpha"]["pinned"]
    assert listed["alpha"]["memory"]["weights_bytes"] > 0
    # The status page's data (and `mlx-router status`) list both, and each worker's model.
    assert {m["id"]: m["pinned"] for m in page["models"]} == {"alpha": True, "beta": False}
    assert {w["model"] for w in page["workers"]} == {"alpha", "beta"}
    assert all("source" not in m for m in page["models"])
    # Idle past its 1 s keep-alive, beta's worker exits (the router says unloaded once its
    # process has exited, so the two views agree); pinned alpha stays.
    wait_until(lambda: states(two)["beta"] == "unloaded", 30, "beta unloaded after its keep-alive",
               on_fail=two.log)
    assert "beta" not in worker_pids(two) and "alpha" in worker_pids(two)
    assert states(two)["alpha"] == "loaded"


def test_unknown_model_is_404_in_each_api_s_shape(two: Router) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        two.client().chat.completions.create(model="gamma", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        two.client().models.retrieve("gamma")
    assert two.client().models.retrieve("beta").id == "beta"
    r = two.http.post("/v1/messages", json={"model": "gamma", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = two.http.post("/v1/responses", json={"model": "gamma", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = two.http.post("/v1/completions", json={"model": "alpha", "prompt": "x", "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_an_external_worker_joins_the_model_it_names(two: Router, models: tuple[Path, Path],
                                                      tmp_path: Path, cache_home: Path) -> None:
    """Started by hand (as on another Mac), it serves beta: no worker is spawned for it; when
    it goes, beta is unloaded (and the next test loads it on demand again)."""
    wait_until(lambda: states(two)["beta"] == "unloaded", 30, "beta unloaded")
    before = loads(two, "beta")
    worker = Proc([sys.executable, "-m", "worker", "--model", str(models[1]), "--router", two.addr],
                  isolated_env(cache_home, tmp_path), tmp_path / "external.log")
    try:
        wait_until(lambda: states(two)["beta"] == "loaded", LOAD_S, "the external worker's hello",
                   on_fail=worker.log)
        complete(two, "beta")
        assert loads(two, "beta") == before, "no worker spawned while the external one serves"
        assert worker.pid in {w["pid"] for w in two.health()["workers"] if w["model"] == "beta"}
    finally:
        assert worker.stop() == 0
    wait_until(lambda: states(two)["beta"] == "unloaded", 10, "beta unloaded once it left")


def test_ten_first_requests_start_one_worker_and_keep_alive_0_unloads(two: Router) -> None:
    wait_until(lambda: states(two)["beta"] == "unloaded", 30, "beta unloaded")
    before = loads(two, "beta")
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(lambda _: complete(two, "beta", keep_alive=0), range(10)))
    assert len(set(texts)) == 1
    assert loads(two, "beta") == before + 1, "exactly one worker for ten requests"
    # keep_alive 0: unloaded right after the last request; the router and ps agree.
    wait_until(lambda: "beta" not in worker_pids(two), 30, "beta's worker to exit (keep_alive 0)",
               on_fail=two.log)
    wait_until(lambda: states(two)["beta"] == "unloaded", 10, "the router to show beta unloaded")


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, cache_home: Path,
          models: tuple[Path, Path]) -> Iterator[Router]:
    """A host budget that holds one model's worker, not two."""
    alpha, beta = models
    router = Router(tmp_path_factory.mktemp("tight"), cache_home, "--model", f"beta={beta}",
                    "--host-memory-mb", "120", model=f"alpha={alpha}")
    router.wait_answering()
    yield router
    router.stop()


class Watch:
    """Polls the router's worker processes and its leases until stopped."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.most_workers = 0
        self.most_leased = 0
        self.seen: list[dict[str, int]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        with httpx.Client(base_url=self.router.url, timeout=10) as http:
            while not self.stopped.wait(0.05):
                pids = worker_pids(self.router)
                self.most_workers = max(self.most_workers, len(pids))
                if pids and (not self.seen or self.seen[-1] != pids):
                    self.seen.append(pids)
                host = http.get("/v1/memory").json()["host"]
                self.most_leased = max(self.most_leased, host["leased_bytes"])

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def test_budget_for_one_swaps_models_and_never_unloads_a_busy_one(tight: Router) -> None:
    watch = Watch(tight)
    try:
        a = complete(tight, "alpha")
        # A long stream keeps alpha busy; beta's request waits for it, never unloads it.
        stream = iter(tight.client().completions.create(
            model="alpha", prompt=PROMPT, max_tokens=200, stream=True,
            extra_body={"ignore_eos": True}))
        first = next(stream)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            beta = pool.submit(complete, tight, "beta")
            chunks = [first] + list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
            b = beta.result(timeout=LOAD_S)
        assert a != b
        assert complete(tight, "alpha") == a  # and back again
    finally:
        watch.stop()
    assert "trimmed on the router's request" in tight.log()  # asked before it was stopped
    assert watch.most_workers == 1, f"two workers at once within a one-model budget: {watch.seen}"
    assert watch.most_leased <= 120 << 20
    events = "\n".join(line for line in tight.log_path.read_text(errors="replace").splitlines()
                       if re.search(r"loading|unloading|standby|exit|dead|wedged|silent|restart|OOM|abort|quarantin|lost", line))
    assert [list(p) for p in watch.seen] == [["alpha"], ["beta"], ["alpha"]], \
        f"workers seen {watch.seen}; the router's log:\n{events}"
