"""Pages of one layer: the page pool of a side (keys or values: ``[P, ...]`` tensors named as in ``docs/LAYOUT.md``,
a bump allocator over them), the page tables (int32 ``[B, W]``, the pool id of a row's j-th page, -1 unused) and the
rule for when tokens complete a page."""

from __future__ import annotations

import torch

from .config import KVQuantConfig
from .storage import FieldSpec, allocate_pool


def pages_completed(cfg: KVQuantConfig, n0: list[int], n1: list[int]) -> tuple[list[int], list[int]]:
    """Key and value pages each row completes when it grows from ``n0[b]`` to ``n1[b]`` tokens.

    A row of ``n`` tokens holds ``max(n - S, 0) // G`` key pages and ``max(n - S - R, 0) // G`` value pages (the
    page counts of :func:`kitty.memory.token_layout`); the difference is what stage 3 packs.
    """
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    key = [max(b - S, 0) // G - max(a - S, 0) // G for a, b in zip(n0, n1)]
    value = [max(b - S - R, 0) // G - max(a - S - R, 0) // G for a, b in zip(n0, n1)]
    return key, value


class PagePool:
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

    def write(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        for name, t in values.items():
            self.tensors[name][ids.long()] = t

    def in_use(self) -> dict[str, torch.Tensor]:
        return {name: t[: self.used] for name, t in self.tensors.items()}

    def reset(self) -> None:
        self.used = 0


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
