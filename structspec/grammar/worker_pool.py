"""Tree-bitmask builds sharded over worker processes: the parent side (the workers' loop is
:mod:`structspec.grammar.mask_worker`; the types both sides share are in
:mod:`structspec.grammar.pool_types`).

Why processes: the bitmask of a verify tree costs ~6 us per node inside xgrammar's
``traverse_draft_tree`` (one C++ call per request, ~35 us for an 8-node tree), and the host
work of a step must fit under the verify forward to stay hidden. xgrammar releases the GIL
inside the call, but threads do not help: each call is so short that the GIL hand-off between
walking threads costs as much as the walk (measured: two threads 1.08x one; see
benchmarks/README.md). Separate processes share nothing but memory.

Design. Each worker process owns *mirror matchers*: for every constrained request sent to it, a
matcher over the same compiled grammar (shipped once per worker as xgrammar's JSON
serialization) that has accepted exactly the request's committed output ids. A matcher's state
is a function of those ids alone (docs/architecture.md, invariant 3: the matcher accepts each
committed id once, and ids are only ever appended while the request runs; a stop cut finishes
it), so a mirror is kept in step by sending only the ids committed since its last use. Per
build:

1. the host writes the batch's tree links into the shared segment once and sends each worker
   its requests' new ids (a small message);
2. each worker advances its mirrors (the same rules as :meth:`Matcher.accept_run`), walks the
   trees into its rows of a shared-memory bitmask slab, and replies which requests it walked,
   which timed out, and the mirrors' verdicts on the new ids (ids not kept, grammar ended);
3. meanwhile the host runs what the scheduler gives it (the previous step's text work): the
   mirrors *are* the grammar barrier, for host trees (n-gram) and device trees (EAGLE, draft
   model) alike (a device tree's used to run on the host matchers while the tree was on its
   way; on the H200 the tree had arrived by then at batch 8-64): the scheduler lets its
   own matchers lag, replaying the ids only if a later step walks in process; this takes the
   matcher advance (~0.8 ms per step at batch 64) off the scheduler's thread, whose time
   bounds the step for small models. It does not wait for the mirrors' verdicts either: it
   applies the verdicts predicted from the new ids
   (:func:`~structspec.scheduler.commit.settle_grammar_advance`; committed ids obey the
   grammar, so only a stop id ends it) and runs its text work while the workers advance and
   walk; the actual verdicts arrive with the walks and are checked against the prediction;
4. the host settles the rows (:func:`~structspec.grammar.tree_mask.settle_tree_rows_batch`) and
   uploads from the slab. On CUDA the slab is page-locked
   (:func:`structspec.staging.page_lock`), so the upload is an asynchronous copy like the
   in-process path's. With the device gate (:meth:`MaskWorkerPool.build_deferred`,
   :mod:`~structspec.grammar.deferred_build`) the host does not wait for the replies first:
   each worker stores a flag after its rows, the upload waits for the flags on the device, and
   the replies are read after the post graph is queued.

Placement. A request goes, on first sight, to the worker with the fewest live mirrors (the
lowest-numbered on a tie) and stays there until it finishes, so the shares stay even as
requests come and go. Spreading beats packing: the busiest worker's time is the build's
critical path, and a message costs the host only ~20 us (measured on the H200 host, batch 8:
one request on each of 8 workers gave a JSON/no-grammar step ratio of 1.02, four on each of 2
workers 1.07, all 8 on one worker 1.16; see benchmarks/README.md).

Shipping grammars. A worker needs the request's compiled grammar before it can keep a mirror.
Serializing one costs ~5-30 ms (a MaskBench schema; xgrammar's JSON with its token-mask cache,
~0.1-0.4 MB) and deserializing ~3-30 ms, so on traffic where every request brings its own
schema, shipping them inside the build messages stalled the step loop for most of the run
(300 distinct MaskBench schemas, batch 64, H200: 76.9 s with 8 workers against 27.6 s in
process). So grammars travel on a second socket per worker, off the step loop: on first sight
(:meth:`MaskWorkerPool.ready`) a request is placed and, when its worker lacks its grammar, the
grammar is queued to the pool's shipping thread (serialize, send); the worker's loader thread
deserializes it and acknowledges. Until the acknowledgement has been seen
(:meth:`MaskWorkerPool.collect_shipped`, polled once per step) the request is not *ready*: the
caller keeps its grammar work in process (its own matcher, the in-process walk), which gives the
same bitmask. Each shipped grammar has a wire id that is never reused, so a drop and a later
shipment of the same grammar cannot be confused by the two sockets' orders. Placement and
shipping live in :mod:`structspec.grammar.grammar_shipping`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from structspec.draft_tree.layout import parents_from_links
from structspec.env_flags import env_flag
from structspec.grammar.bitmask import bitmask_width
from structspec.grammar.deferred_build import DeferredPoolBuild, InflightBuild
from structspec.grammar.grammar_shipping import GrammarShipper
from structspec.grammar.llg_matcher import LlgCompiled
from structspec.grammar.llg_tokenizer import LlgTokenizerSource
from structspec.grammar.mailbox import MAILBOX_BYTES, WAKE, Mailbox, fence
from structspec.grammar.mailbox import supported as mailbox_supported
from structspec.grammar.pool_types import (
    GATE_FLAG_STRIDE,
    LINK_PLANES,
    GateLayout,
    MaskPoolError,
    PoolBuildResult,
    PoolRequest,
    links_offset,
)
from structspec.staging import page_lock, page_unlock
from structspec.stream_wait import host_device_pointer, stream_wait_supported

__all__ = ["MaskPoolError", "MaskWorkerPool", "PoolBuildResult", "PoolRequest"]

logger = logging.getLogger(__name__)

#: the worker processes' module (run as ``python -m``; see :mod:`~.mask_worker`)
_WORKER_MODULE = "structspec.grammar.mask_worker"

#: how long a mask worker polls for its next message before it sleeps (ms), when the host
#: has a core for every worker and two to spare (:func:`default_spin_ms`): longer than a
#: verify step and than most prefill steps, so a worker stays awake while the engine serves
#: and sleeps within this long of the engine going idle
MASK_WORKER_SPIN_MS = 20.0

#: how often a build waiting on a mailbox reply checks that the worker still runs (s)
WORKER_ALIVE_CHECK_S = 2e-3

#: the longest a build waits for a worker's reply (s) before it counts the worker as failed
#: (a worker stopped or stuck, not dead, would otherwise hold the step loop, and every request,
#: for good): far above any build's work, whose walks are each bounded by the build's time
#: limit (50 ms by default) and whose mirror catch-up runs at ~10 us per id
REPLY_TIMEOUT_S = 10.0

#: ``0`` keeps spinning workers on their sockets (no shared-memory mailboxes; A/B runs)
MAILBOX_ENV = "STRUCTSPEC_MASK_WORKER_MAILBOXES"

#: ``0`` keeps the host's wait for the workers' replies before the bitmask upload (no
#: device-side wait on their flags; A/B runs): :mod:`~structspec.grammar.deferred_build`
DEVICE_WAIT_ENV = "STRUCTSPEC_MASK_DEVICE_WAIT"

#: environment override of the spin window (ms; 0 = always sleep in ``recv``)
SPIN_ENV = "STRUCTSPEC_MASK_WORKER_SPIN_MS"

#: the longest spin window accepted (ms): a window is for the gap between two steps; a longer
#: one only keeps an idle engine's workers spinning longer
MAX_SPIN_MS = 1000.0


def default_spin_ms(num_workers: int, *, gpu_engine: bool = True) -> float:
    """The workers' spin window (ms): ``STRUCTSPEC_MASK_WORKER_SPIN_MS`` when set, else
    :data:`MASK_WORKER_SPIN_MS` for a GPU engine whose process may run on at least
    ``num_workers + 2`` CPUs (one per spinning worker, one for the engine's step loop, one for
    the rest), else 0: spinning workers on fewer cores would take CPU time from the step loop,
    and a CPU engine's torch threads take every core for its forward.

    Raises:
        ValueError: the variable is not a number from 0 to :data:`MAX_SPIN_MS` (a longer
            window would keep an idle engine's workers spinning).
    """
    raw = os.environ.get(SPIN_ENV)
    if raw is not None and raw.strip():
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= MAX_SPIN_MS:  # NaN fails it too
            raise ValueError(f"{SPIN_ENV}={raw!r}: expected milliseconds from 0 to "
                             f"{MAX_SPIN_MS:g}")
        return value
    return MASK_WORKER_SPIN_MS if gpu_engine and usable_cpus() >= num_workers + 2 else 0.0


def usable_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> float:
    """CPUs this process may use: its affinity set, capped by a cgroup v2 CPU quota
    (``cpu.max``: ``"<quota> <period>"``, ``"max <period>"`` for none), as a container's
    ``--cpus`` sets it (the affinity set of such a container still lists every host CPU)."""
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    try:
        quota, period = Path(cgroup_cpu_max).read_text().split()[:2]
        if quota != "max" and float(period) > 0:
            cpus = min(cpus, float(quota) / float(period))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity set
    return cpus


class MaskWorkerPool:
    """Worker processes that build tree bitmasks for shards of the batch.

    Args:
        tokenizer_info: the xgrammar backend's ``xgrammar.TokenizerInfo`` (serialized once per
            worker), or None when no xgrammar grammar is served (``llguidance`` mode).
        llguidance_tokenizer: what the workers build llguidance's tokenizer from (each once,
            ~1 s, off their step loop), or None when no llguidance grammar is served.
        num_workers: processes to start (>= 1).
        vocab_size: logits width (bitmask width ``ceil(vocab_size / 32)``).
        max_rows: largest ``batch * tree_size`` a build may cover (the slab's rows).
        stop_token_ids: the matchers' stop ids (as :class:`~structspec.grammar.matcher.Matcher`).
        pin: page-lock the slab for asynchronous H2D copies (needs CUDA).
        max_rollback_tokens: the llguidance mirrors' deepest rollback (as the host matchers').
        spin_ms: how long a worker polls for its next message, without sleeping, before it
            blocks (ms; each poll yields the CPU): a sleeping worker's wake-up delayed the
            verify step on a slow host (:mod:`~structspec.grammar.mask_worker`). None:
            :func:`default_spin_ms`; 0: always sleep; at most :data:`MAX_SPIN_MS`.

    One build at a time, and each reuses the slab: the caller must not start a build before
    the previous build's upload has run. The scheduler guarantees it: it waits for every
    step's results, which its stream orders after that step's mask upload.

    Raises:
        ValueError: ``num_workers < 1`` or ``max_rows < 1``, ``spin_ms`` outside 0 to
            :data:`MAX_SPIN_MS`, or neither tokenizer given.
        RuntimeError: a worker failed to start.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | None, *, num_workers: int,
                 vocab_size: int, max_rows: int, stop_token_ids: Sequence[int],
                 pin: bool = False, llguidance_tokenizer: LlgTokenizerSource | None = None,
                 max_rollback_tokens: int = 64, spin_ms: float | None = None) -> None:
        if tokenizer_info is None and llguidance_tokenizer is None:
            raise ValueError("a mask worker pool needs tokenizer_info (xgrammar) or "
                             "llguidance_tokenizer (llguidance), or both")
        if (not all(isinstance(v, int) and not isinstance(v, bool)
                    for v in (num_workers, max_rows)) or num_workers < 1 or max_rows < 1):
            # checked before the shared memory exists, so a bad value leaks nothing
            raise ValueError(f"num_workers ({num_workers!r}) and max_rows ({max_rows!r}) must "
                             "be integers >= 1")
        self.num_workers = num_workers
        #: how long a worker polls for its next message before it sleeps (ms)
        if spin_ms is not None and (isinstance(spin_ms, bool)
                                    or not isinstance(spin_ms, int | float)):
            raise ValueError(f"spin_ms ({spin_ms!r}) must be a number of milliseconds")
        self.spin_ms = default_spin_ms(num_workers) if spin_ms is None else float(spin_ms)
        if not 0 <= self.spin_ms <= MAX_SPIN_MS:  # NaN fails it too
            raise ValueError(f"spin_ms ({spin_ms!r}) must be from 0 to {MAX_SPIN_MS:g}")
        # what a replacement pool is built from (:meth:`replacement`)
        self._spawn_args = (tokenizer_info, dict(num_workers=num_workers, vocab_size=vocab_size,
                                                 max_rows=max_rows,
                                                 stop_token_ids=tuple(stop_token_ids), pin=pin,
                                                 llguidance_tokenizer=llguidance_tokenizer,
                                                 max_rollback_tokens=max_rollback_tokens,
                                                 spin_ms=self.spin_ms))
        #: the backends whose grammars the workers can load (:meth:`serves`)
        self.backends = frozenset(
            ({"xgrammar"} if tokenizer_info is not None else set())
            | ({"llguidance"} if llguidance_tokenizer is not None else set()))
        self.width = bitmask_width(vocab_size)
        self.max_rows = max_rows
        links_at = links_offset(max_rows, self.width)
        # Spinning workers take their jobs from shared-memory mailboxes
        # (:mod:`~structspec.grammar.mailbox`): one per worker, after the links, 64-aligned
        mailbox_at = (links_at + LINK_PLANES * max_rows * 8 + 63) // 64 * 64
        use_mailboxes = (self.spin_ms > 0 and mailbox_supported()
                         and env_flag(MAILBOX_ENV))
        #: a deferred build's caps and the workers' flags, after the mailboxes
        self.gate_layout = GateLayout.after(
            mailbox_at + (num_workers * MAILBOX_BYTES if use_mailboxes else 0), max_rows,
            num_workers)
        self._shm = SharedMemory(create=True, size=self.gate_layout.end)
        #: per worker, its mailbox, or None: the sockets carry the jobs and replies
        self.mailboxes: list[Mailbox] | None = (
            [Mailbox(self._shm.buf, mailbox_at + w * MAILBOX_BYTES) for w in range(num_workers)]
            if use_mailboxes else None)
        # per worker, the jobs sent (the replies it owes, read off its mailbox's sequence)
        self._jobs_sent = [0] * num_workers
        #: ``int32 [max_rows, W]`` host view of the shared slab (rows ``[:bs * N]`` per build).
        self.slab = torch.frombuffer(self._shm.buf, dtype=torch.int32,
                                     count=max_rows * self.width).view(max_rows, self.width)
        # int64 [4 * max_rows]: a build's tree links (next_token, next_sibling, draft_tokens,
        # parents as [4, bs, N]), written before its messages go out. Reused per build like
        # the slab. (a numpy view of a torch view: np.frombuffer would export the buffer, and
        # the segment cannot be closed while an export lives)
        self._links = torch.frombuffer(self._shm.buf, dtype=torch.int64,
                                       count=LINK_PLANES * max_rows, offset=links_at).numpy()
        #: ``int64 [max_rows]``: a deferred build's caps per batch row (GateLayout)
        self.caps = torch.frombuffer(self._shm.buf, dtype=torch.int64, count=max_rows,
                                     offset=self.gate_layout.caps_at)
        #: per worker, its flag word (a strided numpy view: one cache line each)
        self.flags = torch.frombuffer(
            self._shm.buf, dtype=torch.int32, count=num_workers * GATE_FLAG_STRIDE // 4,
            offset=self.gate_layout.flags_at).numpy()[:: GATE_FLAG_STRIDE // 4]
        self.pinned = False
        if pin:
            # the whole segment: the device reads the slab, the caps and the flags
            err = page_lock(torch.frombuffer(self._shm.buf, dtype=torch.uint8,
                                             count=self.gate_layout.end))
            self.pinned = err == 0
            if err:  # uploads from pageable memory block the host
                logger.warning("mask worker slab could not be page-locked (CUDA error %s): "
                               "bitmask uploads will be synchronous", err)
        # Fresh interpreters (``python -m``), not fork (the engine may hold CUDA and threads)
        # and not multiprocessing's spawn (it re-runs the user's __main__ module, which
        # builds an engine again unless the script has a main guard); a socketpair each.
        self._stop_set = frozenset(int(t) for t in stop_token_ids)
        init = (None if tokenizer_info is None else tokenizer_info.serialize_json(),
                llguidance_tokenizer, self._shm.name, max_rows, self.width,
                tuple(int(t) for t in stop_token_ids), int(max_rollback_tokens),
                self.spin_ms / 1e3)
        mailbox_offsets = [mailbox_at + w * MAILBOX_BYTES if use_mailboxes else None
                           for w in range(num_workers)]
        gate = self.gate_layout
        gate_offsets = [(gate.caps_at, gate.flags_at + w * GATE_FLAG_STRIDE)
                        for w in range(num_workers)]
        self._conns: list[Connection] = []
        self._ship_conns: list[Connection] = []  # per worker: grammars out, acks back
        self._procs: list[subprocess.Popen[bytes]] = []
        pinned_ptr = self.slab.data_ptr() if self.pinned else 0
        try:
            for w in range(num_workers):
                ours, theirs = socket.socketpair()
                ship_ours, ship_theirs = socket.socketpair()
                proc = subprocess.Popen(
                    [sys.executable, "-m", _WORKER_MODULE, str(theirs.fileno()),
                     str(ship_theirs.fileno())],
                    pass_fds=[theirs.fileno(), ship_theirs.fileno()], stdin=subprocess.DEVNULL)
                theirs.close()
                ship_theirs.close()
                conn = Connection(ours.detach())
                self._conns.append(conn)
                self._ship_conns.append(Connection(ship_ours.detach()))
                self._procs.append(proc)
                conn.send((*init, mailbox_offsets[w], gate_offsets[w]))
            for conn in self._conns:
                reply = conn.recv() if conn.poll(120) else None
                if reply != "ready":
                    raise RuntimeError(f"a mask worker failed to start: {reply!r}")
        except (OSError, EOFError, RuntimeError) as e:  # a worker died at startup
            _shutdown(self._conns, self._ship_conns, self._procs, self._shm, pinned_ptr, None)
            if isinstance(e, RuntimeError):
                raise
            raise RuntimeError(f"a mask worker failed to start: {e!r}") from e
        #: placement of requests on workers and the shipping of their grammars (its own
        #: thread; it holds the grammar sockets, never the pool, so the pool's finalizer
        #: still runs when the pool is dropped)
        self.shipping = GrammarShipper(self._ship_conns)
        self._synced: dict[str, int] = {}  # request key -> output ids its mirror accepted
        self._closed = False
        # workers of the build in progress whose walk reply has not been seen (walks_ready);
        # None outside a build
        self._walks_pending: set[int] | None = None
        # walks_ready asks the kernel once for every worker socket: ``Connection.poll`` goes
        # through a selector built per call (~5 us each on the 2-core VM, against ~1 us for
        # one poll(2) over all eight sockets), and the text work polls every 40 us
        self._reply_poller = select.poll()
        self._worker_of_fd: dict[int, int] = {}
        for w, conn in enumerate(self._conns):
            self._reply_poller.register(conn.fileno(), select.POLLIN)
            self._worker_of_fd[conn.fileno()] = w
        #: builds run so far, and of them deferred ones (metrics, tests)
        self.num_builds = 0
        self.num_deferred_builds = 0
        #: whether a deferred build's upload can wait on the device for the workers' flags
        #: (:meth:`build_deferred`): the segment is page-locked, the host orders plain
        #: stores (x86-64, as for the mailboxes), the driver has stream memory operations,
        #: and ``STRUCTSPEC_MASK_DEVICE_WAIT`` is not ``0``
        self.device_gate = (self.pinned and mailbox_supported() and env_flag(DEVICE_WAIT_ENV)
                            and stream_wait_supported())
        self._flag_device_ptrs: list[int] | None = None  # looked up at first use
        self._gate_seq = 0  # the last deferred build's sequence number (1 to 2**31 - 1)
        #: the deferred build whose replies have not been read yet (at most one)
        self.deferred: DeferredPoolBuild | None = None
        self._before_free: list[Callable[[], None]] = []  # close()'s hooks
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._ship_conns,
                                           self._procs, self._shm,
                                           self.slab.data_ptr() if self.pinned else 0,
                                           self.shipping, self._before_free)

    def release(self, key: str) -> None:
        """Forget a finished request (its mirror is dropped with the worker's next message)."""
        self._synced.pop(key, None)
        self.shipping.release(key)

    def serves(self, compiled: xgr.CompiledGrammar | LlgCompiled) -> bool:
        """Whether the workers can load ``compiled`` (its backend's tokenizer was given)."""
        return ("llguidance" if isinstance(compiled, LlgCompiled) else "xgrammar") \
            in self.backends

    def ready(self, key: str, compiled: xgr.CompiledGrammar | LlgCompiled) -> bool:
        """Whether the request's worker holds its grammar, so that :meth:`build` and
        :meth:`advance` can serve it without waiting (see
        :meth:`~structspec.grammar.grammar_shipping.GrammarShipper.ready`; never blocks).

        Args:
            key: the request's id (stable while it runs).
            compiled: its compiled grammar.
        """
        return self.shipping.ready(key, compiled)

    def collect_shipped(self) -> int:
        """Read the workers' acknowledgements of shipped grammars without blocking; returns
        how many arrived (:meth:`~structspec.grammar.grammar_shipping.GrammarShipper.collect`).

        Raises:
            MaskPoolError: a worker's grammar socket broke (the worker died).
        """
        return self.shipping.collect()

    @property
    def ship_ms(self) -> float:
        """Host time the caller's thread spent on shipping grammars (ms)."""
        return self.shipping.ship_ms

    @property
    def num_shipped(self) -> int:
        """Grammars shipped (one per grammar and worker)."""
        return self.shipping.num_shipped

    @property
    def ship_thread_ms(self) -> float:
        """Time the shipping thread spent serializing and sending grammars (ms; it runs beside
        the step loop, not in it)."""
        return self.shipping.thread_ms

    def num_synced(self, key: str) -> int:
        """Output ids the request's mirror has been sent (0 when it has none)."""
        return self._synced.get(key, 0)

    def build(self, requests: Sequence[PoolRequest | None], next_token: torch.Tensor,
              next_sibling: torch.Tensor, draft_tokens: torch.Tensor, *,
              time_limit_s: float, while_waiting: Any = None,
              advance_only: Sequence[PoolRequest] = (),
              on_verdicts: Callable[[PoolBuildResult], None] | None = None,
              host_rows: Sequence[int] = (),
              parents: torch.Tensor | Callable[[], torch.Tensor] | None = None,
              before_send: Callable[[], None] | None = None) -> PoolBuildResult:
        """Advance the mirrors over the new ids, then fill ``slab[:bs * N]`` with the batch's
        tree bitmasks, each walked request's rows settled by its worker (rejected and
        terminating nodes' rows all ones: ``settle_tree_rows_batch``'s rule, its counts in
        ``PoolBuildResult.settled``); rows of unconstrained requests are all ones.

        Args:
            requests: one per batch row (None = unconstrained, or in ``host_rows``). A request
                not :meth:`ready` makes the build wait for its grammar to load.
            next_token, next_sibling, draft_tokens: ``int64 [bs, N]`` host tree links.
            time_limit_s: per-request walk limit; a request over it gets its rows reset and
                row 0 exact (from the state before the tree), as in the in-process path.
            while_waiting: optional callable run on this process while the workers walk
                (the scheduler's grammar barrier).
            advance_only: requests outside the batch whose mirrors only advance (no tree),
                in the same round trip; their verdicts use indices ``bs + j``.
            on_verdicts: called, right after the messages are sent and before
                ``while_waiting``, with the verdicts *predicted* from the new ids alone, so
                the caller need not wait for the mirrors to advance: every committed id was
                chosen under a mask built from the same grammar state, so a mirror keeps all
                its new ids up to and including the first stop id (which ends the grammar)
                and no id after it. The mirrors' actual verdicts are in the result; rows
                where they differ are in ``mismatched``.
            host_rows: batch rows (with None in ``requests``) that the caller walks itself
                into the slab, in ``while_waiting``: left as the caller writes them (and
                settles them).
            parents: ``int64 [bs, N]`` host parent of each node (-1 for the root), a callable
                returning them (called after ``before_send``), or None: derived from the links
                here (a host walk) when a request has a tree to walk.
            before_send: with ``on_verdicts``: called after the predicted verdicts and before
                the tree links are read and the messages sent (a device tree's links may still
                be on their way when ``build`` is called: this waits for them, doing other
                work meanwhile). When it raises, the messages still go out, without the tree
                (the mirrors take their new ids, as recorded), and the error is raised once
                the replies are read.

        Returns:
            :class:`PoolBuildResult`: batch indices walked (mirror not terminated), those
            whose walk timed out, and the mirrors' verdicts on the new ids.

        Raises:
            ValueError: the batch needs more rows than the slab holds.
            MaskPoolError: a worker died or failed, or the pool is closed.
        """
        return self._start_build(requests, next_token, next_sibling, draft_tokens,
                                 time_limit_s=time_limit_s, while_waiting=while_waiting,
                                 advance_only=advance_only, on_verdicts=on_verdicts,
                                 host_rows=host_rows, parents=parents,
                                 before_send=before_send, gated=False).finish()

    def build_deferred(self, requests: Sequence[PoolRequest | None], next_token: torch.Tensor,
                       next_sibling: torch.Tensor, draft_tokens: torch.Tensor, *,
                       time_limit_s: float, while_waiting: Any = None,
                       advance_only: Sequence[PoolRequest] = (),
                       on_verdicts: Callable[[PoolBuildResult], None] | None = None,
                       host_rows: Sequence[int] = (),
                       parents: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                       before_send: Callable[[], None] | None = None) -> DeferredPoolBuild:
        """:meth:`build`, returning once ``while_waiting`` has run, without reading the
        replies: each busy worker writes its caps (0 for a timed-out walk; this process wrote
        ``N - 1`` for every row before sending) and then its flag after its rows, so the
        upload can wait for the rows on the device
        (:meth:`DeferredPoolBuild.device_waits`) while the host queues the post graph. The
        replies are read by :meth:`DeferredPoolBuild.finish`, which must be called before
        the next build (or :meth:`close`).

        Arguments, and the errors of the send: as for :meth:`build`. When a callback raises,
        the replies are read and the error raised, as there (nothing is deferred).
        """
        return self._start_build(requests, next_token, next_sibling, draft_tokens,
                                 time_limit_s=time_limit_s, while_waiting=while_waiting,
                                 advance_only=advance_only, on_verdicts=on_verdicts,
                                 host_rows=host_rows, parents=parents,
                                 before_send=before_send, gated=True)

    def _start_build(self, requests: Sequence[PoolRequest | None], next_token: torch.Tensor,
                     next_sibling: torch.Tensor, draft_tokens: torch.Tensor, *,
                     time_limit_s: float, while_waiting: Any,
                     advance_only: Sequence[PoolRequest],
                     on_verdicts: Callable[[PoolBuildResult], None] | None,
                     host_rows: Sequence[int],
                     parents: torch.Tensor | Callable[[], torch.Tensor] | None,
                     before_send: Callable[[], None] | None,
                     gated: bool) -> DeferredPoolBuild:
        """:meth:`build` and :meth:`build_deferred` up to the replies."""
        if self.deferred is not None:
            raise MaskPoolError("a deferred build's replies were never read")
        bs, n = next_token.shape
        if bs * n > self.max_rows:
            raise ValueError(f"a build of {bs} x {n} rows exceeds the slab's {self.max_rows}")
        if before_send is not None and on_verdicts is None:
            raise ValueError("before_send needs on_verdicts (it runs after the verdicts)")

        def write_links() -> None:
            # The links go through shared memory (pickling them per worker cost the host ~20
            # us a message); jobs carry only ints and the new ids. Safe to overwrite: the
            # previous build read every reply, so no worker still reads them.
            links = self._links[: LINK_PLANES * bs * n].reshape(LINK_PLANES, bs, n)
            for i, part in enumerate((next_token, next_sibling, draft_tokens)):
                links[i] = part.numpy()
            tree_parents = parents() if callable(parents) else parents
            if tree_parents is None and any(req is not None for req in requests):
                tree_parents = parents_from_links(next_token, next_sibling)  # a tree to walk
            if tree_parents is not None:
                links[3] = tree_parents.numpy()

        # The unconstrained rows are all ones: written before the send (no worker writes
        # them), so that a deferred upload finds them ready.
        skip = set(host_rows)
        unconstrained = [b for b, req in enumerate(requests) if req is None and b not in skip]
        if unconstrained:
            self.slab[: bs * n].view(bs, n, self.width)[unconstrained] = -1
        gate_seq = 0
        if gated:
            self._gate_seq = gate_seq = self._gate_seq % 0x7FFFFFFF + 1
            self.caps[:bs] = n - 1  # the workers write 0 over a timed-out walk's
        if before_send is None:
            write_links()
            prepare = None
        else:
            def prepare() -> None:
                before_send()
                write_links()
        inflight = self._send([*requests, *advance_only], True, bs, n, time_limit_s,
                              while_waiting, on_verdicts, prepare, gate_seq)
        pending = DeferredPoolBuild(self, inflight, bs, n, gate_seq)
        if gated:
            self.deferred = pending
            self.num_deferred_builds += 1
            # until its replies are read, freeing the segment (close, or the finalizer of a
            # pool dropped meanwhile) releases its flags first
            self._before_free.append(pending.release)
        return pending

    def advance(self, requests: Sequence[PoolRequest | None]) -> PoolBuildResult:
        """Advance the mirrors over the new ids only (no tree, no rows written): the grammar
        barrier of a step that builds no tree mask (before a prefill).

        Returns:
            :class:`PoolBuildResult` with the verdicts (``walked``/``timed_out`` empty).

        Raises:
            MaskPoolError: a worker died or failed, or the pool is closed.
        """
        if self.deferred is not None:
            raise MaskPoolError("a deferred build's replies were never read")
        return self._collect(self._send(requests, False, 0, 0, 0.0, None, None))

    def _send(self, requests: Sequence[PoolRequest | None], has_tree: bool, bs: int,
              n: int, time_limit_s: float, while_waiting: Any,
              on_verdicts: Callable[[PoolBuildResult], None] | None,
              before_send: Callable[[], None] | None = None, gate_seq: int = 0,
              ) -> InflightBuild:
        """Send each worker its requests' new ids (``has_tree``: the shared ``[4, bs, N]`` tree
        links hold a tree to walk; rows ``>= bs`` advance only), call ``on_verdicts`` with the
        predicted verdicts and run ``while_waiting``; the replies (one per worker, after it
        advanced and walked) are :meth:`_collect`'s. With ``before_send`` the verdicts go
        first, then ``before_send`` (it writes the links), then the messages (without the tree
        when it raised). When a callback raises, the replies are read and then the error
        raised (the protocol is kept). ``gate_seq``: a deferred build's number (0: none)."""
        if self._closed:
            raise MaskPoolError("the mask worker pool is closed")
        jobs: list[list[tuple]] = [[] for _ in range(self.num_workers)]
        # per row with new ids, when predictions are wanted: (ids not kept, grammar ended) as
        # predicted, and the ids sent in all
        predicted: dict[int, tuple[int, bool]] = {}
        sent_total: dict[int, int] = {}
        # this loop runs over the whole batch every step on the engine's thread: locals for
        # what every request touches, and a new-id run without a stop id (nearly all of
        # them) predicted by one set probe
        synced, place, stop_set = self._synced, self.shipping.place, self._stop_set
        predict = on_verdicts is not None
        for b, req in enumerate(requests):
            if req is None:
                continue
            key = req.key
            w, ship = place(key, req.compiled)
            if ship.state != "loaded":  # a direct caller that did not ask ready(): wait
                self.shipping.wait_loaded(w, ship)
            done = synced.get(key, 0)
            ids = req.output_ids
            new_ids = ids[done:] if type(ids) is list else list(ids[done:])  # a copy either way
            total = synced[key] = done + len(new_ids)
            jobs[w].append((b, key, ship.wire_id, new_ids))
            if new_ids and predict:
                sent_total[b] = total
                predicted[b] = ((0, False) if stop_set.isdisjoint(new_ids)
                                else self._predict(new_ids))
        verdicts = PoolBuildResult(
            [], [], rejected={b: r for b, (r, _) in predicted.items() if r},
            terminated=[b for b, (_, ended) in predicted.items() if ended])
        failed: BaseException | None = None
        if before_send is not None:
            # the ids are counted as sent (``_synced``): they go out whatever happens here
            try:
                if on_verdicts is not None:
                    on_verdicts(verdicts)
                before_send()
            except BaseException as e:  # noqa: BLE001 - raised after the replies are read
                failed, has_tree = e, False
        busy = []
        t_send = time.perf_counter()
        for w, job in enumerate(jobs):
            if job or self.shipping.released[w]:
                released, dropped = self.shipping.take_drops(w)
                if gate_seq and has_tree:
                    # cleared first: a flag left from a build 2**31 - 1 builds ago must not
                    # match (that build's device waits ended before its step's results)
                    self.flags[w] = 0
                self._send_job(w, (job, released, dropped, bs, n, has_tree, time_limit_s,
                                   gate_seq if has_tree else 0))
                busy.append(w)
        inflight = InflightBuild(busy, predicted, sent_total, on_verdicts is not None, t_send,
                                 PoolBuildResult([], [], send_ms=(time.perf_counter() - t_send)
                                                 * 1e3))
        self._walks_pending = set(busy)
        try:
            if failed is not None:
                raise failed
            if on_verdicts is not None and before_send is None:  # else applied above
                on_verdicts(verdicts)
            if while_waiting is not None:
                while_waiting()
        except BaseException:
            self._collect(inflight)  # read the replies even when a callback raised
            raise
        finally:
            self._walks_pending = None
        return inflight

    def _collect(self, inflight: InflightBuild) -> PoolBuildResult:
        """Read a sent build's replies (one per busy worker) and check the predictions.

        Raises:
            MaskPoolError: a worker died or failed.
        """
        out = inflight.out
        starts, ends = [], []
        for w in inflight.busy:
            (rejected, terminated, walked, timed_out, settled, t_start,
             t_end) = self._recv(w)
            out.rejected.update(rejected)
            out.settled.update(settled)
            out.terminated += terminated
            out.worker_busy_ms.append((t_end - t_start) * 1e3)
            starts.append(t_start)
            ends.append(t_end)
            out.walked += walked
            out.timed_out += timed_out
        t_send = inflight.t_send
        if inflight.busy:
            out.read_ms = (time.perf_counter() - t_send) * 1e3
            out.first_start_ms = (min(starts) - t_send) * 1e3
            out.last_reply_ms = (max(ends) - t_send) * 1e3
        self.num_builds += 1
        ended = set(out.terminated)
        # Only predictions are checked. A row sent no new ids reports a mirror that ended
        # earlier: the verdict that ended it also finished its request.
        predicted = inflight.predicted
        for b in predicted.keys() | (out.rejected.keys() if inflight.checked else ()):
            actual = (out.rejected.get(b, 0), b in ended)
            if actual != predicted.get(b, (0, False)):
                out.mismatched[b] = (inflight.sent_total.get(b, 0), *actual)
        out.terminated.sort()
        out.walked.sort()
        out.timed_out.sort()
        return out

    def flag_device_pointers(self) -> list[int]:
        """Per worker, the device address of its flag word (looked up once, on the calling
        thread's CUDA context).

        Raises:
            RuntimeError: the segment is not page-locked, or the driver refused.
        """
        if not self.pinned:
            raise RuntimeError("the mask worker slab is not page-locked")
        if self._flag_device_ptrs is None:
            base = self.slab.data_ptr() + self.gate_layout.flags_at
            self._flag_device_ptrs = [host_device_pointer(base + w * GATE_FLAG_STRIDE)
                                      for w in range(self.num_workers)]
        return self._flag_device_ptrs

    def _predict(self, new_ids: list[int]) -> tuple[int, bool]:
        """The mirror's verdict on ``new_ids`` when they obey the grammar: all kept up to and
        including the first stop id, which ends the grammar; none after it."""
        for i, tok in enumerate(new_ids):
            if tok in self._stop_set:
                return len(new_ids) - i - 1, True
        return 0, False

    def walks_ready(self) -> bool:
        """Whether every worker of the build in progress has replied with its walks, so the
        build would return without blocking. For ``while_waiting`` callbacks that can stop
        early and finish their work after the mask upload. Without blocking: the mailboxes'
        sequence numbers, or one ``poll(2)`` over the worker sockets (~1 us); False outside a
        build (a caller then keeps going). A dead worker's socket counts as ready: the
        build's ``recv`` reports it."""
        pending = self._walks_pending
        if pending is None:
            return False
        if pending and self.mailboxes is not None:
            for w in [w for w in pending if self._has_reply(w)]:
                pending.discard(w)
        elif pending:
            try:
                events = self._reply_poller.poll(0)
            except OSError:  # interrupted: not ready yet, the caller asks again
                return False
            for fd, _ in events:  # readable, hung up or closed alike
                pending.discard(self._worker_of_fd.get(fd, -1))
        return not pending

    def _has_reply(self, w: int) -> bool:
        """Whether worker ``w``'s mailbox holds its reply (its sequence moved)."""
        assert self.mailboxes is not None
        return self.mailboxes[w].seq_out() == self._jobs_sent[w]

    def _send_job(self, w: int, msg: tuple) -> None:
        """Send worker ``w`` a job: into its mailbox (a message too large for it goes over
        the socket, announced in the mailbox first), waking it over the socket when it
        sleeps; without mailboxes over the socket. Raises MaskPoolError when it died."""
        mb = None if self.mailboxes is None else self.mailboxes[w]
        try:
            if mb is None:
                self._conns[w].send(msg)
                self._jobs_sent[w] += 1
                return
            # counted once posted or announced (a payload that fails to pickle is neither,
            # and must not leave the build waiting for a reply that never comes)
            if mb.post(msg):
                self._jobs_sent[w] += 1
            else:
                mb.post_on_socket()  # announced first: the worker then waits on the socket
                self._jobs_sent[w] += 1
                self._conns[w].send(msg)
            fence()  # the post's stores before the state's load (mailbox module doc)
            if mb.asleep():
                self._conns[w].send(WAKE)
        except OSError as e:  # a dead worker's socket: broken pipe / reset
            raise MaskPoolError(f"mask worker {w} died") from e

    def _recv(self, w: int) -> Any:
        """Worker ``w``'s next reply; raises MaskPoolError when it died or failed."""
        try:
            reply = self._read_reply(w)
        except (EOFError, OSError) as e:
            raise MaskPoolError(f"mask worker {w} died") from e
        if isinstance(reply, BaseException):
            raise MaskPoolError(f"mask worker {w} failed: {reply!r}") from reply
        return reply

    def _read_reply(self, w: int) -> Any:
        """Worker ``w``'s next reply as it sent it. From its mailbox: this thread polls the
        outbox's sequence without sleeping (the workers' replies come within a step; the
        thread has nothing else to do meanwhile), checking every
        :data:`WORKER_ALIVE_CHECK_S` that the worker still runs. Else from its socket.

        Raises:
            EOFError: the worker exited, or its socket closed.
            MaskPoolError: no reply within :data:`REPLY_TIMEOUT_S` (the worker is stuck or
                stopped; the caller drops the pool, whose close kills it).
        """
        if self.mailboxes is None:
            if not self._conns[w].poll(REPLY_TIMEOUT_S):
                raise MaskPoolError(f"mask worker {w} did not reply within "
                                    f"{REPLY_TIMEOUT_S:g} s")
            return self._conns[w].recv()
        mb, want = self.mailboxes[w], self._jobs_sent[w]
        t0 = time.perf_counter()
        next_check = t0 + WORKER_ALIVE_CHECK_S
        while mb.seq_out() != want:
            now = time.perf_counter()
            if now >= next_check:
                code = self._procs[w].poll()
                if code is not None and mb.seq_out() != want:
                    raise EOFError(f"mask worker {w} exited with status {code}")
                if now - t0 > REPLY_TIMEOUT_S:
                    raise MaskPoolError(f"mask worker {w} did not reply within "
                                        f"{REPLY_TIMEOUT_S:g} s")
                next_check = now + WORKER_ALIVE_CHECK_S
            os.sched_yield()
        in_box, reply = mb.read_out()
        return reply if in_box else self._conns[w].recv()

    def replacement(self) -> MaskWorkerPool:
        """A new pool with this one's settings and fresh workers (no request placed): what the
        scheduler starts, off its thread, after this pool failed. Takes about as long as a
        worker's start (~1-2 s).

        Raises:
            RuntimeError: a worker failed to start.
        """
        tokenizer_info, kwargs = self._spawn_args
        return MaskWorkerPool(tokenizer_info, **kwargs)

    def close(self, before_free: Callable[[], None] | None = None) -> None:
        """Stop the workers and free the slab (idempotent).

        Args:
            before_free: run once the workers have exited and before the segment is unlocked
                and freed (a deferred build's failure path writes the rows there and releases
                the flags the device waits on, in place of the deferred build's own release).
                Without it, a deferred build still unread has its flags released and, when
                the device waits on them, the device is synchronized first: the segment must
                outlive every copy out of it.
        """
        self._closed = True
        pending = self.deferred
        if before_free is not None:
            if pending is not None and pending.release in self._before_free:
                self._before_free.remove(pending.release)  # before_free releases them
            self._before_free.append(before_free)
        self._finalizer()


#: seconds the pool's shutdown waits for its workers to exit (all of them together) before
#: killing the rest: a worker exits within milliseconds of reading the stop message
#: (``os._exit``, no interpreter shutdown: :mod:`~.mask_worker`), after the job it may be
#: running
WORKER_EXIT_S = 2.0
#: seconds the shutdown waits for the shipping thread after the workers are gone: at most one
#: grammar's serialization is left (:meth:`GrammarShipper.join`)
SHIPPER_EXIT_S = 10.0


def _shutdown(conns: list[Connection], ship_conns: list[Connection],
              procs: list[subprocess.Popen[bytes]], shm: SharedMemory, pinned_ptr: int,
              shipping: GrammarShipper | None,
              before_free: Sequence[Callable[[], None]] = ()) -> None:
    """Stop the shipping thread and the workers, unlock the slab (``pinned_ptr``: its address,
    0 when not locked) and free the shared segment (the pool's finalizer; also run at
    interpreter exit for a pool never closed).

    Every wait is bounded, and every thread and process of the pool has ended when it returns
    (a worker that does not exit in time is killed and reaped). The order matters: the
    shipping thread is told to stop first (it drops its queue), then the workers go (a send
    the thread is blocked in then fails), then the thread is joined, and only then are the
    grammar sockets closed, so that no socket is closed under a send in progress."""
    if shipping is not None:
        shipping.request_stop()
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + WORKER_EXIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # wedged: do not wait longer
            logger.warning("mask worker %d did not exit within %.0f s of the stop message; "
                           "killing it", proc.pid, WORKER_EXIT_S)
            proc.kill()
            try:  # SIGKILL ends it at once; reap it, so no zombie stays behind
                proc.wait(timeout=WORKER_EXIT_S)
            except subprocess.TimeoutExpired:
                logger.error("mask worker %d did not end after SIGKILL", proc.pid)
    if shipping is not None and not shipping.join(SHIPPER_EXIT_S):
        logger.warning("the grammar shipping thread is still serializing a grammar after "
                       "%.0f s", SHIPPER_EXIT_S)
    for conn in ship_conns:
        try:
            conn.close()
        except (OSError, ValueError):
            pass
    for hook in before_free:  # the workers are gone: nothing else writes the segment now
        try:
            hook()
        except Exception:  # the segment is freed all the same
            logger.exception("a mask worker pool's before_free hook failed")
    if pinned_ptr:
        page_unlock(pinned_ptr)
    shm.close()
    shm.unlink()
