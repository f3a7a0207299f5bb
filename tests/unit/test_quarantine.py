"""Tests for router/fleet/quarantine.py: a fingerprint in flight at two deaths (explicit ``now``)."""

from __future__ import annotations

from router.fleet.quarantine import DEATHS_TO_QUARANTINE, QUARANTINE_S, SUSPECT_TTL_S, Quarantine


def test_constants() -> None:
    assert DEATHS_TO_QUARANTINE == 2


def test_unknown_is_not_quarantined() -> None:
    assert not Quarantine().is_quarantined("fp", 0.0)


def test_one_death_is_only_a_suspect() -> None:
    q = Quarantine()
    assert q.record_death({"fp"}, 0.0) == set()
    assert not q.is_quarantined("fp", 1.0)


def test_second_death_quarantines() -> None:
    q = Quarantine()
    q.record_death({"fp", "other"}, 0.0)
    assert q.record_death({"fp"}, 10.0) == {"fp"}
    assert q.is_quarantined("fp", 10.0)
    assert not q.is_quarantined("other", 10.0)


def test_newly_quarantined_reported_once() -> None:
    q = Quarantine()
    q.record_death({"a", "b"}, 0.0)
    assert q.record_death({"a", "b", "c"}, 1.0) == {"a", "b"}
    assert q.record_death({"c"}, 2.0) == {"c"}


def test_quarantine_expires() -> None:
    q = Quarantine()
    q.record_death({"fp"}, 0.0)
    q.record_death({"fp"}, 1.0)
    assert q.is_quarantined("fp", 1.0 + QUARANTINE_S - 0.001)
    assert not q.is_quarantined("fp", 1.0 + QUARANTINE_S)
    # Once released it needs two fresh deaths again.
    assert q.record_death({"fp"}, 2000.0) == set()
    assert not q.is_quarantined("fp", 2000.0)
    assert q.record_death({"fp"}, 2001.0) == {"fp"}


def test_suspect_forgotten_after_ttl() -> None:
    q = Quarantine()
    q.record_death({"fp"}, 0.0)
    assert q.record_death({"fp"}, SUSPECT_TTL_S + 1.0) == set()
    assert not q.is_quarantined("fp", SUSPECT_TTL_S + 1.0)


def test_suspect_kept_up_to_ttl() -> None:
    q = Quarantine()
    q.record_death({"fp"}, 0.0)
    assert q.record_death({"fp"}, SUSPECT_TTL_S) == {"fp"}


def test_other_deaths_expire_old_suspects() -> None:
    q = Quarantine()
    q.record_death({"old"}, 0.0)
    q.record_death({"new"}, SUSPECT_TTL_S + 5.0)
    assert "old" not in q.suspects
    assert q.record_death({"old"}, SUSPECT_TTL_S + 6.0) == set()


def test_death_with_nothing_in_flight() -> None:
    q = Quarantine()
    assert q.record_death(set(), 0.0) == set()


def test_a_fingerprint_is_computed_only_while_something_is_quarantined() -> None:
    # A job's fingerprint hashes its whole prompt: asked of every request, it is worth
    # nothing while nothing is quarantined (nearly always).
    calls: list[int] = []

    def fingerprint() -> str:
        calls.append(1)
        return "fp"

    q = Quarantine()
    assert not q.is_quarantined(fingerprint, 0.0) and not calls
    q.record_death({"fp"}, 1.0)
    q.record_death({"fp"}, 2.0)
    assert q.is_quarantined(fingerprint, 3.0) and calls == [1]


def test_a_jobs_fingerprint_is_its_prompt_and_sampling() -> None:
    from common.protocol import SamplingParams
    from router.job import Job, Sampling

    def job(ids: list[int], temperature: float = 0.0) -> Job:
        return Job(request_id="r", prompt_ids=ids, deadline=0.0, enqueued_at=0.0,
                   sampling=Sampling(max_tokens=4, params=SamplingParams(temperature=temperature)))

    assert job([1, 2, 3]).fingerprint() == job([1, 2, 3]).fingerprint()
    assert job([1, 2, 3]).fingerprint() != job([1, 2, 4]).fingerprint()
    assert job([1, 2, 3]).fingerprint() != job([1, 2, 3], 0.5).fingerprint()
    assert job([1 << 40]).fingerprint() != job([0]).fingerprint()
