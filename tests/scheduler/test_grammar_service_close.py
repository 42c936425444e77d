"""GrammarService.close with a replacement worker pool still starting."""

from __future__ import annotations

from concurrent.futures import Future

from structspec.scheduler.grammar_service import RESPAWN_CLOSE_WAIT_S, GrammarService


class _Closable:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def shutdown(self) -> None:  # the backend's
        self.closed = True


class _StartingFuture(Future):
    """A replacement pool's start that completes only while someone waits for it (as a real
    start completes during close()'s bounded wait); records each wait's timeout."""

    def __init__(self, pool: _Closable) -> None:
        super().__init__()
        self.pool = pool
        self.waits_s: list[float | None] = []

    def result(self, timeout: float | None = None) -> _Closable:
        self.waits_s.append(timeout)
        if not self.done():
            self.set_result(self.pool)  # runs the done-callbacks, as the start thread would
        return super().result(timeout)


def test_close_waits_for_a_replacement_pool_still_starting_and_closes_it() -> None:
    """Its start runs in a daemon thread: a process exiting right after close() used to cut
    it off and leave its shared memory to the resource tracker."""
    service = GrammarService.__new__(GrammarService)  # only what close() reads
    replacement, backend = _Closable(), _Closable()
    future = _StartingFuture(replacement)
    service.pool, service._respawn, service.backend = None, future, backend  # type: ignore[assignment]
    service.close()
    assert future.waits_s[0] == RESPAWN_CLOSE_WAIT_S  # close()'s own wait: bounded
    assert replacement.closed and backend.closed
    service.close()  # idempotent


def test_close_with_a_failed_replacement_returns() -> None:
    service = GrammarService.__new__(GrammarService)
    backend = _Closable()
    future: Future[_Closable] = Future()
    future.set_exception(RuntimeError("could not start"))
    service.pool, service._respawn, service.backend = None, future, backend  # type: ignore[assignment]
    service.close()
    assert backend.closed
