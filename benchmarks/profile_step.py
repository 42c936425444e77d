"""Host profile (cProfile, sorted by own time) of steady-state verify steps on one config.

    PYTHONPATH=$PWD python benchmarks/profile_step.py --algorithm ngram --batch 1 --steps 50

``--trace`` profiles the same window with torch.profiler instead (no cProfile: the host runs
at its own speed): per step phase (draft, stage, launch, mask, select, commit) the host time
and the device time of the kernels launched inside it, ms per step, then the kernels per step
and their summed device time against the window's wall time (a draft whose GPU interval is
much longer than its kernels is bound by its launches, not its kernels), the top kernels, and
the top host ops and CUDA runtime calls by their own host time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grammar_overlap import LONG_SCHEMA, draft_for  # noqa: E402
from benchmarks.workloads import extraction_prompts  # noqa: E402
from structspec import LLM, JsonSchemaConstraint, SamplingParams  # noqa: E402
from structspec.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", default="ngram")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--grammar", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--trace", action="store_true",
                    help="torch.profiler per phase and kernel instead of cProfile")
    args = ap.parse_args()
    llm = LLM(args.model, speculative_algorithm=args.algorithm, max_batch_size=args.batch,
              load_format=args.load_format, draft_model=draft_for(args.algorithm, args))
    eng = llm.engine
    sp = SamplingParams(max_tokens=(args.steps + 8) * 8 + 64, ignore_eos=True,
                        grammar=JsonSchemaConstraint(LONG_SCHEMA) if args.grammar else None)
    for p, _ in extraction_prompts(args.batch, seed=3):
        eng.add_request(p, sp)
    # until every request runs (a grammar compiles off the step loop, so the first steps
    # may have nothing to run), then the graphs of this batch size, then a few warm steps
    deadline = time.perf_counter() + 600
    while len(eng.scheduler.running) < args.batch:
        eng.step()
        if time.perf_counter() > deadline:
            raise SystemExit(f"{len(eng.scheduler.running)} of {args.batch} requests running "
                             "after 600 s")
    eng.warmup_cuda_graphs(batch_sizes=[args.batch])
    for _ in range(5):
        eng.step()
    if args.trace:
        eng.step_stats(reset=True)
        traced(eng, args.steps, args.top, f"{args.algorithm} batch={args.batch} "
               f"grammar={args.grammar}")
        return
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    print(f"# {args.algorithm} batch={args.batch} grammar={args.grammar}: "
          + " ".join(f"{k}={v:.3f}" for k, v in eng.step_stats().items()))
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


#: step phases traced as ``step.<name>`` ranges: (object path from the verify step, method)
TRACED_PHASES = {"draft": ("", "_propose"), "stage": ("", "_stage_tree"),
                 "launch": ("", "_launch_verify"), "mask": ("grammar", "build_mask"),
                 "select": ("select", "launch"), "commit": ("", "_commit")}


def traced(eng: LLMEngine, steps: int, top: int, tag: str) -> None:
    """``steps`` engine steps under torch.profiler, each phase of :data:`TRACED_PHASES` in a
    ``step.<name>`` range; prints one ``trace`` line per phase (host and device ms per step),
    one ``trace kernels`` line and the top kernels by device time.

    The ranges can nest: a host tree whose pool build is sent before the launch
    (:mod:`structspec.scheduler.build_order`; always on the CPU) launches inside
    ``build_mask``, so ``mask`` then holds ``launch``'s host and device time too. The
    ``kernels`` counts are every device event (kernels, memcpys, memsets)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    verify = eng.scheduler._verify
    patched = []
    for name, (path, method) in TRACED_PHASES.items():
        owner = getattr(verify, path) if path else verify
        original = getattr(owner, method)

        def in_range(*a: Any, _f: Any = original, _n: str = name, **k: Any) -> Any:
            with record_function(f"step.{_n}"):
                return _f(*a, **k)

        setattr(owner, method, in_range)  # an instance attribute over the class's method
        patched.append((owner, method))
    cuda = torch.cuda.is_available() and eng.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    compiles: list[str] = []
    try:
        with triton_compiles(compiles), profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        for owner, method in patched:
            delattr(owner, method)
    print(f"# {tag}: " + " ".join(f"{k}={v:.3f}" for k, v in eng.step_stats().items()))
    rows = {r.key: r for r in prof.key_averages()}
    for name in TRACED_PHASES:
        r = rows.get(f"step.{name}")
        if r is None:
            continue
        print(f"trace {tag} phase={name} calls={r.count} host_ms={r.cpu_time_total / 1e3 / steps:.3f}"
              f" device_ms={_device_us(r) / 1e3 / steps:.3f}")
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernel_ms = sum(_device_us(e, total=False) for e in kernels) / 1e3
    print(f"trace {tag} kernels_per_step={len(kernels) / steps:.1f} "
          f"kernel_ms_per_step={kernel_ms / steps:.3f} wall_ms_per_step={wall_ms / steps:.3f} "
          f"triton_compiles={len(compiles)}")
    for name in compiles[:8]:  # a compile inside a steady window is a bug of its own
        print(f"trace {tag} compiled: {name[:160]}")
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top,
                                        max_name_column_width=70))
    # the host side: which ops and CUDA runtime calls hold the step's host time
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                    max_name_column_width=70))


@contextlib.contextmanager
def triton_compiles(out: list[str]) -> Iterator[None]:
    """Append to ``out`` the kernel of every Triton JIT compile (a miss of Triton's in-memory
    kernel cache: a new kernel or a new specialization of its arguments) while the block runs.
    Uses ``triton.knobs.runtime.jit_cache_hook`` (Triton >= 3.4), else the older
    ``JITFunction.cache_hook``; without Triton nothing is counted."""
    try:
        import triton
    except ImportError:
        yield
        return
    knobs = getattr(triton, "knobs", None)
    owner: Any = knobs.runtime if knobs is not None else triton.runtime.jit.JITFunction
    attr = "jit_cache_hook" if knobs is not None else "cache_hook"
    previous = getattr(owner, attr, None)

    def hook(*args: Any, **kwargs: Any) -> bool | None:
        out.append(str(kwargs.get("repr", "?")))
        # a true return value would tell Triton to skip the compile (and the launch)
        return previous(*args, **kwargs) if previous is not None else None

    setattr(owner, attr, hook)
    try:
        yield
    finally:
        setattr(owner, attr, previous)


def _device_us(ev: Any, total: bool = True) -> float:
    """An event's device time in us (``device_time_total`` / ``device_time``, or the older
    ``cuda_*`` names)."""
    names = ("device_time_total", "cuda_time_total") if total else ("device_time", "cuda_time")
    for attr in names:
        value = getattr(ev, attr, None)
        if value is not None:
            return float(value)
    return 0.0


if __name__ == "__main__":
    main()
