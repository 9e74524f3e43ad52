"""Unit tests of the cross-process ledger (kvcached.ledger)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import platform
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from process_state import state  # tests/, on sys.path under pytest

from kvcached import ledger as ledger_module
from kvcached.accounting import BudgetAccount
from kvcached.config import reload_settings, settings
from kvcached.errors import InvalidArgument, KVCachedError
from kvcached.ledger import (
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    ROW_SIZE,
    Ledger,
    LedgerError,
    default_key,
    existing_keys,
    ledger_key,
    ledger_path,
    liveness,
    placement,
    process_start_time,
)
from kvcached.ledger import files as ledger_files

MiB = 1 << 20


@pytest.fixture
def folder(ledger_dir: Path) -> Path:
    return ledger_dir  # conftest's: this test's own KVCACHED_LEDGER_DIR


@pytest.fixture
def ledger(folder: Path) -> Iterator[Ledger]:
    with Ledger.open("host-cpu", budget=100 * MiB) as opened:
        yield opened


def _spawn_holder(folder: Path, name: str, nbytes: int) -> subprocess.Popen[str]:
    """A process that registers `name`, charges `nbytes`, says 'ready' and sleeps."""
    code = (
        "import sys, time\n"
        "from kvcached.ledger import Ledger\n"
        f"l = Ledger.open('host-cpu', directory={str(folder)!r})\n"
        f"a = l.register({name!r}, 'test')\n"
        f"assert a.try_charge({nbytes})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


# ------------------------------------------------------------------ files and opening
def test_created_file_is_owner_only_whatever_the_umask(folder: Path) -> None:
    old = os.umask(0)
    try:
        with Ledger.open("host-cpu", budget=MiB) as created:
            mode = stat.S_IMODE(os.stat(created.path).st_mode)
    finally:
        os.umask(old)
    assert mode == 0o600
    assert created.path == folder / f"kvcached-{os.geteuid()}-host-cpu.ledger"
    assert [p.name for p in folder.iterdir()] == [created.path.name]  # no temp file left


def test_header_is_versioned_and_sized(ledger: Ledger) -> None:
    data = ledger.path.read_bytes()
    assert data[:8] == MAGIC
    version, header_size, row_size, capacity, budget = struct.unpack_from("<IIIIQ", data, 8)
    assert (version, header_size, row_size) == (LAYOUT_VERSION, HEADER_SIZE, ROW_SIZE)
    assert capacity == ledger.capacity
    assert budget == 100 * MiB
    assert len(data) == HEADER_SIZE + capacity * ROW_SIZE


def test_open_existing_keeps_its_budget(ledger: Ledger) -> None:
    with Ledger.open("host-cpu", budget=5 * MiB) as again:
        assert again.budget == 100 * MiB
        assert os.path.samefile(again.path, ledger.path)


def test_creating_needs_a_budget_and_create_false_needs_a_file(folder: Path) -> None:
    with pytest.raises(InvalidArgument, match="needs a budget"):
        Ledger.open("cuda-3")
    with pytest.raises(LedgerError, match="no kvcached ledger for 'cuda-3'"):
        Ledger.open("cuda-3", budget=MiB, create=False)
    assert not list(folder.iterdir())


@pytest.mark.parametrize("budget", [0, -1, 1.5, "1GiB", True])
def test_malformed_budget_is_invalid(folder: Path, budget: object) -> None:
    with pytest.raises(InvalidArgument):
        Ledger.open("host-cpu", budget=budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["", "../etc", "CUDA-0", "a/b", "x" * 65, "-lead"])
def test_malformed_key_is_invalid(folder: Path, key: str) -> None:
    with pytest.raises(InvalidArgument, match="ledger key"):
        Ledger.open(key, budget=MiB)


def test_concurrent_creators_share_one_file(folder: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        inodes = pool.starmap(_open_and_report_inode, [(str(folder), i) for i in range(8)])
    assert len(set(inodes)) == 1
    assert [p.name for p in folder.iterdir()] == [ledger_path("race-0", folder).name]


def _open_and_report_inode(folder: str, i: int) -> int:
    with Ledger.open("race-0", budget=(i + 1) * MiB, directory=folder) as opened:
        return os.fstat(opened._fd).st_ino


# ---------------------------------------------------------------- refusing bad files
def _write(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.write_bytes(data)
    os.chmod(path, mode)


def _valid_bytes(folder: Path) -> bytes:
    with Ledger.open("scratch", budget=MiB, directory=folder) as scratch:
        data = scratch.path.read_bytes()
    scratch.path.unlink()
    return data


def test_foreign_file_is_refused_and_left_alone(folder: Path) -> None:
    path = ledger_path("host-cpu")
    size = HEADER_SIZE + 64 * ROW_SIZE
    foreign = b"\x7fELF" + bytes(range(256)) * (size // 256)
    _write(path, foreign[:size])
    with pytest.raises(LedgerError, match="not a kvcached ledger"):
        Ledger.open("host-cpu", budget=MiB)
    assert path.read_bytes() == foreign[:size]


@pytest.mark.parametrize("size", [0, 10, HEADER_SIZE, HEADER_SIZE + 5 * ROW_SIZE])
def test_truncated_file_is_refused(folder: Path, size: int) -> None:
    data = _valid_bytes(folder)[:size]
    _write(ledger_path("host-cpu"), data)
    with pytest.raises(LedgerError, match=r"too short|corrupted"):
        Ledger.open("host-cpu", budget=MiB)
    assert ledger_path("host-cpu").read_bytes() == data


def test_file_with_extra_bytes_is_refused(folder: Path) -> None:
    _write(ledger_path("host-cpu"), _valid_bytes(folder) + b"\0" * ROW_SIZE)
    with pytest.raises(LedgerError, match="corrupted"):
        Ledger.open("host-cpu")


def test_corrupted_header_is_refused(folder: Path) -> None:
    data = bytearray(_valid_bytes(folder))
    struct.pack_into("<I", data, 20, 3)  # row count no longer matches the size
    _write(ledger_path("host-cpu"), bytes(data))
    with pytest.raises(LedgerError, match="corrupted"):
        Ledger.open("host-cpu")


def test_other_layout_version_is_refused_with_a_clear_error(folder: Path) -> None:
    data = bytearray(_valid_bytes(folder))
    struct.pack_into("<I", data, 8, LAYOUT_VERSION + 1)
    _write(ledger_path("host-cpu"), bytes(data))
    with pytest.raises(LedgerError, match=f"layout version {LAYOUT_VERSION + 1}.*understands"):
        Ledger.open("host-cpu")


def test_file_readable_by_others_is_refused(folder: Path) -> None:
    _write(ledger_path("host-cpu"), _valid_bytes(folder), mode=0o644)
    with pytest.raises(LedgerError, match=r"mode 0644.*chmod 600"):
        Ledger.open("host-cpu")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_file_of_another_user_is_refused(folder: Path) -> None:
    path = ledger_path("host-cpu")
    _write(path, _valid_bytes(folder))
    os.chown(path, 54321, -1)
    with pytest.raises(LedgerError, match="owned by uid 54321"):
        Ledger.open("host-cpu")


def test_file_of_another_user_is_refused_without_root(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ledger_path("host-cpu")
    _write(path, _valid_bytes(folder))
    real_fstat = os.fstat

    def fstat_as_if_foreign(fd: int) -> os.stat_result:
        info = list(real_fstat(fd))
        info[stat.ST_UID] = os.geteuid() + 1
        return os.stat_result(info)

    monkeypatch.setattr(ledger_files.os, "fstat", fstat_as_if_foreign)
    with pytest.raises(LedgerError, match="owned by uid"):
        Ledger.open("host-cpu")


def test_symlink_is_not_followed(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tmp_path_factory.mktemp("elsewhere") / "victim"
    target.write_bytes(b"precious")
    ledger_path("host-cpu").symlink_to(target)
    with pytest.raises(LedgerError, match="symbolic link"):
        Ledger.open("host-cpu", budget=MiB)
    assert target.read_bytes() == b"precious"


def test_world_writable_folder_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(LedgerError, match="writable by everyone"):
        Ledger.open("host-cpu", budget=MiB, directory=folder)


# ------------------------------------------------------------------------- accounts
def test_account_is_a_budget_account(ledger: Ledger) -> None:
    with ledger.register("a", "vllm") as account:
        assert isinstance(account, BudgetAccount)
        assert account.limit is None


def test_charges_are_bounded_by_the_budget(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    b = ledger.register("b", "sglang")
    assert a.try_charge(60 * MiB)
    assert not b.try_charge(41 * MiB)
    assert b.try_charge(40 * MiB)
    assert not a.try_charge(1)
    a.refund(10 * MiB)
    assert b.try_charge(10 * MiB)
    totals = ledger.totals()
    assert (totals.reserved, totals.free, totals.instances) == (100 * MiB, 0, 2)
    rows = {row.name: row for row in ledger.rows()}
    assert rows["a"].reserved == 50 * MiB and rows["a"].peak == 60 * MiB
    assert rows["b"].reserved == 50 * MiB and rows["b"].denied == 1
    assert rows["a"].denied == 1


def test_charges_are_bounded_by_the_limit(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm", limit=10 * MiB)
    assert a.limit == 10 * MiB
    assert a.try_charge(10 * MiB)
    assert not a.try_charge(1)
    assert a.reserved == 10 * MiB


def test_zero_charge_succeeds_and_changes_nothing(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(0)
    assert a.reserved == 0


@pytest.mark.parametrize("bad", [-1, 1.0, "4096", None, True])
def test_malformed_amounts_are_invalid(ledger: Ledger, bad: object) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(MiB)
    for method in (a.try_charge, a.refund, a.set_used):
        with pytest.raises(InvalidArgument):
            method(bad)  # type: ignore[arg-type]
    assert a.reserved == MiB and a.used == 0


def test_refunding_more_than_reserved_is_invalid_and_changes_nothing(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(MiB)
    with pytest.raises(InvalidArgument, match="more than"):
        a.refund(MiB + 1)
    assert a.reserved == MiB


def test_used_is_reported(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(8 * MiB)
    a.set_used(3 * MiB)
    assert ledger.totals().used == 3 * MiB
    assert a.row().used == 3 * MiB


@pytest.mark.parametrize("name", ["", " a", "a b", "a\nb", "ünï", "x" * 65, "-a", "a;rm"])
def test_malformed_names_are_invalid(ledger: Ledger, name: str) -> None:
    with pytest.raises(InvalidArgument, match="name"):
        ledger.register(name, "vllm")
    assert ledger.rows() == []


def test_names_are_unique_among_live_instances(ledger: Ledger) -> None:
    a = ledger.register("model/llama-3:8b", "vllm")
    with pytest.raises(InvalidArgument, match="already registered"):
        ledger.register("model/llama-3:8b", "sglang")
    a.close()
    ledger.register("model/llama-3:8b", "sglang")


def test_malformed_limit_is_invalid(ledger: Ledger) -> None:
    with pytest.raises(InvalidArgument, match="limit"):
        ledger.register("a", "vllm", limit=-5)
    a = ledger.register("a", "vllm")
    for bad in (-1, 2.5, "1GiB"):
        with pytest.raises(InvalidArgument, match="limit"):
            ledger.set_limit("a", bad)  # type: ignore[arg-type]
    assert a.limit is None


def test_close_removes_the_row_and_ends_the_account(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(MiB)
    a.close()
    a.close()  # idempotent
    assert ledger.rows() == []
    assert ledger.totals().reserved == 0
    with pytest.raises(LedgerError, match="closed"):
        a.try_charge(1)


def test_closing_the_ledger_closes_its_accounts(folder: Path) -> None:
    first = Ledger.open("host-cpu", budget=MiB)
    account = first.register("a", "vllm")
    with Ledger.open("host-cpu") as observer:
        assert len(observer.rows()) == 1
        first.close()
        assert observer.rows() == []
    assert account.closed
    with pytest.raises(LedgerError, match="closed"):
        first.totals()


def test_ledger_fills_up_with_a_clear_error(ledger: Ledger) -> None:
    for i in range(ledger.capacity):
        ledger.register(f"i{i}", "test")
    with pytest.raises(LedgerError, match="full"):
        ledger.register("one-too-many", "test")


# -------------------------------------------------------------- limits and budget
def test_limit_below_current_use_is_accepted_and_reported(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(30 * MiB)
    change = ledger.set_limit("a", 20 * MiB)
    assert (change.limit, change.previous, change.reserved) == (20 * MiB, None, 30 * MiB)
    assert change.over_by == 10 * MiB
    assert a.limit == 20 * MiB  # the allocator sees it at once
    assert not a.try_charge(1)  # it stops growing
    row = ledger.rows()[0]
    assert row.over_limit == 10 * MiB
    a.refund(15 * MiB)  # ... and shrinks towards the limit
    assert a.try_charge(5 * MiB)
    assert not a.try_charge(1)
    assert ledger.set_limit("a", None).over_by == 0
    assert a.limit is None and a.try_charge(MiB)


def test_limit_of_unknown_instance_names_the_known_ones(ledger: Ledger) -> None:
    ledger.register("alpha", "vllm")
    with pytest.raises(InvalidArgument, match=r"no instance named 'beta'.*alpha"):
        ledger.set_limit("beta", MiB)


def test_budget_below_current_use_is_accepted_and_reported(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(60 * MiB)
    change = ledger.set_budget(50 * MiB)
    assert (change.budget, change.previous, change.over_by) == (50 * MiB, 100 * MiB, 10 * MiB)
    assert ledger.budget == 50 * MiB
    assert not a.try_charge(1)
    a.refund(20 * MiB)
    assert a.try_charge(10 * MiB)
    assert not a.try_charge(1)
    with pytest.raises(InvalidArgument):
        ledger.set_budget(0)


# ------------------------------------------------------------------ dead processes
def test_killed_process_is_reclaimed_by_a_charge_that_would_fail(ledger: Ledger) -> None:
    proc = _spawn_holder(ledger.path.parent, "victim", 70 * MiB)
    try:
        survivor = ledger.register("survivor", "vllm")
        assert [r.name for r in ledger.rows(reclaim=False)] == ["victim", "survivor"]
        assert survivor.try_charge(30 * MiB)
        assert not survivor.try_charge(10 * MiB)  # the victim is alive: no reclaim
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert ledger.totals(reclaim=False).reserved == 100 * MiB  # not yet reclaimed
        assert survivor.try_charge(40 * MiB)  # would fail; clears the dead row, then fits
        assert [r.name for r in ledger.rows(reclaim=False)] == ["survivor"]
        assert ledger.totals().reserved == 70 * MiB
        assert survivor.row().denied == 1
    finally:
        proc.kill()
        proc.wait()


def test_killed_process_not_yet_reaped_counts_as_dead(ledger: Ledger) -> None:
    proc = _spawn_holder(ledger.path.parent, "zombie", 10 * MiB)
    os.kill(proc.pid, signal.SIGKILL)
    try:
        _wait_for(lambda: process_start_time(proc.pid) is None, "the killed holder to exit")
        # Not reaped (no proc.wait() yet): a zombie whose every thread has exited.
        assert state(proc.pid) == "Z"
        assert os.listdir(f"/proc/{proc.pid}/task") == [str(proc.pid)]
        assert ledger.rows() == []
    finally:
        proc.wait()


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30  # only against a hang; never asserts a speed
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


_SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())


@pytest.mark.skipif(_SYS_EXIT is None, reason="needs the exit syscall number of this CPU")
def test_reclaim_waits_for_all_threads_of_a_killed_process(ledger: Ledger) -> None:
    # The main thread exits on its own (the exit syscall, not exit_group) while another
    # thread runs on: /proc/<pid>/stat then says "Z", as it does within milliseconds of
    # a SIGKILL while the other threads still hold the process's memory. That row must
    # stay until the last thread is gone.
    code = (
        "import ctypes, os, sys, threading\n"
        "from kvcached.ledger import Ledger\n"
        f"l = Ledger.open('host-cpu', directory={str(ledger.path.parent)!r})\n"
        "a = l.register('half-dead', 'test')\n"
        f"assert a.try_charge({60 * MiB})\n"
        "def last_thread():\n"
        "    sys.stdin.buffer.read(1)\n"
        "    os._exit(0)\n"
        "threading.Thread(target=last_thread).start()\n"
        "print('ready', flush=True)\n"
        f"ctypes.CDLL(None).syscall({_SYS_EXIT}, 0)  # ends this thread only\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"ready"
        _wait_for(lambda: state(proc.pid) == "Z", "the main thread to become a zombie")
        assert process_start_time(proc.pid) is not None  # a thread is left: alive
        assert ledger.reclaim_dead() == 0
        other = ledger.register("other", "test")
        assert not other.try_charge(50 * MiB)  # a failing charge does not reclaim it
        assert [r.name for r in ledger.rows()] == ["half-dead", "other"]

        proc.stdin.write(b"x")  # the last thread exits; nothing reaps the process yet
        proc.stdin.flush()
        _wait_for(lambda: process_start_time(proc.pid) is None, "the last thread to exit")
        assert os.path.exists(f"/proc/{proc.pid}")
        assert other.try_charge(50 * MiB)  # now it is reclaimed
        assert [r.name for r in ledger.rows()] == ["other"]
    finally:
        proc.kill()
        proc.wait()


def test_process_start_time_of_a_thread_group_counts_live_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The liveness rule on its own: a zombie leader is alive while any task runs.
    pid = os.getpid()
    monkeypatch.setattr(liveness, "_EXITED", (b"Z", b"X", b"x", b"R", b"S"))
    monkeypatch.setattr(liveness, "_has_running_thread", lambda _pid: True)
    assert process_start_time(pid) is not None
    monkeypatch.setattr(liveness, "_has_running_thread", lambda _pid: False)
    assert process_start_time(pid) is None


def test_reused_pid_is_not_mistaken_for_the_old_process(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(MiB)
    # Forge a row with our own (live) pid but another start time: a reused pid.
    ghost = liveness._Identity(os.getpid(), a._start - 1, liveness._pid_namespace())
    b = ledger.register("ghost", "vllm")
    with ledger._locked() as mm:
        struct.pack_into(
            "<IxxxxQ", mm, HEADER_SIZE + b.index * ROW_SIZE, ghost.pid, ghost.start_time
        )
    assert ledger.reclaim_dead() == 1
    assert [r.name for r in ledger.rows()] == ["a"]
    assert not b.try_charge(1)  # the row is no longer b's: refused, not raised
    assert b.lost
    with pytest.raises(LedgerError, match="no longer belongs"):
        b.row()


def test_a_dead_row_taken_again_before_reclaim_clears_it_is_left_alone(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reclaim judges rows outside the lock (the /proc reads are slow), then clears them
    # under it: a row it saw dead may have been forgotten and registered again meanwhile.
    ghost = ledger.register("ghost", "vllm")
    with ledger._locked() as mm:  # a reused pid, as above: the row's process is dead
        struct.pack_into(
            "<IxxxxQ", mm, HEADER_SIZE + ghost.index * ROW_SIZE, os.getpid(), ghost._start - 1
        )
    real_alive = liveness._alive
    raced: list[bool] = []
    newcomer: list[Any] = []

    def judged_while_the_row_is_reused(pid: int, start_time: int) -> bool:
        if not raced:  # meanwhile, elsewhere: kvctl forget, then a new instance
            raced.append(True)
            ledger.forget("ghost", force=True)
            newcomer.append(ledger.register("newcomer", "sglang"))
        return real_alive(pid, start_time)

    monkeypatch.setattr(liveness, "_alive", judged_while_the_row_is_reused)
    assert ledger.reclaim_dead() == 0
    (account,) = newcomer
    assert account.index == ghost.index  # the very row reclaim saw dead
    assert [r.name for r in ledger.rows()] == ["newcomer"]
    assert account.try_charge(MiB) and not account.lost


def test_rows_of_another_pid_namespace_are_left_alone(ledger: Ledger) -> None:
    a = ledger.register("other-ns", "vllm")
    assert a.try_charge(MiB)
    with ledger._locked() as mm:
        offset = HEADER_SIZE + a.index * ROW_SIZE
        struct.pack_into("<IxxxxQQ", mm, offset, 999_999, 1, 12345)  # unknown pid, other ns
    assert ledger.reclaim_dead() == 0
    assert [r.name for r in ledger.rows()] == ["other-ns"]
    with pytest.raises(InvalidArgument, match="another pid namespace"):
        ledger.forget("other-ns")
    row = ledger.forget("other-ns", force=True)
    assert (row.reserved, row.pid_namespace) == (MiB, 12345)
    assert ledger.rows() == []


def test_forget_refuses_a_live_process_unless_forced(ledger: Ledger) -> None:
    a = ledger.register("alive", "vllm")
    with pytest.raises(InvalidArgument, match="alive"):
        ledger.forget("alive")
    ledger.forget("alive", force=True)
    assert ledger.rows() == []
    a.refund(0)  # harmless once forgotten (see the tests of forgotten live instances)
    assert a.lost


def test_rows_of_a_previous_boot_are_cleared_on_open(ledger: Ledger) -> None:
    a = ledger.register("before-reboot", "vllm")
    assert a.try_charge(MiB)
    with ledger._locked() as mm:
        mm[32:48] = b"\x01" * 16  # another boot id
    with Ledger.open("host-cpu") as after:
        assert after.rows(reclaim=False) == []
    assert ledger.path.read_bytes()[32:48] == liveness._boot_id()


def test_process_start_time_reads_field_22() -> None:
    with open(f"/proc/{os.getpid()}/stat") as f:
        text = f.read()
    expected = int(text[text.rfind(")") + 2 :].split()[19])
    assert process_start_time(os.getpid()) == expected
    assert process_start_time(2**22 + 12345) is None


# --------------------------------------------------------------- threads and forks
def test_threads_of_one_process_never_overcommit(ledger: Ledger) -> None:
    accounts = [ledger.register(f"t{i}", "test") for i in range(2)]
    held = [0] * 4  # per thread; threads 0 and 2 share account 0, 1 and 3 account 1
    overs: list[int] = []

    def work(i: int) -> None:
        account = accounts[i % 2]
        for n in range(3000):
            if n % 3 != 2 and account.try_charge(7 * MiB):
                held[i] += 7 * MiB
            elif held[i]:
                account.refund(7 * MiB)
                held[i] -= 7 * MiB

    def sample(stop: threading.Event) -> None:
        while not stop.is_set():
            total = ledger.totals(reclaim=False).reserved
            if total > 100 * MiB:
                overs.append(total)

    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,))
    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside critical sections too
    try:
        sampler.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        stop.set()
        sampler.join()
        sys.setswitchinterval(interval)
    assert overs == []
    assert [a.reserved for a in accounts] == [held[0] + held[2], held[1] + held[3]]
    assert ledger.totals().reserved == sum(held)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_must_register_its_own_instance(ledger: Ledger) -> None:
    parent = ledger.register("parent", "vllm")
    assert parent.try_charge(MiB)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            try:
                parent.try_charge(1)
            except LedgerError:
                child = ledger.register("child", "vllm")
                if child.try_charge(2 * MiB) and ledger.totals().reserved == 3 * MiB:
                    code = 0
                    # The child's flock must exclude the parent's: hold it while the
                    # parent tries to take it.
                    with ledger._locked():
                        os.write(write, b"x")
                        time.sleep(0.3)
                child.close()
        finally:
            os._exit(code)
    os.close(write)
    assert os.read(read, 1) == b"x"
    started = time.monotonic()
    parent.refund(0)  # blocks until the child releases the lock
    assert time.monotonic() - started > 0.1
    _, status = os.waitpid(pid, 0)
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [r.name for r in ledger.rows()] == ["parent"]
    assert parent.reserved == MiB


# ------------------------------------------------------------------ keys and settings
def test_ledger_keys() -> None:
    assert ledger_key("cuda", 0) == "cuda-0"
    assert ledger_key("cuda", "cuda:1") == "cuda-1"
    assert ledger_key("host", "cpu") == "host-cpu"
    with pytest.raises(InvalidArgument):
        ledger_key("cuda", "../0")


def test_default_key_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    reload_settings()
    assert default_key() == "host-cpu"
    assert default_key("host", 3) == "host-3"


def test_existing_keys(folder: Path) -> None:
    assert existing_keys() == []
    Ledger.open("cuda-1", budget=MiB).close()
    Ledger.open("cuda-0", budget=MiB).close()
    (folder / "kvcached-other.ledger").write_bytes(b"")
    assert existing_keys() == ["cuda-0", "cuda-1"]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("KVCACHED_LEDGER_DIR", "relative/dir", "KVCACHED_LEDGER_DIR"),
        ("KVCACHED_METRICS_PORT", "eighty", "KVCACHED_METRICS_PORT"),
        ("KVCACHED_METRICS_PORT", "70000", "KVCACHED_METRICS_PORT"),
        ("KVCACHED_METRICS_PORT", "-1", "KVCACHED_METRICS_PORT"),
    ],
)
def test_malformed_environment_is_named(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    reload_settings()
    with pytest.raises(InvalidArgument, match=message):
        settings()
    if variable == "KVCACHED_LEDGER_DIR":
        with pytest.raises(KVCachedError):
            Ledger.open("host-cpu", budget=MiB)


def test_missing_ledger_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="not usable"):
        Ledger.open("host-cpu", budget=MiB, directory=tmp_path / "nope")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_ledger_folder_is_a_clear_error(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(LedgerError, match="cannot create a ledger"):
            Ledger.open("host-cpu", budget=MiB, directory=tmp_path)
    finally:
        os.chmod(tmp_path, 0o700)


# ------------------------------------------------- a live instance forgotten by hand
def test_forgotten_live_account_refuses_charges_instead_of_raising(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(10 * MiB)
    a.set_used(MiB)
    with Ledger.open("host-cpu") as kvctl_side:
        kvctl_side.forget("a", force=True)
    with caplog.at_level(logging.WARNING, logger="kvcached.ledger"):
        assert not a.try_charge(MiB)
        assert not a.try_charge(0)
        assert a.lost
        assert a.limit == 10 * MiB  # what it still holds: it grows no more
        a.set_used(2 * MiB)
        a.refund(4 * MiB)
        assert (a.reserved, a.used, a.limit) == (6 * MiB, 2 * MiB, 6 * MiB)
        with pytest.raises(InvalidArgument, match="more than"):
            a.refund(7 * MiB)
        a.refund(6 * MiB)
        a.close()
    warnings = [r for r in caplog.records if "was removed while it runs" in r.getMessage()]
    assert len(warnings) == 1  # said once, not at every call
    assert ledger.rows() == [] and ledger.totals().reserved == 0


def test_refund_to_a_forgotten_row_never_touches_a_row_its_process_registered_again(
    ledger: Ledger,
) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(10 * MiB)
    ledger.forget("a", force=True)
    b = ledger.register("a", "vllm")  # same process, same name, the same free row
    assert b.index == a.index
    assert b.try_charge(3 * MiB)
    a.refund(10 * MiB)
    assert not a.try_charge(MiB)
    a.set_used(5 * MiB)
    a.close()
    assert (b.reserved, b.used) == (3 * MiB, 0)
    assert [(r.name, r.reserved) for r in ledger.rows()] == [("a", 3 * MiB)]
    assert not b.lost


# ------------------------------------------------------- bytes held by a free row
def _put_bytes_in_free_row(ledger: Ledger, index: int, nbytes: int) -> None:
    with ledger._locked() as mm:
        offset = HEADER_SIZE + index * ROW_SIZE
        assert struct.unpack_from("<I", mm, offset)[0] == 0
        struct.pack_into("<Q", mm, offset + 32, nbytes)


def test_bytes_in_a_free_row_are_shown_by_listings_as_charges_see_them(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    _put_bytes_in_free_row(ledger, 5, 100 * MiB)  # the whole budget, charged to nobody
    a = ledger.register("a", "vllm")
    with caplog.at_level(logging.WARNING, logger="kvcached.ledger"):
        assert not a.try_charge(MiB)
    assert any("kvctl repair" in r.getMessage() for r in caplog.records)
    totals, rows = ledger.snapshot()
    assert (totals.instances, totals.reserved, totals.unowned) == (1, 100 * MiB, 100 * MiB)
    assert totals.free == 0  # as the refused charge found
    assert [r.name for r in rows] == ["a"]
    assert ledger.unowned_rows() == {5: 100 * MiB}


def test_repair_clears_bytes_left_in_free_rows(ledger: Ledger) -> None:
    a = ledger.register("a", "vllm")
    assert a.try_charge(MiB)
    _put_bytes_in_free_row(ledger, 63, 99 * MiB)
    assert not a.try_charge(MiB)
    repair = ledger.repair()
    assert (repair.rows, repair.unowned) == ([63], 99 * MiB)
    assert ledger.totals().unowned == 0
    assert a.try_charge(99 * MiB)
    assert a.reserved == 100 * MiB  # a's own row was left alone
    assert ledger.repair() == ledger_module.Repair(rows=[], unowned=0)


def test_clearing_a_row_writes_its_pid_last_so_a_torn_clear_holds_no_free_bytes(
    ledger: Ledger,
) -> None:
    class Recording(bytearray):
        writes: list[slice]

        def __setitem__(self, key: Any, value: Any) -> None:
            self.writes.append(key)
            super().__setitem__(key, value)

    rows = Recording(b"\xff" * (HEADER_SIZE + 3 * ROW_SIZE))
    rows.writes = []
    ledger._clear_row(rows, 2)  # type: ignore[arg-type]
    offset = HEADER_SIZE + 2 * ROW_SIZE
    assert rows[offset : offset + ROW_SIZE] == bytes(ROW_SIZE)
    *counters, pid = rows.writes
    assert (pid.start, pid.stop) == (offset, offset + 4)
    assert all(w.start >= offset + 4 for w in counters) and counters


# ------------------------------------------------------------- every row charges
def test_every_row_charges_against_the_budget_the_last_one_too(ledger: Ledger) -> None:
    share = 100 * MiB // ledger.capacity
    accounts = [ledger.register(f"i{i}", "test") for i in range(ledger.capacity)]
    assert [a.index for a in accounts] == list(range(ledger.capacity))
    for account in accounts:
        assert account.try_charge(share)
    rest = 100 * MiB - share * ledger.capacity
    assert accounts[-1].try_charge(rest)  # the last row fills the budget exactly
    for account in accounts:
        assert not account.try_charge(1)  # ... and every row sees it full
    assert ledger.totals().reserved == 100 * MiB
    accounts[-1].refund(share + rest)
    assert accounts[0].try_charge(share + rest)
    assert not accounts[-1].try_charge(1)


@pytest.mark.parametrize("index", [0, 1, 31, 62, 63])
def test_bytes_held_in_any_single_row_bound_every_other_row(ledger: Ledger, index: int) -> None:
    accounts = [ledger.register(f"i{i}", "test") for i in range(ledger.capacity)]
    assert accounts[index].try_charge(100 * MiB)
    assert not any(a.try_charge(1) for a in accounts)
    assert ledger.totals().reserved == 100 * MiB


# ------------------------------------------------------ the budget of an existing ledger
def test_a_budget_asked_for_an_existing_ledger_is_reported_as_ignored(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcached.ledger"):
        with Ledger.open("host-cpu", budget=5 * MiB, budget_source="KVCACHED_BUDGET=5MiB"):
            pass
        with Ledger.open("host-cpu", budget=100 * MiB, budget_source="KVCACHED_BUDGET=100MiB"):
            pass  # the same budget: nothing to say
        with Ledger.open("host-cpu", budget=5 * MiB):
            pass  # not chosen by the user: nothing to say
    (record,) = caplog.records
    message = record.getMessage()
    assert "KVCACHED_BUDGET=5MiB is ignored" in message
    assert "budget of 0.10 GiB (104857600 bytes)" in message
    assert "kvctl budget" in message
    assert ledger.budget == 100 * MiB


def test_open_says_whether_it_created_the_ledger(folder: Path) -> None:
    with Ledger.open("host-cpu", budget=MiB) as first, Ledger.open("host-cpu") as second:
        assert first.created and not second.created


# --------------------------------------------------- where ledgers are, and squatters
def test_relative_ledger_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    with Ledger.open("host-cpu", budget=MiB, directory="rel") as opened:
        assert opened.path == tmp_path / "rel" / opened.path.name
        monkeypatch.chdir("/")
        assert opened.register("a", "test").try_charge(1)
        assert ledger_module.existing_keys(tmp_path / "rel") == ["host-cpu"]


def _private_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    return path


def test_default_folder_is_the_users_runtime_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCACHED_LEDGER_DIR", raising=False)
    monkeypatch.setattr(placement, "_RUN_USER", tmp_path / "no-run-user")
    runtime = _private_dir(tmp_path / "runtime")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    reload_settings()
    assert ledger_module.ledger_dir() == runtime
    assert ledger_path("cuda-0").parent == runtime


@pytest.mark.parametrize("problem", ["open to others", "a symlink", "relative", "missing"])
def test_runtime_directory_others_could_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    monkeypatch.delenv("KVCACHED_LEDGER_DIR", raising=False)
    run_user = _private_dir(tmp_path / "run-user")
    fallback = _private_dir(run_user / str(os.geteuid()))
    if problem == "open to others":
        runtime = str(_private_dir(tmp_path / "runtime", 0o755))
    elif problem == "a symlink":
        (tmp_path / "link").symlink_to(_private_dir(tmp_path / "real"))
        runtime = str(tmp_path / "link")
    elif problem == "relative":
        runtime = "runtime"
    else:
        runtime = str(tmp_path / "missing")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    monkeypatch.setattr(placement, "_RUN_USER", run_user)
    reload_settings()
    assert ledger_module.ledger_dir() == fallback  # /run/user/<uid>, owned and private
    os.chmod(fallback, 0o755)
    assert ledger_module.ledger_dir() in (Path("/dev/shm"), Path(tempfile.gettempdir()))


def test_directory_pre_created_at_the_ledger_path_is_a_clear_error(folder: Path) -> None:
    ledger_path("host-cpu").mkdir()
    with pytest.raises(LedgerError, match=r"is a directory.*nothing was changed") as caught:
        Ledger.open("host-cpu", budget=MiB)
    assert "KVCACHED_LEDGER_DIR" in str(caught.value)
    assert ledger_path("host-cpu").is_dir()


def test_symlink_pre_created_at_the_ledger_path_names_it_and_the_way_out(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    target = tmp_path_factory.mktemp("elsewhere") / "victim"
    target.write_bytes(b"precious")
    ledger_path("host-cpu").symlink_to(target)
    with pytest.raises(LedgerError, match=r"symbolic link to .*victim") as caught:
        Ledger.open("host-cpu", budget=MiB)
    assert "KVCACHED_LEDGER_DIR" in str(caught.value)
    assert target.read_bytes() == b"precious"


def test_file_pre_created_by_another_user_names_them_and_the_way_out(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = ledger_path("host-cpu")
    path.write_bytes(b"")  # empty, as a squatter's `touch` leaves it
    os.chmod(path, 0o600)
    real_fstat = os.fstat

    def fstat_as_if_foreign(fd: int) -> os.stat_result:
        info = list(real_fstat(fd))
        info[stat.ST_UID] = os.geteuid() + 1
        return os.stat_result(info)

    monkeypatch.setattr(ledger_files.os, "fstat", fstat_as_if_foreign)
    with pytest.raises(LedgerError, match=f"owned by uid {os.geteuid() + 1}") as caught:
        Ledger.open("host-cpu", budget=MiB)
    message = str(caught.value)
    assert "another user" in message and "KVCACHED_LEDGER_DIR" in message
    assert path.read_bytes() == b""


def test_a_full_ledger_says_how_to_free_a_row(ledger: Ledger) -> None:
    """The 65th instance got "ledger is full: 64" and no way out."""
    for i in range(ledger.capacity):
        ledger.register(f"i{i}", "test")
    with pytest.raises(LedgerError) as full:
        ledger.register("one-too-many", "test")
    message = str(full.value)
    assert "Close an instance" in message and "kvctl forget NAME" in message
    assert "kvctl list --key host-cpu" in message


# ------------------------------------------- charge and refund: what mutation testing found
def test_a_bad_charge_or_refund_amount_says_what_is_accepted(ledger: Ledger) -> None:
    account = ledger.register("amounts", "test")
    with pytest.raises(InvalidArgument, match=r"charge must be a non-negative int, got -1"):
        account.try_charge(-1)
    with pytest.raises(InvalidArgument, match=r"refund must be a non-negative int, got 1\.5"):
        account.refund(1.5)  # type: ignore[arg-type]


def test_an_over_refund_names_both_amounts_and_changes_nothing(ledger: Ledger) -> None:
    account = ledger.register("over", "test")
    assert account.try_charge(10)
    with pytest.raises(InvalidArgument, match=r"refund of 12 bytes is more than the 10 bytes"):
        account.refund(12)
    assert account.reserved == 10
    ledger.forget("over", force=True)  # the row is lost: this process's own count is checked
    with pytest.raises(InvalidArgument, match=r"refund of 11 bytes is more than the 10 bytes"):
        account.refund(11)


def test_a_lost_row_keeps_counting_from_what_its_refunds_left(ledger: Ledger) -> None:
    account = ledger.register("counted", "test")
    assert account.try_charge(100)
    account.refund(30)
    ledger.forget("counted", force=True)
    account.refund(0)  # the next touch finds the row gone
    assert account.lost
    assert account.reserved == 70  # the row's last figure, kept by the refund
    account.refund(70)
    assert account.reserved == 0
