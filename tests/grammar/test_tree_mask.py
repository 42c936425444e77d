"""Tree bitmask: xgrammar's traverse_draft_tree against pure-Python references, staging of the
tree, the timeout fallback, grammar-rejection counts and the parallel speedup."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from structspec.constraints import JsonSchemaConstraint
from structspec.grammar import (
    GrammarBackend,
    GrammarTree,
    Matcher,
    allocate_bitmask,
    build_grammar_vocab_mask,
)
from structspec.grammar.tree_mask import settle_tree_rows

from .conftest import STOP_ID

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
PREFIX = '{"name": "Bob", "age": '  # last token: "Ġ"; the grammar now expects an integer

# Hand-built tree (node 0 = last committed token). Token ids of SmolLM2: 36 "4", 34 "2",
# 18 '"', 109 "}", 28 ",", 33 "1", 2 <|im_end|>.
#   0 ─┬─ 1 "4" ─┬─ 3 "2" ── 8 "}"          "42}"       valid
#      │         ├─ 4 "}" ── 5 EOS ── 9 "1"  "4}" EOS    terminates; 9 unreachable
#      │         └─ 7 ","                    "4,"        rejected (no more properties)
#      └─ 2 '"' ── 6 "4"                     rejected; 6 unreachable
NEXT_TOKEN = [1, 3, 6, 8, 5, 9, -1, -1, -1, -1]
NEXT_SIBLING = [-1, 2, -1, 4, 7, -1, -1, -1, -1, -1]
DRAFT = [None, 36, 18, 34, 109, STOP_ID, 36, 28, 109, 33]


@pytest.fixture(scope="module")
def compiled(backend: GrammarBackend) -> Any:
    return backend.compile(JsonSchemaConstraint(SCHEMA))


def _prefix_matcher(backend: GrammarBackend, compiled: Any, hf_tokenizer: Any,
                    text: str = PREFIX) -> tuple[Matcher, list[int]]:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    m = backend.create_matcher(compiled)
    assert m.accept_run(ids) == len(ids)
    return m, ids


def _reference_dfs(m: Matcher, nt: list[int], ns: list[int], dt: list[int],
                   rows: torch.Tensor) -> None:
    """Pure-Python DFS: check child against parent row, accept, fill, recurse, roll back."""
    width = rows.shape[1]

    def allowed(row: int, tok: int) -> bool:
        return tok < 32 * width and (int(rows[row, tok >> 5]) >> (tok & 31)) & 1 == 1

    def visit(node: int, parent: int) -> None:
        while node != -1:
            if parent == -1 or allowed(parent, dt[node]):
                if parent != -1:
                    assert m.accept_token(dt[node])
                if not m.is_terminated():
                    m.fill_bitmask(rows, node)
                    visit(nt[node], node)
                if parent != -1:
                    m.rollback(1)
            node = ns[node] if parent != -1 else -1

    visit(0, -1)


def _sequential_row(backend: GrammarBackend, compiled: Any, prefix: list[int],
                    path: list[int], vocab_size: int) -> torch.Tensor | None:
    """The row of a node from a fresh matcher fed prefix + root-to-node path (None: rejected)."""
    m = backend.create_matcher(compiled)
    assert m.accept_run(prefix) == len(prefix)
    if m.accept_run(path) != len(path):
        return None
    row = allocate_bitmask(1, vocab_size, pin=False)
    if not m.is_terminated():
        m.fill_bitmask(row, 0)
    return row[0]


def _tree(root: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = torch.tensor([root] + DRAFT[1:], dtype=torch.int64)
    return (torch.tensor(NEXT_TOKEN, dtype=torch.int64),
            torch.tensor(NEXT_SIBLING, dtype=torch.int64), dt)


def _paths(nt: list[int], ns: list[int], dt: list[int]) -> dict[int, list[int]]:
    paths = {0: []}
    stack = [0]
    while stack:
        p = stack.pop()
        c = nt[p]
        while c != -1:
            paths[c] = paths[p] + [dt[c]]
            stack.append(c)
            c = ns[c]
    return paths


def test_traverse_matches_python_dfs_and_sequential(
        backend: GrammarBackend, compiled: Any, hf_tokenizer: Any) -> None:
    m, prefix = _prefix_matcher(backend, compiled, hf_tokenizer)
    nt, ns, dt = _tree(prefix[-1])
    n, v = len(NEXT_TOKEN), backend.vocab_size
    ours = allocate_bitmask(n, v, pin=False)
    before = m.num_accepted
    assert m.xgr_matcher.traverse_draft_tree(nt, ns, dt, ours, -1.0)
    # The committed root token is not accepted again and the state is restored.
    assert m.num_accepted == before
    root_now = allocate_bitmask(1, v, pin=False)
    m.fill_bitmask(root_now, 0)
    assert torch.equal(root_now[0], ours[0])

    # xgrammar's raw output: all-zero rows for the rejected nodes 2, 7 and the terminating
    # node 5; untouched (all-ones) rows below them (6, 9).
    assert all(bool((ours[i] == 0).all()) for i in (2, 5, 7))
    assert all(bool((ours[i] == -1).all()) for i in (6, 9))
    assert settle_tree_rows(ours, nt, ns, dt, stop_token_ids=[STOP_ID]) == 2

    ref = allocate_bitmask(n, v, pin=False)
    _reference_dfs(m, NEXT_TOKEN, NEXT_SIBLING, dt.tolist(), ref)
    assert torch.equal(ours, ref)

    paths = _paths(NEXT_TOKEN, NEXT_SIBLING, dt.tolist())
    all_ones = torch.full_like(ours[0], -1)
    for node, path in paths.items():
        seq = _sequential_row(backend, compiled, prefix, path, v)
        if seq is None or node in (5, 9):  # rejected / terminated / below termination
            assert torch.equal(ours[node], all_ones), node
        else:
            assert torch.equal(ours[node], seq), node
    # Specific expectations about this tree.
    assert all(torch.equal(ours[i], all_ones) for i in (2, 6, 7, 5, 9))
    assert ours[4].tolist()[0] == 1 << STOP_ID and not ours[4, 1:].any()  # "4}": only EOS


def test_terminated_root_is_left_alone(backend: GrammarBackend, compiled: Any,
                                       hf_tokenizer: Any) -> None:
    m, prefix = _prefix_matcher(backend, compiled, hf_tokenizer, PREFIX + "7}")
    assert m.accept_token(STOP_ID) and m.is_terminated()
    nt, ns, dt = _tree(STOP_ID)
    rows = allocate_bitmask(len(NEXT_TOKEN), backend.vocab_size, pin=False)
    assert m.xgr_matcher.traverse_draft_tree(nt, ns, dt, rows, -1.0)
    # xgrammar zeroes the terminated root's row and visits nothing else ...
    assert bool((rows[0] == 0).all()) and bool((rows[1:] == -1).all())
    # ... build_grammar_vocab_mask skips a terminated matcher: every row stays all ones.
    res = build_grammar_vocab_mask([m], GrammarTree.from_host(nt[None], ns[None], dt[None]),
                                   vocab_size=backend.vocab_size, device="cpu")
    assert res is not None and bool((res.bitmask_cpu == -1).all())


def test_random_trees_match_reference(backend: GrammarBackend, compiled: Any,
                                      hf_tokenizer: Any) -> None:
    m, prefix = _prefix_matcher(backend, compiled, hf_tokenizer, '{"name": "')
    pool = [36, 34, 18, 109, 28, 33, STOP_ID, 216, 476, 473, 1799, 6777, 1002, 1245, 25276]
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 24)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        nt, ns = [-1] * n, [-1] * n
        last_child: dict[int, int] = {}
        for i in range(1, n):
            p = parents[i]
            if p in last_child:
                ns[last_child[p]] = i
            else:
                nt[p] = i
            last_child[p] = i
        dt = [prefix[-1]] + [rng.choice(pool) for _ in range(n - 1)]
        ours = allocate_bitmask(n, backend.vocab_size, pin=False)
        t = [torch.tensor(x, dtype=torch.int64) for x in (nt, ns, dt)]
        assert m.xgr_matcher.traverse_draft_tree(*t, ours, -1.0)
        settle_tree_rows(ours, *t, stop_token_ids=[STOP_ID])
        ref = allocate_bitmask(n, backend.vocab_size, pin=False)
        _reference_dfs(m, nt, ns, dt, ref)
        assert torch.equal(ours, ref)
        assert m.num_accepted == len(prefix)


def test_build_mask_batch_barrier_and_counts(backend: GrammarBackend, compiled: Any,
                                             hf_tokenizer: Any) -> None:
    m0, prefix = _prefix_matcher(backend, compiled, hf_tokenizer)
    m2 = backend.create_matcher(compiled)
    pending = list(prefix)
    calls: list[str] = []

    def barrier() -> None:  # advances m2 over "last step's" committed run
        calls.append("barrier")
        assert m2.accept_run(pending) == len(pending)

    nt, ns, dt = _tree(prefix[-1])
    tree = GrammarTree.from_device(torch.stack([nt] * 3), torch.stack([ns] * 3),
                                   torch.stack([dt] * 3).reshape(-1))
    res = build_grammar_vocab_mask([m0, None, m2], tree, vocab_size=backend.vocab_size,
                                   device="cpu", barrier=barrier)
    assert res is not None and calls == ["barrier"]
    n = len(NEXT_TOKEN)
    assert torch.equal(res.bitmask_cpu[:n], res.bitmask_cpu[2 * n:])
    assert bool((res.bitmask_cpu[n:2 * n] == -1).all())
    assert res.rejected_by_grammar == [2, 0, 2]
    assert res.truncated_requests == [] and res.max_accept_cpu.tolist() == [n - 1] * 3
    assert res.bitmask_device.dtype == torch.int32
    assert m0.num_accepted == m2.num_accepted == len(prefix)
    assert build_grammar_vocab_mask([None, None], tree, vocab_size=backend.vocab_size,
                                    device="cpu") is None


def test_timeout_falls_back_to_root_row(backend: GrammarBackend, compiled: Any,
                                        hf_tokenizer: Any) -> None:
    m, prefix = _prefix_matcher(backend, compiled, hf_tokenizer)
    nt, ns, dt = _tree(prefix[-1])
    tree = GrammarTree.from_host(nt[None], ns[None], dt[None])
    res = build_grammar_vocab_mask([m], tree, vocab_size=backend.vocab_size, device="cpu",
                                   time_limit_s=1e-9)
    assert res is not None
    assert res.truncated_requests == [0] and res.max_accept_cpu.tolist() == [0]
    root = allocate_bitmask(1, backend.vocab_size, pin=False)
    m.fill_bitmask(root, 0)
    assert torch.equal(res.bitmask_cpu[0], root[0])
    assert bool((res.bitmask_cpu[1:] == -1).all())
    assert m.num_accepted == len(prefix)
    # The state survived the interrupted traversal: "42}" + EOS still matches.
    assert m.accept_run([36, 34, 109, STOP_ID]) == 4 and m.is_terminated()


def test_linear_chain() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    t = GrammarTree.from_linear_chain(ids)
    nt, ns, dt = t.resolve()
    assert nt.tolist() == [[1, 2, -1]] * 2 and ns.tolist() == [[-1] * 3] * 2
    assert torch.equal(dt, ids) and t.resolve()[2] is dt  # idempotent


def _packed_links(rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``[4, rows, N]`` links of the module's tree (next_token, next_sibling, draft tokens,
    parents) with a different last row (a bucket's dummy row), and the four fields."""
    nt = torch.tensor([NEXT_TOKEN] * rows)
    ns = torch.tensor([NEXT_SIBLING] * rows)
    dt = torch.tensor([[0 if d is None else d for d in DRAFT]] * rows)
    par = GrammarTree.from_host(nt, ns, dt).parents()
    links = torch.stack([nt, ns, dt, par])
    links[:, -1] = 7
    return links, [nt, ns, dt, par]


@pytest.mark.parametrize("batch", [1, 2])
def test_packed_links_stage_the_batch_rows(batch: int) -> None:
    """``from_links`` (a propose graph's packed links, possibly wider than the batch) gives
    the fields of rows ``[:batch]``, as the four fields staged one by one."""
    links, fields = _packed_links(3)
    tree = GrammarTree.from_links(links, batch)
    assert tree.shape == (batch, len(NEXT_TOKEN))
    for host, ref in zip((*tree.resolve(), tree.parents()), fields, strict=True):
        assert torch.equal(host, ref[:batch])


@pytest.mark.parametrize("bad", ["rows", "narrow", "dtype", "strided"])
def test_packed_links_refuse_a_wrong_layout(bad: str) -> None:
    links, _ = _packed_links(2)
    arg = {"rows": links[:3], "narrow": links, "dtype": links.to(torch.int32),
           "strided": links.transpose(1, 2).contiguous().transpose(1, 2)}[bad]
    with pytest.raises(ValueError, match="links must be"):
        GrammarTree.from_links(arg, 3 if bad == "narrow" else 2)
    for size in (-1, True, 1.0):
        with pytest.raises(ValueError, match="batch_size"):
            GrammarTree.from_links(links, size)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_links_staging_does_not_sync() -> None:
    """A CUDA ``[4, B', N]`` links tensor staged with one copy under
    ``set_sync_debug_mode("error")``: pinned int64 rows ``[:B]``, the same as on the host."""
    links, fields = _packed_links(3)
    dev = links.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree = GrammarTree.from_links(dev, 2)
        got = tree.resolve()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tree.copy is not None and tree.copy.from_device
    for host, ref in zip((*got, tree.parents()), fields, strict=True):
        assert host.is_pinned() and torch.equal(host, ref[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tree_staging_does_not_sync() -> None:
    """A CUDA tree (int32 links) staged and resolved under ``set_sync_debug_mode("error")``:
    the D2H copies are asynchronous and the one wait is on their event."""
    nt = torch.tensor([NEXT_TOKEN] * 2, dtype=torch.int32)
    ns = torch.tensor([NEXT_SIBLING] * 2, dtype=torch.int32)
    dt = torch.tensor([[0 if d is None else d for d in DRAFT]] * 2, dtype=torch.int32)
    dev = [t.cuda() for t in (nt, ns, dt)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree = GrammarTree.from_device(dev[0], dev[1], dev[2].reshape(-1))
        got = tree.resolve()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tree.copy is not None and tree.copy.from_device
    for host, ref in zip(got, (nt, ns, dt), strict=True):
        assert host.dtype == torch.int64 and host.is_pinned() and torch.equal(host, ref.long())
    assert tree.parents().tolist() == GrammarTree.from_host(nt, ns, dt).parents().tolist()


def test_parallel_traversal_speedup(backend: GrammarBackend, hf_tokenizer: Any) -> None:
    """Requests traverse in parallel (xgrammar releases the GIL); print the speedup."""
    schema = {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "pattern": "^[a-z]{2,8}$"} for i in range(12)}}
    cg = backend.compile(JsonSchemaConstraint(schema))
    text = '{"field_0": "abc", "field_1": "de'
    bs, n = 32, 48
    rng = random.Random(1)
    matchers, trees = [], []
    pool = hf_tokenizer.encode('abcdefghij", "field_2": "xy"}', add_special_tokens=False)
    for _ in range(bs):
        m, prefix = _prefix_matcher(backend, cg, hf_tokenizer, text)
        matchers.append(m)
        parents = [-1] + [max(0, i - 1 - rng.randrange(2)) for i in range(1, n)]
        nt, ns, last = [-1] * n, [-1] * n, {}
        for i in range(1, n):
            p = parents[i]
            if p in last:
                ns[last[p]] = i
            else:
                nt[p] = i
            last[p] = i
        trees.append((nt, ns, [prefix[-1]] + [rng.choice(pool) for _ in range(n - 1)]))
    tree = GrammarTree.from_host(*(torch.tensor([t[k] for t in trees]) for k in range(3)))

    def run(executor: ThreadPoolExecutor | None) -> tuple[float, torch.Tensor]:
        best, out = float("inf"), None
        for _ in range(5):
            t0 = time.perf_counter()
            res = build_grammar_vocab_mask(matchers, tree, vocab_size=backend.vocab_size,
                                           device="cpu", time_limit_s=10.0, executor=executor,
                                           num_workers=2)
            best = min(best, time.perf_counter() - t0)
            out = res.bitmask_cpu
        return best, out

    serial_s, serial = run(None)
    with ThreadPoolExecutor(2) as ex:
        par_s, par = run(ex)
    assert torch.equal(serial, par)
    print(f"\ntree mask bs={bs} N={n}: serial {serial_s * 1e3:.2f} ms, 2 threads "
          f"{par_s * 1e3:.2f} ms, speedup {serial_s / par_s:.2f}x")


@pytest.mark.parametrize("seed", range(3))
def test_settle_walks_agree(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python walk of a few requests and the numpy walk of many settle the same rows and
    count the same rejections: random trees (padding, out-of-vocabulary tokens, stop tokens,
    parents under a padding node) over random filled rows, a random subset of requests."""
    import numpy as np

    from structspec.grammar import tree_mask

    rng = random.Random(seed)
    width = 3  # 96 token ids
    for _ in range(150):
        bs, n = rng.randint(1, 12), rng.randint(2, 12)
        toks = torch.tensor([[rng.randrange(100)] + [
            rng.randrange(100) if rng.random() > 0.15 else -1 for _ in range(n - 1)]
            for _ in range(bs)])
        parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, n)]
                                for _ in range(bs)])
        words = torch.from_numpy(np.random.default_rng(rng.randrange(2**31)).integers(
            -2**31, 2**31, size=(bs * n, width), dtype=np.int64).astype(np.int32))
        # dense rows: a random token is allowed with probability ~3/4
        words |= torch.from_numpy(np.random.default_rng(rng.randrange(2**31)).integers(
            -2**31, 2**31, size=(bs * n, width), dtype=np.int64).astype(np.int32))
        requests = sorted(rng.sample(range(bs), rng.randint(0, bs)))
        stops = rng.sample(range(96), 3)
        results = []
        for limit in (0, 10**6):  # numpy walk, then the Python walk
            monkeypatch.setattr(tree_mask, "SETTLE_LIST_MAX_REQUESTS", limit)
            rows = words.clone()
            bad = tree_mask.settle_tree_rows_batch(rows, toks, parents, requests,
                                                   stop_token_ids=stops)
            results.append((rows, bad))
        (rows_np, bad_np), (rows_py, bad_py) = results
        assert torch.equal(rows_np, rows_py)
        assert bad_np.tolist() == bad_py.tolist() and bad_py.dtype == bad_np.dtype
