"""One compile pool per process and settings: backends of the same tokenizer share its
processes, a backend that shuts down stops only its own compiles, the last one stops the
processes."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import xgrammar as xgr

from structspec.config import GrammarConfig
from structspec.constraints import ChoiceConstraint, JsonSchemaConstraint
from structspec.grammar import GrammarBackend, GrammarError
from structspec.grammar.shared_compile_pool import shared_pool_users
from tests.polling import wait_for

from .conftest import STOP_ID


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        # gone before the open (no /proc entry) or reaped between the open and the read
        # (the read then fails with ESRCH)
        return False


def test_backends_share_a_pool_and_a_shutdown_stops_only_its_compiles(
        hf_tokenizer: Any, backend: GrammarBackend) -> None:
    """Two more backends with the session backend's settings join its pool (no process
    starts); one shuts down while its runaway compile runs: that compile is killed and fails
    with "shut down", its worker is replaced, and the others compile on."""
    config = dataclasses.replace(backend.config, max_schema_properties=20_000)
    make = lambda: GrammarBackend(hf_tokenizer, vocab_size=backend.vocab_size,  # noqa: E731
                                  stop_token_ids=backend.stop_token_ids, config=config)
    users = shared_pool_users(backend.pool)
    a, b = make(), make()
    try:
        assert a.pool is b.pool is backend.pool
        assert shared_pool_users(backend.pool) == users + 2
        assert a.wait_ready(120)
        runaway = a.submit(JsonSchemaConstraint({"type": "object", "properties": {
            f"k{i}": {"type": "integer"} for i in range(10_000)}}, strict=False))
        wait_for("the runaway compile to start", lambda: runaway._entry.job is not None  # noqa: SLF001
                 and runaway._entry.job.started_at is not None, 10)  # noqa: SLF001
        before = set(a.worker_pids())
        a.shutdown()
        with pytest.raises(GrammarError, match="shut down") as info:
            runaway.result(timeout=10)
        assert info.value.param == "json_schema"
        assert isinstance(b.compile(ChoiceConstraint(("x", "y")), timeout=20),
                          xgr.CompiledGrammar)
        # its worker was killed and replaced by a fresh fork; the zygote stays
        wait_for("the killed worker's replacement", lambda: len(set(b.worker_pids()) - before)
                 == 1 and len(b.worker_pids()) == len(before), 5)
        killed = before - set(b.worker_pids())
        wait_for(f"the killed worker {killed} to exit",
                 lambda: not any(alive(p) for p in killed), 5)
        with pytest.raises(GrammarError, match="shut down"):  # a is closed for good
            a.compile(ChoiceConstraint(("x",)))
        a.shutdown()  # idempotent: keeps b's reference
        assert shared_pool_users(backend.pool) == users + 1
    finally:
        a.shutdown()
        b.shutdown()
    assert shared_pool_users(backend.pool) == users and backend.pool.usable()


def test_last_release_stops_the_processes(hf_tokenizer: Any) -> None:
    """Settings no other backend uses (the slice): a pool of their own, whose processes go
    with its last user."""
    config = GrammarConfig(num_compile_threads=1, small_lane_slice_s=1.25)
    make = lambda: GrammarBackend(hf_tokenizer, vocab_size=len(hf_tokenizer),  # noqa: E731
                                  stop_token_ids=[STOP_ID], config=config)
    first, second = make(), make()
    pool = first.pool
    assert second.pool is pool
    wait_for("the zygote to start", lambda: bool(first.worker_pids()), 10)
    pids = first.worker_pids()
    first.shutdown()
    assert shared_pool_users(pool) == 1 and all(alive(p) for p in pids)
    second.shutdown()
    assert shared_pool_users(pool) == 0 and not pool.usable()
    wait_for(f"the processes {pids} to exit", lambda: not any(alive(p) for p in pids), 10)


def test_a_dropped_backend_is_collected_and_gives_its_pool_back(
        hf_tokenizer: Any, backend: GrammarBackend) -> None:
    """A backend dropped without shutdown after compiling (an engine garbage-collected) goes:
    its rebuild threads keep no reference to it (regression: the last rebuild, kept in a
    waiting thread's local, held it and, through a cached failure's traceback, its engine),
    so its finalizer releases the shared pool."""
    users = shared_pool_users(backend.pool)
    dropped = GrammarBackend(hf_tokenizer, vocab_size=backend.vocab_size,
                             stop_token_ids=backend.stop_token_ids, config=backend.config)
    assert isinstance(dropped.compile(ChoiceConstraint(("drop", "me")), timeout=20),
                      xgr.CompiledGrammar)
    with pytest.raises(GrammarError):
        dropped.compile(JsonSchemaConstraint(False))  # a cached failure
    ref = weakref.ref(dropped)
    del dropped
    wait_for("the dropped backend to be collected", lambda: gc.collect() >= 0 and ref() is None, 5)
    assert shared_pool_users(backend.pool) == users
