"""Bitmask allocation/application (against xgrammar's kernel) and Matcher bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import xgrammar as xgr

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import GrammarBackend, allocate_bitmask, apply_bitmask_

from .conftest import STOP_ID


def test_allocate() -> None:
    bm = allocate_bitmask(3, 49216, pin=True)
    assert bm.shape == (3, 1538) and bm.dtype == torch.int32 and bm.device.type == "cpu"
    assert bool((bm == -1).all())
    assert allocate_bitmask(1, 33, pin=False).shape == (1, 2)


@pytest.mark.parametrize("vocab", [100, 49152, 49216])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_xgrammar(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 5
    bm = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g,
                       dtype=torch.int64).to(torch.int32)
    bm[0] = -1
    bm[1] = 0
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bm)
    ours = apply_bitmask_(logits.clone(), bm)
    assert torch.equal(ours, ref)
    assert bool(torch.isinf(ours[1]).all())


def test_apply_masks_columns_beyond_bitmask() -> None:
    bm = torch.full((2, 2), -1, dtype=torch.int32)  # covers 64 tokens
    logits = torch.zeros(2, 70)
    apply_bitmask_(logits, bm)
    assert bool((logits[:, :64] == 0).all()) and bool(torch.isinf(logits[:, 64:]).all())
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(3, 70), bm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_cuda_no_sync() -> None:
    bm = torch.randint(-2**31, 2**31 - 1, (4, 1538), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, 49216)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bm)
    dl, db = logits.cuda(), bm.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_bitmask_(dl, db)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(dl.cpu(), ref)


def test_matcher_accept_run_and_rollback(backend: GrammarBackend, hf_tokenizer: Any) -> None:
    cg = backend.compile(JsonSchemaConstraint({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    ids = hf_tokenizer.encode('{"a": 12}', add_special_tokens=False)
    m = backend.create_matcher(cg)
    # Stops after the terminating stop token; what follows is not retained.
    assert m.accept_run(ids + [STOP_ID, 33, 34]) == len(ids) + 1
    assert m.is_terminated() and m.num_accepted == len(ids) + 1
    assert not m.accept_token(33) and m.num_accepted == len(ids) + 1
    m.rollback(2)
    assert m.num_accepted == len(ids) - 1 and not m.is_terminated()
    # Stops before the first rejected token.
    assert m.accept_run([ids[-1], 18, STOP_ID]) == 1 and m.num_accepted == len(ids)
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)
    small = backend.create_matcher(cg)
    small.max_rollback_tokens = 1
    small.accept_run(ids[:3])
    with pytest.raises(ValueError, match="max_rollback_tokens"):
        small.rollback(2)
    row = allocate_bitmask(2, backend.vocab_size, pin=False)
    assert small.fill_bitmask(row, 1) and not bool((row[1] == -1).all())
