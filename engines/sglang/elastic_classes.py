"""How an SGLang allocator object becomes elastic: its class is swapped for a direct
subclass that carries the adapter's methods, and those methods top up before SGLang
allocates.

A leaf of the adapter: `allocator.py` (the token and paged allocators) and `swa.py`
(the hybrid sliding-window pair, whose sub-allocators are `allocator.py`'s) both build
on it. Mixing a class in the usual way does not work here: a mixin placed before an
ABC-derived class changes the object layout, and `__class__` cannot be swapped to such
a class. So `subclass_with` copies the methods into a direct subclass of SGLang's
class, and the methods reach SGLang's own through `_base`.
"""

from __future__ import annotations

from typing import Any


class TopsUpFirst:
    """SGLang's three allocation calls, each preceded by `_ensure(pages)`: the pages the
    allocation needs (as SGLang computes them, `get_num_new_pages`) are in the stock
    before SGLang's code runs, or the call answers None as SGLang's does when memory is
    short. Its kernels read the free list before they check its length, which is only
    safe on a list as long as the whole pool: so the check must come first."""

    _base: Any  # SGLang's allocator class
    page_size: int
    #: SGLang's alloc_extend takes the page count (the paged allocator's does; the
    #: sliding-window pair's computes its own): then it is not computed twice
    _takes_page_count = True

    def _ensure(self, pages: int) -> bool:
        raise NotImplementedError

    def alloc(self, need_size: int) -> Any:
        if not self._ensure(-(-need_size // self.page_size)):
            return None
        return self._base.alloc(self, need_size)

    def alloc_extend(
        self,
        prefix_lens: Any,
        prefix_lens_cpu: Any,
        seq_lens: Any,
        seq_lens_cpu: Any,
        last_loc: Any,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> Any:
        pages = num_new_pages
        if pages is None:
            from sglang.srt.utils import get_num_new_pages

            pages = int(
                get_num_new_pages(
                    seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
                )
            )
        if not self._ensure(pages):
            return None
        given = (pages,) if self._takes_page_count else ()
        return self._base.alloc_extend(
            self,
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            last_loc,
            extend_num_tokens,
            *given,
        )

    def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> Any:
        from sglang.srt.utils import get_num_new_pages

        pages = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
        if not self._ensure(pages):
            return None
        return self._base.alloc_decode(self, seq_lens, seq_lens_cpu, last_loc)


def adapter_methods(mixin: type) -> dict[str, Any]:
    """The methods `mixin` and its bases define (not `object`'s, not dunders)."""
    methods: dict[str, Any] = {}
    for owner in reversed(mixin.__mro__[:-1]):
        for name, value in vars(owner).items():
            if not name.startswith("__") and name != "_base":
                methods[name] = value
    return methods


def subclass_with(cls: type, mixin: type, made: dict[type, type]) -> type:
    """SGLang's class `cls` with `mixin`'s methods, as a direct subclass named
    ``Elastic<cls>`` (cached in `made`)."""
    if cls not in made:
        attributes = {**adapter_methods(mixin), "_base": cls}
        made[cls] = type(f"Elastic{cls.__name__}", (cls,), attributes)
    return made[cls]
