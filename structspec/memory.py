"""Refuse allocations that cannot fit, with one clear message, before making them."""

from __future__ import annotations

import os

import torch

GIB = 1 << 30


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes: ``cudaMemGetInfo`` on CUDA, ``MemAvailable`` of
    ``/proc/meminfo`` on the CPU (None when it cannot be read)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(num_bytes: int, device: torch.device, what: str, hint: str) -> None:
    """Raise before allocating ``num_bytes`` on ``device`` when they cannot fit.

    Raises:
        MemoryError: naming ``what``, the sizes in GiB and ``hint`` (what to change).
    """
    free = available_bytes(device)
    if free is not None and num_bytes > free:
        raise MemoryError(f"{what} needs {num_bytes / GIB:.1f} GiB on {device} but only "
                          f"{free / GIB:.1f} GiB are free; {hint}")
