"""Shared fixtures for kvcached's own tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcached import registry
from kvcached.config import reload_settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees the environment it sets, not one parsed by an earlier test."""
    reload_settings()
    yield
    reload_settings()
    registry.reset()
