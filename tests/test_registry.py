"""Backend discovery, auto-detection order and the errors for bad names."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import kvcached
from kvcached import registry
from kvcached.backends.host import HostBackend
from kvcached.errors import BackendUnavailable, InvalidArgument


class PluginBackend(HostBackend):
    """A third party's backend, registered only through an entry point."""

    name = "plugin"


class BrokenBackend(HostBackend):
    name = "broken"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "needs hardware this machine lacks"


def _with_extra_entry_points(monkeypatch: pytest.MonkeyPatch, **targets: str) -> None:
    real = registry.entry_points

    def fake(*, group: str, name: str | None = None) -> list[EntryPoint]:
        found = real(group=group, name=name)
        if group == registry.ENTRY_POINT_GROUP:
            extra = [EntryPoint(n, target, group) for n, target in targets.items()]
            found += [ep for ep in extra if name in (None, ep.name)]
        return found

    monkeypatch.setattr(registry, "entry_points", fake)


def test_builtin_backends_are_registered_through_entry_points() -> None:
    names = registry.backend_names()
    assert {"cuda", "host"} <= set(names)
    assert registry.backend_class("host") is HostBackend


def test_auto_detection_picks_host_without_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    monkeypatch.setattr(
        registry.backend_class("cuda"), "unavailable_reason", classmethod(lambda cls: "no gpu")
    )
    assert registry.resolve_name() == "host"
    assert isinstance(kvcached.get_backend(), HostBackend)


def test_auto_detection_prefers_cuda_when_it_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    monkeypatch.setattr(
        registry.backend_class("cuda"), "unavailable_reason", classmethod(lambda cls: None)
    )
    assert registry.resolve_name() == "cuda"


def test_env_override_selects_the_named_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_extra_entry_points(monkeypatch, plugin=f"{__name__}:PluginBackend")
    monkeypatch.setenv("KVCACHED_BACKEND", "Plugin ")
    assert registry.resolve_name() == "plugin"
    assert type(kvcached.get_backend()) is PluginBackend


def test_third_party_backends_are_never_auto_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHED_BACKEND", raising=False)
    _with_extra_entry_points(monkeypatch, plugin=f"{__name__}:PluginBackend")
    assert "plugin" in registry.backend_names()
    assert registry.resolve_name() in registry.AUTO_ORDER


def test_unknown_name_lists_registered_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "tpu")
    with pytest.raises(InvalidArgument, match=r"unknown kvcached backend 'tpu'.*host"):
        registry.resolve_name()


def test_unavailable_name_says_why_and_what_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_extra_entry_points(monkeypatch, broken=f"{__name__}:BrokenBackend")
    monkeypatch.setenv("KVCACHED_BACKEND", "broken")
    with pytest.raises(BackendUnavailable, match=r"needs hardware.*Available here: .*host"):
        registry.resolve_name()


def test_entry_point_that_is_not_a_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_extra_entry_points(monkeypatch, bogus="kvcached.errors:OutOfMemory")
    with pytest.raises(InvalidArgument, match=r"not a kvcached\.backend\.Backend subclass"):
        registry.backend_class("bogus")
    assert "failed to load" in (registry.availability()["bogus"] or "")


def test_get_backend_returns_one_instance_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    first = kvcached.get_backend()
    assert kvcached.get_backend() is first
    registry.reset()
    assert first.closed and kvcached.get_backend() is not first


def test_a_device_ordinal_leaves_backends_without_a_device_choice_shared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # a tensor-parallel rank asks for its own device; the host backend has only one
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    assert registry.get_backend("host", device=3) is registry.get_backend("host")


def test_new_backend_is_the_callers_own_not_the_shared_one() -> None:
    shared = kvcached.get_backend("host")
    own = registry.new_backend("host")
    try:
        assert isinstance(own, HostBackend) and own is not shared
        assert registry.new_backend("host") is not own  # a new one every call
    finally:
        own.close()
    assert not shared.closed  # closing one's own leaves the shared instance alone


def test_new_backend_that_cannot_run_here_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_extra_entry_points(monkeypatch, broken=f"{__name__}:BrokenBackend")
    with pytest.raises(BackendUnavailable, match="needs hardware this machine lacks"):
        registry.new_backend("broken")
