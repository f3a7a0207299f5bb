"""One model sharded over two ranks of an mx.distributed ring group on this host, behind
a router: rank 0 is the worker the router sees, rank 1 follows it in lockstep. Its greedy
completions equal the single (unsharded) worker's, and a follower's death takes the group
down as one worker's exit."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from common.protocol import ExitCode

from tests.conftest import free_port, wait_until
from tests.integration.conftest import Proc, Router, isolated_env

READY_S = 120.0
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
PROMPTS = ["sharded over two ranks", "the same greedy tokens"]


def start_rank(tmp_path: Path, cache_home: Path, addr: str, hostfile: Path, rank: int) -> Proc:
    argv = [sys.executable, "-m", "worker", "--model", "demo", "--router", addr,
            "--distributed", str(hostfile), "--rank", str(rank)]
    return Proc(argv, isolated_env(cache_home, tmp_path), tmp_path / f"rank-{rank}.log")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[tuple[Router, list[Proc]]]:
    tmp_path = tmp_path_factory.mktemp("distributed")
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    router = Router(tmp_path, cache_home, "--worker-mode", "external")
    ranks = [start_rank(tmp_path, cache_home, router.addr, hostfile, r) for r in (0, 1)]
    try:
        router.wait_ready(READY_S)
        yield router, ranks
    finally:
        router.stop()
        for r in ranks:
            r.stop()


def greedy(router: Router, prompt: str) -> list[int]:
    r = router.client().completions.create(model="demo", prompt=prompt, max_tokens=12,
                                           temperature=0, logprobs=0)
    assert r.choices[0].logprobs is not None
    return [t for t in r.choices[0].logprobs.tokens or []]  # type: ignore[misc]


def test_sharded_greedy_equals_single_worker(group: tuple[Router, list[Proc]], router: Router) -> None:
    sharded, ranks = group
    assert sharded.worker()["pid"] == ranks[0].pid  # rank 0 is the worker the router sees
    for prompt in PROMPTS:
        assert greedy(sharded, prompt) == greedy(router, prompt)
    assert all(r.popen.poll() is None for r in ranks)


def test_a_grammar_row_stays_in_step(group: tuple[Router, list[Proc]], router: Router) -> None:
    """Every rank masks the row the same way (each builds the grammar compiler), so the
    token each feeds back is the same and the sharded answer still follows the schema."""
    sharded, ranks = group
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}

    def answer(r: Router) -> str:
        return r.client().completions.create(model="demo", prompt="A number:", max_tokens=60,
                                             temperature=0, extra_body={"response_format": fmt}
                                             ).choices[0].text

    text = answer(sharded)
    assert isinstance(json.loads(text)["n"], int)
    assert text == answer(router)
    assert all(r.popen.poll() is None for r in ranks)


def test_a_scored_prompt_stays_in_step(group: tuple[Router, list[Proc]], router: Router) -> None:
    """A prompt scored for its logprobs runs its scoring forwards on every rank, in chunks
    rank 0 chose (recorded like the prefill chunk): the group neither hangs nor parts."""
    sharded, ranks = group
    prompt = [70 + (i * 37) % 300 for i in range(300)]  # several scoring chunks

    def scored(r: Router) -> tuple[str, list[float]]:
        choice = r.client().completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0,
                                               echo=True, logprobs=1).choices[0]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        return choice.text, choice.logprobs.token_logprobs[1:len(prompt)]

    text, logprobs = scored(sharded)
    single_text, single = scored(router)
    assert text == single_text and len(logprobs) == len(prompt) - 1
    assert all(abs(a - b) < 1e-3 for a, b in zip(logprobs, single))
    assert all(r.popen.poll() is None for r in ranks)


def test_a_followers_death_mid_stream_takes_the_group_down(group: tuple[Router, list[Proc]]) -> None:
    """Killed mid-step: rank 0's queued collectives (one or two a layer) would wait for
    ever on the dead ring, out of Python's reach, but for its watch on the ring's sockets."""
    sharded, ranks = group
    stream = sharded.client().completions.create(model="demo", prompt="keep going", max_tokens=3000,
                                                 stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    ranks[1].popen.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    wait_until(lambda: ranks[0].popen.poll() is not None, 60, "rank 0 to exit with its follower gone",
               on_fail=ranks[0].log)
    assert ranks[0].popen.returncode == ExitCode.ENGINE_ERROR, ranks[0].log()
    wait_until(lambda: sharded.worker().get("state") == "down", 30, "the router to mark it down",
               on_fail=sharded.log)
