"""A ledger file damaged under running instances (issue 18.2): truncated, zeroed, cut
short. No instance may die of it, and `kvctl repair` must bring the file back."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcached.apps.kvctl import app as kvctl
from kvcached.cache import KVCache
from kvcached.config import reload_settings
from kvcached.layout import LayerSpec
from kvcached.ledger import (
    HEADER_SIZE,
    LAYOUT_VERSION,
    ROW_SIZE,
    Ledger,
    LedgerDamaged,
    LedgerError,
    check_usable,
    ledger_path,
    repair_file,
)

MiB = 1 << 20
FULL = HEADER_SIZE + 64 * ROW_SIZE
runner = CliRunner()


@pytest.fixture
def folder(ledger_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    reload_settings()
    return ledger_dir


@pytest.fixture
def ledger(folder: Path) -> Iterator[Ledger]:
    with Ledger.open("host-cpu", budget=100 * MiB) as opened:
        yield opened


# ------------------------------------------------- an instance whose ledger shrinks
_GROWER = """
import json, sys, time
from kvcached.cache import KVCache
from kvcached.layout import LayerSpec
from kvcached.ledger import LedgerDamaged

cache = KVCache([LayerSpec(num_kv_heads=2, head_dim=64)] * 4, block_size=16, name="grower",
                backend="host", budget="256MiB", extent_bytes=2 << 20, pool_low=0,
                pool_high=0, release_delay=0.0, poll_interval=0.005)
allocator = cache.allocators[0]
held = cache.alloc(100)  # kept all along: page id 0 stays mapped
print("ready", flush=True)
refused = None
deadline = time.monotonic() + 60
while refused is None and time.monotonic() < deadline:
    try:
        more = cache.alloc(600)  # more than the mapped page id: grows every time
    except LedgerDamaged as exc:
        refused = str(exc)
        break
    if more is not None:
        cache.free(more)
    allocator.trim(0)  # gives the grown extent back: the next alloc grows again
    allocator.obtainable_blocks()  # an engine's free count reads the budget's headroom
    time.sleep(0.0005)
still = all(allocator.is_allocated(block) for block in held)
served = cache.alloc(50)  # from what is mapped: still served
cache.free(held + (served or []))
cache.close()
print(json.dumps({"refused": refused, "held": still, "served": served is not None}))
"""


def test_truncating_the_ledger_under_a_growing_instance_does_not_kill_it(folder: Path) -> None:
    """Truncating the ledger file killed every instance that mapped it with SIGBUS
    (exit status 135, -7 from subprocess), without a message.

    The truncation holds the flock, as `kvctl repair` does: an instance checks the
    file's size under it before each access, and an unlocked truncation could still
    land in the microseconds between a check and its access (the ledger's note "A
    ledger that shrank"), which would make this test fail now and then."""
    env = {**os.environ, "KVCACHED_LEDGER_DIR": str(folder)}
    child = subprocess.Popen(
        [sys.executable, "-c", _GROWER], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # let it grow and release a few times
        with open(ledger_path("host-cpu"), "r+b") as file:  # `truncate -s 0`, locked
            fcntl.flock(file, fcntl.LOCK_EX)
            file.truncate(0)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, f"exit status {child.returncode}: {err}"
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["held"] and outcome["served"]  # keeps serving what it holds
    refused = outcome["refused"]
    assert refused is not None and "shrank" in refused and "kvctl repair" in refused
    assert "Traceback" not in err, err


def test_a_ledger_that_shrank_is_never_touched_again_and_its_account_keeps_count(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    account = ledger.register("victim", "test", limit=50 * MiB)
    assert account.try_charge(8 * MiB)
    account.set_used(MiB)
    os.truncate(ledger.path, HEADER_SIZE + ROW_SIZE // 2)  # row 0 is cut in half
    shrank = r"shrank to \d+ bytes.*kvctl repair"
    with caplog.at_level(logging.WARNING), pytest.raises(LedgerDamaged, match=shrank):
        account.try_charge(MiB)
    assert [r for r in caplog.records if "shrank" in r.getMessage()]
    assert account.limit == 50 * MiB  # the last limit read
    assert account.headroom() == 0
    assert account.reserved == 8 * MiB  # this process's own count
    account.refund(3 * MiB)
    account.set_used(0)
    assert account.reserved == 5 * MiB and account.used == 0
    with pytest.raises(LedgerDamaged):
        account.try_charge(0)
    with pytest.raises(LedgerDamaged):
        ledger.rows()
    account.close()  # quietly: the row cannot be removed from a file that lost it
    ledger.close()


def test_a_refund_that_finds_the_ledger_shrunk_keeps_the_row_its_own(ledger: Ledger) -> None:
    account = ledger.register("refunding", "test")
    assert account.try_charge(8 * MiB)
    os.truncate(ledger.path, HEADER_SIZE + ROW_SIZE // 2)
    account.refund(3 * MiB)  # the first touch since the file shrank is this refund
    assert not account.lost  # damaged is not lost: the row was not taken from it
    assert account.reserved == 5 * MiB
    account.close()
    ledger.close()


def test_a_ledger_cut_short_while_open_is_caught_by_kvctl_too(ledger: Ledger) -> None:
    ledger.register("victim", "test")
    os.truncate(ledger.path, 100)
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert "corrupted" in message and "kvctl repair --key host-cpu" in message


# ----------------------------------------------------------------- kvctl repair
def _start_a_cache(name: str) -> None:
    with KVCache(
        [LayerSpec(num_kv_heads=2, head_dim=64)], block_size=16, name=name, backend="host",
        budget=64 * MiB, pool_low=0, pool_high=0, release_delay=0.0, background=False,
    ) as cache:  # fmt: skip
        blocks = cache.alloc(10)
        assert blocks is not None
        cache.free(blocks)


@pytest.mark.parametrize("size", [0, 20, FULL])
def test_kvctl_repair_removes_a_zeroed_ledger_for_the_next_instance(
    folder: Path, size: int
) -> None:
    """A zeroed ledger (truncated to nothing, or filled with zeros) blocked every
    instance with 'refusing to touch it', and kvctl repair refused it too."""
    Ledger.open("host-cpu", budget=100 * MiB).close()
    path = ledger_path("host-cpu")
    with open(path, "r+b") as file:
        file.truncate(0)
        file.write(bytes(size))
    with pytest.raises(LedgerError, match="kvctl repair --key host-cpu"):
        _start_a_cache("before")
    result = runner.invoke(kvctl, ["repair"])
    assert result.exit_code == 0, result.output
    assert "removed" in result.stdout and "kvctl budget SIZE" in " ".join(result.stdout.split())
    assert not path.exists()
    _start_a_cache("after")  # creates a new ledger, with its own budget
    with Ledger.open("host-cpu", create=False) as fresh:
        assert fresh.budget == 64 * MiB and fresh.rows() == []


@pytest.mark.parametrize("size", [40, HEADER_SIZE, HEADER_SIZE + 5 * ROW_SIZE + 7])
def test_kvctl_repair_gives_a_short_ledger_back_its_size_and_budget(
    folder: Path, size: int
) -> None:
    with Ledger.open("host-cpu", budget=100 * MiB) as first:
        holder = first.register("survivor", "test")
        assert holder.try_charge(4 * MiB)
        os.truncate(first.path, size)
        with pytest.raises(LedgerError, match="kvctl repair"):
            Ledger.open("host-cpu")
        result = runner.invoke(kvctl, ["repair"])
        assert result.exit_code == 0, result.output
        said = " ".join(result.stdout.split())
        assert "full size and a fresh header" in said and "budget of 100 MiB" in said
        assert "restart them" in " ".join(result.stderr.split())
        assert first.path.stat().st_size == FULL
        with Ledger.open("host-cpu", create=False) as repaired:
            assert repaired.budget == 100 * MiB
            rows = repaired.rows()
            if size > HEADER_SIZE:  # row 0 survived the cut: still this live instance's
                assert [(r.name, r.reserved) for r in rows] == [("survivor", 4 * MiB)]
                assert holder.try_charge(MiB)  # the instance never saw the damage
            else:
                assert rows == []
    _start_a_cache("after")


def test_kvctl_repair_of_a_corrupted_header_keeps_the_rows_of_live_instances(
    ledger: Ledger,
) -> None:
    live = ledger.register("live", "test")
    assert live.try_charge(2 * MiB)
    with ledger._locked() as mm:
        struct.pack_into("<I", mm, 20, 3)  # the row count no longer matches the size
    with pytest.raises(LedgerError, match=r"corrupted.*kvctl repair"):
        Ledger.open("host-cpu")
    result = runner.invoke(kvctl, ["repair"])
    assert result.exit_code == 0, result.output
    assert "1 instance row(s) kept" in " ".join(result.stdout.split())
    assert live.try_charge(MiB) and live.reserved == 3 * MiB  # it never stopped
    with Ledger.open("host-cpu", create=False) as repaired:
        assert [(r.name, r.reserved) for r in repaired.rows()] == [("live", 3 * MiB)]


def test_repair_of_a_sound_ledger_changes_nothing(ledger: Ledger) -> None:
    before = ledger.path.read_bytes()
    assert repair_file("host-cpu") is None
    result = runner.invoke(kvctl, ["repair"])
    assert result.exit_code == 0 and "nothing to repair" in result.stdout
    assert ledger.path.read_bytes() == before


def test_repair_leaves_a_ledger_of_another_layout_version_alone(ledger: Ledger) -> None:
    with ledger._locked() as mm:
        struct.pack_into("<I", mm, 8, LAYOUT_VERSION + 1)
    before = ledger.path.read_bytes()
    result = runner.invoke(kvctl, ["repair"])
    assert result.exit_code == 1 and f"layout version {LAYOUT_VERSION + 1}" in result.stderr
    assert ledger.path.read_bytes() == before


def test_repair_without_a_ledger_says_there_is_none(folder: Path) -> None:
    result = runner.invoke(kvctl, ["repair"])
    assert result.exit_code == 1 and "no kvcached ledger" in result.stderr


# ------------------------------------------------------------- a full file system
def _no_space(*args: object, **kwargs: object) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fill_the_file_system(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write to a file fails as it does on a full tmpfs (no tiny tmpfs here)."""
    monkeypatch.setattr(os, "write", _no_space)
    monkeypatch.setattr(os, "pwrite", _no_space)


def test_a_full_file_system_is_a_ledger_error_that_says_so(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger folder on a full file system gave a raw OSError ENOSPC."""
    _fill_the_file_system(monkeypatch)
    with pytest.raises(LedgerError, match=r"file system is full.*KVCACHED_LEDGER_DIR"):
        Ledger.open("host-cpu", budget=MiB)
    assert list(folder.iterdir()) == []  # the temporary file went too


def test_kvctl_budget_on_a_full_file_system_is_an_error_not_a_traceback(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvctl budget 1GiB` on a full file system printed an OSError traceback."""
    _fill_the_file_system(monkeypatch)
    result = runner.invoke(kvctl, ["budget", "1GiB"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert "file system is full" in " ".join(result.stderr.split())


def test_no_space_while_linking_the_new_ledger_is_a_ledger_error(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "link", _no_space)
    with pytest.raises(LedgerError, match="file system is full"):
        Ledger.open("host-cpu", budget=MiB)


# ------------------------------------------------------- what `kvcached info` checks
def test_check_usable_reports_what_an_instance_would_meet(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert check_usable("host-cpu") == ledger_path("host-cpu")  # missing: can be created
    Ledger.open("host-cpu", budget=MiB).close()
    assert check_usable("host-cpu") == ledger_path("host-cpu")
    os.truncate(ledger_path("host-cpu"), 10)
    with pytest.raises(LedgerError, match="kvctl repair"):
        check_usable("host-cpu")
    elsewhere = tmp_path_factory.mktemp("other")
    a_file = elsewhere / "file"
    a_file.write_text("")
    with pytest.raises(LedgerError, match="not a directory"):
        check_usable("host-cpu", a_file)
    with pytest.raises(LedgerError, match="does not exist"):
        check_usable("host-cpu", elsewhere / "missing")
    os.chmod(elsewhere, 0o777)
    with pytest.raises(LedgerError, match="writable by everyone"):
        check_usable("host-cpu", elsewhere)
