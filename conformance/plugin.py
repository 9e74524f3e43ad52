"""pytest plugin: `--kvcached-backend NAME` selects the backend the suite runs against.

Registered through the `pytest11` entry point, so it is active wherever kvcached is
installed; it only adds the option and two fixtures, and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcached.backend import Backend


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kvcached-backend",
        default=None,
        help="backend the kvcached conformance suite runs against "
        "(default: KVCACHED_BACKEND, else auto-detection)",
    )


def _backend_class(config: pytest.Config) -> type[Backend]:
    from kvcached.registry import backend_class, resolve_name

    # without the option, resolve_name reads KVCACHED_BACKEND through kvcached.config
    return backend_class(resolve_name(config.getoption("--kvcached-backend")))


@pytest.fixture
def backend_factory(request: pytest.FixtureRequest) -> Callable[..., Backend]:
    """Makes fresh instances of the selected backend (kwargs: memory_limit=...)."""
    return _backend_class(request.config)


@pytest.fixture
def exhaustible_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A backend whose physical memory the suite may fill. On the host that would be
    the machine's RAM, so the host and mlx backends get a 256 MiB budget of their
    own; a device backend is filled for real."""
    cls = _backend_class(request.config)
    kwargs: dict[str, Any] = {"budget": 256 << 20} if cls.name in {"host", "mlx"} else {}
    instance = cls(**kwargs)
    yield instance
    instance.close()
