"""Every thread and process of the grammar machinery ends when its owner closes it or the
interpreter exits, also with grammar work in flight.

The regression: a process whose daemon thread was still inside xgrammar (a grammar being
serialized for shipping, deserialized by a mask worker's loader, or rebuilt) when the
interpreter finalized aborted after its work was done: CPython ends such a thread with
``pthread_exit`` when it takes the GIL back, and that forced unwind of its C++ frames ends in
``std::terminate`` ("terminate called without an active exception", exit status 134; a mask
worker died the same way, -6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend, GrammarError
from structspec.grammar.worker_pool import MaskWorkerPool
from tests.polling import wait_for

from .conftest import MASKBENCH_DIR, STOP_ID
from .test_shared_compile_pool import alive

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

#: a MaskBench grammar that compiles in ~10 ms and serializes to ~0.17 MB: copies of it keep
#: the shipping thread and the mask workers' loaders inside xgrammar for a while
SHIPPED = "BFCL_javascript_48"
#: MaskBench grammars whose compile (and so rebuild) takes ~0.5 s (both on the fast rebuild
#: thread: the second waits behind the first)
SLOW_REBUILDS = ("Github_hard---o79080", "Github_hard---o72113")

# Starts a grammar backend, submits a grammar and exits (no shutdown()) as soon as the compile
# process has accepted it, i.e. while this process rebuilds it on a daemon thread: the backend's
# finalizer runs at interpreter exit with that thread inside xgrammar's compile.
_EXIT_SCRIPT = """
import json, sys, time
import transformers
from structspec.config import GrammarConfig
from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend

directory, schema, stop_id = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = transformers.AutoTokenizer.from_pretrained(directory)
backend = GrammarBackend(tok, vocab_size=len(tok), stop_token_ids=[stop_id],
                         config=GrammarConfig(num_compile_threads=1,
                                              num_small_compile_workers=0))
future = backend.submit(JsonSchemaConstraint(schema))
deadline = time.monotonic() + 60
while not future._entry.accepted:
    assert time.monotonic() < deadline and not future.done(), "the compile never finished"
    time.sleep(0.002)
print(json.dumps(backend.worker_pids()), flush=True)
"""


def _schema(name: str) -> Any:
    with open(os.path.join(MASKBENCH_DIR, f"{name}.json")) as fh:
        return json.load(fh)["schema"]


@pytest.mark.slow  # ~17 s on 2 cores; the in-flight close below covers the clean shutdown
def test_exit_during_a_rebuild_is_clean(hf_tokenizer: Any) -> None:
    """A process that exits (no shutdown()) while it rebuilds a grammar: exit status 0, no
    "terminate called", and its compile processes gone."""
    path = [os.path.abspath(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, hf_tokenizer.name_or_path,
         json.dumps(_schema(SLOW_REBUILDS[0])), str(STOP_ID)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert "terminate called" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pids  # the zygote and its compile worker
    wait_for(f"the compile processes {pids} to be gone",
             lambda: not any(alive(p) for p in pids), 5)


def test_close_with_grammars_in_flight_ends_the_thread_and_the_workers(
        backend: GrammarBackend) -> None:
    """``close()`` while grammars are queued and being loaded: the shipping thread has ended
    and every worker exited by itself (status 0: neither aborted inside xgrammar nor killed
    for a slow exit)."""
    # compiled here, not by the compile processes: nothing waits for their start
    compiler = xgr.GrammarCompiler(backend.tokenizer_info, max_threads=1, cache_enabled=False)
    text = compiler.compile_json_schema(json.dumps(_schema(SHIPPED))).serialize_json()
    pool = MaskWorkerPool(backend.tokenizer_info, num_workers=2, vocab_size=backend.vocab_size,
                          max_rows=8, stop_token_ids=[STOP_ID])
    try:
        for i in range(40):
            pool.ready(f"c{i}", xgr.CompiledGrammar.deserialize_json(text, backend.tokenizer_info))
        wait_for("a first grammar to load", lambda: pool.collect_shipped() > 0, 30)
    finally:
        pool.close()
    assert not pool.shipping._thread.is_alive()  # noqa: SLF001
    assert [p.returncode for p in pool._procs] == [0, 0]  # noqa: SLF001


def test_shutdown_waits_for_the_rebuild_in_progress(hf_tokenizer: Any,
                                                    backend: GrammarBackend) -> None:
    """``shutdown()`` while grammars are being rebuilt in this process: when it returns no
    rebuild thread runs (none is left inside xgrammar's compile for the interpreter's exit),
    and every request's grammar has ended: rebuilt (the one in progress) or failed with "shut
    down" (one still queued)."""
    own = GrammarBackend(hf_tokenizer, vocab_size=backend.vocab_size,
                         stop_token_ids=backend.stop_token_ids, config=backend.config)
    futures = [own.submit(JsonSchemaConstraint(_schema(name))) for name in SLOW_REBUILDS]
    wait_for("the worker compiles", lambda: all(f._entry.accepted for f in futures),  # noqa: SLF001
             60)
    own.shutdown()
    assert not any(t.is_alive() for t in own._threads)  # noqa: SLF001
    for future in futures:
        assert future.done()
        try:
            assert isinstance(future.result(timeout=0), xgr.CompiledGrammar)
        except GrammarError as e:
            assert "shut down" in str(e)


@pytest.mark.slow  # two more compile pools (~7 s)
def test_compile_pool_close_is_safe_on_any_thread(backend: Any) -> None:
    """The engine may be collected on any thread, and its finalizers close the compile pool:
    close() under the pool's own lock (the dispatcher holds it while it steps) and close()
    from the dispatcher thread itself neither deadlock nor raise."""
    from structspec.grammar.compile_pool import CompilePool

    info = backend.pool._init["tokenizer_info_json"]  # noqa: SLF001 - the served tokenizer
    make = lambda: CompilePool(info, vocab_size=backend.vocab_size,  # noqa: E731
                               stop_token_ids=backend.stop_token_ids, any_whitespace=False,
                               general_workers=1, small_workers=0, small_slice_s=0.1)
    held = make()
    with held._lock:  # noqa: SLF001 - as the dispatcher does around a step
        held.close()
    held._thread.join(5)  # noqa: SLF001
    assert not held._thread.is_alive()  # noqa: SLF001

    own = make()
    errors: list[BaseException] = []
    step = own._step  # noqa: SLF001

    def closing_step() -> None:  # the dispatcher runs close() itself, mid-loop
        try:
            own.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        step()

    own._step = closing_step  # type: ignore[method-assign]  # noqa: SLF001
    own._wake()  # noqa: SLF001
    own._thread.join(10)  # noqa: SLF001
    assert not own._thread.is_alive() and errors == []  # noqa: SLF001
