"""Session-wide test settings."""

from __future__ import annotations

import os
import sys
import warnings

# Idle OpenMP threads sleep instead of spinning. Must be set before torch loads libgomp (it
# reads the variable once, then): on a 2-core machine shared with anything else (the server
# and mask-worker processes these tests start, or other jobs) spinning threads steal the
# cores their partners need, and a batch of CPU forwards took ~10x the CPU time (55 s vs 5 s
# for 8 x 32 greedy tokens of SmolLM2 beside other jobs). Child processes inherit it.
# Numerics are unchanged: it only decides how a thread waits for work.
if "torch" in sys.modules:  # a plugin loaded it first: the setting would come too late
    warnings.warn("torch was imported before tests/conftest.py: OMP_WAIT_POLICY not applied",
                  stacklevel=1)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (the README's ``-n 2``) the workers split the cores: torch threads per
# worker = cores // workers. The suite's CPU forwards are small-row fp32 GEMMs that one thread
# runs as fast as two on the 2-core CI machines (benchmarks/README.md, "fp32 linear by row
# count"), so two one-thread workers do twice the work of one two-thread process; two
# two-thread workers would oversubscribe the cores. The engines (structspec/engine/
# cpu_threads.py) and the server processes these tests start honour OMP_NUM_THREADS.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))
# No GC freeze at each engine start (structspec/engine/gc_heap.py): its full collection costs
# ~0.2-0.3 s per engine, and the suite builds hundreds (engine processes of the server tests
# inherit it). tests/engine/test_gc_heap.py turns it on where it tests it.
os.environ.setdefault("STRUCTSPEC_GC_FREEZE", "0")

import torch  # noqa: E402

# Same as LLMEngine on CPU: flush float32 denormals before torch starts its thread pool
# (threads inherit the flag), so CPU forwards in tests run at full speed.
torch.set_flush_denormal(True)
