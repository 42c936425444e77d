"""TritonAttentionBackend vs TorchAttentionBackend: prefill, decode, tree verify, GQA,
padding rows, ragged L, split-KV."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from structspec.kernels.attention import TritonAttentionBackend  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.attention import TorchAttentionBackend  # noqa: E402
from structspec.layers.forward_batch import ForwardBatch  # noqa: E402
from tests.kernels.conftest import dtypes, tol  # noqa: E402

NUM_SLOTS = 4096


def _pool(hkv: int, d: int, dtype: torch.dtype, dev: torch.device, seed: int) -> KVPool:
    pool = KVPool(num_layers=2, num_pages=NUM_SLOTS // 16, page_size=16, num_kv_heads=hkv,
                  head_dim=d, dtype=dtype, device=dev)
    g = torch.Generator().manual_seed(seed)
    for c in pool.k_cache + pool.v_cache:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return pool


def _random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """``[n, n]`` ancestor mask of a random tree (node i's parent < i; node 0 the root)."""
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        m[i] |= m[p]
    return m


def _batch(kind: str, b: int, nq: int, lens: list[int], kv_len: int, seed: int,
           dev: torch.device) -> ForwardBatch:
    """A ForwardBatch over random distinct slots; ``lens[i]`` = request i's KV length
    (0 = a padding request that attends column 0 only), ``kv_len`` = the padded L."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.zeros(b, kv_len, dtype=torch.int64)
    mask = torch.zeros(b, nq, kv_len, dtype=torch.bool)
    perm = 16 + torch.randperm(NUM_SLOTS - 16, generator=g)
    for i, n in enumerate(lens):
        slots[i, :n] = perm[i * kv_len : i * kv_len + n]
        if n == 0:
            mask[i, :, 0] = True
            continue
        if kind == "causal":  # the last r columns are the r real query tokens
            r = min(nq, n)
            cached = n - r
            mask[i, :r, :cached] = True
            mask[i, :r, cached:n] = torch.ones(r, r, dtype=torch.bool).tril()
            mask[i, r:, 0] = True  # padding query rows (a shorter prompt in prefill)
        elif kind == "tree":
            cached = n - nq
            mask[i, :, :cached] = True
            mask[i, :, cached:n] = _random_tree_mask(nq, g)
        else:  # "random": any pattern, at least one True per row
            mask[i, :, :n] = torch.rand(nq, n, generator=g) > 0.7
            mask[i, :, 0] = True
    ids = torch.zeros(b, nq, dtype=torch.int64)
    fb = ForwardBatch(ids, ids, ids, slots, mask)
    return ForwardBatch(*(t.to(dev) for t in (ids, ids, ids, fb.kv_slots, fb.attn_mask)))


CASES = {
    # name: (kind, B, Q, Hq, Hkv, D, lens, L)
    "decode": ("causal", 2, 1, 9, 3, 64, [77, 130], 130),
    "decode-bucket-pad": ("causal", 3, 1, 9, 3, 64, [5, 200, 0], 256),
    "verify-tree": ("tree", 2, 8, 9, 3, 64, [40, 101], 128),
    "verify-tree-64": ("tree", 1, 64, 4, 1, 32, [150], 150),
    "prefill": ("causal", 2, 67, 4, 2, 32, [67, 30], 67),
    "mha-random": ("random", 2, 5, 4, 4, 16, [33, 90], 95),
    "gqa4-d128": ("random", 1, 3, 8, 2, 128, [70], 70),
    "d48": ("tree", 1, 4, 6, 2, 48, [50], 50),
}


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_matches_torch(dev: torch.device, dtype: torch.dtype, case: str,
                       splits: int | None) -> None:
    kind, b, nq, hq, hkv, d, lens, kv_len = CASES[case]
    seed = sum(map(ord, case))
    pool = _pool(hkv, d, dtype, dev, seed)
    fb = _batch(kind, b, nq, lens, kv_len, seed, dev)
    q = torch.randn(b, nq, hq, d, generator=torch.Generator().manual_seed(seed)).to(dev, dtype)
    ref = TorchAttentionBackend().forward(q, 1, fb, pool)
    out = TritonAttentionBackend(num_splits=splits).forward(q, 1, fb, pool)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol(dtype))


@torch.no_grad()
def test_strided_query_view(dev: torch.device) -> None:
    """q as a strided view into a fused qkv output (what the model passes)."""
    b, nq, hq, hkv, d = 2, 3, 4, 2, 32
    pool = _pool(hkv, d, torch.float32, dev, 5)
    fb = _batch("tree", b, nq, [20, 40], 40, 5, dev)
    qkv = torch.randn(b, nq, (hq + 2 * hkv) * d, device=dev)
    q = qkv[..., : hq * d].view(b, nq, hq, d)
    ref = TorchAttentionBackend().forward(q.contiguous(), 0, fb, pool)
    torch.testing.assert_close(TritonAttentionBackend().forward(q, 0, fb, pool), ref,
                               **tol(torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes: CUDA only")
@pytest.mark.parametrize("kind,b,nq,lens,kv_len", [
    ("causal", 1, 1, [8000], 8192),
    ("causal", 64, 1, [1000] * 64, 1024),
    ("tree", 64, 8, [1000] * 64, 1024),
    ("causal", 1, 2000, [2000], 2000),
    ("causal", 2, 1500, [1500, 700], 1500),
])
@pytest.mark.parametrize("dtype", dtypes())
@torch.no_grad()
def test_large_shapes_cuda(dtype: torch.dtype, kind: str, b: int, nq: int, lens: list[int],
                           kv_len: int) -> None:
    dev = torch.device("cuda")
    global NUM_SLOTS
    old, NUM_SLOTS = NUM_SLOTS, 1 << 17
    try:
        pool = _pool(3, 64, dtype, dev, 7)
        fb = _batch(kind, b, nq, lens, kv_len, 7, dev)
    finally:
        NUM_SLOTS = old
    q = torch.randn(b, nq, 9, 64, device=dev).to(dtype)
    ref = TorchAttentionBackend().forward(q, 0, fb, pool)
    out = TritonAttentionBackend().forward(q, 0, fb, pool)
    # fp32: long reductions in another order (L up to 8k): a little more slack than tol()
    t = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(out, ref, **t)


CAUSAL_CASES = {
    # name: (B, Q, Hq, Hkv, D, lens, L): request i's last min(Q, lens[i]) columns are its
    # query rows, so its chain starts at lens[i] - min(Q, lens[i])
    "chunk-over-prefix": (1, 67, 9, 3, 64, [300], 320),
    "ragged-prompts": (2, 40, 4, 2, 32, [40, 100], 128),
    "few-rows": (1, 5, 4, 1, 16, [37], 48),
}


@pytest.mark.parametrize("blocks", [(128, 64), (16, 16)])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("case", sorted(CAUSAL_CASES))
@torch.no_grad()
def test_causal_chain_matches_masked(dev: torch.device, case: str, splits: int | None,
                                     blocks: tuple[int, int]) -> None:
    """``fb.causal_start`` (the mask-free causal kernel) gives the masked reference's output
    on every real query row, whatever the tiles and splits."""
    from structspec.kernels.attention import CausalConfig

    b, nq, hq, hkv, d, lens, kv_len = CAUSAL_CASES[case]
    seed = sum(map(ord, case))
    pool = _pool(hkv, d, torch.float32, dev, seed)
    fb = _batch("causal", b, nq, lens, kv_len, seed, dev)
    real = [min(nq, n) for n in lens]
    fb.causal_start = torch.tensor([n - r for n, r in zip(lens, real, strict=True)], device=dev)
    q = torch.randn(b, nq, hq, d, generator=torch.Generator().manual_seed(seed)).to(dev)
    ref = TorchAttentionBackend().forward(q, 1, fb, pool)
    cfg = CausalConfig(block_m=blocks[0], block_n=blocks[1], num_warps=4)
    out = TritonAttentionBackend(num_splits=splits, causal_config=cfg).forward(q, 1, fb, pool)
    for i, r in enumerate(real):
        torch.testing.assert_close(out[i, :r], ref[i, :r], **tol(torch.float32))


def test_causal_config_rejects_bad_tiles() -> None:
    from structspec.kernels.attention import CausalConfig

    for bad in (dict(block_m=48), dict(block_n=8), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError, match="CausalConfig"):
            CausalConfig(**bad)
