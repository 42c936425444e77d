"""Prefix caching over KV pages: full prompt pages are kept after their request ends and
handed to later requests whose prompts start with the same tokens.

A cached page is identified by its *chain key* ``(parent entry id, the page's token ids)``
(vLLM's hashed blocks, with the parent's hash replaced by a unique entry id): the key names
the page's tokens and, through the parent, every token before them, so two pages share a key
only if the whole prefix up to their end is equal. Entry ids are never reused, so a page
whose parent was evicted can never be matched under a new parent: there are no hash
collisions to worry about and nothing to verify on a hit. Nothing but the token ids changes a
page's KV today (one model, one dtype, no LoRA, rotary positions follow from the page index).

Pages have reference counts: every running request that holds a cached page counts once. An
unreferenced cached page is *evictable*: it keeps its KV and can still be matched, but it
counts as free for admission and the allocator takes it back (least recently released first)
when the free list runs out. A referenced page is never evicted.

Only *final* pages are registered: a page fully inside a prompt, once the prefill wrote it.
A verify step writes its tree at positions ``>= seq_len`` (the prompt length or more), and the
accepted-path compaction moves KV only inside those positions, so a prompt page is never
written again; a request that reuses cached pages prefills from the first uncached page, so
it never writes into a shared page either. Drafted (possibly rejected) tokens' KV lives in
output pages, which are never registered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from structspec.kvcache.allocator import PageAllocator

_ROOT_ID = 0  # the parent id of a prompt's first page


@dataclass
class PrefixCacheStats:
    """Counters since the engine started (host ints).

    Attributes:
        queried_tokens: prompt tokens of admitted requests (the hit rate's denominator).
        hit_tokens: prompt tokens whose KV came from the cache.
        evicted_pages: cached pages taken back for new allocations.
    """

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before any request)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class RegisterCursor:
    """Where a request's :meth:`PrefixCachingAllocator.register` walk stopped.

    Attributes:
        num_pages: leading pages of the request already registered (or found cached).
        parent_page: the cached page whose entry is the next page's parent (None: the root).
        parent_id: that entry's id (a check that the entry was not evicted since).
    """

    num_pages: int
    parent_page: int | None
    parent_id: int


class PrefixCachingAllocator:
    """A :class:`~structspec.kvcache.allocator.PageAllocator` with a cache of full prompt pages.

    Same interface as the page allocator (``allocate``, ``free``, ``can_allocate``,
    ``pages_for``, ``num_free_pages``, ``capacity_tokens``) plus :meth:`match`,
    :meth:`acquire` and :meth:`register`. ``num_free_pages`` counts evictable cached pages as
    free; :meth:`allocate` evicts them (least recently released first) when the free list is
    short. With ``enabled=False`` nothing is ever cached and it behaves as the plain allocator.

    Host-only bookkeeping (Python ints); every operation is O(pages touched), except
    :meth:`match`, which hashes the prompt's full pages (O(prompt tokens)).

    Args:
        num_pages: pages of the KV pool (page 0, the sink, is never handed out).
        page_size: tokens per page.
        enabled: cache pages (False: a plain allocator with zero hit counters).
    """

    def __init__(self, num_pages: int, page_size: int, *, enabled: bool = True) -> None:
        self.pages = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._entry_of_key: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> page
        self._key_of_page: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._id_of_page: dict[int, int] = {}  # cached page -> its entry id (children's parent)
        self._refs: dict[int, int] = {}  # cached page -> running requests holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, oldest first
        self._next_id = _ROOT_ID + 1

    # -- the PageAllocator interface ---------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: the free list plus the evictable cached pages."""
        return self.pages.num_free_pages + len(self._evictable)

    @property
    def capacity_tokens(self) -> int:
        return self.pages.capacity_tokens

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` token slots."""
        return self.pages.pages_for(num_tokens)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages, evicting unreferenced cached pages (LRU) if needed.

        Raises:
            MemoryError: fewer pages are free or evictable (check :meth:`can_allocate`).
        """
        short = num_pages - self.pages.num_free_pages
        if short > len(self._evictable):
            raise MemoryError(f"KV cache full: need {num_pages} pages, "
                              f"{self.num_free_pages} free or evictable")
        if short > 0:
            evicted = [self._evictable.popitem(last=False)[0] for _ in range(short)]
            for p in evicted:
                self._uncache(p)
            self.stats.evicted_pages += short
            self.pages.free(evicted)
        return self.pages.allocate(num_pages)

    def free(self, pages: Sequence[int]) -> None:
        """A request lets go of its pages: cached ones lose a reference (and become evictable
        at zero), the others go back to the free list.

        The pages are released last first, so a prompt's tail pages are evicted before its
        head pages (a shared system prompt outlives the questions after it).

        Raises:
            ValueError: a double free (of an uncached page, or of a cached page with no
                reference left); nothing is freed then.
        """
        refs = self._refs
        plain: list[int] = []
        dropped: list[int] = []
        taken: dict[int, int] = {}  # references this call drops, per cached page
        for p in pages:
            if p in refs:
                n = taken.get(p, 0) + 1
                if n > refs[p]:
                    raise ValueError(f"invalid or double free of cached KV page {p}")
                taken[p] = n
                dropped.append(p)
            else:
                plain.append(p)
        self.pages.free(plain)  # raises before any cached page changes
        for p in reversed(dropped):
            refs[p] -= 1
            if refs[p] == 0:
                self._evictable[p] = None

    # -- prefix caching ----------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        """Pages holding a registered prefix (referenced or evictable)."""
        return len(self._refs)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no running request holds."""
        return len(self._evictable)

    def ref_count(self, page: int) -> int:
        """Running requests holding cached ``page`` (0 for an evictable or uncached page)."""
        return self._refs.get(page, 0)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """The cached pages of the longest page-aligned prefix of ``token_ids``, in order.

        At most ``(len(token_ids) - 1) // page_size`` pages: the last token is always left to
        compute (its logits give the first output token). Takes no reference (see
        :meth:`acquire`).
        """
        if not self.enabled:
            return []
        ps = self.page_size
        out: list[int] = []
        parent = _ROOT_ID
        for i in range((len(token_ids) - 1) // ps):
            page = self._entry_of_key.get((parent, tuple(token_ids[i * ps:(i + 1) * ps])))
            if page is None:
                break
            out.append(page)
            parent = self._id_of_page[page]
        return out

    def acquire(self, pages: Sequence[int]) -> None:
        """A request takes a reference on matched cached pages (they stop being evictable).

        Raises:
            ValueError: a page is not cached (it was evicted since :meth:`match`).
        """
        for p in pages:
            if p not in self._refs:
                raise ValueError(f"KV page {p} is not in the prefix cache")
        for p in pages:
            self._refs[p] += 1
            self._evictable.pop(p, None)

    def register(self, token_ids: Sequence[int], pages: Sequence[int], num_tokens: int,
                 cursor: RegisterCursor | None = None) -> RegisterCursor | None:
        """Cache the full pages of a request's first ``num_tokens`` tokens, whose KV is final.

        ``pages`` are the request's pages in position order (``pages[i]`` holds positions
        ``i * page_size ..``); the request keeps its reference on each page it registers.
        A page whose key is already cached under another page (two requests prefilled the
        same prefix at once) stays the request's own, uncached; the chain goes on through
        the cached one.

        ``cursor``: what the request's previous call returned (its pages and their first
        ``num_tokens`` tokens unchanged since): the walk resumes after the pages already
        registered instead of hashing the prompt from its first page again. A chunked
        prefill registers after every chunk, so without it a prompt of ``P`` pages in ``C``
        chunks costs ``O(P * C)`` (~0.3 ms a chunk at 7,000 tokens, on the step that
        stalls the running streams). A cursor whose parent entry was evicted since is
        ignored (the walk starts over, as without one).

        Returns:
            The cursor for the request's next call (None when caching is off).
        """
        if not self.enabled:
            return None
        ps = self.page_size
        start, parent, parent_page = 0, _ROOT_ID, None
        if cursor is not None and cursor.parent_page is not None \
                and self._id_of_page.get(cursor.parent_page) == cursor.parent_id:
            start, parent, parent_page = cursor.num_pages, cursor.parent_id, cursor.parent_page
        for i in range(start, min(num_tokens // ps, len(pages))):
            page = pages[i]
            key = (parent, tuple(token_ids[i * ps:(i + 1) * ps]))
            have = self._entry_of_key.get(key)
            if have is None:
                if page in self._refs:
                    raise ValueError(f"KV page {page} is cached under another prefix")
                self._entry_of_key[key] = page
                self._key_of_page[page] = key
                self._id_of_page[page] = self._next_id
                self._next_id += 1
                self._refs[page] = 1  # the registering request holds it
                have = page
            parent, parent_page = self._id_of_page[have], have
            start = i + 1
        return RegisterCursor(start, parent_page, parent)

    def record_admission(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prompt tokens and cache hits (hit-rate counters)."""
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens

    def _uncache(self, page: int) -> None:
        key = self._key_of_page.pop(page)
        del self._entry_of_key[key]
        del self._id_of_page[page]
        del self._refs[page]
