"""GrammarService._on_worker's per-request memo answers exactly as the pool would."""

from __future__ import annotations

from types import SimpleNamespace

from structspec.scheduler.grammar_service import GrammarService


class _Pool:
    """The pool calls ``_on_worker`` makes: ``ready`` turns true for a request only once its
    grammar's acknowledgement is collected (as ``GrammarShipper.ready``), and a release
    forgets the request."""

    def __init__(self) -> None:
        self.ready_calls = 0
        self.loaded: set[str] = set()
        self.acked: set[str] = set()
        self.num_workers = 8

    def serves(self, compiled: object) -> bool:
        return compiled != "other-backend"

    def ready(self, key: str, compiled: object) -> bool:
        self.ready_calls += 1
        return key in self.loaded

    def collect_shipped(self) -> int:
        got = len(self.acked - self.loaded)
        self.loaded |= self.acked
        return got

    def num_synced(self, key: str) -> int:
        return 0

    walks_ready = None

    def release(self, key: str) -> None:
        self.loaded.discard(key)
        self.acked.discard(key)


def _service(pool: _Pool) -> GrammarService:
    service = GrammarService.__new__(GrammarService)  # only what the memo paths read
    service.pool, service._respawn, service._on_worker_memo = pool, None, {}  # type: ignore[assignment]
    return service


def _req(rid: str, compiled: object = "g") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, matcher=SimpleNamespace(compiled=compiled),
                           num_grammar_advanced=0, output_ids=[])


def test_memo_matches_the_pool_across_collect_release_and_pool_loss() -> None:
    pool = _Pool()
    service = _service(pool)
    a, b, other = _req("a"), _req("b"), _req("c", "other-backend")
    unconstrained = SimpleNamespace(request_id="u", matcher=None)
    assert not service._on_worker(a) and not service._on_worker(b)
    calls = pool.ready_calls
    for _ in range(3):  # asked again in the same step: the memo answers
        assert not service._on_worker(a)
    assert pool.ready_calls == calls
    assert not service._on_worker(other) and not service._on_worker(unconstrained)

    pool.acked.add("a")  # a's grammar reached its worker: seen once plan_step collects
    assert not service._on_worker(a)  # not collected yet: the pool says False as well
    service.plan_step([a, b], [])  # collects, drops the memo
    assert service._on_worker(a) and not service._on_worker(b)
    assert pool.ready("a", "g") and not pool.ready("b", "g")

    service.release("a")  # a finished; a new request may reuse its id
    a2 = _req("a")
    assert not service._on_worker(a2) and not pool.ready("a", "g")

    pool.acked.add("b")
    service.plan_step([b], [])
    assert service._on_worker(b)
    assert service._on_worker_memo["b"] is not None
    service.pool = None  # the pool failed: nothing is on a worker
    assert not service._on_worker(b)


def test_plan_step_without_new_acknowledgements_keeps_the_memo() -> None:
    pool = _Pool()
    pool.acked.add("a")
    service = _service(pool)
    a = _req("a")
    service.plan_step([a], [])
    assert service._on_worker(a)
    calls = pool.ready_calls
    service.plan_step([a], [a])
    assert service._on_worker(a) and pool.ready_calls == calls


def test_memoized_pool_request_sees_later_commits_and_cuts() -> None:
    """The memo keeps one PoolRequest per request across steps: it must read the request's
    own output list, so ids committed (or cut) after it was made are what the pool sends."""
    pool = _Pool()
    pool.acked.add("a")
    service = _service(pool)
    a = _req("a")
    service.plan_step([a], [])
    first = service._pool_requests([a])[0]
    assert first is not None and list(first.output_ids) == []
    a.output_ids.extend([5, 6, 7])
    again = service._pool_requests([a])[0]
    assert again is first and list(again.output_ids) == [5, 6, 7]
    del a.output_ids[1:]  # a stop-string cut removes ids in place
    assert list(service._pool_requests([a])[0].output_ids) == [5]
    unconstrained = SimpleNamespace(request_id="u", matcher=None, output_ids=[])
    assert service._pool_requests([unconstrained, a]) == [None, first]
