"""Placement of constrained requests on mask workers, and the shipping of their grammars.

The half of :class:`~structspec.grammar.worker_pool.MaskWorkerPool` that decides which worker
keeps a request's mirror matcher and gets that worker the request's compiled grammar, off the
step loop (the pool module's docstring, "Placement" and "Shipping grammars", says why).

A grammar travels on a second socket per worker: the shipping thread sends its source (what
the engine compiled it from, :mod:`.grammar_source`; an llguidance grammar as its grammar
text; xgrammar's JSON serialization only for a grammar compiled outside the engine's backend,
:func:`wire_form`); the worker's loader thread compiles (or deserializes) it and
acknowledges. Until the acknowledgement has been
read (:meth:`GrammarShipper.collect`, polled once per step) the request is not *ready* and its
caller keeps the grammar work in process. Each shipment has a wire id that is never reused, so
a drop and a later shipment of the same grammar cannot be confused by the two sockets' orders.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection

import xgrammar as xgr

from structspec.grammar.grammar_source import XgrSource, source_of
from structspec.grammar.llg_matcher import LlgCompiled
from structspec.grammar.pool_types import MaskPoolError

logger = logging.getLogger(__name__)

#: serialized grammars the shipping thread keeps for the next worker that needs the same one
#: (a schema shared by many requests reaches every worker once; serializing it again would
#: cost the thread, and through the GIL the step loop, ~5-30 ms each time)
SHIP_CACHE_SIZE = 8

#: how long a direct caller (tests, tools) of ``MaskWorkerPool.build`` waits for a grammar its
#: request needs before the pool counts the worker as failed (s)
SHIP_WAIT_S = 120.0


@dataclass
class Shipment:
    """One compiled grammar on (or on its way to) one worker.

    Attributes:
        compiled: the grammar (held so that ``id(compiled)``, the key, is not reused while
            the worker may hold it).
        wire_id: the worker's key for it (unique over the pool's life).
        live: requests placed on the worker that use it.
        state: ``"shipping"`` (queued or in flight), ``"loaded"`` (acknowledged: jobs may
            name it) or ``"failed"`` (the worker could not load it: those requests stay in
            process).
    """

    compiled: xgr.CompiledGrammar | LlgCompiled
    wire_id: int
    live: int = 0
    state: str = "shipping"


WireForm = str | tuple[str, str, str] | tuple[str, XgrSource]
"""What travels to a worker for one grammar (:func:`wire_form`)."""


def wire_form(compiled: xgr.CompiledGrammar | LlgCompiled) -> WireForm:
    """What travels to a worker for ``compiled``: ``("xgrammar", source)`` for a grammar the
    engine's backend compiled (the worker compiles the source: :mod:`.grammar_source` says
    why), ``("llguidance", kind, grammar text)`` (llguidance's objects cannot be pickled; the
    worker compiles the text, in milliseconds), else xgrammar's JSON serialization."""
    if isinstance(compiled, LlgCompiled):
        return ("llguidance", compiled.kind, compiled.grammar)
    source = source_of(compiled)
    if source is not None:
        return ("xgrammar", source)
    return compiled.serialize_json()


def _ship_loop(jobs: queue.SimpleQueue[tuple[int, int, xgr.CompiledGrammar | LlgCompiled]
                                       | None],
               conns: list[Connection], busy_s: list[float], stopping: threading.Event) -> None:
    """The shipping thread: serialize each queued grammar and send it on its worker's grammar
    socket. ``busy_s[0]`` accumulates the thread's time (metrics). A dead worker's socket is
    skipped: the step loop's own messages find the death and report it. Once ``stopping`` is
    set the jobs still queued are dropped, not serialized
    (:meth:`GrammarShipper.request_stop`)."""
    cache: OrderedDict[int, tuple[xgr.CompiledGrammar | LlgCompiled,
                                  str | tuple[str, str, str]]] = OrderedDict()
    while True:
        job = jobs.get()
        if job is None or stopping.is_set():
            return
        w, wire_id, compiled = job
        t0 = time.perf_counter()
        hit = cache.get(id(compiled))
        if hit is not None and hit[0] is compiled:
            text = hit[1]
            cache.move_to_end(id(compiled))
        else:
            text = wire_form(compiled)
            cache[id(compiled)] = (compiled, text)
            if len(cache) > SHIP_CACHE_SIZE:
                cache.popitem(last=False)
        if stopping.is_set():  # stopped during the serialization: the workers are going
            return
        try:
            conns[w].send((wire_id, text))
        except (OSError, ValueError):
            pass
        del job, compiled, text
        busy_s[0] += time.perf_counter() - t0


class GrammarShipper:
    """Which worker serves each request, and each worker's copies of the grammars.

    Args:
        ship_conns: per worker, the parent's end of its grammar socket (grammars out,
            acknowledgements ``(wire_id, error or None)`` back).

    Not thread-safe: every method runs on the pool owner's thread; only the serialization and
    the sends run on the shipping thread, which gets the queue and the sockets, never this
    object's maps.
    """

    def __init__(self, ship_conns: list[Connection]) -> None:
        num_workers = len(ship_conns)
        self._conns = ship_conns
        self._jobs: queue.SimpleQueue[tuple[int, int, xgr.CompiledGrammar | LlgCompiled]
                                      | None] = queue.SimpleQueue()
        self._busy_s = [0.0]
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=_ship_loop,
                                        args=(self._jobs, ship_conns, self._busy_s,
                                              self._stopping),
                                        name="grammar-shipper", daemon=True)
        self._thread.start()
        # request key -> (worker, its grammar's shipment to that worker)
        self._assigned: dict[str, tuple[int, Shipment]] = {}
        # per worker: id(compiled grammar) -> its shipment (which holds the object, so the id
        # is not reused while the worker may hold the grammar)
        self.known: list[dict[int, Shipment]] = [{} for _ in range(num_workers)]
        #: per worker: wire id -> shipment not yet acknowledged
        self.in_flight: list[dict[int, Shipment]] = [{} for _ in range(num_workers)]
        self._wire_ids = itertools.count()
        #: host time the owner's thread spent on shipping grammars (placing and queueing,
        #: reading acknowledgements, and any wait of a direct ``build``/``advance`` caller for a
        #: grammar not yet loaded; the scheduler never waits), ms
        self.ship_ms = 0.0
        #: grammars shipped (one per grammar and worker)
        self.num_shipped = 0
        #: per worker: released request keys / dropped wire ids for its next message
        self.released: list[list[str]] = [[] for _ in range(num_workers)]
        self.dropped: list[list[int]] = [[] for _ in range(num_workers)]
        self._live = [0] * num_workers  # live mirrors per worker (placement)

    @property
    def thread_ms(self) -> float:
        """Time the shipping thread spent serializing and sending grammars (ms)."""
        return self._busy_s[0] * 1e3

    def ready(self, key: str, compiled: xgr.CompiledGrammar | LlgCompiled) -> bool:
        """Whether the request's worker holds its grammar. On first sight the request is
        placed and its grammar queued for that worker's shipment; never blocks (~1 us). The
        answer changes only in :meth:`collect`, so a caller that asks once per step gets one
        consistent split of its batch."""
        entry = self._assigned.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = self.place(key, compiled)
            self.ship_ms += (time.perf_counter() - t0) * 1e3
        return entry[1].state == "loaded"

    def place(self, key: str, compiled: xgr.CompiledGrammar | LlgCompiled
              ) -> tuple[int, Shipment]:
        """The request's ``(worker, shipment)``; on first sight the request goes to the worker
        with the fewest live mirrors (the lowest-numbered on a tie: spreading beats packing)
        and its grammar is queued when that worker has not got it."""
        entry = self._assigned.get(key)
        if entry is not None:
            return entry
        w = self._live.index(min(self._live))
        self._live[w] += 1
        ship = self.known[w].get(id(compiled))
        if ship is None:
            ship = self.known[w][id(compiled)] = Shipment(compiled, next(self._wire_ids))
            self.in_flight[w][ship.wire_id] = ship
            self._jobs.put((w, ship.wire_id, compiled))
            self.num_shipped += 1
        ship.live += 1
        entry = self._assigned[key] = (w, ship)
        return entry

    def release(self, key: str) -> None:
        """Forget a finished request: its mirror is dropped, and its grammar too when no other
        request on that worker uses it, with the worker's next message."""
        entry = self._assigned.pop(key, None)
        if entry is None:
            return
        w, ship = entry
        self._live[w] -= 1
        self.released[w].append(key)
        ship.live -= 1
        if ship.live == 0 and ship.state != "shipping":
            self._forget(w, ship)
        # a grammar still in flight is forgotten when its acknowledgement arrives

    def take_drops(self, w: int) -> tuple[list[str], list[int]]:
        """Worker ``w``'s released request keys and dropped wire ids since its last message
        (for the message about to go out; cleared)."""
        out = self.released[w], self.dropped[w]
        self.released[w], self.dropped[w] = [], []
        return out

    def _forget(self, w: int, ship: Shipment) -> None:
        """Worker ``w`` no longer needs ``ship``'s grammar: drop its copy with the next
        message (a failed one was never stored there)."""
        del self.known[w][id(ship.compiled)]
        if ship.state == "loaded":
            self.dropped[w].append(ship.wire_id)

    def collect(self) -> int:
        """Read the workers' acknowledgements without blocking (a poll per worker with a
        grammar in flight; nothing when none is); returns how many arrived. A grammar a worker
        could not load stays ``failed``: its requests keep being served in process (logged).

        Raises:
            MaskPoolError: a worker's grammar socket broke (the worker died).
        """
        if not any(self.in_flight):
            return 0
        t0 = time.perf_counter()
        got = 0
        try:
            for w, flight in enumerate(self.in_flight):
                conn = self._conns[w]
                while flight and conn.poll():
                    self.acknowledge(w, *conn.recv())
                    got += 1
        except (EOFError, OSError) as e:
            raise MaskPoolError(f"mask worker {w} died") from e
        finally:
            self.ship_ms += (time.perf_counter() - t0) * 1e3
        return got

    def acknowledge(self, w: int, wire_id: int, error: str | None) -> None:
        """Record worker ``w``'s answer for shipment ``wire_id`` (loaded, or the load error)."""
        ship = self.in_flight[w].pop(wire_id)
        if error is None:
            ship.state = "loaded"
        else:
            ship.state = "failed"
            logger.warning("mask worker %d could not load a grammar (%s); its requests' masks "
                           "are built in the engine process", w, error)
        if ship.live == 0:  # every request using it finished while it was on its way
            self._forget(w, ship)

    def wait_loaded(self, w: int, ship: Shipment) -> None:
        """Block until ``ship`` is acknowledged (direct callers of ``build``/``advance`` only;
        the scheduler asks :meth:`ready` and never waits).

        Raises:
            MaskPoolError: the worker died, could not load the grammar, or did not answer
                within :data:`SHIP_WAIT_S`.
        """
        t0 = time.perf_counter()
        try:
            conn = self._conns[w]
            while ship.state == "shipping":
                if not conn.poll(SHIP_WAIT_S):
                    raise MaskPoolError(f"mask worker {w} did not load a grammar in "
                                        f"{SHIP_WAIT_S:.0f} s")
                self.acknowledge(w, *conn.recv())
        except (EOFError, OSError) as e:
            raise MaskPoolError(f"mask worker {w} died") from e
        finally:
            self.ship_ms += (time.perf_counter() - t0) * 1e3
        if ship.state != "loaded":
            raise MaskPoolError(f"mask worker {w} could not load a grammar")

    def request_stop(self) -> None:
        """Tell the shipping thread to end without serializing what is still queued (never
        blocks); :meth:`join` waits for it. The owner stops its workers in between, so that a
        send the thread is blocked in fails instead of waiting for a worker that no longer
        reads."""
        self._stopping.set()
        self._jobs.put(None)  # wakes a thread waiting for work

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the shipping thread to end (after :meth:`request_stop`);
        True when it has ended. On the thread itself (a finalizer run by a garbage collection
        there) it returns True at once: the thread ends as soon as that call returns.

        Why wait at all: the thread is a daemon, and a daemon thread still inside xgrammar's
        ``serialize_json`` (which releases the GIL) when the interpreter finalizes is ended by
        ``pthread_exit`` as it takes the GIL back, and that forced unwind of its C++ frames ends
        in ``std::terminate``: the whole process aborts ("terminate called without an active
        exception", exit status 134). After
        :meth:`request_stop` at most the one grammar being serialized is left: ~5-30 ms for
        a MaskBench schema."""
        if threading.current_thread() is self._thread:
            return True
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()
