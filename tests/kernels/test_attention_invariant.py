"""``TritonAttentionBackend(batch_invariant=True)``: a tree-verify forward gives, for each
node of the first chain, bitwise the output of the decode forward of the same token."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from structspec.kernels.attention import TritonAttentionBackend  # noqa: E402
from structspec.kvcache.pool import KVPool  # noqa: E402
from structspec.layers.attention import TorchAttentionBackend  # noqa: E402
from structspec.layers.forward_batch import ForwardBatch  # noqa: E402
from tests.kernels.conftest import dtypes, tol  # noqa: E402

HQ, HKV, D = 4, 2, 32
NUM_SLOTS = 1024
# Tree of 6 nodes in verify order: nodes 0-1-2-3 are the first chain (node i at depth i),
# node 4 is a second child of node 0 and node 5 a second child of node 2.
PARENTS = [-1, 0, 1, 2, 0, 2]
CHAIN = 4


def _pool(dtype: torch.dtype, dev: torch.device) -> KVPool:
    pool = KVPool(num_layers=1, num_pages=NUM_SLOTS // 16, page_size=16, num_kv_heads=HKV,
                  head_dim=D, dtype=dtype, device=dev)
    g = torch.Generator().manual_seed(3)
    for c in pool.k_cache + pool.v_cache:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return pool


def _ancestors() -> torch.Tensor:
    n = len(PARENTS)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(PARENTS):
        if p >= 0:
            m[i] |= m[p]
    return m


def _fb(slots: torch.Tensor, mask: torch.Tensor, dev: torch.device) -> ForwardBatch:
    ids = torch.zeros(mask.shape[:2], dtype=torch.int64)
    return ForwardBatch(ids.to(dev), ids.to(dev), ids.to(dev), slots.to(dev), mask.to(dev))


def _verify(seq_len: int, kv_len: int, seq_slots: torch.Tensor, other: torch.Tensor,
            dev: torch.device) -> ForwardBatch:
    """Request 0: ``seq_len`` cached columns then the tree at ``seq_len + node``; request 1:
    another request (different slots, 100 cached columns) sharing the forward."""
    n = len(PARENTS)
    slots = torch.zeros(2, kv_len, dtype=torch.int64)  # padding columns read slot 0
    mask = torch.zeros(2, n, kv_len, dtype=torch.bool)
    for b, (sl, src) in enumerate([(seq_len, seq_slots), (100, other)]):
        slots[b, :sl + n] = src[:sl + n]
        mask[b, :, :sl] = True
        mask[b, :, sl:sl + n] = _ancestors()
    return _fb(slots, mask, dev)


def _decode(pos: int, kv_len: int, seq_slots: torch.Tensor, other: torch.Tensor,
            dev: torch.device) -> ForwardBatch:
    """Request 0 decodes the token at column ``pos`` (sees columns ``0..pos``); request 1 is
    a different request of another length, so the batch differs from the verify one."""
    slots = torch.zeros(2, kv_len, dtype=torch.int64)
    mask = torch.zeros(2, 1, kv_len, dtype=torch.bool)
    slots[0, :pos + 1] = seq_slots[:pos + 1]
    mask[0, 0, :pos + 1] = True
    slots[1, :31] = other[:31]
    mask[1, 0, :31] = True
    return _fb(slots, mask, dev)


# (seq_len, verify L, decode L extra padding, kv_chunk): the chain's keys in one chunk with
# S=1 in decode and S=2 in verify; several chunks in both (the chain crossing a chunk
# boundary, S=3 in decode vs S=4 in verify); the default 1024-key chunk (S=1 everywhere).
CASES = {
    "one-chunk-s1-vs-s2": (40, 128, 0, 64),
    "multi-chunk": (126, 256, 5, 64),
    "default-chunk": (150, 192, 8, 1024),
}


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_chain_nodes_match_decode_bitwise(dev: torch.device, dtype: torch.dtype,
                                          case: str) -> None:
    seq_len, verify_len, pad, chunk = CASES[case]
    pool = _pool(dtype, dev)
    g = torch.Generator().manual_seed(11)
    perm = 1 + torch.randperm(NUM_SLOTS - 1, generator=g)
    seq_slots, other = perm[:400], perm[400:800]
    n = len(PARENTS)
    q = torch.randn(2, n, HQ, D, generator=g).to(dev, dtype)
    attn = TritonAttentionBackend(batch_invariant=True, kv_chunk=chunk)
    vfb = _verify(seq_len, verify_len, seq_slots, other, dev)
    v_out = attn(q, 0, vfb, pool)
    torch.testing.assert_close(v_out, TorchAttentionBackend()(q, 0, vfb, pool), **tol(dtype))
    for depth in range(CHAIN):
        pos = seq_len + depth
        dfb = _decode(pos, pos + 1 + pad, seq_slots, other, dev)
        dq = torch.stack([q[0, depth], torch.randn(HQ, D, generator=g).to(dev, dtype)])[:, None]
        d_out = attn(dq, 0, dfb, pool)
        torch.testing.assert_close(d_out, TorchAttentionBackend()(dq, 0, dfb, pool),
                                   **tol(dtype))
        assert torch.equal(d_out[0, 0], v_out[0, depth]), f"{case}: depth {depth} differs"


@torch.no_grad()
def test_split_count_follows_kv_len_only(dev: torch.device,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """S = cdiv(L, kv_chunk) whatever B and Q; the ordered merge runs for S > 1."""
    from structspec.kernels import attention

    seen: list[int] = []
    real = attention._combine_ordered_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
            def launch(*args: object, **kw: object) -> None:
                seen.append(int(args[3]))  # num_splits
                real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(attention, "_combine_ordered_kernel", Spy())
    pool = _pool(torch.float32, dev)
    slots = torch.arange(1, 401)
    attn = TritonAttentionBackend(batch_invariant=True, kv_chunk=64)
    q = torch.randn(2, 6, HQ, D).to(dev)
    attn(q, 0, _verify(100, 256, slots, slots + 400, dev), pool)
    attn(q[:, :1], 0, _decode(130, 131, slots, slots + 400, dev), pool)
    assert seen == [4, 3]


def test_invalid_arguments() -> None:
    for bad in (100, 0, -64, 64.0, "1024", True):
        with pytest.raises(ValueError, match="multiple of 64"):
            TritonAttentionBackend(batch_invariant=True, kv_chunk=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_splits"):
        TritonAttentionBackend(num_splits=2, batch_invariant=True)
