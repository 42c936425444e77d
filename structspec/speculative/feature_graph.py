"""CUDA graphs of EAGLE's feature store after a verify: one replay for its kernels.

After every verify the EAGLE drafter stores the target features of the verified rows
(:meth:`~structspec.speculative.eagle.EagleDrafter.on_target_hidden`): concatenate the aux
layers, gather the rows of node 0 and the accepted path, project them (``fc``), and
``index_copy_`` them into the per-slot feature table. At batch 1 on the H200 host that was
~0.5 ms of host launches per step (``host_step_cost.py``: 487 us), for a few microseconds of
GPU work, and an EAGLE step at batch 1 is bound by its host. Captured, it is one H2D copy of
the destination slots (computed on the host, from the page table) and one graph replay.

**What a graph reads.** Its inputs are the verify's outputs (hidden states, aux hidden states,
``accept_nodes``). When the verify and its post step replay from CUDA graphs those are static
buffers: the same addresses, shapes and strides every step of a batch bucket. A graph is keyed
by exactly that (address, shape, stride, dtype of every input, and the slot count), so a replay
reads the tensors the caller passed, wherever they came from: an eager verify's fresh outputs
that land at a new address simply miss. To keep eager verifies from capturing graph after
graph, a key is captured only when it is seen a second time (its first sighting runs eagerly);
at most :data:`MAX_STORE_GRAPHS` graphs are kept (then the rest run eagerly).

**Order.** The slots reach the graph's static slot buffer through the drafter's pinned ring
(non-blocking copy on the current stream, queued before the replay on that stream), so the
replay reads this step's slots; the ring waits for a slot's previous copy before refilling it.
Capture syncs the device (once per key, like the other graphs); a replay never does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from structspec.runner.cuda_graph import capture_after_warmup
from structspec.staging import PinnedRing

#: graphs kept per drafter (a batch bucket x verify tree size each, in practice)
MAX_STORE_GRAPHS = 64

#: uncaptured keys remembered (first sightings); cleared when full
MAX_PENDING_KEYS = 256

#: ``store(sources, rows, slots_gpu)``: the eager store (writes the feature table)
StoreFn = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor], None]

_Key = tuple[object, ...]


def _tensor_key(t: torch.Tensor) -> tuple[object, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class FeatureStoreGraphs:
    """The feature-store graphs of one drafter (CUDA only).

    Args:
        device: the drafter's CUDA device.
        ring: a pinned int64 ring for the slot uploads (the drafter's staging ring).
        max_graphs: graphs kept; further keys run eagerly.
    """

    def __init__(self, device: torch.device, ring: PinnedRing, *,
                 max_graphs: int = MAX_STORE_GRAPHS) -> None:
        self.device = device
        self.ring = ring
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        #: key -> (graph, its static ``[S]`` int64 slot buffer)
        self._graphs: dict[_Key, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._seen: set[_Key] = set()
        #: replays and eager runs so far (tests, benchmarks)
        self.replays = 0
        self.eager_runs = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def store(self, store: StoreFn, sources: Sequence[torch.Tensor], rows: torch.Tensor,
              slots: np.ndarray) -> None:
        """Run ``store(sources, rows, slots_gpu)`` for this step: a replay when its key was
        captured, a capture on the key's second sighting, else eagerly.

        Args:
            store: the eager store; must read only ``sources``, ``rows``, ``slots_gpu`` and
                fixed tensors (weights, the feature table), and write only the table.
            sources: the feature sources (``[B, Q, H]`` each; the aux hidden states, or the
                final hidden states), on ``device``.
            rows: ``[B, R]`` int64 query row per stored position, on ``device``.
            slots: ``[B * R]`` (any shape of that size) int64 destination slots, host.
        """
        flat = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        key = (*(_tensor_key(t) for t in sources), _tensor_key(rows), flat.size)
        hit = self._graphs.get(key)
        if hit is not None:
            graph, slots_gpu = hit
            self._upload(flat, slots_gpu)
            graph.replay()
            self.replays += 1
            return
        capture = key in self._seen and len(self._graphs) < self.max_graphs
        slots_gpu = torch.empty(flat.size, dtype=torch.int64, device=self.device)
        self._upload(flat, slots_gpu)
        if not capture:
            if len(self._seen) >= MAX_PENDING_KEYS:
                self._seen.clear()
            self._seen.add(key)
            store(sources, rows, slots_gpu)
            self.eager_runs += 1
            return
        self._seen.discard(key)
        # the warm-up run inside is this step's store (it writes the same table rows the
        # replay would); the capture itself executes nothing
        graph, _ = capture_after_warmup(lambda: store(sources, rows, slots_gpu), self.pool)
        self._graphs[key] = (graph, slots_gpu)
        self.eager_runs += 1

    def _upload(self, flat: np.ndarray, dst: torch.Tensor) -> None:
        buf = self.ring.acquire(flat.size)
        buf.numpy()[:] = flat
        self.ring.copy_to(buf, dst)
