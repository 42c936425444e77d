"""Torch's intra-op threads in the engine process.

CPU engine: one per physical core this process may run on. A CPU decode step of a small model
is a chain of small GEMMs bound by memory bandwidth; a second hardware thread of the same core
(SMT) adds no bandwidth and makes every OpenMP barrier wait for the slower sibling, so torch's
threads are set to the physical cores of the process's CPU affinity set (torch's own default
counts logical CPUs on some builds and ignores the affinity mask on others).

GPU engine: one. Its host-side torch work is bookkeeping on small CPU tensors (tree links,
bitmask rows, staging copies), yet a host op past torch's grain size (a batch's bitmask slab,
``64 x 8 x 1,536`` words, filled or copied) wakes one OpenMP thread per core, and those spin
after the region ends: on a 16-core GPU host, 16 spinning threads beside the step loop, the
grammar's mask worker processes and its compile threads. vLLM's GPU workers make the same
choice (``OMP_NUM_THREADS=1`` unless set, "to avoid unnecessary CPU contention").

``OMP_NUM_THREADS`` set by the user wins on both: the engine leaves the count alone then.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["physical_cores", "set_cpu_threads", "set_gpu_host_threads"]


def physical_cores(cpus: set[int] | None = None) -> int:
    """Distinct physical cores among ``cpus`` (default: this process's affinity set).

    Read from ``/sys/devices/system/cpu/cpuN/topology/{physical_package_id,core_id}``; a CPU
    whose topology cannot be read counts as its own core. At least 1.
    """
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(
            range(os.cpu_count() or 1))
    cores: set[tuple[str, str] | int] = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(cpu)
    return max(1, len(cores))


def set_cpu_threads() -> int:
    """Set torch's intra-op threads to :func:`physical_cores` unless ``OMP_NUM_THREADS`` is
    set; returns the thread count in effect. Process-wide (torch's setting is global)."""
    if not os.environ.get("OMP_NUM_THREADS"):
        n = physical_cores()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return torch.get_num_threads()


def set_gpu_host_threads() -> int:
    """A GPU engine's host threads (module doc): torch's intra-op threads set to 1 unless
    ``OMP_NUM_THREADS`` is set; returns the thread count in effect. Process-wide."""
    if not os.environ.get("OMP_NUM_THREADS") and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return torch.get_num_threads()
