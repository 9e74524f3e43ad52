"""The page book alone (kvcached/page_book.py), driven by hypothesis through random steps.

The model is the set of blocks handed out, the extents added and the page-id ranges
claimed for growth. After every step the book must satisfy Note [Page book
invariants]: every block of a mapped page is either out or free, once; every page of an
extent in service sits in exactly the structure its free count says; the counters agree
with the lists; the unmapped ranges, the extents and the claims tile the page-id space.
Single takes must follow Note [Filling pages]: the current page first, then the partly
used page with the fewest free blocks, then the lowest fresh page.

The steps are the ones `PageAllocator` makes, in the order it makes them (the current
page is retired before an extent is drained or removed), so that what is checked here is
what the allocator relies on; no driver, lock or thread is involved.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcached.page_book import NO_EXTENT, UNMAPPED, Extent, PageBook


def check_invariants(book: PageBook, used: set[int], claims: set[tuple[int, int]]) -> None:
    """Every clause of Note [Page book invariants], against the model's `used` blocks
    and `claims` (page-id ranges claimed and neither added nor returned)."""
    bpp = book.bpp
    assert book.used == used
    covered = [0] * book.num_pages  # how many of holes, extents and claims hold each id
    for start, length in book.holes:
        assert length > 0
        for page in range(start, start + length):
            covered[page] += 1
    for left, right in zip(book.holes, book.holes[1:], strict=False):
        assert left[0] + left[1] < right[0]  # sorted, disjoint, never adjacent
    for start, npages in claims:
        for page in range(start, start + npages):
            covered[page] += 1
    in_buckets = {page: k for k, bucket in enumerate(book.buckets) for page in bucket}
    assert not book.buckets[0]  # a page with no free block is in no bucket
    assert book.mask == sum(1 << k for k, bucket in enumerate(book.buckets) if bucket)
    assert len(book.empty) == len(set(book.empty))
    assert all(book.empty[i] <= book.empty[c] for i in range(len(book.empty))
               for c in (2 * i + 1, 2 * i + 2) if c < len(book.empty))  # fmt: skip
    free_total = available = capacity = 0
    seen_blocks: set[int] = set()
    for start, extent in book.extents.items():
        assert extent.start == start
        capacity += extent.npages * bpp
        nonempty = 0
        for page in range(start, start + extent.npages):
            covered[page] += 1
            assert book.page_ext[page] is extent
            free = book.free_lists[page]
            assert free is not UNMAPPED
            blocks = set(range(page * bpp, (page + 1) * bpp))
            out = {b for b in blocks if b in used}
            assert len(free) == len(set(free)) and set(free) == blocks - out
            seen_blocks |= blocks
            free_total += len(free)
            k = len(free)
            if extent.draining:
                assert page != book.current
                assert page not in in_buckets and page not in book.empty
                nonempty += k < bpp
                continue
            available += k
            nonempty += k < bpp or page == book.current
            # exactly one place: current, fully free, partly used by its count, or full
            if page == book.current:
                assert book.current_list is free
                assert page not in book.empty and page not in in_buckets
            elif k == bpp:
                assert page in book.empty and page not in in_buckets
            elif k:
                assert in_buckets.get(page) == k and page not in book.empty
            else:
                assert page not in book.empty and page not in in_buckets
        assert extent.nonempty == nonempty
    assert covered == [1] * book.num_pages
    assert used <= seen_blocks
    assert book.capacity == capacity
    assert len(used) + free_total == capacity
    assert book.available == available
    in_service = {
        page
        for extent in book.extents.values()
        if not extent.draining
        for page in range(extent.start, extent.start + extent.npages)
    }
    assert set(book.empty) | set(in_buckets) <= in_service
    for page in range(book.num_pages):
        if book.page_ext[page] is NO_EXTENT:
            assert book.free_lists[page] is UNMAPPED


def expected_next_page(book: PageBook) -> tuple[str, int] | None:
    """Where the next single take must come from (Note [Filling pages]): ("page", p)
    for the current page or the lowest fresh one, ("fewest", k) for any partly used
    page with k free blocks, the fewest there are; None when nothing is available."""
    if book.current_list:
        return ("page", book.current)
    partly = [len(book.free_lists[page]) for bucket in book.buckets for page in bucket]
    if partly:
        return ("fewest", min(partly))
    return ("page", min(book.empty)) if book.empty else None


class PageBookMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.integers(1, 12),
        bpp=st.integers(1, 5),
        low=st.integers(0, 3),
        high=st.integers(0, 4),
    )
    def setup(self, num_pages: int, bpp: int, low: int, high: int) -> None:
        self.signals = 0

        def signal() -> None:
            self.signals += 1

        self.book = PageBook(num_pages, bpp, low_pages=low, high_pages=max(low, high),
                             signal=signal)  # fmt: skip
        self.used: set[int] = set()
        self.claims: set[tuple[int, int]] = set()

    # ------------------------------------------------------------ page-id ranges
    @rule(want=st.integers(1, 6))
    def claim(self, want: int) -> None:
        holes = [tuple(hole) for hole in self.book.holes]
        free_before = self.book.unmapped_pages()
        got = self.book.claim_range(want)
        if got is None:
            assert free_before == 0
            return
        fits = [hole for hole in holes if hole[1] >= want]
        if fits:  # the first hole that holds them all
            assert got == (fits[0][0], want)
        else:  # else the (first) largest, whole
            largest = max(length for _, length in holes)
            assert got == next(hole for hole in holes if hole[1] == largest)
        assert self.book.unmapped_pages() == free_before - got[1]
        self.claims.add(got)

    @precondition(lambda self: self.claims)
    @rule(data=st.data(), build=st.booleans(), halve=st.booleans())
    def settle_claim(self, data: st.DataObject, build: bool, halve: bool) -> None:
        """What growth does with its claim: build it (or, refused, its lower half after
        returning the upper one), or give it all back."""
        start, npages = data.draw(st.sampled_from(sorted(self.claims)))
        self.claims.discard((start, npages))
        if halve and npages > 1:
            half = npages // 2
            self.book.return_range(start + half, npages - half)
            npages = half
        if build:
            self.book.add_extent(Extent(start, npages, []))
        else:
            self.book.return_range(start, npages)

    # --------------------------------------------------------------- handing out
    @rule()
    def take_one(self) -> None:
        book = self.book
        expected = expected_next_page(book)
        available = book.available
        block = book.take_one()
        if block is None:
            assert available == 0 and expected is None
            return
        assert available > 0 and block not in self.used
        page = block // book.bpp
        assert expected is not None
        kind, value = expected
        if kind == "page":
            assert page == value
        else:  # a partly used page with the fewest free blocks (before this take)
            assert len(book.free_lists[page]) + 1 == value
        assert not book.page_ext[page].draining
        self.used.add(block)

    @precondition(lambda self: self.book.available)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, self.book.available))
        blocks = self.book.take(n)
        assert len(blocks) == len(set(blocks)) == n
        assert not set(blocks) & self.used
        for block in blocks:
            assert not self.book.page_ext[block // self.book.bpp].draining
        self.used.update(blocks)

    # -------------------------------------------------------------- giving back
    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def give_one(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.used)))
        assert self.book.give_one(block)
        self.used.discard(block)

    @rule(block=st.integers(-2, 70))
    def give_one_not_out(self, block: int) -> None:
        if block in self.used:
            return
        available, capacity = self.book.available, self.book.capacity
        assert not self.book.give_one(block)
        assert (self.book.available, self.book.capacity) == (available, capacity)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        blocks = data.draw(st.sets(st.sampled_from(sorted(self.used)), min_size=1))
        assert self.book.give(sorted(blocks))
        self.used -= blocks

    @rule(data=st.data(), stranger=st.integers(-2, 70), twice=st.booleans())
    def give_with_a_bad_id(self, data: st.DataObject, stranger: int, twice: bool) -> None:
        """A batch with one id that is not out, or one id twice: refused, and undone."""
        good = data.draw(st.sets(st.sampled_from(sorted(self.used)))) if self.used else set()
        if twice and good:
            batch = sorted([*good, min(good)])
        elif stranger not in self.used:
            batch = sorted([*good, stranger])
        else:
            return
        available = self.book.available
        assert not self.book.give(batch)
        unknown = self.book.undo_bad_give(batch)
        assert unknown == ([] if twice and good else [stranger])
        assert self.book.available == available  # nothing went into a free list

    # ------------------------------------------------------------------ extents
    @precondition(lambda self: any(not e.draining for e in self.book.extents.values()))
    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        self.book.retire_current()  # as the allocator's _plan_limit does first
        active = [e for e in self.book.extents.values() if not e.draining]
        self.book.drain(data.draw(st.sampled_from(sorted(active, key=lambda e: e.start))))

    @precondition(lambda self: any(e.draining for e in self.book.extents.values()))
    @rule(data=st.data())
    def undrain(self, data: st.DataObject) -> None:
        draining = [e for e in self.book.extents.values() if e.draining]
        self.book.undrain(data.draw(st.sampled_from(sorted(draining, key=lambda e: e.start))))

    @rule()
    def release_empty_extents(self) -> None:
        """What the allocator releases: extents with no block out, draining or not."""
        self.book.retire_current()
        empty = [e for e in self.book.extents.values() if e.nonempty == 0]
        for extent in empty:
            blocks = range(
                extent.start * self.book.bpp, (extent.start + extent.npages) * self.book.bpp
            )
            assert not set(blocks) & self.used  # nonempty == 0: nothing of it is out
        self.book.remove_extents(empty)
        for extent in empty:
            self.book.return_range(extent.start, extent.npages)

    @precondition(lambda self: self.book.extents)
    @rule()
    def clear(self) -> None:
        """`close`: every extent out, blocks in use included."""
        extents = self.book.clear()
        for extent in extents:
            self.book.return_range(extent.start, extent.npages)
        self.used.clear()
        assert self.book.capacity == self.book.available == 0

    # --------------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        check_invariants(self.book, self.used, self.claims)


PageBookMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_page_book_against_its_model = PageBookMachine.TestCase


# ---------------------------------------------------------------- worked examples
def _book(num_pages: int = 4, bpp: int = 4, **kwargs: object) -> PageBook:
    book = PageBook(num_pages, bpp, **kwargs)  # type: ignore[arg-type]
    claim = book.claim_range(num_pages)
    assert claim == (0, num_pages)
    book.add_extent(Extent(0, num_pages, []))
    return book


def test_partly_used_pages_are_filled_before_a_fresh_one_is_opened() -> None:
    book = _book()
    first = book.take(6)  # page 0 full, page 1 half used
    assert first == [0, 1, 2, 3, 4, 5]
    assert book.give([0, 1, 2])  # page 0 now has 3 free, page 1 has 2 free
    assert book.take_one() in (6, 7)  # page 1: the fewest free blocks
    assert book.take_one() in (6, 7)
    assert book.take_one() in (0, 1, 2)  # then page 0, before fresh page 2
    check_invariants(book, book.used, set())


def test_a_fresh_page_is_the_lowest_free_page_id() -> None:
    book = _book()
    assert book.take(16) == list(range(16))
    assert book.give(list(range(12, 16)) + list(range(4, 8)))  # pages 3 and 1 empty
    assert book.take_one() // 4 == 1  # page 1, the lower of the two fully free pages


def test_a_refused_batch_changes_nothing() -> None:
    book = _book()
    held = book.take(5)
    assert not book.give([*held, 99])
    assert book.undo_bad_give([*held, 99]) == [99]
    assert book.used == set(held)
    check_invariants(book, set(held), set())


@pytest.mark.parametrize("draining", [False, True])
def test_an_extent_that_empties_signals_the_pool(draining: bool) -> None:
    calls: list[int] = []
    book = _book(num_pages=2, bpp=2, high_pages=0, signal=lambda: calls.append(1))
    blocks = book.take(2)  # page 0, from the extent's fresh pages
    if draining:
        book.retire_current()
        book.drain(book.extents[0])
    calls.clear()
    assert book.give(blocks)
    assert calls == [1]  # the whole extent is free again: the pool thread must look
    assert book.extents[0].nonempty == 0


def test_claims_take_the_first_hole_that_fits_else_the_largest() -> None:
    book = PageBook(10, 1)
    assert book.claim_range(2) == (0, 2)
    assert book.claim_range(3) == (2, 3)
    book.return_range(0, 2)  # holes: [0, 2) and [5, 10)
    assert book.claim_range(4) == (5, 4)  # [0, 2) is too small: the first that fits
    assert book.claim_range(9) == (0, 2)  # none fits: the largest
    book.return_range(0, 2)
    book.return_range(5, 4)
    book.return_range(2, 3)
    assert book.holes == [[0, 10]]  # returned ranges merge back into one
