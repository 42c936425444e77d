"""GPU micro-benchmark of the fused Triton kernels vs the torch reference ops.

Every timing replays a CUDA graph that holds ``REPS`` back-to-back calls (so launch gaps are
what a graph replay sees, not Python overhead) and reports microseconds per call.

Part 1, whole forward: a random-weight SmolLM2-shaped model (30 layers, bf16), one
CUDA-graph-replayed forward + logits per config, ``kernels`` torch vs triton: ms per forward,
CUDA kernels per forward (profiler, eager), and the logits' relative difference.

Part 2, per op at SmolLM2-135M shapes (hidden 576, 9/3 heads, head_dim 64, intermediate
1536, vocab 49152), bf16: RMSNorm, add + RMSNorm, rotary + KV store, SiLU * mul, attention
(decode, tree verify, prefill), token bitmask.

``--gemv`` (instead of parts 1 and 2): cuBLAS ``F.linear`` vs the Triton
:func:`~structspec.kernels.gemv.skinny_linear` at the Llama-3-8B linear shapes (qkv, o,
gate_up, down, lm_head), bf16, ``M`` rows (``--gemv-rows``, default 1 8 16). Each graph
cycles through enough copies of the weight (>= 256 MB) that every call streams its weight
from HBM, as in a real forward (a layer's 436 MB never stay in the 50 MB L2); times are the
median of ``--gemv-samples`` graph timings. One line per (shape, M) with both times, the
weight bandwidth of each (weight bytes / time) and the config used, then per M the linears
of one decode step (32 x (qkv + o + gate_up + down) + lm_head).

Usage: ``PYTHONPATH=$PWD python benchmarks/kernels_micro.py [--context 512] [--batch 1 8 64]
[--nodes 1 8]``; ``... kernels_micro.py --gemv [--gemv-rows 1 8 16]``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_decode import smol_model  # noqa: E402
from structspec.kernels.activation import silu_and_mul
from structspec.kernels.attention import TritonAttentionBackend
from structspec.kernels.bitmask import apply_token_bitmask_inplace
from structspec.kernels.gemv import config_for, skinny_linear
from structspec.kernels.norm import fused_add_rmsnorm, rmsnorm
from structspec.kernels.rotary import rotary_and_store_kv
from structspec.kvcache.pool import KVPool
from structspec.layers.attention import TorchAttentionBackend, write_kv
from structspec.layers.forward_batch import ForwardBatch
from structspec.layers.norm import RMSNorm
from structspec.layers.rotary import RotaryEmbedding, apply_rotary

try:  # structspec.grammar imports xgrammar, which a bare GPU box may lack
    from structspec.grammar.bitmask import apply_bitmask_reference_
except ImportError:
    def apply_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Same ops as structspec.grammar.bitmask's torch path (shifts + masked_fill_)."""
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        rows, vocab = logits.shape
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]
        return logits.masked_fill_(allowed == 0, float("-inf"))

REPS = 20
DEV = torch.device("cuda")
DT = torch.bfloat16


def graph_us(fn: Callable[[], object], reps: int = REPS, iters: int = 10,
             samples: int = 1) -> float:
    """Microseconds per ``fn()`` call inside a CUDA graph of ``reps`` calls (the median of
    ``samples`` timings of ``iters`` replays each)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (iters * reps))
    return statistics.median(times)


def row(name: str, torch_fn: Callable[[], object], triton_fn: Callable[[], object]) -> None:
    try:
        t, k = graph_us(torch_fn), graph_us(triton_fn)
    except Exception as e:  # noqa: BLE001 - report and go on with the next op
        print(f"op {name:<34s} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
        return
    print(f"op {name:<34s} torch_us={t:8.2f} triton_us={k:8.2f} speedup={t / k:5.1f}x",
          flush=True)


def attn_batch(b: int, q: int, ctx: int, *, tree: bool) -> ForwardBatch:
    """``b`` requests of ``ctx`` KV slots each; the last ``q`` are the query block (causal,
    or a chain-shaped tree mask, same cost)."""
    g = torch.Generator().manual_seed(b * 7 + q)
    kv = 16 + torch.randperm(b * ctx + 64, generator=g)[: b * ctx].view(b, ctx)
    mask = torch.ones(b, q, ctx, dtype=torch.bool)
    mask[:, :, ctx - q :] = torch.ones(q, q, dtype=torch.bool).tril()
    if tree and q > 1:
        mask[:, 2:, ctx - q + 1] = False  # node 1 is a sibling branch of the others
    pos = torch.arange(ctx - q, ctx).expand(b, q).contiguous()
    ids = torch.zeros(b, q, dtype=torch.int64)
    return ForwardBatch(ids.to(DEV), pos.to(DEV), kv[:, -q:].contiguous().to(DEV), kv.to(DEV),
                        mask.to(DEV))


@torch.inference_mode()
def ops(context: int) -> None:
    torch.manual_seed(0)
    h, hq, hkv, d, inter = 576, 9, 3, 64, 1536
    norm = RMSNorm(h, 1e-5).to(DEV, DT)
    for t in (1, 8, 512):
        x = torch.randn(t, h, device=DEV, dtype=DT)
        res = torch.randn(t, h, device=DEV, dtype=DT)
        row(f"rmsnorm T={t}", lambda x=x: norm(x), lambda x=x: rmsnorm(x, norm.weight, 1e-5))
        row(f"add+rmsnorm T={t}", lambda x=x, r=res: norm(r + x),
            lambda x=x, r=res: fused_add_rmsnorm(x, r, norm.weight, 1e-5))
        gu = torch.randn(t, 2 * inter, device=DEV, dtype=DT)
        row(f"silu_and_mul T={t}", lambda gu=gu: F.silu(gu[:, :inter]) * gu[:, inter:],
            lambda gu=gu: silu_and_mul(gu))
        rot = RotaryEmbedding(head_dim=d, rope_theta=1e5, max_position_embeddings=8192,
                              rope_scaling=None).to(DEV)
        rot.reset_inv_freq()
        qkv = torch.randn(1, t, (hq + 2 * hkv) * d, device=DEV, dtype=DT)
        qq, kk, vv = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        qq, kk, vv = qq.view(1, t, hq, d), kk.view(1, t, hkv, d), vv.view(1, t, hkv, d)
        cos, sin = rot(torch.arange(t, device=DEV)[None], DT)
        pool = KVPool(num_layers=1, num_pages=64, page_size=16, num_kv_heads=hkv, head_dim=d,
                      dtype=DT, device=DEV)
        slots = (16 + torch.arange(t, device=DEV))[None]

        def torch_rot(qq=qq, kk=kk, vv=vv, cos=cos, sin=sin, slots=slots, pool=pool) -> None:
            apply_rotary(qq, cos, sin)
            write_kv(pool, 0, slots, apply_rotary(kk, cos, sin), vv)

        row(f"rotary+kv_store T={t}", torch_rot,
            lambda qq=qq, kk=kk, vv=vv, cos=cos, sin=sin, slots=slots, pool=pool:
            rotary_and_store_kv(qq, kk, vv, cos, sin, pool.k_cache[0], pool.v_cache[0], slots))
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend()
    for b, q, ctx, tree in ((1, 1, context, False), (1, 8, context, True),
                            (64, 1, 1024, False), (64, 8, 1024, True), (1, 1, 8192, False),
                            (1, 2048, 2048, False)):
        pool = KVPool(num_layers=1, num_pages=(b * ctx + 64) // 16 + 2, page_size=16,
                      num_kv_heads=hkv, head_dim=d, dtype=DT, device=DEV)
        pool.k_cache[0].normal_()
        pool.v_cache[0].normal_()
        fb = attn_batch(b, q, ctx, tree=tree)
        qt = torch.randn(b, q, hq, d, device=DEV, dtype=DT)
        try:
            diff = tri.forward(qt, 0, fb, pool).float() - ref.forward(qt, 0, fb, pool).float()
            print(f"# attention B={b} Q={q} L={ctx} "
                  f"max|triton-torch|={diff.abs().max().item():.4f}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"# attention B={b} Q={q} ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
        row(f"attention B={b} Q={q} L={ctx}", lambda qt=qt, fb=fb, pool=pool:
            ref.forward(qt, 0, fb, pool), lambda qt=qt, fb=fb, pool=pool:
            tri.forward(qt, 0, fb, pool))
    for r in (1, 64):
        logits = torch.randn(r, 49152, device=DEV)
        bm = torch.randint(-(2**31), 2**31 - 1, (r, 1536), device=DEV, dtype=torch.int32)
        row(f"token_bitmask R={r} V=49152", lambda lg=logits, bm=bm:
            apply_bitmask_reference_(lg, bm), lambda lg=logits, bm=bm:
            apply_token_bitmask_inplace(lg, bm))


LLAMA3_8B_LINEARS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                     ("down", 4096, 14336), ("lm_head", 128256, 4096))
LLAMA3_8B_LAYERS = 32
L2_DEFEAT_BYTES = 256 << 20


@torch.inference_mode()
def gemv(rows: list[int], samples: int) -> None:
    """cuBLAS vs Triton skinny GEMM at the Llama-3-8B shapes (see the module docstring)."""
    step_us = {m: [0.0, 0.0] for m in rows}
    for name, n, k in LLAMA3_8B_LINEARS:
        nbytes = n * k * DT.itemsize
        copies = max(1, -(-L2_DEFEAT_BYTES // nbytes))
        ws = [torch.randn(n, k, device=DEV, dtype=DT) / k**0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            cfg = config_for(m, n, k, DEV)
            try:
                ref = F.linear(x, ws[0]).float()
                rel = ((skinny_linear(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                it_c, it_t = itertools.cycle(ws), itertools.cycle(ws)
                cub = graph_us(lambda x=x, it=it_c: F.linear(x, next(it)), samples=samples)
                tri = graph_us(lambda x=x, it=it_t: skinny_linear(x, next(it)), samples=samples)
            except Exception as e:  # noqa: BLE001 - report and go on with the next config
                print(f"gemv {name:<7s} N={n} K={k} M={m} ERROR {type(e).__name__}: "
                      f"{str(e)[:400]}", flush=True)
                continue
            times = 1 if name == "lm_head" else LLAMA3_8B_LAYERS
            step_us[m][0] += times * cub
            step_us[m][1] += times * tri
            print(f"gemv {name:<7s} N={n:<6d} K={k:<5d} M={m:<2d} cublas_us={cub:8.2f} "
                  f"triton_us={tri:8.2f} cublas_GBs={nbytes / cub / 1e3:5.0f} "
                  f"triton_GBs={nbytes / tri / 1e3:5.0f} speedup={cub / tri:5.2f}x "
                  f"rel_diff={rel:.1e} cfg=({cfg.block_n},{cfg.block_k},split{cfg.split_k},"
                  f"w{cfg.num_warps},s{cfg.num_stages})", flush=True)
        del ws
        torch.cuda.empty_cache()
    for m, (cub, tri) in step_us.items():
        print(f"gemv llama3-8b step linears M={m:<2d} cublas_ms={cub / 1e3:6.3f} "
              f"triton_ms={tri / 1e3:6.3f} saved_ms={(cub - tri) / 1e3:6.3f}", flush=True)


def count_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels launched by one eager ``fn()`` (profiler; -1 if unavailable)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception:  # noqa: BLE001 - the count is informative only
        return -1


@torch.inference_mode()
def forwards(context: int, batches: list[int], nodes: list[int]) -> None:
    model, cfg = smol_model(DEV, DT)
    max_b = max(batches)
    pool = KVPool(num_layers=30, num_pages=(max_b * context + 64) // 16 + 2, page_size=16,
                  num_kv_heads=3, head_dim=64, dtype=DT, device=DEV)
    for c in pool.k_cache + pool.v_cache:
        c.normal_()
    for q in nodes:
        for b in batches:
            fb = attn_batch(b, q, context, tree=q > 1)

            def step(fb: ForwardBatch = fb) -> torch.Tensor:
                out = model(fb, pool)
                return model.compute_logits(out.hidden_states.view(-1, cfg.hidden_size))

            res = {}
            try:
                for kernels in ("torch", "triton"):
                    model.set_kernels(kernels)
                    logits = step().clone()
                    n_k = count_kernels(step)
                    ms = graph_us(step, reps=1, iters=30) / 1e3
                    res[kernels] = (logits, ms, n_k)
            except Exception as e:  # noqa: BLE001 - report and go on with the next config
                print(f"forward B={b} Q={q} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            (lt, mt, kt), (lk, mk, kk) = res["torch"], res["triton"]
            rel = ((lk - lt).norm() / lt.norm()).item()
            agree = (lk.argmax(-1) == lt.argmax(-1)).float().mean().item()
            print(f"forward B={b:<3d} Q={q:<2d} ctx={context} torch_ms={mt:7.3f} "
                  f"triton_ms={mk:7.3f} speedup={mt / mk:5.2f}x kernels torch={kt} "
                  f"triton={kk} (per layer ~{kt / 30:.0f} -> ~{kk / 30:.0f}) "
                  f"logits_rel_diff={rel:.4f} argmax_agree={agree:.3f}", flush=True)
    model.set_kernels("torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--gemv", action="store_true",
                    help="only the skinny-GEMM section (Llama-3-8B linear shapes)")
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 8, 16],
                    help="M (rows of x) for --gemv")
    ap.add_argument("--gemv-samples", type=int, default=7,
                    help="graph timings per --gemv measurement (median)")
    args = ap.parse_args()
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{triton.__version__} bf16; graph-replayed timings", flush=True)
    if args.gemv:
        gemv(args.gemv_rows, args.gemv_samples)
        return
    forwards(args.context, args.batch, args.nodes)
    if not args.skip_ops:
        ops(args.context)


if __name__ == "__main__":
    main()
