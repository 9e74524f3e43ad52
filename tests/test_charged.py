"""Ledger-charged pages (kvcached.charged): charged before they are created, refunded when
creation fails and when they are released, so the account always equals what is held."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcached.allocator import LocalAccount, LocalBudget
from kvcached.backend import Page
from kvcached.backends.host import HostBackend
from kvcached.charged import ChargedPages
from kvcached.errors import OutOfMemory

G = 64 << 10


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    b = HostBackend(granularity=G, budget=2 * G)  # the device holds two pages
    yield b
    b.close()


def test_pages_are_charged_while_they_live(backend: HostBackend) -> None:
    account = LocalAccount()
    pages = ChargedPages(backend, account)
    page = pages.create(G)
    assert account.charged == pages.held_bytes == account.used == G
    pages.release(page)
    pages.release(page)  # idempotent
    assert account.charged == pages.held_bytes == account.used == 0 == pages.live_pages


def test_a_refused_charge_creates_nothing_and_says_what_to_do(backend: HostBackend) -> None:
    account = LocalAccount(limit=G)
    pages = ChargedPages(backend, account)
    pages.create(G)
    with pytest.raises(OutOfMemory) as refused:
        pages.create(G)
    assert str(refused.value) == (
        "KV memory exhausted: 65536 more bytes refused by the ledger (this instance holds "
        "65536 bytes, limit 65536; stop admitting or preempt, then retry)"
    )
    assert account.charged == G and backend.mem_info()[0] == G  # one page, one charge
    pages.release_all()


def test_a_refusal_without_a_limit_names_none(backend: HostBackend) -> None:
    account = LocalAccount(budget=LocalBudget(total=G // 2))  # the device budget refuses
    with pytest.raises(OutOfMemory) as refused:
        ChargedPages(backend, account, what="state").create(G)
    assert str(refused.value) == (
        "state memory exhausted: 65536 more bytes refused by the ledger (this instance "
        "holds 0 bytes; stop admitting or preempt, then retry)"
    )


def test_a_creation_the_device_refuses_gives_its_charge_back(backend: HostBackend) -> None:
    account = LocalAccount()  # the account has room; the device has not
    pages = ChargedPages(backend, account)
    pages.create(2 * G)
    with pytest.raises(OutOfMemory, match="host budget exhausted"):
        pages.create(G)
    assert account.charged == pages.held_bytes == 2 * G
    pages.release_all()
    assert account.charged == 0


def test_a_failed_make_gives_its_charge_back(backend: HostBackend) -> None:
    account = LocalAccount()
    pages = ChargedPages(backend, account)

    def broken() -> Page:
        raise RuntimeError("the framework could not build the page")

    with pytest.raises(RuntimeError, match="could not build"):
        pages.create(G, broken)
    assert account.charged == pages.held_bytes == 0


def test_a_page_of_the_wrong_size_is_released_and_its_charge_given_back(
    backend: HostBackend,
) -> None:
    account = LocalAccount()
    pages = ChargedPages(backend, account)
    with pytest.raises(AssertionError, match="has 131072"):
        pages.create(G, lambda: backend.create(2 * G))
    assert account.charged == pages.held_bytes == 0
    assert backend.mem_info()[0] == 2 * G  # the page was released too
