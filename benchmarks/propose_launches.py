"""Kernel launches of one EAGLE propose (the work a propose CUDA graph replays), on the CPU.

A propose at small batch is launch-bound: a graph replays each recorded kernel in a few us,
whatever its size, so the number of kernels is the first-order cost of the draft. This script
runs the propose graph's body (``DraftGraph.forward``: the catch-up, every expansion step, the
tree layout) once eagerly on the CPU over the default model and its shipped EAGLE-3 head, and
counts what would be launches on a GPU: aten ops that are not views, and Triton kernel launches
(run under the Triton interpreter, ``TRITON_INTERPRET=1``). Three configurations: the head on
torch ops; the head on the target's fused Triton kernels; and that plus the index kernels
(the expansion bookkeeping, tree layout and page lookups of :mod:`structspec.kernels.draft_tree`
and :mod:`structspec.kernels.paging`: what a CUDA engine with Triton runs). The target side of
the drafter (its embeddings and LM head) stays on torch ops in all three. The tree layout is
counted as a CUDA tree's (torch ops or the one kernel), not the host's numpy pass a CPU tree
takes. One summary line per configuration, then the busiest call sites.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/propose_launches.py

Without the interpreter (no triton) only the torch configuration runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structspec.kernels as kernels_pkg  # noqa: E402
from structspec import LLM  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.speculative.draft_graph import DraftGraph  # noqa: E402

#: aten ops that only make views, metadata or uninitialised allocations (no kernel on a GPU)
VIEW_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.promote_types.default", "aten.result_type.Tensor",
    "aten.view.default", "aten.reshape.default", "aten.unsqueeze.default", "aten.slice.Tensor",
    "aten.expand.default", "aten.transpose.int", "aten.select.int", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.lift_fresh.default", "aten.detach_.default",
    "aten.squeeze.dim", "aten.permute.default", "aten.t.default", "aten._unsafe_view.default",
    "aten.alias.default", "aten.as_strided.default", "aten.unbind.int",
    "aten.flatten.using_ints", "aten.detach.default", "aten.view.dtype",
})


def _site() -> str:
    """The innermost structspec frame of the current stack (``path:function``)."""
    for frame in reversed(traceback.extract_stack(limit=30)):
        if "/structspec/" in frame.filename:
            return f"{frame.filename.split('/structspec/')[1]}:{frame.name}"
    return "?"


class LaunchCounter(TorchDispatchMode):
    """Counts non-view aten ops (by call site) while active; Triton launches are added by
    :func:`count_triton_launches`."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: collections.Counter[str] = collections.Counter()
        #: > 0 inside an interpreted Triton kernel, whose own tensor ops are not launches
        self.in_kernel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.in_kernel and str(func) not in VIEW_OPS:
            self.by_site[_site()] += 1
        return out


@contextlib.contextmanager
def count_triton_launches(counter: LaunchCounter) -> Iterator[None]:
    """While active, count every interpreted Triton kernel launch into ``counter`` (as
    ``triton:<kernel>``); the tensor ops inside a kernel are not counted as launches."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter.by_site[f"triton:{getattr(self.fn, '__name__', '?')}"] += 1
        counter.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.in_kernel -= 1

    InterpretedFunction.run = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]


@contextlib.contextmanager
def device_tree_layout(index_kernels: bool) -> Iterator[None]:
    """While active, a CPU tree's layout runs what a CUDA tree's runs (the torch ops, or the
    index kernel's one launch) instead of the host's numpy pass, so the count is the graph's."""
    host = VerifyTree.__dict__["_from_parents_host"]

    def device_path(cls: Any, tokens: torch.Tensor, parents: torch.Tensor) -> VerifyTree:
        if index_kernels:
            from structspec.kernels.draft_tree import tree_layout

            par, depth, first, sibling, anc = tree_layout(tokens, parents)
            return cls(draft_tokens=tokens, parents=par, depth=depth, next_token=first,
                       next_sibling=sibling, ancestor_mask=anc)
        return cls._from_parents_torch(tokens, parents)

    VerifyTree._from_parents_host = classmethod(device_path)  # type: ignore[assignment]
    try:
        yield
    finally:
        VerifyTree._from_parents_host = host  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pages", type=int, default=16, help="page-table width of the bucket")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    llm = LLM(None, speculative_algorithm="eagle", max_batch_size=args.batch,
              speculative_adaptive="off", dtype="float32", quantization="none")
    drafter: Any = llm.engine.drafter
    while hasattr(drafter, "inner"):
        drafter = drafter.inner
    graph = DraftGraph(args.batch, args.pages, drafter.short_catch_up, torch.device("cpu"))
    graph.reset_dummy()  # dummy rows run every op a real row runs
    # (head kernels, index kernels): the head on torch ops / on the target's fused Triton
    # kernels, the tree bookkeeping and page lookups on torch ops / on the index kernels
    configs = [("torch", False)]
    if interp:
        configs += [("triton", False), ("triton", True)]
    for head_kernels, index in configs:
        drafter.head.set_kernels(head_kernels, max_positions=8192)
        if drafter.reduced_lm_head is not None:
            drafter.reduced_lm_head.set_kernels(head_kernels)
        kernels_pkg.INDEX_KERNELS = index
        counter = LaunchCounter()
        with torch.inference_mode(), device_tree_layout(index):
            graph.forward(drafter)  # first call: anything lazy happens here
            triton = (count_triton_launches(counter) if head_kernels == "triton"
                      else contextlib.nullcontext())
            with triton, counter:
                graph.forward(drafter)
        total = sum(counter.by_site.values())
        triton = sum(v for k, v in counter.by_site.items() if k.startswith("triton:"))
        print(f"propose_launches head={head_kernels} index_kernels={'on' if index else 'off'} "
              f"batch={args.batch} N={drafter.num_nodes} depth={drafter.depth} "
              f"topk={drafter.topk} launches={total} aten={total - triton} triton={triton}",
              flush=True)
        for site, n in counter.by_site.most_common(args.top):
            print(f"    {n:5d} {site}")
    llm.close()


if __name__ == "__main__":
    main()
