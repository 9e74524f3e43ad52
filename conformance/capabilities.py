"""Which conformance checks need which backend capability, and what runs instead.

A backend without a VMM (mlx) cannot keep every promise a VMM backend keeps, and says
so in `Backend.capabilities`. The suite must then neither fail it for that nor skip
the checks unannounced: each check that needs a capability is listed in `NEEDS`, and
`CapabilityGate` (a base of `ConformanceSuite`) reports it as *not applicable*, naming
the capability, whenever the backend lacks one. What such a backend must do instead is
checked here too (`test_missing_capabilities_fail_cleanly`): a view it cannot give is an
`InvalidArgument`, never a wrong answer.

Data without writable views. The suite writes and reads through the backend's views
(`ConformanceSuite.fill` / `read`). A backend whose views are values, not aliases,
provides `fill(reservation, offset, nbytes, value)` and `byte_values(reservation,
offset, nbytes)` instead, and the suite's hooks use them (`fill_bytes`, `read_bytes`).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcached.backend import Backend, Capabilities
from kvcached.errors import InvalidArgument

#: check name -> capabilities it needs. A name that is not a check of the suite fails
#: `test_capability_table_names_real_checks`, so a renamed check cannot slip through.
NEEDS: dict[str, tuple[str, ...]] = {
    # the last view covers bytes that are not mapped
    "test_views_are_bounds_checked": ("views_span_mappings",),
    # writes through torch views of several dtypes
    "test_view_dtypes_share_bytes": ("writable_views",),
    # one view over a whole reservation, written while pages come and go under it
    "test_views_stay_valid_while_other_pages_churn": ("views_span_mappings", "writable_views"),
    # a view taken before anything is mapped, written through after each remap
    "test_remap_at_same_offset_shows_the_new_page": ("views_span_mappings", "writable_views"),
    # a child process's pages must show in this process's mem_info
    "test_process_exit_returns_everything": ("device_wide_mem_info",),
    # a view taken before an unmap must fault after it: only a view of the mapping can
    "test_unmapped_range_faults_on_access": ("views_span_mappings", "writable_views"),
}


def capabilities_of(factory: Any) -> Capabilities:
    """The capabilities of what `backend_factory` builds (a class, or a callable)."""
    declared = getattr(factory, "capabilities", None)
    return declared if isinstance(declared, Capabilities) else Capabilities()


def not_applicable_reason(check: str, factory: Any) -> str | None:
    """Why `check` does not apply to the backend `factory` builds, or None."""
    caps = capabilities_of(factory)
    missing = [name for name in NEEDS.get(check, ()) if not getattr(caps, name)]
    if not missing:
        return None
    name = getattr(factory, "name", getattr(factory, "__name__", "this"))
    lacks = ", ".join(f"{cap}=False" for cap in missing)
    return f"not applicable: the {name} backend declares {lacks} (Backend.capabilities)"


def fill_bytes(backend: Backend, reservation: Any, offset: int, nbytes: int, value: int) -> None:
    """`ConformanceSuite.fill` for a backend without writable views."""
    _data_method(backend, "fill")(reservation, offset, nbytes, value)


def read_bytes(backend: Backend, reservation: Any, offset: int, nbytes: int) -> set[int]:
    """`ConformanceSuite.read` for a backend without writable views."""
    return set(_data_method(backend, "byte_values")(reservation, offset, nbytes))


def _data_method(backend: Backend, method: str) -> Any:
    found = getattr(backend, method, None)
    if found is None:
        raise AssertionError(
            f"the {backend.name} backend declares writable_views=False, so it must provide "
            f"{method}() for data access; it does not"
        )
    return found


class CapabilityGate:
    """Mixed into `ConformanceSuite`: reports capability-bound checks as not applicable."""

    @pytest.fixture(autouse=True)
    def _capability_gate(self, request: pytest.FixtureRequest, backend_factory: Any) -> None:
        check = getattr(request.node, "originalname", None) or request.node.name
        reason = not_applicable_reason(check.split("[")[0], backend_factory)
        if reason is not None:
            pytest.skip(reason)

    def test_capability_table_names_real_checks(self) -> None:
        checks = {name for name in dir(type(self)) if name.startswith("test_")}
        unknown = sorted(set(NEEDS) - checks)
        assert not unknown, f"capabilities.NEEDS names checks the suite lacks: {unknown}"
        fields = set(Capabilities.__dataclass_fields__)
        assert {cap for caps in NEEDS.values() for cap in caps} <= fields

    def test_missing_capabilities_fail_cleanly(self, backend: Backend) -> None:
        """What a backend lacking a capability must do instead of the missing behaviour."""
        caps = type(backend).capabilities
        if not caps.missing():
            pytest.skip(f"not applicable: the {backend.name} backend lacks no capability")
        g = backend.granularity
        if not caps.views_span_mappings:
            with backend.reserve(4 * g) as r, backend.create(g) as a, backend.create(g) as b:
                with pytest.raises(InvalidArgument):
                    backend.view(r, 0, (g,), "uint8")  # nothing mapped there
                backend.map_many(r, [(0, a), (g, b)])
                with pytest.raises(InvalidArgument):
                    backend.view(r, g // 2, (g,), "uint8")  # across two mappings
                assert backend.view(r, g, (g // 2,), "uint8").shape == (g // 2,)
                backend.unmap(r, 0, 2 * g)
        if not caps.writable_views:
            with backend.reserve(2 * g) as r, backend.create(g) as p:
                backend.map(r, g, p)
                fill_bytes(backend, r, g, g, 0x5A)
                fill_bytes(backend, r, g + 16, 16, 0xA5)
                assert read_bytes(backend, r, g, 16) == {0x5A}
                assert read_bytes(backend, r, g + 16, 16) == {0xA5}
                backend.unmap(r, g, g)
