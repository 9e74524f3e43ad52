"""The SGLang adapter's tensor parallelism (engines/sglang/tensor_parallel.py), on two
real ranks: two processes in one torch.distributed gloo group, as SGLang's TP
schedulers are, each rank's memory on its own ledger (host-0, host-1), against
kvcached's own allocator and host backend. SGLang itself is not needed: the ranks
drive the capacity the way SGLang's allocator does (tests/sglang_tp/rank.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # the gloo group; torch comes with the dev install

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "tests" / "sglang_tp" / "rank.py"
PAGE_ID = 8 * 1024 * 1024  # tests/sglang_tp/rank.py's geometry: 4 segments x 2 MiB


def _run_ranks(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    env = dict(os.environ)
    env.update(
        KVCACHED_LEDGER_DIR=str(ledgers),
        KVCACHED_BACKEND="host",
        KVCACHED_BUDGET="128MiB",  # each device's ledger
        KVCACHED_EXTENT_SIZE="2MiB",  # one page id per extent: releases show at once
        KVCACHED_POOL_LOW="0",
        KVCACHED_POOL_HIGH="0",
        KVCACHED_POOL_RELEASE_DELAY="0",
    )
    env.pop("KVCACHED_INSTANCE_LIMIT", None)
    env.pop("KVCACHED_INSTANCE_NAME", None)
    rendezvous = tmp_path / "rendezvous"
    outs = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK), str(rank), str(rendezvous), str(outs[rank]), scenario],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = []
    for process in ranks:
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
        logs.append(output)
    for rank, process in enumerate(ranks):
        assert process.returncode == 0, f"rank {rank} failed:\n{logs[rank][-3000:]}"
    return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_ranks(tmp_path_factory.mktemp("sglang-tp"), "shared")


def test_every_rank_gets_the_same_pages_and_counts(shared: list[dict[str, Any]]) -> None:
    leader, follower = shared
    assert len(leader["rounds"]) == 24
    taken = [r["ids"] for r in leader["rounds"] if r["ids"]]
    assert sum(len(ids) for ids in taken) > 8192  # more than one page id's worth moved
    assert leader["rounds"] == follower["rounds"]  # ids, free counts, held counts
    for name in ("available_before_neighbour", "available_with_neighbour", "available_end"):
        assert leader[name] == follower[name], name


def test_every_rank_maps_its_own_memory_under_the_pages_handed_out(
    shared: list[dict[str, Any]],
) -> None:
    leader, follower = shared
    for rank in (leader, follower):
        assert rank["mapped_held"]
    assert leader["touched"] == [40] and follower["touched"] == [41]  # its own bytes
    assert leader["mappings"] == follower["mappings"] != []  # same offsets, same sizes


def test_the_fullest_device_bounds_every_rank_and_is_not_overcommitted(
    shared: list[dict[str, Any]],
) -> None:
    leader, follower = shared
    # a neighbour filled rank 1's device: the count every rank sees dropped to it
    assert leader["available_with_neighbour"] < leader["available_before_neighbour"]
    # more than rank 1's device can hold (rank 0's could): refused on both ranks
    assert leader["too_big"] is None and follower["too_big"] is None
    assert leader["fits"] == follower["fits"] and leader["fits"]
    # each device is charged for its own copy, all along
    for rows in [*leader["rows_by_round"], leader["rows_busy"]]:
        assert rows["host-0"] == rows["host-1"] >= PAGE_ID
    assert max(rows["host-0"] for rows in leader["rows_by_round"]) >= 3 * PAGE_ID


def test_memory_given_back_is_unmapped_on_every_rank_then_refunded(
    shared: list[dict[str, Any]],
) -> None:
    leader, follower = shared
    assert leader["released"] and follower["released"]
    # only the padding page's page id stays, mapped on both ranks and charged on both
    one_page_id = [[0, 2 * 1024 * 1024]]
    assert [m for m in leader["mappings_after"] if m[0] == 0] == one_page_id
    assert len(leader["mappings_after"]) == len(follower["mappings_after"]) == 4
    assert leader["rows_idle"] == {"host-0": PAGE_ID, "host-1": PAGE_ID}


def test_ranks_deciding_alone_drift_apart(tmp_path: Path) -> None:
    # what the shared path prevents, and what makes the comparison above able to fail:
    # two allocators with different histories hand out different pages for the same calls
    leader, follower = _run_ranks(tmp_path, "alone")
    assert leader["rounds"] != follower["rounds"]
    pairs = zip(leader["rounds"], follower["rounds"], strict=True)
    differ = [a["ids"] != b["ids"] for a, b in pairs]
    assert any(differ)


def test_a_lowered_limit_is_judged_by_rank_0_and_carried_out_on_every_rank(
    tmp_path: Path,
) -> None:
    leader, follower = _run_ranks(tmp_path, "upkeep")
    # the same stock on both ranks, each over its own mapped memory, charged on both devices
    assert leader["stock"] == follower["stock"] >= 3 * 8192
    assert leader["stock_ids"] == follower["stock_ids"]
    assert leader["mapped_stock"] and follower["mapped_stock"]
    full = leader["rows_full"]
    assert full["host-0"] == full["host-1"] >= 4 * PAGE_ID
    # rank 0 alone saw the lower limit; both gave their stock back and both unmapped
    assert leader["settled"] and follower["settled"]
    assert leader["stock_after"] == follower["stock_after"] == 0
    assert leader["available_after"] == follower["available_after"]
    assert leader["mappings_after"] == follower["mappings_after"]
    assert len(follower["mappings_after"]) == 4  # the padding page's page id, 4 segments
    assert leader["rows_after"] == {"host-0": PAGE_ID, "host-1": PAGE_ID}


def test_a_state_pool_is_charged_on_every_device_or_the_start_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    # a hybrid Mamba model's state pool (engines/sglang/mamba.py): SGLang holds one per
    # rank, outside the KV pool; rank 0 charges each device for its own copy
    mib = 1024 * 1024
    leader, follower = _run_ranks(tmp_path, "state")
    assert leader["fixed"] == 24 * mib
    assert leader["rows"] == {"host-0": 24 * mib + PAGE_ID, "host-1": 24 * mib + PAGE_ID}
    # under a 48 MiB limit the KV pool's share on every device is what the state leaves
    assert leader["kv_limit"] == 48 * mib - 24 * mib
    # closed: both devices refunded (the rows are gone)
    assert leader["totals_closed"] == {"host-0": 0, "host-1": 0}
    # 40 MiB fits rank 0's device, not rank 1's (a neighbour holds 100 of its 128 MiB):
    # refused on both ranks, naming the state and the fullest device, and neither
    # device keeps any of the refused start's charge
    assert "Mamba state pool holds 41943040 bytes" in leader["refused"]
    assert "on its fullest device" in leader["refused"]
    assert follower["refused"].startswith("kvcached: tensor-parallel rank 0 failed: SGLang's Mamba")
    assert follower["refused"].count("Unset ENABLE_KVCACHED") == 1  # wrapped once
    assert leader["totals_refused"] == {"host-0": 0, "host-1": 100 * mib}
