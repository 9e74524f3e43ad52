"""The SGLang adapter's pure parts, without SGLang: the shim table's checks, the start-up
refusals, the pool geometry, and the capacity bookkeeping against kvcached's own
allocator on the host backend (the parts that need SGLang and a GPU are in
benchmarks/sglang_*.py and run on the device)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
import shim_scan
from hypothesis import given

from kvcached import contacts
from kvcached.backends.host import HostBackend
from kvcached.contacts import Contact
from kvcached.engines.sglang import instance, refusals, shims
from kvcached.engines.sglang.allocator import ElasticAllocator
from kvcached.engines.sglang.capacity import ElasticCapacity
from kvcached.engines.sglang.geometry import PADDING_PAGE, PoolGeometry

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = ("0.5.16",)


@pytest.fixture
def ledger_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    monkeypatch.delenv("KVCACHED_INSTANCE_LIMIT", raising=False)
    monkeypatch.delenv("KVCACHED_INSTANCE_NAME", raising=False)
    for name in ("KVCACHED_BUDGET", "KVCACHED_EXTENT_SIZE"):  # set by _instance
        monkeypatch.setenv(name, "1MiB")
    return tmp_path


# ------------------------------------------------------------------ the plugin
def test_register_is_inert_and_imports_nothing_without_enable_kvcached() -> None:
    probe = (
        "import sys, kvcached.engines.sglang as p; p.register(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch') "
        "or m.startswith('kvcached.engines.sglang.')))"
    )
    env = {"PATH": "/usr/bin:/bin", "ENABLE_KVCACHED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env
    )
    assert out.stdout.strip() == "[]"


def test_the_entry_point_names_the_register_function() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert (
        '[project.entry-points."sglang.srt.plugins"]\nkvcached = "kvcached.engines.sglang:register"'
        in text
    )
    assert '"kvcached.engines.sglang",' in text


# ------------------------------------------------------------------ the shim table
def test_an_unsupported_sglang_version_is_refused_naming_it() -> None:
    with pytest.raises(
        shims.UnsupportedSglang, match=r"supports SGLang 0\.5\.16; this is SGLang 0\.5\.15"
    ):
        shims.plan("0.5.15")


def test_a_moved_target_is_refused_naming_the_target_and_the_version() -> None:
    present = shims.Shim(
        "present", "kvcached.allocator.PageAllocator.alloc", ("0.5.16",), lambda: print
    )
    moved = shims.Shim(
        "moved", "kvcached.allocator.PageAllocator.no_such_method", ("0.5.16",), lambda: print
    )
    assert shims.plan("0.5.16", (present,), contacts=()) == [present]
    with pytest.raises(shims.UnsupportedSglang) as refused:
        shims.plan("0.5.16", (present, moved), contacts=())
    assert "kvcached.allocator.PageAllocator.no_such_method" in str(refused.value)
    assert "SGLang 0.5.16" in str(refused.value)
    assert "(moved)" in str(refused.value)


def test_a_target_in_a_missing_module_is_refused() -> None:
    gone = shims.Shim("gone", "kvcached.no_such_module.Thing.method", ("0.5.16",), lambda: print)
    with pytest.raises(shims.UnsupportedSglang, match=r"kvcached\.no_such_module\.Thing\.method"):
        shims.plan("0.5.16", (gone,), contacts=())


def test_a_moved_internal_the_adapter_only_calls_is_refused_too() -> None:
    # e.g. SGLang's get_tp_group, which the tensor-parallel path calls without hooking it
    targets = {contact.target for contact in shims.CONTACTS}
    assert "sglang.srt.distributed.parallel_state.get_tp_group" in targets
    used = Contact("tensor-parallel group", "kvcached.allocator.nope", SUPPORTED, "calls", "x.py")
    with pytest.raises(shims.UnsupportedSglang, match=r"\(tensor-parallel group\) needs"):
        shims.plan("0.5.16", (), contacts=(used,))
    present = Contact("present", "kvcached.allocator.PageAllocator", SUPPORTED, "reads", "x.py")
    assert shims.plan("0.5.16", (), contacts=(present,)) == []


def test_a_contact_may_be_an_instance_attribute_a_hook_target_may_not() -> None:
    # `group` is set in PageAllocator.__init__, not on the class: SGLang's HookRegistry
    # could not wrap it, but the adapter may read it on an instance
    attribute = "kvcached.allocator.PageAllocator.group"
    assert contacts.missing(attribute) is None
    hooked = shims.Shim("hooked", attribute, SUPPORTED, lambda: print)
    with pytest.raises(shims.UnsupportedSglang, match=r"\(hooked\) needs"):
        shims.plan("0.5.16", (hooked,), contacts=())
    read = Contact("read", attribute, SUPPORTED, "reads", "x.py")
    assert shims.plan("0.5.16", (), contacts=(read,)) == []
    gone = Contact(
        "gone", "kvcached.allocator.PageAllocator.no_such_field", SUPPORTED, "reads", "x"
    )
    with pytest.raises(shims.UnsupportedSglang, match=r"no attribute 'no_such_field'"):
        shims.plan("0.5.16", (), contacts=(gone,))


def test_a_refusal_sglangs_loader_swallows_is_raised_again_from_server_args() -> None:
    registered: list[tuple[str, Any, Any]] = []

    class Recorder:  # records what would go to SGLang's HookRegistry.register
        @staticmethod
        def register(target: str, hook: Any, hook_type: Any) -> None:
            registered.append((target, hook, hook_type))

    refusal = shims.UnsupportedSglang("SGLang 9.9 is not supported")
    shims._refuse_at_start(Recorder, SimpleNamespace(BEFORE="before"), refusal)
    [(target, hook, hook_type)] = registered
    assert target == shims.SERVER_ARGS_INIT and hook_type == "before"
    with pytest.raises(shims.UnsupportedSglang, match=r"9\.9"):
        hook(object())  # what ServerArgs(...) runs first


def test_every_hook_of_the_table_loads_without_sglang() -> None:
    targets = [shim.target for shim in shims.SHIMS]
    assert len(targets) == len(set(targets))
    for shim in shims.SHIMS:
        assert shim.versions == shims.SUPPORTED
        assert callable(shim.hook()), shim.concern


def test_the_tables_name_everything_the_adapter_imports_and_every_private_name() -> None:
    targets = {entry.target for entry in (*shims.SHIMS, *shims.CONTACTS)}
    folder = ROOT / "engines" / "sglang"
    assert shim_scan.unlisted(folder, "sglang", targets) == []
    imported = shim_scan.engine_imports(folder, "sglang")
    for name in (  # what the issue found missing from the old table
        "sglang.srt.utils.get_num_new_pages",
        "sglang.srt.mem_cache.base_prefix_cache.EvictParams",
    ):
        assert name in imported and name in targets
    dropped = targets - {"sglang.srt.utils.get_num_new_pages"}
    assert shim_scan.unlisted(folder, "sglang", dropped) == [
        "import sglang.srt.utils.get_num_new_pages"
    ]


def test_the_class_swap_and_the_methods_it_overrides_are_in_the_table() -> None:
    from kvcached.engines.sglang.allocator import _SERVED
    from kvcached.engines.sglang.elastic_classes import adapter_methods
    from kvcached.engines.sglang.swa import ElasticSWAAllocator

    swaps = {c.target.rsplit(".", 1)[1] for c in shims.CONTACTS if c.how == "swaps"}
    # `__class__` of each served allocator is swapped
    assert {*_SERVED, "SWATokenToKVPoolAllocator"} <= swaps
    own = {"attach", "stock_pages", "tokens_held", "give_back_stock"}  # the adapter's own
    for mixin, used_in in ((ElasticAllocator, "allocator.py"), (ElasticSWAAllocator, "swa.py")):
        overridden = {
            c.target.rsplit(".", 1)[1]
            for c in shims.CONTACTS
            if c.how == "overrides" and c.used_in == used_in
        }
        sglangs = {
            name
            for name, value in adapter_methods(mixin).items()
            if callable(value) and not name.startswith("_")
        } - own
        assert sglangs == overridden, mixin


def test_the_table_agrees_with_the_facts_recorded_from_sglang_0_5_16() -> None:
    # SGLang runs only on the GPU machine: scripts/record_engine_facts.py recorded where
    # each target is defined, from the 0.5.16 wheel
    recorded = shim_scan.facts("sglang", "0.5.16")
    entries = [*shims.SHIMS, *shims.CONTACTS]
    assert shim_scan.disagreements(entries, recorded) == []
    assert recorded["targets"]["sglang.srt.utils.get_num_new_pages"].startswith("sglang/srt/utils/")
    invented = Contact("invented", "sglang.srt.utils.invented", SUPPORTED, "calls", "x.py")
    assert shim_scan.disagreements([*entries, invented], recorded) == [
        "not recorded: sglang.srt.utils.invented"
    ]
    gone = dict(recorded, targets={**recorded["targets"], shims.SERVER_ARGS_INIT: None})
    assert shim_scan.disagreements(entries, gone) == [
        f"absent from sglang 0.5.16: {shims.SERVER_ARGS_INIT}"
    ]


# ------------------------------------------------------------------ refusals
def _args(**overrides: Any) -> SimpleNamespace:
    defaults: dict[str, Any] = {
        "enable_hierarchical_cache": False,
        "enable_lmcache": False,
        "disaggregation_mode": "null",
        "enable_dp_attention": False,
        "enable_memory_saver": False,
        "enable_hisparse": False,
        "enable_unified_memory": False,
        "speculative_algorithm": None,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "dcp_size": 1,
        "kv_cache_dtype": "auto",
    }
    defaults.update(overrides)
    return SimpleNamespace(**defaults)


def test_the_default_options_are_accepted() -> None:
    refusals.check(_args())
    refusals.check(SimpleNamespace())  # options SGLang left out count as their defaults
    refusals.check(_args(kv_cache_dtype="bfloat16"))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("enable_hierarchical_cache", True),
        ("disaggregation_mode", "prefill"),
        ("enable_dp_attention", True),
        ("enable_memory_saver", True),
        ("enable_lmcache", True),
        ("speculative_algorithm", "EAGLE"),
        ("pp_size", 2),
        ("kv_cache_dtype", "fp8_e4m3"),
    ],
)
def test_an_unsupported_option_is_refused_naming_it(option: str, value: Any) -> None:
    with pytest.raises(refusals.Refused) as refused:
        refusals.check(_args(**{option: value}))
    message = str(refused.value)
    assert f"{option}={value!r}" in message
    assert "Unset ENABLE_KVCACHED" in message


def test_sglangs_own_vmm_kv_arena_is_refused() -> None:
    args = _args()
    args.post_capture_kv_sizing_planned = lambda: True
    with pytest.raises(refusals.Refused, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"):
        refusals.check(args)


# ------------------------------------------------------------------ geometry
def test_the_pool_geometry_puts_every_buffer_on_whole_page_ids() -> None:
    backend = HostBackend()
    geometry = PoolGeometry(segments=6, rows=16385, row_bytes=256, page_size=1)
    backing = geometry.backing(backend)
    try:
        group = backing.group
        assert len(group.segments) == 6
        assert group.num_blocks >= geometry.pages  # rounded up, never short
        assert group.num_blocks % group.blocks_per_page == 0
        assert all(s.offset % group.page_bytes == 0 for s in group.segments)
    finally:
        backing.close()


def test_a_paged_pool_maps_sglang_pages_to_kvcached_blocks() -> None:
    geometry = PoolGeometry(segments=2, rows=4096 + 16, row_bytes=512, page_size=16)
    assert geometry.pages == 257  # the padding page and 256 pages of 16 slots
    assert geometry.page_bytes == 16 * 512


# ------------------------------------------------------------------ capacity
def _instance(
    ledger_env: Path, rows: int = 16385, budget: str = "64MiB"
) -> instance.SglangInstance:
    import os

    from kvcached.config import reload_settings

    os.environ["KVCACHED_BUDGET"] = budget
    os.environ["KVCACHED_EXTENT_SIZE"] = "2MiB"  # one page id per extent: releases show
    reload_settings()
    geometry = PoolGeometry(segments=4, rows=rows, row_bytes=256, page_size=1)
    return instance.single(geometry, HostBackend(), name=f"test-{rows}")


def test_the_padding_page_is_mapped_and_pinned(ledger_env: Path) -> None:
    found = _instance(ledger_env)
    try:
        assert found.allocator.is_allocated(PADDING_PAGE)
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        capacity.give([PADDING_PAGE])  # ignored: never handed out, never freed
        assert found.allocator.is_allocated(PADDING_PAGE)
    finally:
        found.close()


def test_the_free_count_is_what_kvcached_can_supply(ledger_env: Path) -> None:
    found = _instance(ledger_env)
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        free = capacity.available(0)
        assert 0 < free <= found.last_page  # never more than SGLang's pool has
        taken = capacity.take(100)
        assert taken is not None and len(taken) == 100 and 0 not in taken
        assert capacity.held_by_engine(stock=100) == 0  # all 100 still in the stock
        assert capacity.held_by_engine(stock=40) == 60  # 60 went to SGLang's requests
        capacity._counted_at = -1.0
        expected = min(found.allocator.obtainable_blocks(), capacity.unused_pages())
        assert capacity.available(0) == expected
        assert capacity.take(capacity.unused_pages() + 1, wait=0) is None  # past the pool
    finally:
        found.close()


def test_the_free_count_leaves_out_what_another_instance_took_from_the_budget(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")  # nothing mapped ahead: exact figures
    found = _instance(ledger_env, rows=10 * 8192 + 1, budget="24MiB")  # 3 of 11 page ids
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        group = found.allocator.group
        assert capacity.available(0) == 3 * group.blocks_per_page - 1  # not the padding page
        neighbour = found.cache.ledger.register("neighbour", "vllm")
        assert neighbour.try_charge(group.page_id_bytes)
        capacity._counted_at = -1.0  # past the refresh window
        assert capacity.available(0) == 2 * group.blocks_per_page - 1
        neighbour.close()
    finally:
        found.close()


def test_a_take_lowers_the_cached_free_count_at_once(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGLang asks for the free count several times a step, and the count is cached for
    # that while: a take must lower it at once, or SGLang counts the taken pages twice
    from kvcached import supply  # the count is the core's ElasticSupply's

    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    found = _instance(ledger_env, rows=10 * 8192 + 1, budget="24MiB")
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        free = capacity.available(0)  # counted now, and from here on never again:
        monkeypatch.setattr(supply, "COUNT_REFRESH_S", float("inf"))
        assert 100 < free < capacity.unused_pages() - 100  # the budget bounds it
        taken = capacity.take(100)
        assert taken is not None
        assert capacity.available(stock=0) == free - 100
        assert capacity.available(stock=100) == free  # the same pages, now in the stock
        capacity.give(taken)
        assert capacity.available(stock=0) == free
    finally:
        found.close()


def test_pages_past_sglangs_last_page_are_kept_aside_not_handed_out(ledger_env: Path) -> None:
    found = _instance(ledger_env, rows=101)  # the reservation rounds up to a whole page id
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        taken = capacity.take(100)
        assert taken is not None and max(taken) == 100
        assert capacity.take(1, wait=0) is None  # SGLang's pool is used up
        assert capacity.available(0) == 0
    finally:
        found.close()


def test_a_take_larger_than_sglangs_pool_pins_no_pages(ledger_env: Path) -> None:
    # it once took the pages past SGLang's last page as "kept aside" before failing,
    # pinning the last page id's memory for good
    found = _instance(ledger_env, rows=101)
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        assert capacity.take(200, wait=0) is None
        assert found.allocator.used_blocks == 1  # the padding page only
        assert capacity.kept_aside == []
    finally:
        found.close()


def test_over_the_limit_is_reported_in_bytes(ledger_env: Path) -> None:
    found = _instance(ledger_env, rows=4 * 8192 + 1)
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        taken = capacity.take(3 * found.allocator.group.blocks_per_page)
        assert taken is not None
        assert capacity.over_limit() == 0
        page_id = found.allocator.group.page_id_bytes
        found.cache.set_limit(page_id)
        allocator = found.allocator
        # let the pool thread's growth in flight land and its releases finish: both
        # change what is held between two reads (a flake under load)
        allocator.pause_growth()
        allocator.trim(keep=0)
        allocator.wait_released()
        assert capacity.over_limit() >= 2 * page_id  # busy pages stay mapped until freed
        assert capacity.over_limit() == allocator.reserved_bytes - allocator.effective_limit
        allocator.resume_growth()
        found.cache.set_limit(None)  # lifted: nothing is over it any more
        assert capacity.over_limit() == 0
        capacity.give(taken)
    finally:
        found.close()


def test_a_full_budget_is_pressure_with_another_instance_on_it(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a flake: the pool thread, mapping ahead to its 256 MiB low watermark, filled the
    # 40 MiB budget before the first look, about one run in two after other tests
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    found = _instance(ledger_env, rows=10 * 8192 + 1, budget="40MiB")
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        assert not capacity.under_pressure()
        while capacity.take(1024, wait=0) is not None:
            pass
        # alone on the budget, the instance holds all of it: nobody to give back to
        assert not capacity.under_pressure()
        neighbour = found.cache.ledger.register("neighbour", "vllm")
        assert capacity.under_pressure()  # another instance, which cannot grow
        neighbour.close()
        assert not capacity.under_pressure()
    finally:
        found.close()


# ------------------------------------------------------------------ the idle invariant
def _invariant(checker: Any, ps: Any, uncached: int = 0) -> tuple[bool, str]:
    """SGLang's rule for the full pool: available + evictable + protected == total, the
    total being `max_total_num_tokens`, or the allocator's `size` for hybrid Mamba
    models (SGLang 0.5.16's `_check_full_pool`)."""
    total = ps.full_available_size + ps.full_evictable_size + ps.protected
    if checker.is_hybrid_ssm:
        expected = checker.token_to_kv_pool_allocator.size
    else:
        expected = checker.max_total_num_tokens
    return total != expected, f"{total} vs {expected}"


class _StockOnly:
    """Stands in for SGLang's allocator object: a stock count and the capacity."""

    def __init__(self, capacity: ElasticCapacity, stock: int) -> None:
        self.kv_capacity = capacity
        self.stock = stock

    def stock_pages(self) -> int:
        return self.stock

    # the adapter's own count over this stand-in's stock
    tokens_held = ElasticAllocator.tokens_held


@pytest.mark.parametrize("hybrid_mamba", [False, True])
def test_the_idle_check_still_catches_a_leaked_page(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch, hybrid_mamba: bool
) -> None:
    from kvcached.engines.sglang import allocator as elastic

    monkeypatch.setattr(elastic, "is_elastic", lambda _a: True)
    found = _instance(ledger_env)
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        assert capacity.take(30) is not None
        pool = _StockOnly(capacity, stock=10)  # 20 pages went to SGLang
        pool.size = 16384  # type: ignore[attr-defined]  # SGLang's static size
        checker = SimpleNamespace(
            token_to_kv_pool_allocator=pool, max_total_num_tokens=16384, is_hybrid_ssm=hybrid_mamba
        )

        def stats(evictable: int) -> SimpleNamespace:
            return SimpleNamespace(
                full_available_size=capacity.available(pool.stock),
                full_evictable_size=evictable,
                protected=0,
            )

        leak, _ = elastic.checks_elastic_capacity(_invariant, checker, stats(evictable=20))
        assert not leak  # the radix cache accounts for all 20
        leak, message = elastic.checks_elastic_capacity(_invariant, checker, stats(evictable=19))
        assert leak, message  # one page lost track of
        assert checker.max_total_num_tokens == 16384  # the static figures are put back
        assert pool.size == 16384  # type: ignore[attr-defined]
    finally:
        found.close()


# ------------------------------------------------------------ the corrupting test plugin
PLUGINS = ROOT / "tests" / "sglang_engine" / "plugins"


@pytest.fixture
def corrupt_plugin(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(PLUGINS))
    import kvcached_corrupt_kv

    monkeypatch.setattr(kvcached_corrupt_kv, "_done", False)
    return kvcached_corrupt_kv


def test_the_corrupting_hook_is_a_test_plugin_sglang_finds_on_the_path() -> None:
    from importlib.metadata import distributions

    found = [
        (ep.name, ep.value)
        for dist in distributions(path=[str(PLUGINS)])
        for ep in dist.entry_points
        if ep.group == "sglang.srt.plugins"  # the group SGLang's load_plugins reads
    ]
    assert found == [("kvcached_corrupt_kv", "kvcached_corrupt_kv:register")]
    assert not (ROOT / "engines" / "sglang" / "debug.py").exists()
    product = [p for p in (ROOT / "engines").rglob("*.py") if "CORRUPT" in p.read_text()]
    assert product == []  # kvcached itself reads no corruption trigger


def test_the_test_plugin_registers_its_hook_only_when_armed(
    corrupt_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    registered: list[tuple[str, Any, Any]] = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookRegistry = SimpleNamespace(  # type: ignore[attr-defined]
        register=lambda target, hook, kind: registered.append((target, hook, kind))
    )
    registry.HookType = SimpleNamespace(AROUND="around")  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    monkeypatch.delenv(corrupt_plugin.CORRUPT_ENV, raising=False)
    corrupt_plugin.register()
    assert registered == []
    monkeypatch.setenv(corrupt_plugin.CORRUPT_ENV, "1")
    corrupt_plugin.register()
    assert registered == [(corrupt_plugin.TARGET, corrupt_plugin.corrupts_when_idle, "around")]
    assert corrupt_plugin.TARGET in {shim.target for shim in shims.SHIMS}  # SGLang 0.5.16's


def test_the_test_plugin_corrupts_the_held_kv_once_and_records_it(
    ledger_env: Path, corrupt_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = _instance(ledger_env)
    try:
        taken = found.capacity.take(64)
        assert taken is not None
        found.pool_allocator = SimpleNamespace(stock_pages=lambda: 0)  # all 64 held by SGLang
        monkeypatch.setattr(instance, "current", lambda: found)
        raw = found.backing.raw("uint8")
        group = found.backing.group
        lo = group.segments[0].offset + taken[0] * group.block_bytes
        raw[lo : lo + 2 * group.block_bytes] = 0
        raw[lo : lo + group.block_bytes] = 7  # one page of sevens, its neighbour zeros
        trigger = ledger_env / "corrupt-now"
        monkeypatch.setenv(corrupt_plugin.CORRUPT_ENV, str(trigger))
        assert corrupt_plugin.maybe_corrupt() == 0  # armed, but the file is not there yet
        trigger.touch()
        touched = corrupt_plugin.maybe_corrupt()
        assert touched > 0
        assert (ledger_env / "corrupt-now.done").read_text() == str(touched)
        page = raw[lo + group.block_bytes : lo + 2 * group.block_bytes]
        assert int(page.min()) == 7  # the sevens moved one page on
        assert corrupt_plugin.maybe_corrupt() == 0  # once only
    finally:
        found.close()


def test_pulling_the_trigger_waits_for_the_hooks_record(
    corrupt_plugin: Any, tmp_path: Path
) -> None:
    import threading

    trigger = tmp_path / "corrupt-now"
    Path(f"{trigger}.done").write_text("99")  # a stale record of an earlier pull

    def scheduler() -> None:  # the hook's side: sees the trigger, writes its record
        while not trigger.exists():
            threading.Event().wait(0.01)
        Path(f"{trigger}.done").write_text("12")

    threading.Thread(target=scheduler, daemon=True).start()
    assert corrupt_plugin.pull(trigger, timeout=30.0) == 12
    assert corrupt_plugin.pull(tmp_path / "never", timeout=0.3) == 0  # no record: 0


def test_each_kv_buffer_sglang_gets_is_a_storage_of_its_own() -> None:
    # as SGLang's own torch.zeros buffers are: an engine or connector that reads a
    # buffer's storage (its offset, its size, its address) must see that buffer only
    import torch

    from kvcached.backing import BackingBuffer
    from kvcached.engines.sglang.buffers import _views

    granule, blocks, layers = 64 << 10, 4, 3
    backend = HostBackend(granularity=granule)
    segment = blocks * granule
    with BackingBuffer(
        backend, nbytes=layers * segment, num_blocks=blocks, block_bytes=granule,
        segment_offsets=[i * segment for i in range(layers)],
    ) as backing:  # fmt: skip
        rows, row_bytes = 1000, 256  # 1000 token slots of 8 heads x 16 bf16 values
        geometry = SimpleNamespace(rows=rows, row_bytes=row_bytes)
        found = SimpleNamespace(backing=backing, geometry=geometry)
        views = _views(found, [(rows, 8, 16)] * layers, torch.bfloat16)  # type: ignore[arg-type]
        base = backing.raw("int8").data_ptr()
        assert [v.data_ptr() - base for v in views] == [i * segment for i in range(layers)]
        assert all(v.storage_offset() == 0 for v in views)
        assert len({v.untyped_storage().data_ptr() for v in views}) == layers
        assert all(v.untyped_storage().nbytes() == rows * row_bytes for v in views)
    backend.close()


# ------------------------------------------------------------------ hybrid Mamba models
GIB = 1 << 30


class _MambaConfigurator:
    """SGLang 0.5.16's `KVCacheConfigurator` as `mamba.py` sees it: the options, the
    state slots per request, and `_handle_max_mamba_cache`'s three rules (GiB in, the
    rest out), without speculative decoding (refused)."""

    def __init__(self, per_req: int, **options: Any) -> None:
        args = {"max_mamba_cache_size": None, "max_running_requests": None,
                "disable_radix_cache": False, "mamba_full_memory_ratio": 0.9}  # fmt: skip
        args.update(options)
        self.server_args = SimpleNamespace(**args)
        self.server_args.override = self._override
        self.per_req = per_req
        self.overrides: list[str] = []

    def _override(self, source: str, **fields: Any) -> None:
        self.overrides.append(source)
        for name, value in fields.items():
            setattr(self.server_args, name, value)

    def _calculate_mamba_ratio(self) -> int:
        return 1 if self.server_args.disable_radix_cache else 3

    def _handle_max_mamba_cache(self, rest_gib: float) -> float:
        args = self.server_args
        if args.max_mamba_cache_size is None:
            if args.disable_radix_cache and args.max_running_requests is not None:
                args.max_mamba_cache_size = args.max_running_requests
            else:
                ratio = args.mamba_full_memory_ratio
                share = rest_gib * ratio / (1 + ratio) * GIB
                args.max_mamba_cache_size = int(share // self.per_req)
        return rest_gib - args.max_mamba_cache_size * self.per_req / GIB


def test_a_mamba_state_pool_is_sized_from_the_request_count_not_the_budget() -> None:
    from kvcached.engines.sglang import mamba

    # with the radix cache on, SGLang itself would take 0.9/1.9 of the budget
    found = _MambaConfigurator(per_req=64 << 20, max_running_requests=16)
    state, rest = mamba.state_bytes_and_rest(found, 40 * GIB, None)
    assert found.server_args.max_mamba_cache_size == 16 * 3  # requests x slots a request
    assert state == 48 * (64 << 20)
    assert rest == 40 * GIB - state
    assert found.overrides == ["kvcached: mamba_pool.from_max_running_requests"]


def test_a_given_mamba_cache_size_is_kept_and_the_share_rule_uses_the_instance_limit() -> None:
    from kvcached.engines.sglang import mamba

    given = _MambaConfigurator(per_req=1 << 20, max_mamba_cache_size=100, max_running_requests=8)
    state, rest = mamba.state_bytes_and_rest(given, 40 * GIB, None)
    assert given.server_args.max_mamba_cache_size == 100 and state == 100 << 20
    assert given.overrides == []

    # no size, no request count: SGLang's share rule, over the limit rather than the budget
    shared = _MambaConfigurator(per_req=1 << 20)
    state, rest = mamba.state_bytes_and_rest(shared, 40 * GIB, 4 * GIB)
    assert abs(state - 4 * GIB * 0.9 / 1.9) <= 1 << 20
    assert rest == 40 * GIB - state  # the KV pool's virtual size stays the budget's


def test_a_mamba_state_pool_with_no_room_left_for_kv_is_refused_naming_what_to_change() -> None:
    from kvcached.engines.sglang import mamba

    found = _MambaConfigurator(per_req=GIB, max_mamba_cache_size=8)
    with pytest.raises(refusals.Refused, match="--max-mamba-cache-size"):
        mamba.state_bytes_and_rest(found, 40 * GIB, 4 * GIB)


def test_hybrid_mamba_models_are_served_with_one_rank_or_several(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # several ranks: rank 0 charges every rank's state pool to its own device
    # (tests/test_sglang_tensor_parallel.py runs it on two ranks)
    from kvcached.engines.sglang import sizing, tensor_parallel

    model = SimpleNamespace(mambaish_config=object(), is_hybrid_swa=False)
    monkeypatch.setattr(tensor_parallel, "sglang_channel", lambda: None)
    sizing.check_model(model)
    monkeypatch.setattr(tensor_parallel, "sglang_channel", lambda: object())
    sizing.check_model(model)


def test_the_state_pools_bytes_are_charged_to_the_row_for_the_instances_life(
    ledger_env: Path,
) -> None:
    import os

    from kvcached.config import reload_settings

    os.environ["KVCACHED_BUDGET"] = "64MiB"
    os.environ["KVCACHED_EXTENT_SIZE"] = "2MiB"
    reload_settings()
    # 64 Ki slots of 4 x 256 bytes: 64 MiB of KV, the whole budget, were it all free
    geometry = PoolGeometry(segments=4, rows=65537, row_bytes=256, page_size=1)
    found = instance.single(geometry, HostBackend(), name="mamba", fixed_bytes=24 << 20)
    try:
        assert found.cache.account.reserved >= (24 << 20) + (8 << 20)  # state + padding
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        assert capacity.available(0) * 4 * 256 <= (64 - 24) << 20  # KV gets the rest only
        # under a limit too: the free count leaves the state out (else SGLang would admit
        # a batch whose pages the ledger then refuses, and raise)
        found.cache.set_limit(48 << 20)
        capacity.recount()  # the count is kept for a moment: ask the allocator now
        assert capacity.available(0) * 4 * 256 <= (48 - 24) << 20
    finally:
        found.close()
    # more than the budget holds: refused at start, and the refused row is gone again
    with pytest.raises(refusals.Refused, match="Mamba state pool holds"):
        instance.single(geometry, HostBackend(), name="mamba-big", fixed_bytes=128 << 20)
    # all but the padding page id (4 segments x 2 MiB): the pages the pool thread mapped
    # ahead since the start are given back for it, and nothing of the refused start stayed
    again = instance.single(geometry, HostBackend(), name="mamba-big", fixed_bytes=56 << 20)
    try:
        assert again.cache.account.reserved == 64 << 20
    finally:
        again.close()


def test_a_cache_without_evictable_leaves_evicts_in_its_own_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MambaRadixCache: no evictable_leaves, no eviction strategy, evictable_size() raises
    import dataclasses
    import types

    from kvcached.engines.sglang import eviction

    @dataclasses.dataclass
    class EvictParams:
        num_tokens: int = 0
        swa_num_tokens: int = 0
        mamba_num: int = 0

    module = types.ModuleType("sglang.srt.mem_cache.base_prefix_cache")
    module.EvictParams = EvictParams  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class MambaTree:
        def __init__(self) -> None:
            self.asked: list[Any] = []

        def supports_mamba(self) -> bool:
            return True

        def supports_swa(self) -> bool:
            return False

        def evictable_size(self) -> int:
            raise NotImplementedError  # as SGLang's: tokens and state slots apart

        def full_evictable_size(self) -> int:
            return 300

        def evict(self, params: Any) -> Any:
            self.asked.append(params)
            return SimpleNamespace(num_tokens_evicted=min(params.num_tokens, 300))

    tree = MambaTree()
    allocator = SimpleNamespace(give_back_stock=lambda: 7)
    assert eviction.give_back(tree, allocator, tokens=None) == (300, 7)
    assert tree.asked == [EvictParams(num_tokens=300)]
    assert eviction.give_back(tree, allocator, tokens=50) == (50, 7)

    class PlainTree(MambaTree):
        # RadixCache: the base class's full_evictable_size() answers 0, evictable_size()
        # the tokens (SGLang 0.5.16's base_prefix_cache.py)
        def supports_mamba(self) -> bool:
            return False

        def full_evictable_size(self) -> int:
            return 0

        def evictable_size(self) -> int:
            return 120

    assert eviction.evictable_tokens(PlainTree()) == 120
    assert eviction.evictable_tokens(tree) == 300

    class WindowTree(PlainTree):
        # UnifiedRadixCache of a hybrid sliding-window model: full and window tokens
        # evicted apart; a full token given back frees its window slot too
        def supports_swa(self) -> bool:
            return True

        def swa_evictable_size(self) -> int:
            return 40

    window_tree = WindowTree()
    assert eviction.give_back(window_tree, allocator, tokens=None) == (120, 7)
    assert eviction.give_back(window_tree, allocator, tokens=10) == (10, 7)
    assert window_tree.asked == [
        EvictParams(num_tokens=120, swa_num_tokens=40),
        EvictParams(num_tokens=10, swa_num_tokens=10),
    ]


def test_sliding_window_hybrids_are_served_with_one_rank_and_refused_with_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcached.engines.sglang import sizing, tensor_parallel

    model = SimpleNamespace(is_hybrid_swa=True, mambaish_config=None)
    monkeypatch.setattr(tensor_parallel, "sglang_channel", lambda: None)
    sizing.check_model(model)  # one rank: both pools served (swa.py)
    monkeypatch.setattr(tensor_parallel, "sglang_channel", lambda: object())
    with pytest.raises(refusals.Refused, match=r"tensor parallelism.*--disable-hybrid-swa-memory"):
        sizing.check_model(model)


# ------------------------------------------------------------ the pool statistics
def _static_token_info(observer: Any) -> SimpleNamespace:
    """SGLang 0.5.16's `_get_token_info`: used = size - (free + evictable), against the
    pool's static size, `max_total_num_tokens`."""
    available = observer.token_to_kv_pool_allocator.kv_capacity.available(
        observer.token_to_kv_pool_allocator.stock
    )
    evictable = observer.evictable
    used = observer.max_total_num_tokens - (available + evictable)
    return SimpleNamespace(
        full_num_used=used,
        full_token_usage=used / observer.max_total_num_tokens,
        full_available_size=available,
        full_evictable_size=evictable,
    )


def test_the_pool_statistics_count_what_the_requests_hold_of_what_the_pool_can_hold(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.engines.sglang import allocator as elastic
    from kvcached.engines.sglang import pool_stats

    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")  # nothing mapped ahead: exact figures
    monkeypatch.setattr(elastic, "is_elastic", lambda _a: True)
    monkeypatch.setattr(pool_stats, "is_elastic", lambda _a: True)
    found = _instance(ledger_env, rows=4 * 8192 + 1)
    try:
        capacity = ElasticCapacity(found.allocator, last_page=found.last_page, page_size=1)
        size = found.last_page  # SGLang's static size: the whole virtual pool
        taken = capacity.take(3000)  # 1,000 in the stock, 2,000 SGLang's (300 cached)
        assert taken is not None
        pool = _StockOnly(capacity, stock=1000)
        observer = SimpleNamespace(
            token_to_kv_pool_allocator=pool, max_total_num_tokens=size, evictable=300
        )
        # a limit of a quarter of what the pool could hold: against the static size the
        # requests' 1,700 tokens read as the three quarters over the limit as well
        found.cache.set_limit(found.allocator.group.page_id_bytes)
        capacity.recount()
        static = _static_token_info(observer)
        assert static.full_num_used > size // 2, static
        stats = pool_stats.usage_of_what_it_can_hold(_static_token_info, observer)
        assert stats.full_num_used == 1700  # 2,000 handed to SGLang, less the 300 cached
        free = stats.full_available_size
        assert free == capacity.available(1000) and free < size // 2
        assert stats.full_token_usage == 1700 / (1700 + 300 + free)
        assert stats.full_evictable_size == 300  # SGLang's own, unchanged
        capacity.give(taken)
        pool.stock = 0
        observer.evictable = 0
        idle = pool_stats.usage_of_what_it_can_hold(_static_token_info, observer)
        assert (idle.full_num_used, idle.full_token_usage) == (0, 0.0)
        assert _static_token_info(observer).full_token_usage >= 0.7  # idle, read 3/4 used
    finally:
        found.close()


# ------------------------------------------------------ hybrid sliding-window models
def test_the_joint_level_never_promises_one_byte_to_two_pools() -> None:
    from kvcached.engines.sglang.capacity import joint_level

    mib = 1 << 20
    # two pools whose page id is 12 MiB over 8192 SGLang pages: a page costs 3 KiB in both
    costs = [(12 * mib, 8192), (12 * mib, 8192)]
    assert joint_level(72 * mib, costs, (0, 0)) == 16384  # (72 - 2 x 12) MiB / 3 KiB
    assert joint_level(24 * mib, costs, (0, 0)) == 0  # only the page-id margin is left
    assert joint_level(0, costs, (0, 0)) == 0
    assert joint_level(0, costs, (7, 9)) == 7  # no room: what both have already
    # pools of other widths (Gemma 4: the full layers' pages cost more)
    uneven = [(16 * mib, 4096), (4 * mib, 8192)]
    pages = joint_level(100 * mib, uneven, (0, 0))
    assert pages * (16 * mib / 4096 + 4 * mib / 8192) <= 80 * mib
    assert (pages + 1) * (16 * mib / 4096 + 4 * mib / 8192) > 80 * mib


def test_the_joint_level_gives_the_room_to_the_pool_short_of_pages() -> None:
    from kvcached.engines.sglang.capacity import joint_level

    mib = 1 << 20
    costs = [(12 * mib, 8192), (12 * mib, 8192)]  # 1.5 KiB a page in each pool
    # the window pool has 20,000 free pages (slots of tokens that left the window): the
    # full pool alone grows, 32,768 pages on the 48 MiB (an even split gave it 16,384)
    assert joint_level(72 * mib, costs, (0, 20000)) == 20000 + (48 * mib - 20000 * 1536) // 3072
    assert joint_level(72 * mib, costs, (0, 40000)) == 32768
    # and the one with pages to spare needs none of the room, whichever it is
    assert joint_level(72 * mib, costs, (40000, 0)) == 32768


@given(
    room=st.integers(0, 1 << 34),
    costs=st.lists(
        st.tuples(st.sampled_from([2, 4, 12, 32]), st.sampled_from([512, 4096, 8192])),
        min_size=2,
        max_size=3,
    ),
    free=st.lists(st.integers(0, 1 << 18), min_size=3, max_size=3),
)
def test_the_joint_level_is_the_highest_the_room_pays_for(
    room: int, costs: list[tuple[int, int]], free: list[int]
) -> None:
    from kvcached.engines.sglang.capacity import joint_level

    costs = [(mib << 20, pages) for mib, pages in costs]
    free = free[: len(costs)]
    level = joint_level(room, costs, free)
    spare = room - sum(page_id for page_id, _ in costs)

    def cost(at: int) -> Fraction:  # the growth every pool needs to have `at` pages free
        return sum(
            (
                max(0, at - has) * Fraction(page_id, pages)
                for has, (page_id, pages) in zip(free, costs, strict=True)
            ),
            Fraction(0),
        )

    assert level >= min(free)
    if spare <= 0:
        assert level == min(free)
        return
    assert cost(level) <= spare, "promised more than the room"
    assert cost(level + 1) > spare, "a page more was paid for"
    # never below the even split of the counts before 2026-12-05
    even = spare / sum(Fraction(page_id, pages) for page_id, pages in costs)
    assert level >= int(min(free) + even)


def _hybrid(budget: str) -> instance.SglangInstance:
    """A hybrid instance over two buffers of the same width: the full-attention pool of
    64 Ki slots, the window pool of 32 Ki, 6 segments of 256-byte rows each."""
    import os

    from kvcached.config import reload_settings

    os.environ["KVCACHED_BUDGET"] = budget
    reload_settings()
    backend = HostBackend()
    full = PoolGeometry(segments=6, rows=65537, row_bytes=256, page_size=1)
    window = PoolGeometry(segments=6, rows=32769, row_bytes=256, page_size=1)
    return instance.hybrid(
        (full, full.backing(backend)), (window, window.backing(backend)), backend, name="swa"
    )


@pytest.fixture
def exact_hybrid(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[instance.SglangInstance]:
    """`_hybrid` under 96 MiB, nothing mapped ahead of demand: exact figures."""
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    found = _hybrid("96MiB")
    try:
        yield found
    finally:
        found.close()


def test_a_hybrid_instance_splits_its_room_between_the_pools_it_counts_free(
    exact_hybrid: instance.SglangInstance,
) -> None:
    from kvcached.engines.sglang.capacity import HybridCapacity

    found = exact_hybrid
    capacity, window = found.capacity, found.window
    assert isinstance(capacity, HybridCapacity) and window is not None
    cache = found.cache
    assert cache is not None and [a.used_blocks for a in cache.allocators] == [1, 1]
    assert cache.account.reserved == 24 << 20  # each pool's padding page id
    full_free, window_free = capacity.free_pages(0, 0)
    # the rest of each padding page id (8191 slots) plus 48 of the 72 MiB left, in
    # slots that cost 1.5 KiB in each pool
    assert (full_free, window_free) == (8191 + 16384, 8191 + 16384)
    # what was counted is there, in both pools (each pool alone counted 57,343)
    assert capacity.take(full_free) is not None
    assert window.capacity.take(window_free) is not None
    assert capacity.free_pages(0, 0) == (0, 0)
    # under a limit, the pools share the limit's room, not each the whole of it
    cache.set_limit(cache.account.reserved)
    capacity.recount()
    window.capacity.recount()
    assert capacity.free_pages(3, 5) == (3, 5)  # only the stocks
    # over the limit: both pools' bytes count (the policy gives back from both)
    cache.set_limit(60 << 20)
    assert capacity.over_limit() == cache.reserved_bytes - (60 << 20) > 0
    assert capacity.bytes_per_token == 2 * 6 * 256


def test_a_hybrid_instances_room_goes_to_the_pool_short_of_pages(
    exact_hybrid: instance.SglangInstance,
) -> None:
    # decoding past the window: the window pool's stock holds 20,000 slots SGLang gave
    # back (free_swa), which cost no room; the 48 MiB left go to the full pool alone
    found = exact_hybrid
    capacity, window = found.capacity, found.window
    assert window is not None
    stock = window.capacity.take(20000)  # the window's stock (its own page ids)
    assert stock is not None
    capacity.recount()
    window.capacity.recount()
    room = capacity.room()
    assert room == 48 << 20  # 96 MiB less the padding page ids and the window's 24
    full_free, window_free = capacity.free_pages(0, len(stock))
    # the full pool: the rest of its padding page id, and the room less its margin
    # in 1.5 KiB slots (an even split of the growth counted 8191 + 8192)
    assert full_free == 8191 + (room - (24 << 20)) // 1536 == 8191 + 16384
    assert window_free == len(stock) + window.capacity.allocator.mapped_free_blocks()
    assert window_free >= full_free  # the window needs none of the room
    assert capacity.take(full_free) is not None  # and the full pool has it


def test_a_hybrid_instance_is_one_ledger_row_and_closes_both_pools(ledger_env: Path) -> None:
    found = _hybrid("96MiB")
    cache = found.cache
    assert cache is not None and found.window is not None
    rows = [row.name for row in cache.ledger.rows()]
    assert rows.count("swa") == 1
    found.close()
    assert found.backing.closed and found.window.backing.closed


def test_a_hybrid_instance_without_a_limit_is_bounded_by_the_budget_not_one_pools_size(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # both pools full: 144 MiB held under a 256 MiB budget, more than the full pool's
    # own range (96 MiB), which is no limit of the instance's
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    found = _hybrid("256MiB")
    try:
        capacity, window = found.capacity, found.window
        assert window is not None
        full_free, window_free = capacity.free_pages(0, 0)
        assert (full_free, window_free) == (65536, 32768)  # every slot of both pools
        assert capacity.take(full_free) is not None
        assert window.capacity.take(window_free) is not None
        assert capacity.over_limit() == 0 and not capacity.under_pressure()
    finally:
        found.close()


def test_a_hybrid_instance_the_budget_cannot_grow_in_both_pools_is_under_pressure(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each pool's page id is 12 MiB and a token takes a slot in both: with 18 MiB of
    # headroom one full-pool page id would fit, but the instance grows only both at once
    # (joint_level), so it is stuck, and the policy must ask for memory back
    monkeypatch.setenv("KVCACHED_POOL_LOW", "0")
    found = _hybrid("42MiB")  # the two padding page ids, and 18 MiB
    try:
        capacity = found.capacity
        assert capacity.allocator.account.headroom() == 18 << 20
        assert capacity.free_pages(0, 0) == (8191, 8191)  # the padding page ids' rest only
        assert capacity.under_pressure()
    finally:
        found.close()


def test_a_hybrid_instance_follows_its_limit_in_both_pools_before_it_counts_the_excess(
    ledger_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kvcached.engines.sglang import lifecycle
    from kvcached.supply import Reclaim

    found = _hybrid("96MiB")
    try:
        capacity, window = found.capacity, found.window
        assert window is not None
        order: list[str] = []
        caller = threading.get_ident()  # the pool threads call maintain() too
        for name, allocator in (("full", capacity.allocator), ("window", window.allocator)):
            maintain = allocator.maintain

            def recorded(_name: str = name, _maintain: Any = maintain) -> int:
                if threading.get_ident() == caller:
                    order.append(_name)
                return int(_maintain())

            monkeypatch.setattr(allocator, "maintain", recorded)
        over = capacity.over_limit
        monkeypatch.setattr(capacity, "over_limit", lambda: order.append("counted") or over())
        pool = SimpleNamespace(kv_capacity=capacity, give_back_stock=lambda: 0)
        assert lifecycle.evict_for(pool, None, Reclaim("limit", None)) == (0, 0)
        # the window pool's emptied extents go back first (room the full pool's limit
        # sees), and only then is the excess counted, so no more is evicted than needed
        assert order == ["window", "full", "counted"]
    finally:
        found.close()


def test_a_pool_of_no_whole_number_of_pages_hands_out_only_its_whole_pages() -> None:
    # SGLang's window pool can be 1,000 tokens of 16-token pages: its allocator's pages
    # are 1 to 62 (1000 // 16), over buffers of 1,016 rows; page 63 is partly outside them
    window = PoolGeometry(segments=2, rows=1000 + 16, row_bytes=256, page_size=16)
    assert window.pages == 64  # the address space covers the partial page
    assert window.last_page == 62
    aligned = PoolGeometry(segments=2, rows=1024 + 16, row_bytes=256, page_size=16)
    assert aligned.last_page == aligned.pages - 1 == 64


def test_the_elastic_classes_top_up_before_sglangs_code_and_pass_the_page_count_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    from kvcached.engines.sglang.elastic_classes import TopsUpFirst, subclass_with

    utils = types.ModuleType("sglang.srt.utils")
    utils.get_num_new_pages = lambda **kw: 7 if not kw.get("decode") else 2  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)

    class SglangAllocator:  # stands in for SGLang's: records what reached it
        page_size = 16

        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def alloc(self, need: int) -> str:
            self.calls.append(("alloc", need))
            return "slots"

        def alloc_extend(self, *args: Any) -> str:
            self.calls.append(("extend", *args[5:]))  # the token and page counts
            return "slots"

        def alloc_decode(self, *args: Any) -> str:
            self.calls.append(("decode",))
            return "slots"

    class Mixin(TopsUpFirst):
        ensured: list[int]
        room = True

        def _ensure(self, pages: int) -> bool:
            self.ensured.append(pages)
            return self.room

    class PairMixin(Mixin):
        _takes_page_count = False

    for mixin, made_with in ((Mixin, (100, 7)), (PairMixin, (100,))):
        allocator = SglangAllocator()
        allocator.__class__ = subclass_with(SglangAllocator, mixin, {})
        allocator.ensured = []  # type: ignore[attr-defined]
        assert allocator.alloc(33) == "slots"  # 33 tokens: 3 pages of 16
        assert allocator.alloc_extend(None, None, None, None, None, 100) == "slots"
        assert allocator.alloc_decode(None, None, None) == "slots"
        assert allocator.ensured == [3, 7, 2]  # type: ignore[attr-defined]
        assert allocator.calls == [("alloc", 33), ("extend", *made_with), ("decode",)]
        allocator.room = False  # type: ignore[attr-defined]  # kvcached cannot supply
        assert allocator.alloc(1) is None and allocator.alloc_decode(None, None, None) is None
        assert len(allocator.calls) == 3  # SGLang's code did not run
