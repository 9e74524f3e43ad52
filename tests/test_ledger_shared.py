"""Device-wide ledgers shared by a Unix group (KVCACHED_LEDGER_GROUP), and how kvctl
tells a user about other users' instances (Note [Shared ledgers] in kvcached/ledger/placement.py).

A second user is played by `nobody` in a forked child that drops root with setgid and
setuid; it runs on the modules the test process already imported (python itself may
not be readable by nobody)."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import select
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import kvcached.ledger as ledger_module
from kvcached.apps.kvctl import app as kvctl
from kvcached.apps.ledger_view import format_bytes
from kvcached.config import reload_settings, settings
from kvcached.errors import InvalidArgument
from kvcached.ledger import (
    HEADER_SIZE,
    Ledger,
    LedgerError,
    SeparateLedger,
    check_usable,
    ledger_path,
    liveness,
    placement,
    separate_ledgers,
)

MiB = 1 << 20
runner = CliRunner()


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


_NOBODY = _user("nobody")
_DAEMON = _user("daemon")  # a user outside nobody's group, to own things it must not

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: a second user is played by 'nobody' in a child that drops "
        "root with setuid, and files are given to other owners with chown",
    ),
    pytest.mark.skipif(_NOBODY is None, reason="this machine has no 'nobody' user"),
]

NOBODY = _NOBODY.pw_uid if _NOBODY else 65534
GID = _NOBODY.pw_gid if _NOBODY else 65534  # nobody's own group (nogroup on Debian)
GROUP = grp.getgrgid(GID).gr_name if _NOBODY else "nogroup"
SHARED_NAME = "kvcached-shared-host-cpu.ledger"


# ------------------------------------------------------------------- a second user
_kept: list[object] = []  # what a child holds on to until it is released


@dataclasses.dataclass
class Child:
    """A forked child running as another user: `result` is what its work returned (or
    the error it raised); it keeps running, with its ledger rows, until `finish`."""

    pid: int
    results: int
    release: int

    def result(self, timeout: float = 30.0) -> Any:
        ready, _, _ = select.select([self.results], [], [], timeout)
        assert ready, "the child did not answer"
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self.results, 65536)
            assert chunk, "the child exited without an answer"
            data += chunk
        return json.loads(data)

    def finish(self) -> None:
        os.close(self.release)
        os.close(self.results)
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def as_user(uid: int, gid: int, work: Callable[[], object]) -> Child:
    """Run `work` in a forked child as `uid`:`gid` with no supplementary groups. The
    settings are read here first, so that the child imports nothing new (pydantic's
    lazy imports would fail where nobody cannot read python's own files)."""
    reload_settings()
    settings()
    results_r, results_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(results_r)
            os.close(release_w)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                reload_settings()
                answer: dict[str, object] = {"ok": work()}
            except BaseException as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(results_w, (json.dumps(answer) + "\n").encode())
            os.read(release_r, 1)  # hold the rows until the parent is done
        finally:
            os._exit(0)
    os.close(results_w)
    os.close(release_r)
    return Child(pid, results_r, release_w)


def flat(text: str) -> str:
    """Output with every run of white space made one space (rich wraps long lines)."""
    return " ".join(text.split())


# ------------------------------------------------------------------------ folders
@pytest.fixture
def base() -> Iterator[Path]:
    """A folder every user can enter (pytest's tmp_path is root's only)."""
    folder = Path(tempfile.mkdtemp(prefix="kvcached-shared-test-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """monkeypatch, with the settings read again after every change is undone."""
    yield monkeypatch
    monkeypatch.undo()
    reload_settings()


def make_shared_folder(path: Path, *, owner: int = 0, gid: int = GID, mode: int = 0o2770) -> Path:
    path.mkdir()
    os.chown(path, owner, gid)
    path.chmod(mode)
    return path


@pytest.fixture
def shared(base: Path, settings_env: pytest.MonkeyPatch) -> Path:
    """A folder as an administrator makes it for group GROUP ('install -d -m 2770 -g'),
    chosen with KVCACHED_LEDGER_DIR and KVCACHED_LEDGER_GROUP."""
    folder = make_shared_folder(base / "ledgers")
    settings_env.setenv("KVCACHED_LEDGER_DIR", str(folder))
    settings_env.setenv("KVCACHED_LEDGER_GROUP", GROUP)
    settings_env.setenv("KVCACHED_BACKEND", "host")
    settings_env.setenv("COLUMNS", "200")
    reload_settings()
    return folder


def hold(name: str, nbytes: int, budget: int = 100 * MiB) -> Callable[[], object]:
    """Work for a child: open the device's ledger (creating it with `budget`), register
    `name`, try to charge `nbytes`, and keep it all until released."""

    def work() -> object:
        ledger = Ledger.open("host-cpu", budget=budget)
        account = ledger.register(name, "test")
        charged = account.try_charge(nbytes)
        _kept.append((ledger, account))
        return {"created": ledger.created, "charged": charged, "path": str(ledger.path)}

    return work


# ------------------------------------------------------------------ one budget
def test_a_shared_ledger_holds_one_budget_for_two_users(shared: Path) -> None:
    path = shared / SHARED_NAME
    first = as_user(NOBODY, GID, hold("nobody-a", 60 * MiB))
    try:
        assert first.result() == {"ok": {"created": True, "charged": True, "path": str(path)}}
        info = os.stat(path)  # made by a member who is not root: the group's, 0660
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (NOBODY, GID, 0o660)

        with Ledger.open("host-cpu", budget=100 * MiB) as ledger:
            assert not ledger.created and ledger.group == GROUP and ledger.path == path
            mine = ledger.register("root-a", "test")
            assert not mine.try_charge(41 * MiB)  # 60 + 41 > 100, across two users
            assert mine.try_charge(40 * MiB)
            second = as_user(NOBODY, GID, hold("nobody-b", 1))
            try:
                answer = second.result()["ok"]
                assert answer["created"] is False and answer["charged"] is False
                totals, rows = ledger.snapshot()
                assert totals.reserved == totals.budget == 100 * MiB
                assert {row.name: row.uid for row in rows} == {
                    "nobody-a": NOBODY,
                    "nobody-b": NOBODY,
                    "root-a": 0,
                }
                listing = runner.invoke(kvctl, ["list", "--key", "host-cpu"])
                assert listing.exit_code == 0, listing.output
                assert (
                    f"2 instance(s) of other users (uid {NOBODY} (nobody)) hold "
                    f"{format_bytes(60 * MiB)} of this budget, shared with group {GROUP} ({path})"
                ) in flat(listing.stdout)
                rows_json = json.loads(
                    runner.invoke(kvctl, ["list", "--key", "host-cpu", "--json"]).stdout
                )["instances"]
                assert sorted(row["uid"] for row in rows_json) == [0, NOBODY, NOBODY]
            finally:
                second.finish()
        first.finish()
        first = None
        with Ledger.open("host-cpu") as ledger:  # the other user's dead rows are cleared
            assert ledger.rows() == []
            listing = runner.invoke(kvctl, ["list", "--key", "host-cpu"])
            assert f"this budget is shared with group {GROUP}" in flat(listing.stdout)
            assert "no other user's instance holds any now" in flat(listing.stdout)
    finally:
        if first is not None:
            first.finish()


def test_a_member_who_cannot_open_the_shared_file_is_told_why(shared: Path) -> None:
    with Ledger.open("host-cpu", budget=100 * MiB):
        pass
    path = shared / SHARED_NAME
    path.chmod(0o600)  # root's, of the group, but the group may not write it
    child = as_user(NOBODY, GID, hold("nobody-a", MiB))
    try:
        error = child.result()["error"]
        assert error.startswith("LedgerError: shared ledger")
        assert "has mode 0600; a shared ledger must have mode 0660" in error
        assert f"chmod 660 {path}" in error
    finally:
        child.finish()


def test_a_user_outside_the_group_is_refused(shared: Path) -> None:
    users = grp.getgrnam("users").gr_gid if _group("users") else 100
    child = as_user(NOBODY, users, hold("nobody-a", MiB))
    try:
        error = child.result()["error"]
        assert f"is not in group {GROUP}, which KVCACHED_LEDGER_GROUP names" in error
        assert "usermod -aG" in error and "unset KVCACHED_LEDGER_GROUP" in error
    finally:
        child.finish()
    assert list(shared.iterdir()) == []


def _group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


# ------------------------------------------------------------------- refusals
def _no_setgid(folder: Path) -> None:
    folder.chmod(0o770)


def _world(folder: Path) -> None:
    folder.chmod(0o2777)


def _group_readable_only(folder: Path) -> None:
    folder.chmod(0o2750)


def _wrong_group(folder: Path) -> None:
    os.chown(folder, 0, 0)


def _owned_by_outsider(folder: Path) -> None:
    assert _DAEMON is not None
    os.chown(folder, _DAEMON.pw_uid, GID)


def _a_link(folder: Path) -> None:
    real = folder.with_name("real")
    folder.rename(real)
    folder.symlink_to(real)


def _missing(folder: Path) -> None:
    folder.rmdir()


def _a_file(folder: Path) -> None:
    folder.rmdir()
    folder.write_text("")


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (_no_setgid, r"has mode 0770; accepted: 2770 \(read, write and enter"),
        (_world, r"has mode 2777; accepted: 2770 .* or 3770"),
        (_group_readable_only, r"has mode 2750; accepted: 2770"),
        (_wrong_group, rf"belongs to group root \(gid 0\), not to {GROUP}; accepted: a "),
        (_owned_by_outsider, r"is owned by uid \d+ \(daemon\), who is neither root nor a member"),
        (_a_link, r"is a symbolic link to .*real; accepted: the real folder"),
        (_missing, r"does not exist. An administrator creates it once: 'install -d -m 2770 "),
        (_a_file, rf"is not a directory; accepted: a folder of group {GROUP}"),
    ],
)
def test_an_unfit_shared_folder_is_refused(
    shared: Path, spoil: Callable[[Path], None], expected: str
) -> None:
    if spoil is _owned_by_outsider and _DAEMON is None:
        pytest.skip("this machine has no 'daemon' user to own the folder")
    spoil(shared)
    pattern = rf"shared ledger folder {shared} \(KVCACHED_LEDGER_DIR\) {expected}"
    with pytest.raises(LedgerError, match=pattern):
        Ledger.open("host-cpu", budget=100 * MiB)
    with pytest.raises(LedgerError, match=pattern):
        check_usable("host-cpu")
    assert not (shared / SHARED_NAME).exists()


def test_a_sticky_shared_folder_is_accepted(shared: Path) -> None:
    shared.chmod(0o3770)
    with Ledger.open("host-cpu", budget=100 * MiB) as ledger:
        assert ledger.created and ledger.path == shared / SHARED_NAME


def _mode(mode: int) -> Callable[[Path], None]:
    return lambda path: path.chmod(mode)


def _file_of_root_group(path: Path) -> None:
    os.chown(path, 0, 0)


def _file_of_outsider(path: Path) -> None:
    assert _DAEMON is not None
    os.chown(path, _DAEMON.pw_uid, GID)


def _file_link(path: Path) -> None:
    real = path.with_name("elsewhere.ledger")
    path.rename(real)
    path.symlink_to(real)


def _file_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (_mode(0o640), r"has mode 0640; a shared ledger must have mode 0660 \(read and write"),
        (_mode(0o666), r"has mode 0666; a shared ledger must have mode 0660"),
        (_mode(0o600), r"has mode 0600; a shared ledger must have mode 0660"),
        (_mode(0o2660), r"has mode 2660; a shared ledger must have mode 0660"),
        (_file_of_root_group, rf"belongs to group root \(gid 0\), not to {GROUP}; accepted"),
        (_file_of_outsider, r"is owned by uid \d+ \(daemon\), who is neither root nor a member "),
        (_file_link, r"is a symbolic link to .*elsewhere.ledger \(never followed here\), so "),
        (_file_dir, rf"is a directory, so it cannot be the shared ledger of group {GROUP}"),
    ],
)
def test_an_unfit_shared_ledger_file_is_refused_and_left_alone(
    shared: Path, spoil: Callable[[Path], None], expected: str
) -> None:
    if spoil is _file_of_outsider and _DAEMON is None:
        pytest.skip("this machine has no 'daemon' user to own the file")
    with Ledger.open("host-cpu", budget=100 * MiB):
        pass
    path = shared / SHARED_NAME
    before = path.read_bytes()
    spoil(path)
    after = os.lstat(path)
    with pytest.raises(LedgerError, match=expected):
        Ledger.open("host-cpu", budget=100 * MiB)
    with pytest.raises(LedgerError, match=expected):
        check_usable("host-cpu")
    assert os.lstat(path) == after  # nothing was changed
    if path.is_file():
        assert path.read_bytes() == before


def test_a_shared_group_needs_a_folder(settings_env: pytest.MonkeyPatch) -> None:
    settings_env.delenv("KVCACHED_LEDGER_DIR", raising=False)
    settings_env.setenv("KVCACHED_LEDGER_GROUP", GROUP)
    reload_settings()
    with pytest.raises(LedgerError, match=r"needs KVCACHED_LEDGER_DIR: .*install -d -m 2770"):
        Ledger.open("host-cpu", budget=100 * MiB)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("no-such-group-kvcached", "no such group on this machine; accepted: the name of"),
        ("1000", "is not a group name; accepted: the name of an existing Unix group"),
        ("a b", "is not a group name"),
        ("   ", "KVCACHED_LEDGER_GROUP is blank; accepted: the name of an existing"),
    ],
)
def test_a_bad_ledger_group_names_the_variable(
    settings_env: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    settings_env.setenv("KVCACHED_LEDGER_GROUP", value)
    reload_settings()
    with pytest.raises(InvalidArgument, match="KVCACHED_LEDGER_GROUP") as caught:
        settings()
    assert expected in str(caught.value)


# ----------------------------------------------------------------- opt-in off
def test_without_the_group_ledgers_stay_per_user(
    base: Path, settings_env: pytest.MonkeyPatch
) -> None:
    folder = make_shared_folder(base / "ledgers")  # a group folder is no opt-in by itself
    settings_env.setenv("KVCACHED_LEDGER_DIR", str(folder))
    settings_env.delenv("KVCACHED_LEDGER_GROUP", raising=False)
    reload_settings()
    with Ledger.open("host-cpu", budget=100 * MiB) as ledger:
        assert ledger.group is None
        assert ledger.path == folder / f"kvcached-{os.geteuid()}-host-cpu.ledger"
        assert stat.S_IMODE(os.stat(ledger.path).st_mode) == 0o600
        account = ledger.register("a", "test")
        assert account.row().uid == os.geteuid()
    ledger.path.chmod(0o660)  # what a shared ledger has: still refused for a per-user one
    with pytest.raises(LedgerError, match=r"has mode 0660; ledgers must be owner-only \(0600\)"):
        Ledger.open("host-cpu")


def test_a_ledger_of_layout_version_1_is_refused_with_the_way_out(
    base: Path, settings_env: pytest.MonkeyPatch
) -> None:
    settings_env.setenv("KVCACHED_LEDGER_DIR", str(base))
    reload_settings()
    with Ledger.open("host-cpu", budget=100 * MiB):
        pass
    path = ledger_path("host-cpu")
    with open(path, "r+b") as file:
        file.seek(8)
        file.write((1).to_bytes(4, "little"))
    with pytest.raises(LedgerError, match=rf"layout version 1, .* remove the file: 'rm {path}'"):
        Ledger.open("host-cpu")
    assert ledger_module.LAYOUT_VERSION == 2 and os.path.getsize(path) > HEADER_SIZE


# ---------------------------------------------------------- other users' ledgers
@pytest.fixture
def public(base: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder like /dev/shm (anyone may create names; sticky), where other users'
    ledgers are looked for."""
    folder = base / "shm"
    folder.mkdir()
    folder.chmod(0o1777)
    monkeypatch.setattr(placement, "_public_ledger_folders", lambda: [folder])
    return folder


def _per_user_holder(folder: Path, nbytes: int) -> Callable[[], object]:
    def work() -> object:
        os.environ["KVCACHED_LEDGER_DIR"] = str(folder)
        os.environ.pop("KVCACHED_LEDGER_GROUP", None)  # this user did not opt in
        reload_settings()
        return hold("nobody-a", nbytes, budget=50 * MiB)()

    return work


def test_kvctl_list_tells_of_other_users_separate_budgets(
    base: Path, public: Path, settings_env: pytest.MonkeyPatch
) -> None:
    mine = base / "mine"
    mine.mkdir(mode=0o700)
    settings_env.setenv("KVCACHED_LEDGER_DIR", str(mine))
    settings_env.delenv("KVCACHED_LEDGER_GROUP", raising=False)
    settings_env.setenv("COLUMNS", "200")
    reload_settings()
    with Ledger.open("host-cpu", budget=100 * MiB) as ledger:
        ledger.register("root-a", "test")
        alone = runner.invoke(kvctl, ["list", "--key", "host-cpu"])
        assert alone.exit_code == 0 and "separate" not in alone.stdout

        theirs = public / f"kvcached-{NOBODY}-host-cpu.ledger"
        child = as_user(NOBODY, GID, _per_user_holder(public, 10 * MiB))
        try:
            assert child.result()["ok"]["path"] == str(theirs)
            # A name that claims another user's uid but is not theirs does not count.
            (public / "kvcached-4242-host-cpu.ledger").write_bytes(theirs.read_bytes())
            assert separate_ledgers("host-cpu") == [SeparateLedger(theirs, NOBODY, 1, 10 * MiB)]
            listing = flat(runner.invoke(kvctl, ["list", "--key", "host-cpu"]).stdout)
            assert (
                f"1 instance(s) of uid {NOBODY} (nobody) hold {format_bytes(10 * MiB)} on this "
                f"device in a budget separate from this one (ledger: {theirs})"
            ) in listing
            assert "see 'Sharing a device between users' in the README" in listing
        finally:
            child.finish()
        assert separate_ledgers("host-cpu") == [SeparateLedger(theirs, NOBODY, 0, 0)]


def test_another_users_ledger_that_cannot_be_read_is_still_named(
    base: Path, public: Path, settings_env: pytest.MonkeyPatch
) -> None:
    settings_env.setenv("KVCACHED_LEDGER_DIR", str(public))
    reload_settings()
    with Ledger.open("host-cpu", budget=100 * MiB) as ledger:  # root's, 0600
        ledger.register("root-a", "test").try_charge(MiB)
        roots = ledger.path

        def look() -> object:
            return [[o.uid, o.instances] for o in separate_ledgers("host-cpu", base)]

        child = as_user(NOBODY, GID, look)
        try:
            assert child.result() == {"ok": [[0, None]]}
        finally:
            child.finish()
    assert roots.exists()


def test_a_shared_ledger_user_is_told_of_per_user_ledgers_beside_it(
    shared: Path, public: Path
) -> None:
    with Ledger.open("host-cpu", budget=100 * MiB):
        pass
    child = as_user(NOBODY, GID, _per_user_holder(public, 5 * MiB))
    try:
        assert child.result()["ok"]["charged"] is True
        listing = flat(runner.invoke(kvctl, ["list", "--key", "host-cpu"]).stdout)
        assert f"1 instance(s) of uid {NOBODY} (nobody) hold {format_bytes(5 * MiB)}" in listing
        assert "budget separate from this one" in listing
    finally:
        child.finish()


def test_another_users_row_hidden_by_hidepid_stays_while_its_pid_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # /proc mounted with hidepid: another user's /proc/<pid>/stat cannot be read.
    monkeypatch.setattr(liveness, "process_start_time", lambda pid: None)
    monkeypatch.setattr(liveness, "_stat_readable", lambda pid: False)
    assert liveness._row_alive(os.getpid(), 1, NOBODY)  # kill(pid, 0) finds it
    gone = as_user(NOBODY, GID, lambda: None)
    gone.result()
    gone.finish()
    assert not liveness._row_alive(gone.pid, 1, NOBODY)  # reaped: no such process
    assert not liveness._row_alive(os.getpid(), 1, os.geteuid())  # one's own: /proc
