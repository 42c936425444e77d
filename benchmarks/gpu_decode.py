"""GPU verify-step benchmark: eager vs CUDA-graph replay of ``ModelRunner.verify``.

Random-weight SmolLM2-shaped Llama (30 layers, hidden 576, heads 9/3, head_dim 64,
intermediate 1536, vocab 49152, tied) built on the GPU in bf16; no checkpoint needed.
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

Usage: ``PYTHONPATH=$PWD python benchmarks/gpu_decode.py [--batch 1 8 32 64] [--nodes 1 8]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from structspec.config import CacheConfig, ModelConfig
from structspec.engine.model_runner import ModelRunner
from structspec.layers.attention import TorchAttentionBackend
from structspec.models.llama import LlamaForCausalLM
from structspec.spec.tree import VerifyTree


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


def random_tree(bsz: int, n: int, seed: int) -> VerifyTree:
    """Host tree ``[bsz, n]`` with random parents (n=1: plain decode)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 49152, (bsz, n), generator=g)
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
    args = ap.parse_args()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    model, cfg = smol_model(dev, dtype)
    ps = 16
    max_b = max(args.batch)
    num_pages = max_b * (-(-args.context // ps) + 1) + 2
    cache = CacheConfig(page_size=ps, num_pages=num_pages)
    default_backend = model.attn_backend
    fold_backend = TorchAttentionBackend(fold_gqa=True)

    def runner(graph: bool) -> ModelRunner:
        return ModelRunner(model, cfg, cache, device=dev, dtype=dtype, use_cuda_graph=graph,
                           max_model_len=4096)

    eager, graph, fold = runner(False), runner(True), runner(True)
    for r in (eager, graph, fold):  # identical random prefix KV in the three pools
        torch.manual_seed(1)
        for kc, vc in zip(r.kv_pool.k_cache, r.kv_pool.v_cache, strict=True):
            kc.normal_()
            vc.normal_()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} bf16 SmolLM2-shape "
          f"30 layers, context {args.context}, page_size {ps}")
    for n in args.nodes:
        for bsz in args.batch:
            try:
                seq = [args.context - n] * bsz
                k = -(-args.context // ps)
                pages = [list(range(1 + b * k, 1 + (b + 1) * k)) for b in range(bsz)]
                tree = random_tree(bsz, n, seed=bsz * 100 + n)
                model.attn_backend = default_backend

                def run(r: ModelRunner, sync: bool, tree: VerifyTree = tree,
                        seq: list[int] = seq, pages: list[list[int]] = pages) -> None:
                    out = r.verify(tree, seq, pages)
                    am = out.logits.argmax(-1)
                    if sync:
                        am.cpu()

                e_ms = step_time(lambda: run(eager, True), max(5, args.iters // 3),
                                 sync_each=False)
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
                # fold_gqa variant (captured with the fold backend)
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
            except Exception as e:  # noqa: BLE001 - report and go on with the next config
                model.attn_backend = default_backend
                print(f"B={bsz} N={n} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(f"# graphs captured: {len(graph.graphs.graphs)} + {len(fold.graphs.graphs)} "  # type: ignore[union-attr]
          f"(fold); peak allocated {mem:.2f} GiB")


if __name__ == "__main__":
    main()
