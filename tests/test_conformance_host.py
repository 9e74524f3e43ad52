"""The conformance suite against the host backend: the contract CI holds it to."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcached.backends.host import HostBackend
from kvcached.conformance import ConformanceSuite


class TestHostConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self) -> Callable[..., HostBackend]:
        return HostBackend
