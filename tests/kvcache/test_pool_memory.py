"""The KV pool's CPU buffer: zeros whose memory is committed only where slots are written."""

from __future__ import annotations

import os

import torch

from structspec.kvcache.pool import KVPool, zeros_on_touch


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_zeros_on_touch_are_zeros_of_the_asked_layout() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for shape in ((2, 3, 5, 7), (3,), (0, 4)):
            z = zeros_on_touch(shape, dtype=dtype, device=torch.device("cpu"))
            assert z.shape == shape and z.dtype == dtype and z.is_contiguous()
            assert not z.any() and z.data_ptr() % 64 == 0
            z.fill_(1)  # writable, owns its memory
            assert bool((z == 1).all())


def test_cpu_pool_commits_memory_only_where_written() -> None:
    """A 1.5 GiB pool costs almost no resident memory until written; torch.zeros would
    commit all of it at construction (seconds of page faults at every engine start)."""
    before = rss_bytes()
    pool = KVPool(num_layers=32, num_pages=1024, page_size=16, num_kv_heads=6, head_dim=64,
                  dtype=torch.float32, device=torch.device("cpu"))
    assert pool.size_bytes == 1536 << 20
    assert rss_bytes() - before < 64 << 20
    assert not pool.k_cache[5][16:32].any()  # zeros where read
    pool.v_cache[3][16:32] = 1.0
    pool.copy_slots(torch.arange(16, 32), torch.arange(32, 48))
    assert bool((pool.v_cache[3][32:48] == 1).all()) and not pool.v_cache[3][48:64].any()
    # the copy wrote 16 slots of every layer's K and V: 64 regions, each committing at most
    # a 2 MiB page where transparent huge pages are on
    assert rss_bytes() - before < 256 << 20
