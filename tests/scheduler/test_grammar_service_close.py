"""GrammarService.close with a replacement worker pool still starting."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from structspec.scheduler.grammar_service import GrammarService


class _Closable:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def shutdown(self) -> None:  # the backend's
        self.closed = True


def test_close_waits_for_a_replacement_pool_still_starting_and_closes_it() -> None:
    """Its start runs in a daemon thread: a process exiting right after close() used to cut
    it off and leave its shared memory to the resource tracker."""
    service = GrammarService.__new__(GrammarService)  # only what close() reads
    replacement, backend = _Closable(), _Closable()
    future: Future[_Closable] = Future()
    service.pool, service._respawn, service.backend = None, future, backend  # type: ignore[assignment]

    def start() -> None:
        time.sleep(0.2)
        future.set_result(replacement)

    threading.Thread(target=start, daemon=True).start()
    service.close()
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
