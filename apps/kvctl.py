"""kvctl: read and steer a device's kvcached ledger from the shell.

    kvctl list [--json]            every instance: used, reserved, limit, peak
    kvctl limit NAME 8GiB|25%|0|none  set (or remove) an instance's limit
    kvctl budget [SIZE]            show or set the device budget
    kvctl watch                    the list, refreshed
    kvctl forget NAME [--force]    remove a row the ledger cannot judge dead by itself
    kvctl repair                   fix a damaged ledger file, clear bytes of free rows
    kvctl serve-metrics --port N   Prometheus metrics of every ledger

Which ledger: `--key cuda-0`, or `--backend`/`--device`, else the one an instance started
here would use (KVCACHED_BACKEND or auto-detection, and KVCACHED_DEVICE). Choosing it
never creates a device context. Exit status: 0 on success, 1 on any error, whose
message goes to stderr.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, RenderableType
from rich.markup import escape

from kvcached.apps.ledger_view import (
    fail,
    format_bytes,
    instances_table,
    open_ledger,
    over_limit_notes,
    percent,
    resolve_key,
    summary,
    unowned_note,
)
from kvcached.config import parse_size
from kvcached.errors import InvalidArgument, KVCachedError
from kvcached.ledger import (
    FileRepair,
    InstanceRow,
    Ledger,
    Totals,
    repair_file,
    separate_ledgers,
    user_name,
)

app = typer.Typer(
    add_completion=False,
    rich_markup_mode="markdown",
    no_args_is_help=True,
    help="Inspect and steer the kvcached ledger of a device: instances, limits, budget.",
)
_out = Console()
_err = Console(stderr=True)

KeyOption = Annotated[
    str | None, typer.Option("--key", "-k", help="Ledger key, e.g. cuda-0 or host-cpu.")
]
BackendOption = Annotated[
    str | None, typer.Option(help="Backend of the device (default: KVCACHED_BACKEND or auto).")
]
DeviceOption = Annotated[
    str | None, typer.Option(help="Device ordinal (default: KVCACHED_DEVICE; cpu for host).")
]
DirOption = Annotated[
    Path | None,
    typer.Option(
        help="Ledger folder, relative to the current directory or absolute (default: "
        "KVCACHED_LEDGER_DIR, else your runtime directory, else /dev/shm)."
    ),
]
_NO_LIMIT = ("none", "unlimited", "off")
_ZERO = re.compile(r"^\s*0+(?:\.0+)?\s*(?:[kmgtpe]i?b?|b)?\s*$", re.IGNORECASE)
_LIMITS_ACCEPTED = (
    "a size ('8GiB', '512MiB'), a percentage of the budget ('25%'), 0 (take no more "
    "memory and give pages back as they empty) or 'none' (no limit of its own)"
)


_BUDGETS_ACCEPTED = "a size such as '20GiB', '512MiB' or '1.5GB', or a byte count"
_NEGATIVE = re.compile(r"^\s*-\s*[\d.]")


def refuse_negative(text: str, what: str, accepted: str) -> None:
    """A value that click would take for an unknown option ('-5'), named for what it is.
    The commands that take one accept unknown options as their argument."""
    if _NEGATIVE.match(text):
        raise InvalidArgument(f"{what} {text!r} is negative; accepted: {accepted}")
    if text.strip().startswith("-"):
        raise InvalidArgument(
            f"no such option: {text.strip()} (see --help); a {what} is {accepted}"
        )


def refuse_negative_limit(text: str) -> None:
    refuse_negative(text, "limit", _LIMITS_ACCEPTED)


def parse_limit(text: str, budget: int) -> int | None:
    """The bytes of `kvctl limit`'s SIZE argument; None for 'none'."""
    if text.strip().lower() in _NO_LIMIT:
        return None
    refuse_negative_limit(text)
    if _ZERO.match(text):
        return 0
    try:
        return parse_size(text, total=budget, what="limit")
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc} (kvctl limit accepts {_LIMITS_ACCEPTED})") from None


@app.command("list")
def list_(
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every instance on the device with its used, reserved and limit bytes."""
    with fail(), open_ledger(key, backend, device, ledger_dir) as ledger:
        totals, rows = ledger.snapshot()
        if as_json:
            document = {
                "key": ledger.key,
                "path": str(ledger.path),
                **totals.as_dict(),
                "instances": [row.as_dict() for row in rows],
            }
            typer.echo(json.dumps(document, indent=2))
            return
        _out.print(summary(ledger.key, totals))
        if rows:
            _out.print(instances_table(rows, totals))
            if any(row.over_limit for row in rows):
                _out.print(over_limit_notes(rows))
        _warn_unowned(ledger, totals)
        _note_other_users(ledger, rows, ledger_dir)


def _note_other_users(ledger: Ledger, rows: list[InstanceRow], ledger_dir: Path | None) -> None:
    """Lines under the table on whose instances share this budget (a shared ledger) and
    which other ledgers of the device keep budgets of their own (per-user ledgers of
    other users, or yours beside a shared one): see Note [Shared ledgers] in ledger.py."""
    me = os.geteuid()
    notes = []
    if ledger.group is not None:
        others = [row for row in rows if row.uid != me]
        where = f"shared with group {ledger.group} ({ledger.path})"
        if others:
            users = ", ".join(sorted({user_name(row.uid) for row in others}))
            held = format_bytes(sum(row.reserved for row in others))
            notes.append(
                f"{len(others)} instance(s) of other users ({users}) hold {held} of this "
                f"budget, {where}"
            )
        else:
            notes.append(f"this budget is {where}; no other user's instance holds any now")
    separate = separate_ledgers(ledger.key, ledger_dir)
    for other in separate:
        whose = "of yours" if other.uid == me else f"of {user_name(other.uid)}"
        if other.instances is None:
            notes.append(
                f"a kvcached ledger {whose} for this device, {other.path}, keeps a budget "
                "separate from this one"
            )
        else:
            notes.append(
                f"{other.instances} instance(s) {whose} hold {format_bytes(other.reserved)} "
                f"on this device in a budget separate from this one (ledger: {other.path})"
            )
    if separate:
        notes.append(
            "separate budgets together can overcommit the device: see 'Sharing a device "
            "between users' in the README (KVCACHED_LEDGER_GROUP)"
        )
    for note in notes:
        _out.print(escape(note), highlight=False)


def _warn_unowned(ledger: Ledger, totals: Totals) -> None:
    if totals.unowned:
        _err.print(unowned_note(ledger.key, totals), highlight=False)


@app.command(context_settings={"ignore_unknown_options": True})  # 'limit NAME -1'
def limit(
    name: Annotated[str, typer.Argument(help="Instance name, as kvctl list shows it.")],
    size: Annotated[
        str,
        typer.Argument(
            help="Bytes ('8GiB', '512MiB'), a percentage of the budget ('25%'), 0 (stop "
            "growing, give pages back as they empty), or 'none'."
        ),
    ],
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
) -> None:
    """Set (or remove) an instance's limit.

    Below its current use, the instance stops growing and shrinks towards the limit as
    its pages empty."""
    with fail():
        refuse_negative_limit(size)  # before any ledger is looked for
        with open_ledger(key, backend, device, ledger_dir) as ledger:
            _set_limit(ledger, name, size)


def _set_limit(ledger: Ledger, name: str, size: str) -> None:
    """Apply `kvctl limit` and say what it changed."""
    budget = ledger.budget  # read once: `kvctl budget` may change it meanwhile
    change = ledger.set_limit(name, parse_limit(size, budget))
    shown = escape(name)
    if change.limit is None:
        _out.print(f"{shown}: limit removed (bounded by the device budget only)")
    else:
        _out.print(
            f"{shown}: limit {format_bytes(change.limit)} "
            f"({percent(change.limit, budget)} of the budget), "
            f"was {format_bytes(change.previous)}"
        )
    if change.limit == 0:
        _out.print(
            f"{shown} takes no more memory and gives its pages back as their blocks "
            "are freed; 'kvctl limit NAME none' lets it grow again"
        )
    if change.over_by:
        _err.print(
            f"[yellow]warning:[/] {shown} holds {format_bytes(change.reserved)}, "
            f"{format_bytes(change.over_by)} above its new limit: it stops growing and "
            "releases free pages towards the limit; pages holding live blocks stay "
            "until their requests finish",
            highlight=False,
        )


@app.command(context_settings={"ignore_unknown_options": True})  # 'budget -5'
def budget(
    size: Annotated[
        str | None, typer.Argument(help="New budget ('20GiB'); omit to show the budget.")
    ] = None,
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
) -> None:
    """Show the device budget, or set it (creating the ledger if no instance ran yet)."""
    with fail():
        if size is None:
            with open_ledger(key, backend, device, ledger_dir) as ledger:
                totals = ledger.totals()
                _out.print(summary(ledger.key, totals))
                _warn_unowned(ledger, totals)
            return
        refuse_negative(size, "budget", _BUDGETS_ACCEPTED)
        nbytes = parse_size(size, what="budget")
        with open_ledger(key, backend, device, ledger_dir, create_with=nbytes) as ledger:
            change = ledger.set_budget(nbytes)
            _out.print(
                f"{ledger.key}: budget {format_bytes(change.budget)}, "
                f"was {format_bytes(change.previous)}"
            )
            if change.over_by:
                _err.print(
                    f"[yellow]warning:[/] instances hold {format_bytes(change.reserved)}, "
                    f"{format_bytes(change.over_by)} above the new budget: no instance can "
                    "grow until they release that much",
                    highlight=False,
                )


@app.command()
def watch(
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between refreshes.")] = 1.0,
    count: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many refreshes.")
    ] = None,
) -> None:
    """The list, refreshed every --interval seconds until Ctrl-C."""
    from rich.console import Group
    from rich.live import Live

    def render(ledger: Ledger) -> Group:
        totals, rows = ledger.snapshot()
        parts: list[RenderableType] = [summary(ledger.key, totals)]
        if rows:
            parts.append(instances_table(rows, totals))
        if any(row.over_limit for row in rows):
            parts.append(over_limit_notes(rows))
        if totals.unowned:
            parts.append(unowned_note(ledger.key, totals))
        return Group(*parts)

    with fail(), open_ledger(key, backend, device, ledger_dir) as ledger:
        shown = 1
        with Live(render(ledger), console=_out, auto_refresh=False) as live:
            try:
                while count is None or shown < count:
                    time.sleep(interval)
                    live.update(render(ledger), refresh=True)
                    shown += 1
            except KeyboardInterrupt:
                pass
        if not _out.is_terminal:
            _out.line()


@app.command()
def forget(
    name: Annotated[str, typer.Argument(help="Instance name.")],
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Remove the row even if its process is alive (that instance then takes "
            "no more memory, and what it holds is no longer counted in the budget).",
        ),
    ] = False,
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
) -> None:
    """Remove an instance's row by hand.

    Rows of dead processes are removed automatically; this is for rows written from
    another pid namespace, whose liveness cannot be checked from here."""
    with fail(), open_ledger(key, backend, device, ledger_dir) as ledger:
        row = ledger.forget(name, force=force)
        _out.print(
            f"{escape(name)}: row of pid {row.pid} removed ({format_bytes(row.reserved)} freed)"
        )
        if row.process_alive():
            _err.print(
                f"[yellow]warning:[/] pid {row.pid} is still running: {escape(name)} keeps "
                f"the {format_bytes(row.reserved)} it holds, no longer counted in the "
                "budget, and takes no more memory; restart it to give it a row again",
                highlight=False,
            )


@app.command()
def repair(
    key: KeyOption = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
) -> None:
    """Repair a damaged ledger file; clear bytes that a corrupted ledger charges to free rows.

    A file cut short, zeroed or with a corrupted header gets its full size and a fresh
    header back, keeping its budget and the rows that survived; when its header lost the
    budget too, it is removed, and the next instance (or 'kvctl budget SIZE') creates a
    new one. Bytes in free rows count against the budget though no instance holds them
    (kvctl list warns about them); live instances' rows are left as they are."""
    with fail():
        chosen = resolve_key(key, backend, device)
        fixed = repair_file(chosen, ledger_dir)
        if fixed is not None:
            _report_file_repair(chosen, fixed)
            if fixed.budget is None:
                return
        with Ledger.open(chosen, create=False, directory=ledger_dir) as ledger:
            done = ledger.repair()
        if not done.rows:
            if fixed is None:
                _out.print(f"{chosen}: nothing to repair")
            return
        rows = ", ".join(str(index) for index in done.rows)
        _out.print(
            f"{chosen}: cleared free row(s) {rows}; {format_bytes(done.unowned)} that "
            "no instance held can be charged again"
        )


def _report_file_repair(key: str, fixed: FileRepair) -> None:
    """Say what `repair_file` did to a damaged file, and what is left to do."""
    damaged = escape(f"{fixed.path} {fixed.problem}")
    if fixed.budget is None:
        _out.print(
            f"{key}: {damaged}; its header no longer names a budget, so it was removed. "
            "The next instance creates a new ledger with its own budget (KVCACHED_BUDGET, "
            f"else the device's memory); 'kvctl budget SIZE --key {key}' creates it now",
            highlight=False,
            soft_wrap=True,
        )
    else:
        _out.print(
            f"{key}: {damaged}; it has its full size and a fresh header again, with its "
            f"budget of {format_bytes(fixed.budget)} and {fixed.rows} instance row(s) kept",
            highlight=False,
            soft_wrap=True,
        )
    _err.print(
        "[yellow]note:[/] instances that found the ledger damaged (they logged that it "
        "shrank) keep serving the memory they hold, which the repaired ledger does not "
        "count, and take no more: restart them",
        highlight=False,
    )


@app.command("serve-metrics")
def serve_metrics(
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: pick a free one).")],
    addr: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    key: Annotated[
        list[str] | None, typer.Option("--key", "-k", help="Ledger key; repeat for several.")
    ] = None,
    backend: BackendOption = None,
    device: DeviceOption = None,
    ledger_dir: DirOption = None,
) -> None:
    """Serve Prometheus gauges of the ledgers until Ctrl-C.

    Every ledger of this user, unless --key or --backend/--device choose one."""
    from kvcached.metrics import serve

    with fail():
        keys = key or ([resolve_key(None, backend, device)] if backend or device else None)
        try:
            server = serve(keys, port=port, addr=addr, directory=ledger_dir)
        except OSError as exc:
            raise KVCachedError(_bind_problem(exc, addr, port)) from None
        which = ", ".join(keys) if keys else "every ledger"
        _out.print(f"serving kvcached metrics of {which} on {server.url}")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            server.close()


def _bind_problem(exc: OSError, addr: str, port: int) -> str:
    """Why the metrics endpoint could not listen on addr:port, in words."""
    where = f"cannot serve metrics on {addr}:{port}"
    if isinstance(exc, socket.gaierror):
        return (
            f"{where}: --addr {addr!r} is not an address or host name of this machine "
            "(use an IP address such as 127.0.0.1 or 0.0.0.0, or a resolvable host name)"
        )
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where}: port {port} is already in use (another serve-metrics, or an "
            "instance with KVCACHED_METRICS_PORT?); choose another --port, or 0 for a free one"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {addr} is not an address of this machine's network interfaces"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{where}: not permitted (ports below 1024 need privileges); choose another --port"
    return f"{where}: {exc.strerror or exc}"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
