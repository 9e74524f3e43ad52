"""The conformance suite against the mlx backend (mlx[cpu] in CI), and the checks that
its capability handling reports, rather than hides, what a VMM-less backend cannot do."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("mlx.core")

from kvcached.backend import Capabilities
from kvcached.backends.host import HostBackend
from kvcached.backends.mlx import MlxBackend
from kvcached.conformance import ConformanceSuite
from kvcached.conformance.capabilities import NEEDS, not_applicable_reason
from kvcached.errors import BackendUnavailable


class TestMlxConformance(ConformanceSuite):
    # MLX's counters are this process's own, so they do not drift with other
    # processes: a tight tolerance makes the accounting checks bite at 16 KiB pages.
    accounting_pages = 256

    def mem_tolerance(self, backend: MlxBackend) -> int:  # type: ignore[override]
        return 64 * backend.granularity

    @pytest.fixture
    def backend_factory(self) -> Callable[..., MlxBackend]:
        return MlxBackend

    @pytest.fixture
    def exhaustible_backend(self) -> Iterator[MlxBackend]:
        backend = MlxBackend(budget=64 << 20)
        yield backend
        backend.close()


def test_mlx_lacks_exactly_the_vmm_capabilities() -> None:
    assert MlxBackend.capabilities.missing() == [
        "views_span_mappings",
        "writable_views",
        "device_wide_mem_info",
    ]
    assert HostBackend.capabilities == Capabilities()


def test_every_capability_bound_check_is_reported_not_applicable_on_mlx() -> None:
    for check in NEEDS:
        reason = not_applicable_reason(check, MlxBackend)
        assert reason is not None and reason.startswith("not applicable: the mlx backend")
        assert not_applicable_reason(check, HostBackend) is None


def test_mlx_is_never_auto_selected_on_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached import registry

    monkeypatch.setattr("sys.platform", "linux")
    assert MlxBackend.is_available() and not MlxBackend.auto_selectable()
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    assert registry.resolve_name() != "mlx"
    assert registry.resolve_name("mlx") == "mlx"  # still usable when named


def test_zero_copy_mode_is_refused_where_mlx_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("this machine has Metal: zero-copy is expected to work here")
    with pytest.raises(BackendUnavailable, match="copies external memory"):
        MlxBackend(zero_copy=True)
    monkeypatch.setenv("KVCACHED_MLX_ZERO_COPY", "1")
    from kvcached.config import reload_settings

    reload_settings()
    with pytest.raises(BackendUnavailable, match="KVCACHED_MLX_ZERO_COPY"):
        MlxBackend()


def test_release_returns_the_bytes_to_mlx_counters() -> None:
    import mlx.core as mx

    backend = MlxBackend()
    mx.clear_cache()
    before = mx.get_active_memory() + mx.get_cache_memory()
    page = backend.create(256 * backend.granularity)
    assert mx.get_active_memory() - before >= 256 * backend.granularity
    backend.release(page)
    assert mx.get_active_memory() + mx.get_cache_memory() - before < backend.granularity
    backend.close()
