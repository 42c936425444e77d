"""The train stage under ``torchrun``: one process per GPU, joined by ``torch.distributed``.

``torchrun --nproc-per-node N -m structspec train-eagle --stage train ...`` starts N processes
with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (and the rendezvous address) in their
environment. :func:`init_distributed` reads them, binds the process to GPU ``LOCAL_RANK``
(NCCL) or keeps it on the CPU (gloo, ``--device cpu``), and joins the process group; without
``WORLD_SIZE`` > 1 nothing is initialised and training runs as one process.

Every decision that ends the loop is rank 0's (:func:`reduce_step`): its clock alone measures
the time limit, and its verdict travels in the same all-reduce as the step's statistics, so
all ranks stop after the same step and none waits for a collective that never comes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """This process's place in the training job.

    Attributes:
        rank: global rank (0 writes the log, checkpoints and the export).
        world: processes in the job (1: no process group).
        local_rank: rank on this host (the GPU index it uses).
        backend: ``nccl``, ``gloo``, or "" without a process group.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def is_main(self) -> bool:
        """Whether this process writes the job's files and lines (rank 0)."""
        return self.rank == 0


def launched_world_size() -> int:
    """``WORLD_SIZE`` of the environment (``torchrun`` sets it), 1 when unset.

    Raises:
        ValueError: it is not a positive integer.
    """
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(f"WORLD_SIZE={text!r}: expected a positive integer (set by torchrun)")
    return world


def rank_device(device: str, local_rank: int) -> str:
    """The device of the process with ``local_rank`` for the config's ``device``: ``auto``
    and ``cuda`` -> ``cuda:LOCAL_RANK`` (``auto`` without CUDA -> ``cpu``); ``cpu`` stays.

    Raises:
        ValueError: ``cuda:N`` (one device for every rank), or CUDA asked for but absent or
            with fewer devices than ``local_rank + 1`` (naming ``device``).
    """
    if device == "cpu":
        return "cpu"
    if device.startswith("cuda:"):
        raise ValueError(f"device={device!r}: under torchrun each rank uses GPU LOCAL_RANK: "
                         f"use --device cuda (or auto) and choose the GPUs with "
                         f"CUDA_VISIBLE_DEVICES")
    if device == "auto" and not torch.cuda.is_available():
        return "cpu"
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"device={device!r}: local rank {local_rank} needs GPU {local_rank}, "
                         f"{count} CUDA devices are visible")
    return f"cuda:{local_rank}"


def init_distributed(device: str) -> tuple[DistContext, str]:
    """Join ``torchrun``'s process group when ``WORLD_SIZE`` > 1.

    Args:
        device: the config's ``device``.

    Returns:
        ``(context, device)``: this process's :class:`DistContext` and the device string it
        trains on (``cuda:LOCAL_RANK`` or ``cpu``); ``(DistContext(), device)`` unchanged
        for one process.

    Raises:
        ValueError: see :func:`launched_world_size` and :func:`rank_device`.
    """
    world = launched_world_size()
    if world == 1:
        return DistContext(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = rank_device(device, local)
    if dev.startswith("cuda"):
        # NVLink multicast (NVLS) can put a shared host's GPUs out of service: keep it off
        # unless the launcher decided otherwise.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        backend = "nccl"
    else:
        dist.init_process_group("gloo")
        backend = "gloo"
    return DistContext(rank=rank, world=world, local_rank=local, backend=backend), dev


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (no barrier: after an error the other ranks may never come);
    nothing for one process."""
    if ctx.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op for one process)."""
    if ctx.world > 1:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.local_rank])
        else:
            dist.barrier()


def reduce_step(values: torch.Tensor, stop: bool, ctx: DistContext) -> tuple[torch.Tensor, bool]:
    """Sum one step's statistics over the ranks and agree on rank 0's stop decision.

    Args:
        values: ``[n]`` float64 per-rank sums (losses, agreement counts, tokens...), on the
            process group's device (the GPU for NCCL, the CPU for gloo).
        stop: this rank's verdict; only rank 0's counts.

    Returns:
        ``(sums, stop)``: ``[n]`` float64 sums over all ranks (``values`` itself for one
        process) and rank 0's verdict, the same on every rank.
    """
    if ctx.world == 1:
        return values, stop
    flag = torch.tensor([1.0 if (stop and ctx.is_main) else 0.0], dtype=torch.float64,
                        device=values.device)
    packed = torch.cat((values.to(torch.float64), flag))
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return packed[:-1], bool(packed[-1].item() > 0)
