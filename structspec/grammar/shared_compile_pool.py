"""One grammar compile pool per process and settings, shared by the xgrammar backends that ask
for the same one.

A :class:`~structspec.grammar.compile_pool.CompilePool` starts a zygote process that imports
xgrammar and torch (~2.5 s of CPU) and forks its workers from it. A served engine builds one
backend, but a process that builds several engines for the same tokenizer (a test session, a
benchmark comparing configurations, a notebook) paid that start for each and kept one idle set
of processes per engine. Backends take their pool here instead: the first
:func:`acquire_compile_pool` for a set of settings starts it, later ones share it, and the
last :func:`release_compile_pool` closes it, so the processes still go when the last engine
using them closes (and at interpreter exit, through the backends' finalizers and the exit hook
below). Sharing changes no guarantee of a single backend: each job keeps its own request's
time limit and lane, and a backend that shuts down cancels its own jobs
(:meth:`CompilePool.cancel`) while the others' go on.

Settings are the pool's constructor arguments: the tokenizer (its serialized
``xgrammar.TokenizerInfo``, hashed), the logits width, the stop ids, the JSON whitespace option
and the lane sizes. A pool whose compile processes failed is not handed out again: the next
acquire starts a fresh one. A forked child forgets its parent's pools (their dispatcher
threads do not exist in it).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
from collections.abc import Sequence

from structspec.grammar.compile_pool import CompilePool

_PoolKey = tuple[str, int, tuple[int, ...], bool, int, int, float]

_lock = threading.Lock()
_current: dict[_PoolKey, CompilePool] = {}  # the pool handed out for each settings
_users: dict[CompilePool, int] = {}  # live acquires per pool (a replaced one keeps its own)
_key_of: dict[CompilePool, _PoolKey] = {}


def acquire_compile_pool(tokenizer_info_json: str, *, vocab_size: int,
                         stop_token_ids: Sequence[int], any_whitespace: bool,
                         general_workers: int, small_workers: int,
                         small_slice_s: float) -> CompilePool:
    """The process's compile pool for these settings (see :class:`CompilePool` for the
    arguments), started on first use; every call must be paired with one
    :func:`release_compile_pool` of the returned pool."""
    key: _PoolKey = (hashlib.sha256(tokenizer_info_json.encode()).hexdigest(), int(vocab_size),
                     tuple(int(t) for t in stop_token_ids), bool(any_whitespace),
                     max(1, int(general_workers)), max(0, int(small_workers)),
                     float(small_slice_s))
    with _lock:
        pool = _current.get(key)
        if pool is None or not pool.usable():
            pool = CompilePool(tokenizer_info_json, vocab_size=vocab_size,
                               stop_token_ids=stop_token_ids, any_whitespace=any_whitespace,
                               general_workers=general_workers, small_workers=small_workers,
                               small_slice_s=small_slice_s)
            _current[key] = pool
            _key_of[pool] = key
        _users[pool] = _users.get(pool, 0) + 1
        return pool


def release_compile_pool(pool: CompilePool) -> None:
    """Give back one :func:`acquire_compile_pool` of ``pool``; the last one closes it (its
    queued and running jobs fail, its processes are killed). A pool this process never
    handed out (or already closed at exit) is closed directly; idempotent for it."""
    with _lock:
        users = _users.get(pool)
        if users is not None and users > 1:
            _users[pool] = users - 1
            return
        _users.pop(pool, None)
        key = _key_of.pop(pool, None)
        if key is not None and _current.get(key) is pool:
            del _current[key]
    pool.close()  # outside the lock: joins the dispatcher (up to seconds)


def shared_pool_users(pool: CompilePool) -> int:
    """How many backends hold ``pool`` now (0: none, or not a shared pool)."""
    with _lock:
        return _users.get(pool, 0)


def _close_all() -> None:
    """Exit hook: close every pool still held (a backend that was never shut down and is
    still referenced at exit; its own finalizer may come later and is then a no-op)."""
    with _lock:
        pools = list(_users)
        _users.clear()
        _current.clear()
        _key_of.clear()
    for pool in pools:
        pool.close()


def _forget_after_fork() -> None:
    """In a forked child: the parent's pools are not ours (no dispatcher thread here)."""
    global _lock
    _lock = threading.Lock()  # it may have been held by another thread at the fork
    _current.clear()
    _users.clear()
    _key_of.clear()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_after_fork)
