"""Prefix-caching page allocator: matching, reference counts, LRU eviction, no leaks."""

from __future__ import annotations

import pytest

from structspec.kvcache.prefix_cache import PrefixCachingAllocator

PS = 4


def _run(alloc: PrefixCachingAllocator, prompt: list[int], extra_pages: int = 1) -> list[int]:
    """Admit a request the way the scheduler does: reuse, allocate the rest, register."""
    hits = alloc.match(prompt)
    alloc.acquire(hits)
    pages = hits + alloc.allocate(alloc.pages_for(len(prompt)) - len(hits) + extra_pages)
    alloc.register(prompt, pages, len(prompt))
    return pages


def test_match_reuses_full_pages_and_leaves_the_last_token() -> None:
    alloc = PrefixCachingAllocator(16, PS)
    prompt = list(range(10))  # pages [0..3] [4..7] full, [8, 9] partial
    a = _run(alloc, prompt)
    assert alloc.num_cached_pages == 2 and alloc.ref_count(a[0]) == 1
    assert alloc.match(prompt) == a[:2]
    assert alloc.match(list(range(8))) == a[:1]  # page-aligned prompt: last page recomputed
    assert alloc.match([0, 1, 2, 3, 9, 9, 9, 9, 9]) == a[:1]  # diverges in page 2
    assert alloc.match([1, 2, 3, 4, 5]) == []
    b = _run(alloc, prompt + [42])
    assert b[:2] == a[:2] and alloc.ref_count(a[0]) == 2 and not set(b[2:]) & set(a)


def test_same_tokens_under_another_parent_do_not_match() -> None:
    alloc = PrefixCachingAllocator(16, PS)
    _run(alloc, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert alloc.match([3, 3, 3, 3, 2, 2, 2, 2, 0]) == []  # page 2's tokens, other prefix


def test_free_makes_cached_pages_evictable_and_counts_them_free() -> None:
    alloc = PrefixCachingAllocator(8, PS)  # 7 usable pages
    a = _run(alloc, list(range(9)))  # 3 + 1 pages, 2 cached
    assert alloc.num_free_pages == 3
    alloc.free(a)
    assert alloc.num_free_pages == 7 and alloc.num_evictable_pages == 2
    assert alloc.match(list(range(9))) == a[:2]  # still matchable
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[0]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[3]])


def test_lru_eviction_takes_tails_first_and_never_referenced_pages() -> None:
    alloc = PrefixCachingAllocator(8, PS)
    a = _run(alloc, list(range(13)), extra_pages=0)  # 4 pages, 3 cached
    alloc.free(a)
    b = _run(alloc, [100, 101, 102, 103, 104], extra_pages=0)  # 2 pages, 1 cached; held
    got = alloc.allocate(3)  # 2 free left: one eviction, the LRU tail page of ``a``
    assert alloc.stats.evicted_pages == 1 and a[2] in got
    assert alloc.match(list(range(13))) == a[:2]
    assert alloc.ref_count(b[0]) == 1 and b[0] not in got
    alloc.free(got)
    assert not alloc.can_allocate(8)
    got = alloc.allocate(alloc.num_free_pages)  # everything evictable goes, b's page stays
    assert b[0] not in got and alloc.ref_count(b[0]) == 1
    with pytest.raises(MemoryError):
        alloc.allocate(1)
    alloc.free(got)
    alloc.free(b)
    assert alloc.num_free_pages == 7  # no leak: every page free or evictable


def test_concurrent_duplicate_prefill_stays_uncached_and_is_freed() -> None:
    alloc = PrefixCachingAllocator(16, PS)
    prompt = list(range(9))
    a = alloc.allocate(3)
    b = alloc.allocate(3)  # both admitted before either registered
    alloc.register(prompt, a, 9)
    alloc.register(prompt, b, 9)
    assert alloc.num_cached_pages == 2 and alloc.ref_count(b[0]) == 0
    alloc.free(b)
    alloc.free(a)
    assert alloc.num_free_pages == 15 and alloc.num_evictable_pages == 2


def test_disabled_is_a_plain_allocator() -> None:
    alloc = PrefixCachingAllocator(8, PS, enabled=False)
    a = _run(alloc, list(range(9)))
    assert alloc.num_cached_pages == 0 and alloc.match(list(range(9))) == []
    alloc.free(a)
    assert alloc.num_free_pages == 7 and alloc.num_evictable_pages == 0


def test_hit_rate_counters() -> None:
    alloc = PrefixCachingAllocator(8, PS)
    assert alloc.stats.hit_rate == 0.0
    alloc.record_admission(10, 0)
    alloc.record_admission(10, 8)
    assert alloc.stats.hit_rate == pytest.approx(0.4)


def _cache_state(alloc: PrefixCachingAllocator) -> tuple:
    return (dict(alloc._entry_of_key), dict(alloc._refs))  # noqa: SLF001


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 8, 30])
def test_chunked_registration_with_a_cursor_equals_one_registration(chunk: int) -> None:
    """A prompt registered chunk by chunk, each call resuming at the previous call's cursor,
    caches exactly what one registration of the whole prompt does (same keys, same pages,
    same references), also when another request registered the same first pages first."""
    prompt = [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
              24, 25, 26, 27, 28, 29]
    states = []
    for chunked in (False, True):
        alloc = PrefixCachingAllocator(32, PS)
        other = alloc.allocate(2)
        alloc.register(prompt[:8], other, 8)  # two of the prompt's pages, cached already
        pages = alloc.allocate(alloc.pages_for(len(prompt)))
        if chunked:
            cursor = None
            for end in [*range(chunk, len(prompt), chunk), len(prompt)]:
                cursor = alloc.register(prompt, pages, end, cursor)
            assert cursor is not None and cursor.num_pages == len(prompt) // PS
        else:
            alloc.register(prompt, pages, len(prompt))
        states.append(_cache_state(alloc))
        assert alloc.match(prompt + [0])[:2] == other
    assert states[0] == states[1]


def test_a_cursor_whose_parent_was_evicted_starts_over() -> None:
    alloc = PrefixCachingAllocator(8, PS)
    prompt = list(range(12))
    other = alloc.allocate(1)
    cursor_other = alloc.register(prompt, other, 4)  # page 0 of the prompt, held by "other"
    mine = alloc.allocate(3)
    cursor = alloc.register(prompt, mine, 4)  # chains through other's cached page
    assert cursor is not None and cursor.parent_page == other[0] and cursor_other is not None
    alloc.free(other)
    alloc.allocate(alloc.num_free_pages)  # evicts other's page
    assert alloc.match(prompt) == []
    cursor = alloc.register(prompt, mine, 12, cursor)  # stale: walks from the first page
    assert cursor is not None and cursor.num_pages == 3
    assert alloc.match(prompt + [0]) == mine  # my own pages now carry the prefix


def test_register_returns_no_cursor_when_disabled() -> None:
    alloc = PrefixCachingAllocator(8, PS, enabled=False)
    assert alloc.register(list(range(8)), alloc.allocate(2), 8) is None
