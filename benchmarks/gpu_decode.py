"""GPU verify-step benchmark: eager vs CUDA-graph replay of ``ModelRunner.verify``, and the
HBM floor.

Default model: a random-weight SmolLM2-shaped Llama (30 layers, hidden 576, heads 9/3,
head_dim 64, intermediate 1536, vocab 49152, tied) built on the GPU in bf16; no checkpoint
needed. ``--model PATH`` benchmarks a model directory instead, e.g. the Llama-3-8B shape with
random weights: ``--model benchmarks/assets/llama3-8b-shape --load-format dummy`` (weights
allocated and initialised directly on the GPU from config.json, see
:func:`structspec.models.loader.load_model`).
Per (B, N): every request has ``context - N`` committed tokens, so ``seq_len + N = context``;
the tree comes from the host (as from the n-gram drafter) and is staged by the runner.

Prints one summary line per configuration:

* ``eager_ms`` / ``graph_ms``: wall time per step with a host wait every step (``verify`` +
  greedy argmax + ``.cpu()``, i.e. what the scheduler sees);
* ``graph_async_ms``: per step when the host never waits (GPU-bound throughput);
* ``host_ms``: host time of one ``verify()`` call on the graph path (staging + replay launch);
* ``fold_ms``: graph step with ``TorchAttentionBackend(fold_gqa=True)``;
* ``exact``: graph logits == the same bucket's forward run eagerly (bit for bit);
* ``argmax_agree``: graph vs unpadded eager argmax agreement, ``max_gap`` the eager-logit gap
  of disagreeing rows; ``nosync``: a replayed verify + argmax under
  ``torch.cuda.set_sync_debug_mode("error")``.

and a second line per configuration, ``decode_floor``: the measured step (``graph_async_ms``,
the GPU-bound CUDA-graph replay; ``graph_ms`` with the host wait) against the HBM floor
(:mod:`benchmarks.hbm_floor`): ``floor_ms`` = weight bytes read per step / measured copy
bandwidth, ``ratio`` = graph_async_ms / floor_ms; ``floor_kv_ms`` / ``ratio_kv`` add the KV
cache the step reads (``B * context`` tokens).

Usage::

    PYTHONPATH=$PWD python benchmarks/gpu_decode.py [--batch 1 8 32 64] [--nodes 1 8]
    PYTHONPATH=$PWD python benchmarks/gpu_decode.py --model benchmarks/assets/llama3-8b-shape \
        --load-format dummy --nodes 1 --skip-eager --skip-fold
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hbm_floor import (  # noqa: E402
    GIB,
    copy_bandwidth,
    floor_ms,
    kv_read_bytes,
    step_read_bytes,
)
from structspec.config import CacheConfig, ModelConfig  # noqa: E402
from structspec.draft_tree.layout import VerifyTree  # noqa: E402
from structspec.layers.attention import TorchAttentionBackend  # noqa: E402
from structspec.models.llama import LlamaForCausalLM  # noqa: E402
from structspec.runner.model_runner import ModelRunner  # noqa: E402


def smol_model(device: torch.device, dtype: torch.dtype) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Random-weight SmolLM2-135M-shaped Llama on ``device`` in ``dtype``."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(std=0.02)
    model = model.to(device, dtype)
    model.rotary.reset_inv_freq()
    return model, cfg


def load_bench_model(path: str | None, load_format: str, seed: int, device: torch.device,
                     dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig, str]:
    """``(model, config, display name)``: :func:`smol_model` when ``path`` is None, else
    :func:`structspec.models.loader.load_model` of ``path`` (``load_format`` "auto" reads the
    checkpoint, "dummy" builds seeded random weights on ``device``).

    Raises:
        FileNotFoundError / ValueError: from the loader (missing weights with "auto", ...).
    """
    if path is None:
        model, cfg = smol_model(device, dtype)
        return model, cfg, "smollm2-135m-shape"
    from structspec.models.loader import load_model

    model, cfg = load_model(path, device=device, dtype=dtype, load_format=load_format,
                            seed=seed)
    return model, cfg, Path(path).name


def random_tree(bsz: int, n: int, seed: int, vocab_size: int = 49152) -> VerifyTree:
    """Host tree ``[bsz, n]`` of token ids ``< vocab_size`` with random parents (n=1: plain
    decode)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (bsz, n), generator=g)
    parents = torch.zeros((bsz, n), dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    return VerifyTree.from_parents(tokens, parents)


def step_time(fn: Callable[[], None], iters: int, *, sync_each: bool) -> float:
    """Mean wall ms per call of ``fn`` (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        if sync_each:
            torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--model", default=None,
                    help="model directory (default: a random SmolLM2-135M-shaped Llama)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="--model weights: read them (auto) or seeded random on the GPU (dummy)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --load-format dummy")
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                    help="forward implementation passed to ModelRunner (auto: what the engine "
                         "picks, Triton when it imports)")
    ap.add_argument("--skip-eager", action="store_true",
                    help="skip the eager runner (eager_ms, argmax_agree; saves time and KV "
                         "memory on large models)")
    ap.add_argument("--skip-fold", action="store_true",
                    help="skip the fold_gqa attention variant (always skipped with triton)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="batch-invariant kernels (EngineConfig.batch_invariant): its cost")
    ap.add_argument("--floor-gib", type=float, default=4.0,
                    help="size of the device-to-device copy measuring HBM bandwidth (0: skip)")
    args = ap.parse_args()
    kernels = args.kernels
    if kernels == "auto":
        from structspec.kernels import triton_available

        kernels = "triton" if triton_available() else "torch"
    if args.batch_invariant and kernels != "triton":
        ap.error("--batch-invariant needs the Triton kernels (--kernels triton, or auto with "
                 "triton installed)")
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    # bandwidth first, while the device memory is still empty
    bw = copy_bandwidth(int(args.floor_gib * GIB)) if args.floor_gib > 0 else None
    model, cfg, model_name = load_bench_model(args.model, args.load_format, args.seed, dev, dtype)
    ps = 16
    max_b = max(args.batch)
    num_pages = max_b * (-(-args.context // ps) + 1) + 2
    cache = CacheConfig(page_size=ps, num_pages=num_pages)
    runner_kw = {"kernels": kernels, "batch_invariant": args.batch_invariant}

    def runner(graph: bool) -> ModelRunner:
        return ModelRunner(model, cfg, cache, device=dev, dtype=dtype, use_cuda_graph=graph,
                           max_model_len=4096, **runner_kw)

    graph = runner(True)
    eager = None if args.skip_eager else runner(False)
    default_backend = model.attn_backend
    use_fold = not args.skip_fold and getattr(model, "kernels", "torch") == "torch"
    fold_backend = TorchAttentionBackend(fold_gqa=True)
    fold = runner(True) if use_fold else None
    for r in (eager, graph, fold):  # identical random prefix KV in the pools
        if r is None:
            continue
        torch.manual_seed(1)
        for kc, vc in zip(r.kv_pool.k_cache, r.kv_pool.v_cache, strict=True):
            kc.normal_()
            vc.normal_()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} bf16 {model_name} "
          f"{cfg.num_hidden_layers} layers hidden {cfg.hidden_size} vocab {cfg.vocab_size}, "
          f"kernels {getattr(model, 'kernels', 'torch')}"
          f"{' batch-invariant' if args.batch_invariant else ''}, context {args.context}, "
          f"page_size {ps}")
    if bw is not None:
        print(bw.describe())
    for n in args.nodes:
        for bsz in args.batch:
            try:
                seq = [args.context - n] * bsz
                k = -(-args.context // ps)
                pages = [list(range(1 + b * k, 1 + (b + 1) * k)) for b in range(bsz)]
                tree = random_tree(bsz, n, seed=bsz * 100 + n, vocab_size=cfg.vocab_size)
                model.attn_backend = default_backend

                def run(r: ModelRunner, sync: bool, tree: VerifyTree = tree,
                        seq: list[int] = seq, pages: list[list[int]] = pages) -> None:
                    out = r.verify(tree, seq, pages)
                    am = out.logits.argmax(-1)
                    if sync:
                        am.cpu()

                e_ms = float("nan") if eager is None else step_time(
                    lambda: run(eager, True), max(5, args.iters // 3), sync_each=False)
                g_ms = step_time(lambda: run(graph, True), args.iters, sync_each=False)
                ga_ms = step_time(lambda: run(graph, False), args.iters, sync_each=False)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    graph.verify(tree, seq, pages)
                host_ms = (time.perf_counter() - t0) * 1e2
                torch.cuda.synchronize()
                # correctness
                out = graph.verify(tree, seq, pages)
                gl = out.logits.clone()
                need = -(-(max(seq) + n) // ps)
                g = graph.graphs.lookup(bsz, n, need, ())  # type: ignore[union-attr]
                assert g is not None
                se, _, _ = g.forward(model, graph.kv_pool, ps)
                exact = torch.equal(gl, se[: bsz * n])
                agree = gap = maxdiff = float("nan")
                if eager is not None:
                    ref = eager.verify(tree, seq, pages).logits
                    agree = (gl.argmax(-1) == ref.argmax(-1)).float().mean().item()
                    picked = ref.gather(1, gl.argmax(-1, keepdim=True)).squeeze(1)
                    gap = (ref.max(-1).values - picked).max().item()
                    maxdiff = (gl - ref).abs().max().item()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    graph.verify(tree, seq, pages).logits.argmax(-1)
                    nosync = "ok"
                except RuntimeError as e:
                    nosync = f"FAIL({str(e)[:60]})"
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                f_ms = fagree = float("nan")
                if fold is not None:  # fold_gqa variant (captured with the fold backend)
                    model.attn_backend = fold_backend
                    f_ms = step_time(lambda: run(fold, True), args.iters, sync_each=False)
                    fl = fold.verify(tree, seq, pages).logits
                    fagree = (fl.argmax(-1) == gl.argmax(-1)).float().mean().item()
                    model.attn_backend = default_backend
                print(f"B={bsz:<3d} N={n:<2d} kv_bucket={g.pages * ps:<5d} eager_ms={e_ms:7.3f} "
                      f"graph_ms={g_ms:7.3f} speedup={e_ms / g_ms:5.1f}x "
                      f"graph_async_ms={ga_ms:7.3f} host_ms={host_ms:6.3f} "
                      f"fold_ms={f_ms:7.3f} fold_agree={fagree:.3f} exact={exact} "
                      f"argmax_agree={agree:.3f} max_gap={gap:.3f} maxdiff={maxdiff:.3f} "
                      f"nosync={nosync}", flush=True)
                if bw is not None:
                    w_bytes = step_read_bytes(model, cfg, bsz)
                    kv_bytes = kv_read_bytes(cfg, bsz, args.context, dtype)
                    fl_ms, flkv_ms = floor_ms(w_bytes, bw), floor_ms(w_bytes + kv_bytes, bw)
                    print(f"decode_floor model={model_name} B={bsz:<3d} N={n:<2d} "
                          f"graph_async_ms={ga_ms:7.3f} graph_ms={g_ms:7.3f} "
                          f"floor_ms={fl_ms:6.3f} ratio={ga_ms / fl_ms:6.2f} "
                          f"floor_kv_ms={flkv_ms:6.3f} ratio_kv={ga_ms / flkv_ms:6.2f} "
                          f"read_gb={w_bytes / 1e9:.3f} kv_gb={kv_bytes / 1e9:.3f} "
                          f"hbm_tb_s={bw.tb_per_s:.3f}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the next config
                model.attn_backend = default_backend
                print(f"B={bsz} N={n} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    mem = torch.cuda.max_memory_allocated() / 2**30
    n_fold = len(fold.graphs.graphs) if fold is not None else 0  # type: ignore[union-attr]
    print(f"# graphs captured: {len(graph.graphs.graphs)} + {n_fold} "  # type: ignore[union-attr]
          f"(fold); peak allocated {mem:.2f} GiB")


if __name__ == "__main__":
    main()
