"""Settings and sizes: every bad value gets an error naming it and what is accepted."""

from __future__ import annotations

import pytest

from kvcached.backends.host import HostBackend
from kvcached.config import parse_size, settings
from kvcached.errors import InvalidArgument

GiB = 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GiB), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
     (" 2 MiB ", 2 << 20), (123, 123)],
)  # fmt: skip
def test_sizes_parse(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


def test_percentages_need_a_total() -> None:
    assert parse_size("25%", total=8 * GiB) == 2 * GiB
    with pytest.raises(InvalidArgument, match="percentage is not accepted"):
        parse_size("25%")
    with pytest.raises(InvalidArgument, match=r"\(0, 100\]"):
        parse_size("150%", total=GiB)


@pytest.mark.parametrize(
    "bad", ["lots", "-1GiB", "0", "", "GiB", True, -5, "1.5.5GiB", "1.9", "2 MiB MiB"]
)
def test_bad_sizes_are_named(bad: str | int) -> None:
    with pytest.raises(InvalidArgument, match=r"size|positive"):
        parse_size(bad, what="test size")


def test_bad_env_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE", "first")
    with pytest.raises(InvalidArgument, match="KVCACHED_DEVICE"):
        settings()


def test_negative_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE", "-1")
    with pytest.raises(InvalidArgument, match="KVCACHED_DEVICE"):
        settings()


def test_host_budget_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "64MiB")
    with HostBackend() as backend:
        assert backend.mem_info() == (64 << 20, 64 << 20)


def test_bad_host_budget_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "a lot")
    with pytest.raises(InvalidArgument, match="KVCACHED_HOST_BUDGET 'a lot' is not a size"):
        HostBackend()


@pytest.mark.parametrize("bad", ["3MiB", "1000", "1KiB"])
def test_bad_host_granularity_is_refused(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("KVCACHED_HOST_GRANULARITY", bad)
    with pytest.raises(InvalidArgument, match="granularity"):
        HostBackend()
