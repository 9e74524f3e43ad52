"""kvctl, kvtop and the Prometheus endpoint, against a real ledger in a temporary folder."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvcached.apps.kvctl import app as kvctl
from kvcached.apps.kvtop import app as kvtop
from kvcached.apps.kvtop import frame, usage_bar
from kvcached.apps.ledger_view import format_bytes, format_bytes_short
from kvcached.config import reload_settings
from kvcached.ledger import HEADER_SIZE, ROW_SIZE, Ledger, LedgerAccount, ledger_path

MiB = 1 << 20
GiB = 1 << 30
runner = CliRunner()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    monkeypatch.setenv("COLUMNS", "120")
    reload_settings()
    return tmp_path


@pytest.fixture
def ledger(folder: Path) -> Iterator[Ledger]:
    with Ledger.open("host-cpu", budget=8 * GiB) as opened:
        yield opened


@pytest.fixture
def instances(ledger: Ledger) -> tuple[LedgerAccount, LedgerAccount]:
    a = ledger.register("vllm-a", "vllm")
    assert a.try_charge(3 * GiB)
    a.set_used(2 * GiB)
    b = ledger.register("sglang-b", "sglang", limit=2 * GiB)
    assert b.try_charge(GiB)
    return a, b


# ------------------------------------------------------------------------ kvctl list
def test_list_json_reports_every_instance(instances: object, ledger: Ledger) -> None:
    result = runner.invoke(kvctl, ["list", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["key"] == "host-cpu"
    assert report["path"] == str(ledger.path)
    assert (report["budget"], report["reserved"], report["free"]) == (8 * GiB, 4 * GiB, 4 * GiB)
    rows = {row["name"]: row for row in report["instances"]}
    assert rows["vllm-a"]["used"] == 2 * GiB and rows["vllm-a"]["limit"] is None
    assert rows["sglang-b"]["reserved"] == GiB and rows["sglang-b"]["limit"] == 2 * GiB
    assert rows["vllm-a"]["pid"] == os.getpid()


def test_list_table(instances: object) -> None:
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "2 instances, 4.00 GiB of 8.00 GiB reserved (50%), 2.00 GiB used" in lines[0]
    assert lines[1].split()[:3] == ["NAME", "ENGINE", "PID"]
    assert lines[2].split()[:5] == ["vllm-a", "vllm", str(os.getpid()), "2.00", "GiB"]


def test_list_by_explicit_key_and_folder(tmp_path: Path) -> None:
    with Ledger.open("cuda-3", budget=GiB, directory=tmp_path) as other:
        other.register("x", "vllm")
        result = runner.invoke(
            kvctl, ["list", "--json", "--key", "cuda-3", "--ledger-dir", str(tmp_path)]
        )
        assert result.exit_code == 0, result.output
        assert [r["name"] for r in json.loads(result.stdout)["instances"]] == ["x"]
        result = runner.invoke(
            kvctl,
            ["list", "--backend", "cuda", "--device", "3", "--ledger-dir", str(tmp_path)],
        )
        # cuda is not available here: a clear error, not a traceback
        assert result.exit_code == 1
        assert "cuda" in result.stderr and "Traceback" not in result.output


def test_list_without_a_ledger_is_a_clear_error(folder: Path) -> None:
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1
    assert "no kvcached ledger for 'host-cpu'" in result.stderr
    assert not list(folder.iterdir())  # listing never creates a ledger


def test_key_and_backend_together_are_refused(ledger: Ledger) -> None:
    result = runner.invoke(kvctl, ["list", "--key", "host-cpu", "--backend", "host"])
    assert result.exit_code == 1
    assert "either --key or --backend" in result.stderr


def test_corrupted_ledger_is_reported_not_crashed_on(folder: Path) -> None:
    path = ledger_path("host-cpu")
    path.write_bytes(b"garbage" * 100)
    os.chmod(path, 0o600)
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1
    assert "not a kvcached ledger" in result.stderr
    assert path.read_bytes() == b"garbage" * 100


# ----------------------------------------------------------------------- kvctl limit
def test_limit_by_size(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    a, _ = instances
    result = runner.invoke(kvctl, ["limit", "vllm-a", "4GiB"])
    assert result.exit_code == 0, result.output
    assert "vllm-a: limit 4.00 GiB (50% of the budget), was -" in result.stdout
    assert a.limit == 4 * GiB
    assert result.stderr == ""


def test_limit_by_percent_of_the_budget(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    _, b = instances
    result = runner.invoke(kvctl, ["limit", "sglang-b", "25%"])
    assert result.exit_code == 0, result.output
    assert b.limit == 2 * GiB


def test_limit_below_use_warns(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    a, _ = instances
    result = runner.invoke(kvctl, ["limit", "vllm-a", "1GiB"])
    assert result.exit_code == 0, result.output
    assert a.limit == GiB
    assert "holds 3.00 GiB, 2.00 GiB above its new limit" in " ".join(result.stderr.split())
    assert not a.try_charge(1)
    listing = runner.invoke(kvctl, ["list"])
    assert "vllm-a is 2.00 GiB over its limit" in listing.stdout


def test_limit_none_removes_it(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    _, b = instances
    result = runner.invoke(kvctl, ["limit", "sglang-b", "none"])
    assert result.exit_code == 0, result.output
    assert b.limit is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["vllm-a", "lots"], "is not a size"),
        (["vllm-a", "150%"], "percentage must be in"),
        (["vllm-a", "1.5.5GiB"], "is not a size"),
        (["--", "vllm-a", "-3GiB"], "is negative"),
        (["vllm-a", "-3GiB"], "is negative"),
    ],
)
def test_limit_rejects_malformed_sizes(
    instances: tuple[LedgerAccount, LedgerAccount], args: list[str], message: str
) -> None:
    a, _ = instances
    result = runner.invoke(kvctl, ["limit", *args])
    assert result.exit_code == 1, result.output
    assert message in result.stderr
    assert a.limit is None


def test_limit_of_unknown_instance(instances: object) -> None:
    result = runner.invoke(kvctl, ["limit", "nobody", "1GiB"])
    assert result.exit_code == 1
    assert "no instance named 'nobody'" in result.stderr
    assert "sglang-b, vllm-a" in result.stderr


# ---------------------------------------------------------------------- kvctl budget
def test_budget_show_and_set(instances: object, ledger: Ledger) -> None:
    shown = runner.invoke(kvctl, ["budget"])
    assert shown.exit_code == 0
    assert "4.00 GiB of 8.00 GiB reserved" in shown.stdout
    result = runner.invoke(kvctl, ["budget", "16GiB"])
    assert result.exit_code == 0, result.output
    assert "budget 16.0 GiB, was 8.00 GiB" in result.stdout
    assert ledger.budget == 16 * GiB


def test_budget_below_use_warns(instances: object, ledger: Ledger) -> None:
    result = runner.invoke(kvctl, ["budget", "3GiB"])
    assert result.exit_code == 0, result.output
    assert "1.00 GiB above the new budget" in " ".join(result.stderr.split())
    assert ledger.budget == 3 * GiB


def test_budget_creates_a_missing_ledger(folder: Path) -> None:
    result = runner.invoke(kvctl, ["budget", "2GiB"])
    assert result.exit_code == 0, result.output
    with Ledger.open("host-cpu", create=False) as created:
        assert created.budget == 2 * GiB


@pytest.mark.parametrize("size", ["nonsense", "0", "50%"])
def test_budget_rejects_malformed_sizes(folder: Path, size: str) -> None:
    result = runner.invoke(kvctl, ["budget", size])
    assert result.exit_code == 1
    assert "budget" in result.stderr
    assert not list(folder.iterdir())


def test_malformed_environment_is_reported(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", "not/absolute")
    reload_settings()
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1
    assert "KVCACHED_LEDGER_DIR" in result.stderr


# ------------------------------------------------------------ watch, forget, kvtop
def test_watch_refreshes(instances: object) -> None:
    result = runner.invoke(kvctl, ["watch", "--count", "2", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    assert "vllm-a" in result.stdout and "sglang-b" in result.stdout


def test_forget_refuses_a_live_instance(instances: object, ledger: Ledger) -> None:
    result = runner.invoke(kvctl, ["forget", "vllm-a"])
    assert result.exit_code == 1
    assert "alive" in result.stderr
    result = runner.invoke(kvctl, ["forget", "vllm-a", "--force"])
    assert result.exit_code == 0
    assert [r.name for r in ledger.rows()] == ["sglang-b"]


def test_forget_force_of_a_live_instance_warns_that_its_bytes_leave_the_budget(
    instances: tuple[LedgerAccount, LedgerAccount], ledger: Ledger
) -> None:
    result = runner.invoke(kvctl, ["forget", "vllm-a", "--force"])
    assert result.exit_code == 0, result.output
    warning = " ".join(result.stderr.split())
    assert f"pid {os.getpid()} is still running: vllm-a keeps the 3.00 GiB" in warning
    assert "takes no more memory" in warning
    a, _ = instances
    assert not a.try_charge(1) and a.lost  # as the warning says


def test_kvtop_once_draws_bars(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    result = runner.invoke(kvtop, ["--once"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "host-cpu: 2 instances, 4.00 GiB of 8.00 GiB reserved (50%)" in out
    vllm = next(line for line in out.splitlines() if line.startswith("vllm-a"))
    sglang = next(line for line in out.splitlines() if line.startswith("sglang-b"))
    assert "█" in vllm and "▒" in vllm and "│" not in vllm  # no limit
    assert "│" in sglang  # its limit is drawn
    assert vllm.count("█") > sglang.count("█")


def test_kvtop_without_ledger(folder: Path) -> None:
    result = runner.invoke(kvtop, ["--once"])
    assert result.exit_code == 1
    assert "no kvcached ledger" in result.stderr


def test_usage_bar_cells() -> None:
    bar = usage_bar(used=25, reserved=50, limit=75, scale=100, width=8)
    assert bar.plain == "██▒▒··│·"
    over = usage_bar(used=50, reserved=100, limit=25, scale=100, width=4)
    assert over.plain == "█│▒▒"


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(512 * MiB) == "512 MiB"
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(int(12.5 * GiB)) == "12.5 GiB"
    assert format_bytes(None) == "-"


# ------------------------------------------------------------------------- metrics
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _get(samples: Samples, metric: str, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def test_metrics_endpoint_serves_gauges(instances: tuple[LedgerAccount, LedgerAccount]) -> None:
    from kvcached.metrics import serve

    server = serve(port=0)
    try:
        assert server.addr == "127.0.0.1"
        samples = _scrape(server.url)
        pid = str(os.getpid())
        a = {"ledger": "host-cpu", "name": "vllm-a", "engine": "vllm", "pid": pid}
        b = {"ledger": "host-cpu", "name": "sglang-b", "engine": "sglang", "pid": pid}
        assert _get(samples, "kvcached_ledger_budget_bytes", ledger="host-cpu") == 8 * GiB
        assert _get(samples, "kvcached_ledger_reserved_bytes", ledger="host-cpu") == 4 * GiB
        assert _get(samples, "kvcached_ledger_used_bytes", ledger="host-cpu") == 2 * GiB
        assert _get(samples, "kvcached_ledger_instances", ledger="host-cpu") == 2
        assert _get(samples, "kvcached_instance_reserved_bytes", **a) == 3 * GiB
        assert _get(samples, "kvcached_instance_used_bytes", **a) == 2 * GiB
        assert _get(samples, "kvcached_instance_peak_reserved_bytes", **a) == 3 * GiB
        assert _get(samples, "kvcached_instance_refused_charges", **a) == 0
        assert _get(samples, "kvcached_instance_limit_bytes", **b) == 2 * GiB
        assert _get(samples, "kvcached_instance_limit_bytes", **a) is None  # no limit: absent
        # Read at scrape time: a change shows at the next scrape.
        instances[1].refund(GiB)
        assert _get(_scrape(server.url), "kvcached_instance_reserved_bytes", **b) == 0
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_metrics_start_from_settings(instances: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached.metrics import start_from_settings

    assert start_from_settings() is None  # KVCACHED_METRICS_PORT unset
    port = _free_port()
    monkeypatch.setenv("KVCACHED_METRICS_PORT", str(port))
    reload_settings()
    first = start_from_settings()
    assert first is not None
    try:
        assert first.port == port
        assert start_from_settings() is None  # the port is taken: another process serves it
        budget = _get(_scrape(first.url), "kvcached_ledger_budget_bytes", ledger="host-cpu")
        assert budget == 8 * GiB
    finally:
        first.close()


def test_metrics_skip_missing_ledgers(folder: Path) -> None:
    from kvcached.metrics import serve

    server = serve(["cuda-7"], port=0)
    try:
        assert _scrape(server.url) == {}  # nothing from cuda-7, nothing from other ledgers
    finally:
        server.close()


def test_kvctl_serve_metrics_subprocess(instances: object, folder: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.apps.kvctl", "serve-metrics", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving kvcached metrics of every ledger on http://127.0.0.1:" in line, line + (
            proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        )
        url = line.split(" on ", 1)[1].strip()
        reserved = _get(_scrape(url), "kvcached_ledger_reserved_bytes", ledger="host-cpu")
        assert reserved == 4 * GiB
    finally:
        proc.terminate()
        proc.wait(10)


def test_console_scripts_are_installed() -> None:
    bindir = Path(sys.executable).parent
    for script in ("kvctl", "kvtop"):
        result = subprocess.run(
            [str(bindir / script), "--help"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "ledger" in result.stdout


# ------------------------------------------------- limits of 0 and below, relative dirs
@pytest.mark.parametrize("size", ["-1", "-0.5GiB", "-25%"])
def test_limit_minus_one_is_refused_as_negative_not_as_an_unknown_option(
    instances: tuple[LedgerAccount, LedgerAccount], size: str
) -> None:
    a, _ = instances
    result = runner.invoke(kvctl, ["limit", "vllm-a", size])
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert f"limit '{size}' is negative" in message
    assert "'none'" in message and "0 (take no more memory" in message
    assert "No such option" not in result.output
    assert a.limit is None


@pytest.mark.parametrize("size", ["0", "0B", "0GiB"])
def test_limit_zero_is_accepted_as_the_library_accepts_it(
    instances: tuple[LedgerAccount, LedgerAccount], size: str
) -> None:
    a, _ = instances
    result = runner.invoke(kvctl, ["limit", "vllm-a", size])
    assert result.exit_code == 0, result.output
    assert a.limit == 0
    assert not a.try_charge(1)
    assert "takes no more memory" in " ".join(result.stdout.split())


def test_malformed_limit_names_every_accepted_form(
    instances: tuple[LedgerAccount, LedgerAccount],
) -> None:
    result = runner.invoke(kvctl, ["limit", "vllm-a", "lots"])
    message = " ".join(result.stderr.split())
    assert "is not a size" in message and "'none'" in message and "'25%'" in message


def test_relative_ledger_dir_is_taken_from_the_current_directory(
    ledger: Ledger, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder.parent)
    result = runner.invoke(kvctl, ["list", "--json", "--ledger-dir", folder.name])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == str(ledger.path)
    assert Path(json.loads(result.stdout)["path"]).is_absolute()
    missing = runner.invoke(kvctl, ["list", "--ledger-dir", "no-such-dir"])
    assert missing.exit_code == 1
    assert str(folder.parent / "no-such-dir") in " ".join(missing.stderr.split())


# ----------------------------------------------------------- serve-metrics errors
def test_serve_metrics_on_a_port_in_use_is_a_clear_error(ledger: Ledger) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(kvctl, ["serve-metrics", "--port", str(port)])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert f"cannot serve metrics on 127.0.0.1:{port}: port {port} is already in use" in message
    assert "Traceback" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_serve_metrics_on_an_address_not_of_this_machine_is_a_clear_error(
    ledger: Ledger,
) -> None:
    result = runner.invoke(kvctl, ["serve-metrics", "--port", "0", "--addr", "192.0.2.1"])
    assert result.exit_code == 1
    assert "192.0.2.1 is not an address of this machine" in " ".join(result.stderr.split())
    assert isinstance(result.exception, SystemExit)


def test_serve_metrics_on_a_name_that_does_not_resolve_is_a_clear_error(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_such_name(*args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)  # no resolver needed
    result = runner.invoke(kvctl, ["serve-metrics", "--port", "0", "--addr", "metrics.nowhere"])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert "--addr 'metrics.nowhere' is not an address or host name" in message
    assert isinstance(result.exception, SystemExit)


# ------------------------------------------------- names from the file, shown safely
HOSTILE = b"evil[/]\x1b[2J\x1b]0;owned\x07\xe2\x80\xae"


def _rename_row(ledger: Ledger, account: LedgerAccount, raw: bytes) -> None:
    """Write `raw` as the account's name, as anything with write access to the file can."""
    with ledger._locked() as mm:
        offset = HEADER_SIZE + account.index * ROW_SIZE + 72
        mm[offset : offset + 64] = raw.ljust(64, b"\0")


@pytest.mark.parametrize("command", [["list"], ["watch", "--count", "1"], ["budget"]])
def test_hostile_names_in_the_ledger_crash_nothing_and_reach_no_terminal(
    instances: tuple[LedgerAccount, LedgerAccount], ledger: Ledger, command: list[str]
) -> None:
    _rename_row(ledger, instances[0], HOSTILE)
    result = runner.invoke(kvctl, command)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\u202e" not in result.output
    if command[0] != "budget":
        assert "evil[/]\\x1b[2J" in result.stdout  # shown, escaped, not read as markup


def test_hostile_names_are_shown_safely_by_kvtop_and_json(
    instances: tuple[LedgerAccount, LedgerAccount], ledger: Ledger
) -> None:
    _rename_row(ledger, instances[0], HOSTILE)
    top = runner.invoke(kvtop, ["--once"])
    assert top.exit_code == 0, top.output
    assert "\x1b" not in top.output and "evil[/]" in top.stdout
    listing = runner.invoke(kvctl, ["list", "--json"])
    names = [row["name"] for row in json.loads(listing.stdout)["instances"]]
    assert "evil[/]\\x1b[2J\\x1b]0;owned\\x07\\u202e" in names


def test_a_hostile_name_can_be_forgotten_by_the_name_shown(
    instances: tuple[LedgerAccount, LedgerAccount], ledger: Ledger
) -> None:
    _rename_row(ledger, instances[0], b"evil[/]\x1b[2J")
    result = runner.invoke(kvctl, ["forget", "--force", "evil[/]\\x1b[2J"])
    assert result.exit_code == 0, result.output
    assert "evil[/]\\x1b[2J: row of pid" in result.stdout
    unknown = runner.invoke(kvctl, ["limit", "[/]", "1GiB"])
    assert unknown.exit_code == 1
    assert "no instance named '[/]'" in unknown.stderr


# --------------------------------------------------- bytes that free rows still hold
def test_list_shows_bytes_held_by_free_rows_and_repair_clears_them(
    instances: tuple[LedgerAccount, LedgerAccount], ledger: Ledger
) -> None:
    with ledger._locked() as mm:
        mm[HEADER_SIZE + 40 * ROW_SIZE + 32 : HEADER_SIZE + 40 * ROW_SIZE + 40] = (
            4 * GiB
        ).to_bytes(8, "little")
    a, _ = instances
    assert not a.try_charge(1)  # the budget is full of bytes nobody holds
    listing = runner.invoke(kvctl, ["list"])
    assert listing.exit_code == 0, listing.output
    assert "2 instances, 8.00 GiB of 8.00 GiB reserved (100%)" in listing.stdout
    warning = " ".join(listing.stderr.split())
    assert "4.00 GiB of the reserved bytes belong to no instance" in warning
    assert "kvctl repair" in warning
    report = json.loads(runner.invoke(kvctl, ["list", "--json"]).stdout)
    assert (report["reserved"], report["unowned"], report["free"]) == (8 * GiB, 4 * GiB, 0)
    assert "belong to no instance" in runner.invoke(kvtop, ["--once"]).stdout

    repaired = runner.invoke(kvctl, ["repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "cleared free row(s) 40; 4.00 GiB" in " ".join(repaired.stdout.split())
    assert a.try_charge(GiB)
    assert "nothing to repair" in runner.invoke(kvctl, ["repair"]).stdout
    assert runner.invoke(kvctl, ["list"]).stderr == ""


# ------------------------------------------------------------------- kvtop at 80x24
REALISTIC = [f"model-{i:02d}-llama-3.1-8b-instruct" for i in range(30)]


def _render(renderable: object, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


@pytest.mark.parametrize(("width", "height"), [(80, 24), (60, 20), (120, 40)])
def test_kvtop_at_80x24_keeps_realistic_names_whole_and_says_how_many_rows_are_hidden(
    folder: Path, width: int, height: int
) -> None:
    with Ledger.open("cuda-0", budget=140 * GiB) as ledger:
        for i, name in enumerate(REALISTIC):
            account = ledger.register(name, "vllm")
            assert account.try_charge((i + 1) * 30 * MiB)  # 30 MiB .. 900 MiB each
            account.set_used((i + 1) * 10 * MiB)
            if i in (28, 29):  # two over their limit: their notes take lines too
                ledger.set_limit(name, 100 * MiB)
        lines = _render(frame(ledger, width, height), width)
    assert len(lines) <= height
    assert all(len(line) <= width for line in lines)
    if width < 80:
        return  # narrower: names are cut with an ellipsis, but the frame still fits
    notes = [line for line in lines if "over its limit" in line]
    assert len(notes) == 2
    rows = [line for line in lines if line.startswith("model-") and line not in notes]
    assert len(rows) >= 10
    assert rows[0].startswith("model-29-llama-3.1-8b-instruct ")  # largest first, whole
    for row in rows:
        name, rest = row.split(" ", 1)
        assert name in REALISTIC
        assert "█" in rest and "▒" in rest  # sub-GiB on 140 GiB: bars still drawn
    hidden = len(REALISTIC) - len(rows)
    assert (hidden > 0) == (height < 40)  # 30 rows fit in 40 lines, not in 24
    assert any(f"+ {hidden} more not shown" in line for line in lines) == (hidden > 0)


def test_kvtop_once_at_80_columns_shows_whole_names(folder: Path) -> None:
    with Ledger.open("host-cpu", budget=140 * GiB) as ledger:
        accounts = [ledger.register(name, "vllm") for name in REALISTIC[:3]]
        for account in accounts:
            assert account.try_charge(300 * MiB)
        result = runner.invoke(kvtop, ["--once"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert sum(1 for line in lines if line.split(" ")[0] in REALISTIC) == 3


def test_usage_bar_draws_a_cell_for_any_non_zero_amount() -> None:
    bar = usage_bar(used=1, reserved=2, limit=None, scale=1 << 40, width=10)
    assert bar.plain == "█·········"
    assert usage_bar(used=0, reserved=0, limit=None, scale=100, width=4).plain == "····"
    full_limit = usage_bar(used=50, reserved=100, limit=100, scale=100, width=4)
    assert full_limit.plain == "██▒│"  # a limit at the scale is still marked


def test_format_bytes_short_fits_five_characters() -> None:
    assert format_bytes_short(0) == "0B"
    assert format_bytes_short(512 * MiB) == "512M"
    assert format_bytes_short(3 * GiB // 2) == "1.50G"
    assert format_bytes_short(int(12.5 * GiB)) == "12.5G"
    assert format_bytes_short(1023 * MiB) == "1023M"
    assert format_bytes_short(None) == "-"


# ------------------------------------------------------ raw errors at the edges (issue 18.3)
@pytest.mark.parametrize("size", ["-5", "-1GiB", " -0.5GB"])
def test_budget_minus_five_is_refused_as_negative_not_as_an_unknown_option(
    ledger: Ledger, size: str
) -> None:
    """`kvctl budget -5` said "No such option: -5"."""
    result = runner.invoke(kvctl, ["budget", size])
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert f"budget {size!r} is negative" in message and "'20GiB'" in message
    assert "No such option" not in result.output
    assert ledger.budget == 8 * GiB


def test_budget_with_an_unknown_option_says_so(ledger: Ledger) -> None:
    result = runner.invoke(kvctl, ["budget", "--bogus"])
    assert result.exit_code == 1
    assert "no such option: --bogus" in " ".join(result.stderr.split())


def test_forget_names_the_force_flag_as_the_cli_spells_it(instances: object) -> None:
    """`kvctl forget` said "pass force" where the flag is --force."""
    result = runner.invoke(kvctl, ["forget", "vllm-a"])
    assert result.exit_code == 1
    message = " ".join(result.stderr.split())
    assert "'kvctl forget vllm-a --force'" in message and "pass force" not in message


def test_list_finds_the_folders_only_ledger_when_told_nothing(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve-mlx on Linux keeps `mlx-0` where this machine's default is `host-cpu`: a bare
    `kvctl list` shows it instead of saying there is no ledger."""
    monkeypatch.delenv("KVCACHED_BACKEND")
    reload_settings()
    with Ledger.open("mlx-0", budget=GiB) as mlx:
        mlx.register("serve-mlx/qwen", "mlx")
        result = runner.invoke(kvctl, ["list", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["key"] == "mlx-0"
        assert [r["name"] for r in report["instances"]] == ["serve-mlx/qwen"]
        with Ledger.open("cuda-1", budget=GiB):
            result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1
    assert "the ledger folder has cuda-1, mlx-0: pass --key" in result.stderr
    monkeypatch.setenv("KVCACHED_BACKEND", "host")  # told: no guessing
    reload_settings()
    result = runner.invoke(kvctl, ["list"])
    assert result.exit_code == 1 and "no kvcached ledger for 'host-cpu'" in result.stderr
