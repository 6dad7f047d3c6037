"""Pages of one layer: the page pool of a side (keys or values: ``[P, ...]`` tensors named as in ``docs/LAYOUT.md``),
the page tables (int32 ``[B, W]``, the pool id of a row's j-th page, -1 unused) and the rule for when tokens complete
a page.

Two page-id policies, one per layer kind, chosen when the layer is built (:class:`GrowingPages`, :class:`FixedPages`):

- :class:`PagePool`, a growing layer's: a bump allocator; the tensors grow by doubling and the tables widen as rows
  grow;
- :class:`FixedPagePool`, a static layer's: every page preallocated, row b's page j at the fixed id ``b * W + j``
  (no allocator), tables at their full width ``W`` from the start.

Both pools answer the same questions (room for pages, ids for new pages, a fresh or cleared table, the pages in use),
so the layer code never asks which one it holds.

The completion rule, "the token that brought row b to ``n`` tokens filled its qbuffer, which becomes page j", has a
host form (:func:`filled_page`) and a device form (:func:`filled_pages`) side by side; ``kernels/pack.py`` keeps one
inline copy of it (``_filled_page``) and :func:`pages_completed` counts the pages a growth of several tokens fills."""

from __future__ import annotations

import torch

from .config import KVQuantConfig
from .storage import FieldSpec, allocate_pool


def filled_page(n: int, start: int, group_size: int) -> int | None:
    """Host form of the completion rule: the page index ``j`` that the token bringing a row to ``n`` tokens filled,
    else ``None``. ``start``: tokens before the side's pages (``S`` for keys, ``S + R`` for values); with
    ``m = n - start``, the qbuffer filled when ``m > 0`` and ``m % G == 0``, and it becomes page ``j = m // G - 1``."""
    m = n - start
    return m // group_size - 1 if m > 0 and m % group_size == 0 else None


def filled_pages(lengths: torch.Tensor, start: int, group_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device form of :func:`filled_page` for every row at once (no host read): ``(done, j)``, bool and int64 ``[B]``
    from ``lengths`` ``[B]`` (counting the new token); ``j`` is clamped into ``[0, width)`` so that it indexes a page
    table of ``width`` columns whatever ``done`` says, and ``done`` is False for a page past the table (a step past
    ``max_cache_len``: nothing is written there)."""
    m = lengths.long() - start
    j = m // group_size - 1
    done = (m > 0) & (m % group_size == 0) & (j < width)
    return done, j.clamp(0, max(width - 1, 0))


def pages_completed(cfg: KVQuantConfig, n0: list[int], n1: list[int]) -> tuple[list[int], list[int]]:
    """Key and value pages each row completes when it grows from ``n0[b]`` to ``n1[b]`` tokens.

    A row of ``n`` tokens holds ``max(n - S, 0) // G`` key pages and ``max(n - S - R, 0) // G`` value pages (the
    page counts of :func:`kitty.core.memory.token_layout`); the difference is what stage 3 packs.
    """
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    key = [max(b - S, 0) // G - max(a - S, 0) // G for a, b in zip(n0, n1)]
    value = [max(b - S - R, 0) // G - max(a - S - R, 0) // G for a, b in zip(n0, n1)]
    return key, value


class PoolStorage:
    """The tensors of one side's page pool, ``name -> [P, ...]`` (``docs/LAYOUT.md`` names), and how pages are
    written."""

    tensors: dict[str, torch.Tensor]

    def write(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Pages ``ids`` (``[n]``) of the pool take ``values`` (``name -> [n, ...]``)."""
        for name, t in values.items():
            self.tensors[name][ids.long()] = t


class PagePool(PoolStorage):
    """Page storage of one layer, for keys or for values: tensors ``[P, ...]`` named as in ``docs/LAYOUT.md``.

    Pages are handed out in order (a bump allocator: a page is never freed alone, :meth:`reset` frees them all) and
    the tensors grow by doubling when full, never beyond ``max_pages``. Only ``[:used]`` holds live pages.
    """

    def __init__(
        self,
        fields: FieldSpec,
        device: torch.device,
        max_pages: int | None,
        kind: str,
    ):
        self.fields = fields  # name -> (shape of one page, dtype)
        self.max_pages = max_pages
        self.kind = kind  # "key" or "value", for messages
        self.device = device
        self.tensors = allocate_pool(fields, 0, device)
        self.used = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def check(self, n: int) -> None:
        """Raise ``RuntimeError`` if ``n`` more pages would exceed ``max_pages`` (nothing is changed)."""
        if self.max_pages is not None and self.used + n > self.max_pages:
            raise RuntimeError(
                f"the {self.kind} page pool is exhausted: {self.used} pages in use, {n} more needed, "
                f"max_pages={self.max_pages}. The cache is unchanged; call cache.reset() or build it with a larger "
                "max_pages (or max_pages=None to grow on demand)."
            )

    def allocate(self, n: int) -> torch.Tensor:
        """Ids (int32 ``[n]``) of ``n`` fresh pages, growing the storage if needed."""
        self.check(n)
        need = self.used + n
        if need > self.capacity:
            new_cap = max(need, 2 * self.capacity, 4)
            if self.max_pages is not None:
                new_cap = min(new_cap, self.max_pages)
            grown = allocate_pool(self.fields, new_cap, self.device)
            for name, t in self.tensors.items():
                grown[name][: self.used] = t[: self.used]
            self.tensors = grown
        ids = torch.arange(self.used, need, dtype=torch.int32, device=self.device)
        self.used = need
        return ids

    def place(self, dest: list[tuple[int, int, int]]) -> torch.Tensor:
        """Ids (int32) of the new pages ``dest`` = ``[(row, first page, count)]``, in order: fresh ones, allocated."""
        return self.allocate(sum(n for *_, n in dest))

    def in_use(self) -> dict[str, torch.Tensor]:
        return {name: t[: self.used] for name, t in self.tensors.items()}

    def live(self, pages: list[int]) -> dict[str, torch.Tensor]:
        """The pool tensors of the live pages, for rows holding ``pages[b]`` pages each (all pages handed out)."""
        return self.in_use()

    def view(self, table: torch.Tensor, pages: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``table`` cut to ``pages`` columns and the pool cut to the pages in use (views, no copies)."""
        return table[:, :pages], self.in_use()

    def new_table(self, rows: int) -> torch.Tensor:
        """An empty page table: no column yet (:meth:`widen` grows it)."""
        return torch.full((rows, 0), -1, dtype=torch.int32, device=self.device)

    def widen(self, table: torch.Tensor, pages: int) -> torch.Tensor:
        """``table`` with room for ``pages`` pages per row (:func:`grow_page_table`)."""
        return grow_page_table(table, pages)

    def clear(self, table: torch.Tensor) -> torch.Tensor:
        """Free every page (the storage is kept) and return ``table`` emptied."""
        self.reset()
        return table[:, :0]

    def mark(self) -> int:
        """What :meth:`rewind` needs to free the pages handed out after this call."""
        return self.used

    def rewind(self, mark: int) -> None:
        self.used = mark

    def reset(self) -> None:
        self.used = 0


class FixedPagePool(PoolStorage):
    """A static layer's page pool of one side: ``rows * width`` preallocated pages, row b's page j at the fixed id
    ``b * width + j`` (no allocator; ``max_cache_len`` bounds every row's pages, checked before a step)."""

    def __init__(self, fields: FieldSpec, device: torch.device, rows: int, width: int, kind: str):
        self.fields, self.device, self.width, self.kind = fields, device, width, kind
        self.max_pages = rows * width
        # zeros, not empty: the torch reference dequantizes whole rows of the table, unused pages included
        self.tensors = allocate_pool(fields, rows * width, device, fill=0)

    def check(self, n: int) -> None:
        """Nothing to check (module docstring)."""

    def place(self, dest: list[tuple[int, int, int]]) -> torch.Tensor:
        """Ids (int32) of the pages ``dest`` = ``[(row, first page, count)]``, in order: ``row * width + j``."""
        W = self.width
        ids = torch.cat([torch.arange(b * W + j, b * W + j + n, dtype=torch.int32) for b, j, n in dest])
        return ids.to(self.device)

    def live(self, pages: list[int]) -> dict[str, torch.Tensor]:
        """The pool tensors of the live pages, for rows holding ``pages[b]`` pages each."""
        ids = [b * self.width + j for b, p in enumerate(pages) for j in range(p)]
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return {name: t[ids] for name, t in self.tensors.items()}

    def view(self, table: torch.Tensor, pages: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The whole table and pool (fixed shapes: captured kernels see the same ones at every step)."""
        return table, self.tensors

    def new_table(self, rows: int) -> torch.Tensor:
        """A page table at its full width, every entry -1 until its page is written."""
        return torch.full((rows, self.width), -1, dtype=torch.int32, device=self.device)

    def widen(self, table: torch.Tensor, pages: int) -> torch.Tensor:
        """``table`` itself: it has its full width already."""
        return table

    def clear(self, table: torch.Tensor) -> torch.Tensor:
        """Every entry of ``table`` back to -1, in place (the pages keep their storage)."""
        return table.fill_(-1)

    def mark(self) -> None:
        """Nothing: page ids follow from rows and indices."""

    def rewind(self, mark: None) -> None:
        """Nothing to free."""


class GrowingPages:
    """The page-id policy of a growing layer: a bump allocator per side, at most ``max_pages`` pages each."""

    def __init__(self, max_pages: int | None = None):
        self.max_pages = max_pages

    def pools(self, key_fields: FieldSpec, value_fields: FieldSpec, rows: int, device) -> tuple[PagePool, PagePool]:
        return (
            PagePool(key_fields, device, self.max_pages, "key"),
            PagePool(value_fields, device, self.max_pages, "value"),
        )


class FixedPages:
    """The page-id policy of a static layer: ``key_width`` / ``value_width`` pages per row at fixed ids."""

    def __init__(self, key_width: int, value_width: int):
        self.key_width, self.value_width = key_width, value_width

    def pools(self, key_fields, value_fields, rows: int, device) -> tuple[FixedPagePool, FixedPagePool]:
        return (
            FixedPagePool(key_fields, device, rows, self.key_width, "key"),
            FixedPagePool(value_fields, device, rows, self.value_width, "value"),
        )


def grow_page_table(table: torch.Tensor, need: int) -> torch.Tensor:
    """``table`` with at least ``need`` columns (doubling; new entries -1); ``table`` itself if it has them."""
    if need <= table.shape[1]:
        return table
    new = torch.full((table.shape[0], max(need, 2 * table.shape[1])), -1, dtype=torch.int32, device=table.device)
    new[:, : table.shape[1]] = table
    return new


def point(table: torch.Tensor, dest: list[tuple[int, int, int]], ids: torch.Tensor) -> None:
    """Page-table entries ``table[b, first : first + n]`` = the next ``n`` of ``ids``, for each ``(b, first, n)``."""
    i = 0
    for b, first, n in dest:
        table[b, first : first + n] = ids[i : i + n]
        i += n
