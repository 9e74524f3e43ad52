"""The supervisor of `kvcached serve`: one engine process per model, and who gets memory.

What it does
------------
`Supervisor` turns a `ServeConfig` into one `EngineProcess` per model and runs, in the
router's event loop (uvicorn runs the router in the same loop, so nothing here needs a
thread), everything that happens to them: starting the preloaded ones, starting or
waking the others when a request comes, putting idle ones to sleep, restarting the ones
that die, and stopping all of them on shutdown, leaving no process, no listening port
and no ledger row behind. The router sees each model only as a `state.ModelHandle`
(`EngineProcess.serving()` yields the engine's base URL) and the set of them as
`state.Models`; the dashboard and `/metrics` read `Supervisor.snapshot()`.

An engine process
-----------------
Each engine runs in a session (so a process group) of its own, with its launcher's
command line and environment (`launchers.py`: the only engine-specific code of
`kvcached serve`), a free port on 127.0.0.1 and its output appended to
``<log_dir>/<name>.log``. It is `loading` until its health call answers 200, and
`failed` if it exits first or takes longer than `start_timeout` (the detail then ends
with the log's last lines: what the engine said before it died is almost always the
reason). A watcher task awaits every process; a process that exits when nobody asked
it to makes the model `failed`: the requests in flight on it see the engine's
connection drop (the router answers them with a 503), the requests waiting for it get
`ModelUnavailable` at once (never a hang), and the process is started again after a
back-off of 1, 2, 4 ... up to 30 seconds (`RestartPolicy`). After `max_failures`
failures within `window_s` it is left `failed` for good, and the detail says so.

Stopping sends SIGTERM to the whole process group (vLLM's API server and its engine
core, SGLang's scheduler processes), then SIGKILL to whatever is left after a grace
period, waits until no member of the group runs, and then until the engine's ledger
row is gone: the ledger clears the row of a dead process (`Ledger.rows` reclaims it),
so a row that stays means a member escaped, and the supervisor says so.

Sharing memory
--------------
Every engine charges its KV to the device ledger (kvcached/ledger.py); the supervisor
opens that ledger before the first engine starts and sets its budget to the config's
`budget`, so the engines find it with that budget. Twice a second (and at once when a
request is waiting or a model changed state) the policy loop reads every row, hands
the policy (`policy.py`, decision record 0009) a view of each model, and carries out
what it decides through the same levers `kvctl` pulls:

* limits: `Ledger.set_limit(row, bytes)`; a model's allocator stops growing at its
  limit and gives pages back towards a lowered one as they empty;
* sleep (a model idle past its `keep_alive`, or the least recently used idle one when
  another must wake past `max_awake`): `kv` sets its limit to 0, so its KV goes back
  to the budget while its weights stay; `weights` also calls the engine's own weights
  sleep; `unload` stops its process;
* wake (a sleeping model a request waits for): the limit the policy gives it is
  restored (and the engine's weights wake called), or for `unload` the process started
  again. The time from the first waiting request to `awake` is the model's wake time
  (`ModelStats.record_wake`).

Note [waiting for room]: an engine maps one page id of KV before it serves (policy.py,
Note [room to start]), so a start waits, `loading` with no process yet, until the budget
has the model's start room free: the policy sees it loading and lowers the others'
limits, and their allocators give back their empty pages. It starts at once when the room
is there (the usual case), and without it when waiting cannot help: when the policy's
limits leave less than that room (the guarantees of busy and starting models do not
fit; the engine's own check then decides, and the estimate may be above its need), or
after `start_timeout` (a donor whose requests never end). Waiting first rather than
starting at once and letting the room drain in while the engine loads its weights: a
start that fails for want of one page costs a whole load and a back-off, while the wait
costs the drain, usually one poll of the donors' allocators. A wake needs no such wait:
an engine put to sleep keeps its first page mapped (engines/vllm/sleep.py), and the
policy guarantees the room from the decision that admits the wake.

Note [one transition at a time]: start, sleep, wake and stop of one model run one at a
time under the model's lock, each as its own task (`EngineProcess._run`), so a stop or
a death can cancel the one in progress (a start waiting for health, a wake calling the
engine) without cancelling whoever awaited it. Every transition checks, once it holds
the lock, that it still applies (a sleep finds its model busy: it does nothing), and
changes of state happen without an `await` between the check and the change, so a
request that arrives in between is either counted before the check or sees the new
state.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcached.apps.serve import policy
from kvcached.apps.serve.launchers import LAUNCHERS, HttpCall, Launcher, launcher_for
from kvcached.apps.serve.state import (
    ModelSnapshot,
    ModelState,
    ModelStats,
    ModelUnavailable,
    ServeSnapshot,
    UnknownModel,
)
from kvcached.errors import InvalidArgument, KVCachedError
from kvcached.ledger import InstanceRow, Ledger, ledger_dir

if TYPE_CHECKING:
    import httpx

    from kvcached.apps.serve.config import ModelSpec, ServeConfig

log = logging.getLogger("kvcached.serve")

__all__ = ["EngineProcess", "RestartPolicy", "Supervisor"]

#: engines listen here only; the router in front is the public endpoint
HOST = "127.0.0.1"
#: seconds between two runs of the policy loop (it also runs when poked)
TICK_S = 0.5
#: seconds between health calls while an engine starts, and each call's timeout
HEALTH_EVERY_S = 0.25
HEALTH_TIMEOUT_S = 2.0
#: seconds an engine has to exit after SIGTERM before SIGKILL
STOP_GRACE_S = 10.0
#: seconds a process's ledger row may outlive the process (it is reclaimed at once
#: normally; this covers members of the group still exiting)
ROW_GONE_TIMEOUT_S = 5.0
#: seconds a `kv` sleep waits for the row to empty before calling the model asleep
TRIM_WAIT_S = 2.0
#: seconds an engine's own sleep or wake call may take (vLLM copies weights to host)
ENGINE_CALL_TIMEOUT_S = 300.0
#: the samples of KV bytes the snapshot's history keeps (TICK_S apart: 5 minutes)
HISTORY_SAMPLES = 600
#: the lines of an engine's log quoted in a failure's detail
LOG_TAIL_LINES = 20
#: Retry-After of a full queue, and of a wait that ran out
QUEUE_FULL_RETRY_S = 2.0
WAIT_TIMEOUT_RETRY_S = 5.0
#: Retry-After of a model given up for good
GAVE_UP_RETRY_S = 60.0
#: seconds between two looks at the budget while a start waits for room
ROOM_EVERY_S = 0.05

_RUNNING = (ModelState.LOADING, ModelState.AWAKE, ModelState.SLEEPING, ModelState.WAKING)
#: states whose ledger limit is 0 whatever the policy gives the model
_KV_ASLEEP = (ModelState.SLEEPING, ModelState.ASLEEP)
#: states a model the policy lets wake may be woken from (a sleeping one once asleep)
_WAKEABLE = (ModelState.STOPPED, ModelState.SLEEPING, ModelState.ASLEEP)


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead engine is started again: after `delay(n)` seconds for the n-th
    failure within the last `window_s` seconds (base, 2*base, 4*base ... at most
    `cap_s`), and never again once `max_failures` happened within the window."""

    base_s: float = 1.0
    cap_s: float = 30.0
    max_failures: int = 5
    window_s: float = 600.0

    def delay(self, failures: int) -> float:
        return float(min(self.cap_s, self.base_s * 2 ** max(0, failures - 1)))


def _parent_death_signal() -> Callable[[], None] | None:
    """Linux's prctl(PR_SET_PDEATHSIG), looked up once here: the engine a supervisor
    starts gets SIGTERM when the supervisor dies, even by SIGKILL, so no engine outlives
    it holding its memory. Looked up before any fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_signal


_die_with_parent = _parent_death_signal()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies do not count: their
    memory is gone, and only their parent, often init, can reap them)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; whether it is set. (Not
    `asyncio.wait_for`: on Python 3.11 it can swallow a cancellation that arrives as
    the event is set, and a loop around it then never ends.)"""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=max(0.0, timeout))
    finally:
        waiter.cancel()
    return event.is_set()


def _exit_text(code: int) -> str:
    """A process's exit status in words: "code 3", "signal SIGKILL"."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _group_of(pid: int) -> int | None:
    """The process group of `pid`; None when there is no such process."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 32768))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class WeightsFromLog:
    """The memory an engine's weights took, as the engine itself logged it
    (`Launcher.weights_log`): the last matching line of the current run, read from the
    model's log as it grows, a bounded piece per look, so that a snapshot costs a `stat`
    and the new bytes, never the whole file. None until such a line appears, and always
    for an engine without a pattern."""

    #: the most new log read per look (a chatty engine's backlog is read over several)
    READ_LIMIT = 1 << 20

    def __init__(self, path: Path, pattern: str | None) -> None:
        self.path = path
        self.pattern = None if pattern is None else re.compile(pattern)
        self.offset = 0
        self.value: int | None = None
        self._partial = b""  # a line not yet ended

    def restart(self, offset: int) -> None:
        """A new run of the engine writes from `offset` on: earlier lines are not its."""
        self.offset, self.value, self._partial = offset, None, b""

    def read(self) -> int | None:
        if self.pattern is None:
            return None
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(self.READ_LIMIT)
        except OSError:
            return self.value
        if not chunk:
            return self.value
        self.offset += len(chunk)
        *lines, rest = (self._partial + chunk).split(b"\n")
        self._partial = rest[-self.READ_LIMIT :]
        for line in lines:
            found = self.pattern.search(line.decode(errors="replace"))
            if found is not None:
                self.value = int(float(found.group(1)) * _UNITS[found.group(2)])
        return self.value


def _log_file_name(name: str) -> str:
    """A model's log file name: its name with '/' (allowed in model names) as '_'."""
    return name.replace("/", "_") + ".log"


class EngineProcess:
    """One model's engine process; the `state.ModelHandle` the router holds.

    Built by `Supervisor` (it needs the supervisor's ledger, HTTP client and policy
    loop). `start`, `sleep`, `wake` and `stop` change its state (Note [one transition
    at a time]); they report failure through `state` and `detail`, never by raising.
    """

    def __init__(self, spec: ModelSpec, launcher: Launcher, supervisor: Supervisor) -> None:
        self.spec = spec
        self.launcher = launcher
        self.row_name = launcher.ledger_row(spec)
        self._sup = supervisor
        self._state = ModelState.STOPPED
        self.detail = "not started" if spec.preload else "starts on its first request"
        self._stats = ModelStats()
        self.port: int | None = None
        self.log_path = supervisor.log_dir / _log_file_name(spec.name)
        self._weights = WeightsFromLog(self.log_path, launcher.weights_log)
        #: the ledger limit the policy gives this model while it is awake
        self.target_limit: int | None = spec.limit
        self._proc: asyncio.subprocess.Process | None = None
        self._exited = asyncio.Event()  # the current process exited
        self._changed = asyncio.Event()  # set (and replaced) at every change of state
        self._lock = asyncio.Lock()
        self._current: asyncio.Task[None] | None = None  # the transition in progress
        self._watcher: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None
        self._failures: deque[float] = deque()
        self._next_restart: float | None = None
        self._gave_up = False
        self._closing = False
        self._expect_exit = False  # the current process is being stopped on purpose
        self._wake_since: float | None = None  # when the first waiting request came
        #: why requests wait although it could wake (the policy's `waiting`), else None
        self.waiting_reason: str | None = None
        self._awake_since: float | None = None
        #: the least positive KV its ledger row was seen to hold, over all its engines:
        #: never below one page id (Note [room to start] in policy.py); None: not seen
        self.smallest_kv_seen: int | None = None
        #: what the policy's last limits (and rows that are no model's) leave of the
        #: budget to it, and that decision's number (`Supervisor.decisions`), for a start
        #: waiting for room
        self.room_left: int | None = None
        self.room_decided = 0

    # ------------------------------------------------------------ ModelHandle
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine(self) -> str:
        return self.launcher.engine

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def stats(self) -> ModelStats:
        return self._stats

    @property
    def base_url(self) -> str:
        """The engine's URL (`http://127.0.0.1:PORT`); meaningful while it runs."""
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The engine's process (and process group) id while one exists."""
        proc = self._proc
        return None if proc is None else proc.pid

    @property
    def busy(self) -> bool:
        return self._stats.in_flight > 0 or self._stats.queued > 0

    @property
    def gave_up(self) -> bool:
        """Whether restarts stopped after too many failures (see `RestartPolicy`)."""
        return self._gave_up

    def last_active(self) -> float | None:
        """Monotonic time of its last request's start or end, or of becoming awake if
        later (a model just woken is not idle since its previous request)."""
        used, awake = self._stats.last_used, self._awake_since
        if used is None or awake is None:
            return used if awake is None else awake
        return max(used, awake)

    @contextlib.asynccontextmanager
    async def serving(self, timeout: float | None = None) -> AsyncIterator[str]:
        """Hold one request until this model serves (`state.ModelHandle.serving`)."""
        wait_s = self._sup.config.queue_timeout if timeout is None else timeout
        stats = self._stats
        if self._state is not ModelState.AWAKE:
            self._check_servable()
            limit = self._sup.config.max_queue
            if stats.queued >= limit:
                raise ModelUnavailable(
                    self.name,
                    f"{stats.queued} requests already wait for it to be {ModelState.AWAKE.value} "
                    f"(it is {self._state.value}), as many as max_queue allows",
                    QUEUE_FULL_RETRY_S,
                )
            stats.queued += 1
            stats.touch()
            if self._wake_since is None and self._state in (
                ModelState.STOPPED, ModelState.SLEEPING, ModelState.ASLEEP,
            ):  # fmt: skip
                self._wake_since = time.monotonic()
            try:
                self._sup.poke()
                await self._wait_awake(wait_s)
            finally:
                stats.queued -= 1
        stats.in_flight += 1
        stats.touch()
        try:
            yield self.base_url
        finally:
            stats.in_flight -= 1
            stats.touch()
            if not self.busy:
                self._sup.poke()

    def _check_servable(self) -> None:
        """Raise `ModelUnavailable` when waiting cannot help: failed (for good, or until
        its restart), or the server is stopping."""
        if self._closing:
            raise ModelUnavailable(self.name, "the server is shutting down", GAVE_UP_RETRY_S)
        if self._state is not ModelState.FAILED:
            return
        if self._gave_up or self._next_restart is None:
            raise ModelUnavailable(self.name, self._short_detail(), GAVE_UP_RETRY_S)
        wait = self._next_restart - time.monotonic()
        raise ModelUnavailable(self.name, self._short_detail(), min(30.0, max(1.0, wait + 1.0)))

    def _short_detail(self) -> str:
        return self.detail.split("\n", 1)[0]

    async def _wait_awake(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self._state is not ModelState.AWAKE:
            self._check_servable()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                why = self.waiting_reason or self._short_detail()
                raise ModelUnavailable(
                    self.name,
                    f"it did not become {ModelState.AWAKE.value} within {wait_s:g} s "
                    f"(it is {self._state.value}: {why})",
                    WAIT_TIMEOUT_RETRY_S,
                )
            await _wait_event(self._changed, remaining)

    # ------------------------------------------------------------ transitions
    async def start(self) -> None:
        """Start the engine and wait until it is healthy (or failed); also after it
        was given up (a person asked)."""
        if self._gave_up:
            self._gave_up = False
            self._failures.clear()
        await self._run(self._do_start)

    async def sleep(self, reason: str | None = None) -> None:
        """Put the model to sleep its way (`spec.sleep`) if it is awake and idle;
        `reason` (the policy's) goes into its detail."""

        async def step() -> None:
            await self._do_sleep(reason)

        await self._run(step)

    async def wake(self) -> None:
        """Wake a sleeping model, or start a stopped one."""
        await self._run(self._do_wake)

    async def stop(self) -> None:
        """Stop the engine for good (the server is shutting down): no restarts, no
        starts; idempotent. Returns once no process of its group runs and its ledger
        row is gone."""
        self._closing = True
        if self._restart is not None:
            self._restart.cancel()
        current = self._current
        if current is not None and current is not asyncio.current_task():
            current.cancel()
        async with self._lock:
            await self._end_process()
            if self._state is not ModelState.FAILED or not self._gave_up:
                self._set_state(ModelState.STOPPED, "stopped (the server shut down)")
        watcher = self._watcher
        if watcher is not None and watcher is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _run(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run one transition under the lock, as a task a stop or a death may cancel
        (Note [one transition at a time])."""
        async with self._lock:
            task = asyncio.ensure_future(step())
            self._current = task
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.wait({task})
                raise
            finally:
                self._current = None
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                log.error("%s: %s failed", self.name, step.__name__, exc_info=exc)
                await self._end_process()
                self._failed(f"internal error while changing state: {exc!r}")

    async def _do_start(self) -> None:
        if self._closing or self._state in _RUNNING or self._state is ModelState.ASLEEP:
            return
        watcher = self._watcher
        if watcher is not None and watcher is not asyncio.current_task():
            await watcher  # the last process's group reaped, its row gone
        held = self._sup.ledger_row(self)
        if held is not None:
            self._gave_up = True
            self._set_state(
                ModelState.FAILED,
                f"its ledger row {self.row_name!r} is held by another live process (pid "
                f"{held.pid}, engine {held.engine}): another kvcached serve, or an engine "
                "started by hand, uses that name; stop it ('kvctl list' shows it) or "
                "rename the model",
            )
            return
        self._set_state(ModelState.LOADING, "waiting for room in the budget to start")
        await self._wait_for_room()
        port = _free_port()
        command = self.launcher.command(self.spec, HOST, port)
        env = self._sup.engine_environment(self)
        self.port = port
        self._set_state(ModelState.LOADING, f"starting on port {port}")
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as out:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                out.write(f"\n=== kvcached serve, {stamp}: {' '.join(command)}\n".encode())
                out.flush()
                self._weights.restart(out.tell())
                spawn = asyncio.ensure_future(
                    asyncio.create_subprocess_exec(
                        *command,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # a group of its own: stopped as a whole
                        preexec_fn=_die_with_parent,
                    )
                )
                try:
                    proc = await asyncio.shield(spawn)
                except asyncio.CancelledError:  # stopped meanwhile: leave no orphan
                    with contextlib.suppress(Exception):
                        orphan = await spawn
                        _signal_group(orphan.pid, signal.SIGKILL)
                        await orphan.wait()
                    raise
        except OSError as exc:
            self._failed(f"could not run {command[0]} (log {self.log_path}): {exc}")
            return
        self._proc = proc
        self._expect_exit = False
        self._exited = asyncio.Event()
        self._watcher = asyncio.ensure_future(self._watch(proc, self._exited))
        log.info("%s: started %s (pid %d, port %d)", self.name, self.engine, proc.pid, port)
        why = await self._wait_healthy(proc)
        if why is not None:
            await self._end_process()
            self._failed(why)
            return
        self._awake_since = time.monotonic()
        self._set_state(ModelState.AWAKE, f"serving on port {port} (pid {proc.pid})")
        if self._sup.ledger_row(self) is None:
            log.warning(
                "%s: its engine serves but registered no ledger row %r in ledger %s, so "
                "its memory is not shared (is the kvcached plugin of %s installed, and "
                "KVCACHED_BACKEND the same for the engines and for kvcached serve?)",
                self.name, self.row_name, self._sup.ledger_key(self), self.engine,
            )  # fmt: skip

    async def _wait_for_room(self) -> None:
        """Return once the budget has this model's start room free, or once waiting
        cannot help (Note [waiting for room])."""
        sup = self._sup
        own = self.target_limit if self.target_limit else self.spec.limit
        need = min(sup.start_room(self), sup.config.budget if own is None else own)
        asked = sup.decisions  # a decision made after this model became loading counts
        deadline = time.monotonic() + sup.config.start_timeout
        while True:
            free = sup.free_bytes(self)
            if free is None or free >= need:
                return
            left = self.room_left if self.room_decided > asked else None
            if left is not None and left < need:
                log.warning(
                    "%s: the others' guarantees leave %d bytes of the %d it is given to "
                    "start; starting with %d free",
                    self.name, left, need, free,
                )  # fmt: skip
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "%s: %d bytes free after %g s (start_timeout), not the %d it is given "
                    "to start; starting anyway",
                    self.name, free, sup.config.start_timeout, need,
                )  # fmt: skip
                return
            self.detail = (
                f"waiting for room in the budget to start: {free} of {need} bytes free "
                "(the other models give back what they do not use)"
            )
            await asyncio.sleep(ROOM_EVERY_S)

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> str | None:
        """None once the health call answers 200; else why it never will."""
        import httpx

        call = self.launcher.health
        timeout_s = self._sup.config.start_timeout
        deadline = time.monotonic() + timeout_s
        url = self.base_url + call.path
        client = self._sup.client
        while True:
            if proc.returncode is not None:
                return f"exited with {_exit_text(proc.returncode)} while starting"
            try:
                answer = await client.request(call.method, url, timeout=HEALTH_TIMEOUT_S)
                if answer.status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return (
                    f"did not answer {call.method} {call.path} with 200 within "
                    f"{timeout_s:g} s (start_timeout)"
                )
            await _wait_event(self._exited, min(HEALTH_EVERY_S, remaining))

    async def _do_sleep(self, reason: str | None = None) -> None:
        if self._state is not ModelState.AWAKE or self.busy or self._closing:
            return
        kind = self.spec.sleep
        idle = time.monotonic() - (self.last_active() or time.monotonic())
        because = f"{reason}, " if reason else ""
        self._set_state(
            ModelState.SLEEPING, f"going to sleep ({kind}): {because}idle for {idle:.0f} s"
        )
        if kind == "unload":
            await self._end_process()
            self._set_state(
                ModelState.STOPPED, "unloaded (sleep: unload); starts again on its next request"
            )
            return
        self._sup.set_row_limit(self, 0)
        note = ""
        if kind == "weights" and self.launcher.weights_sleep is not None:
            why = await self._call(self.launcher.weights_sleep)
            if why is not None:
                note = f"; its weights stay: {why}"
                log.warning("%s: weights sleep failed: %s", self.name, why)
        await self._wait_trimmed()
        self._set_state(ModelState.ASLEEP, f"asleep ({kind}){note}")

    async def _wait_trimmed(self) -> None:
        """Wait (briefly) for the engine to give its KV back after its limit became 0."""
        deadline = time.monotonic() + TRIM_WAIT_S
        while time.monotonic() < deadline:
            row = self._sup.ledger_row(self)
            if row is None or row.reserved == 0 or self._stats.queued:
                return
            await asyncio.sleep(0.05)

    async def _do_wake(self) -> None:
        if self._closing:
            return
        if self._state is ModelState.STOPPED:
            await self._do_start()
            return
        if self._state is not ModelState.ASLEEP:
            return
        self._set_state(ModelState.WAKING, "waking")
        if self.spec.sleep == "weights" and self.launcher.weights_wake is not None:
            why = await self._call(self.launcher.weights_wake)
            if why is not None:
                await self._end_process()
                self._failed(f"its weights did not wake: {why}")
                return
        self._sup.set_row_limit(self, self.target_limit)
        self._awake_since = time.monotonic()
        self._set_state(ModelState.AWAKE, f"serving on port {self.port} (pid {self.pid})")

    async def _call(self, call: HttpCall) -> str | None:
        """Make one of the engine's own calls; None when it answered 2xx, else why not."""
        import httpx

        try:
            answer = await self._sup.client.request(
                call.method,
                self.base_url + call.path,
                json=call.json_for(self.name),
                timeout=ENGINE_CALL_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            return f"{call.method} {call.path} failed: {exc!r}"
        if answer.status_code // 100 != 2:
            return f"{call.method} {call.path} answered {answer.status_code}: {answer.text[:200]}"
        return None

    # ------------------------------------------------------------- processes
    async def _watch(self, proc: asyncio.subprocess.Process, exited: asyncio.Event) -> None:
        """Await the process; one that exits unasked makes the model `failed`."""
        code = await proc.wait()
        exited.set()
        if proc is not self._proc or self._expect_exit or self._state is ModelState.LOADING:
            return  # stopped on purpose, or its start sees the exit and fails itself
        # unasked, even code 0 is a crash: vLLM's API server exits 0 when its engine
        # core died, so the cause is in the model's log, which the message names
        how = f"{_exit_text(code)}, unasked (its log: {self.log_path})"
        log.warning("%s: engine (pid %d) exited with %s", self.name, proc.pid, how)
        current = self._current
        if current is not None:
            current.cancel()  # a sleep or wake talking to the dead engine
        self._expect_exit = True
        self._proc = None
        # failed at once, so that waiting requests hear it now; the restart waits for
        # this task (`_do_start`), so for the group and the row to be gone
        self._failed(f"exited with {how} while {self._state.value}")
        await self._reap_group(proc.pid, grace_s=0.0)
        await self._await_row_gone(proc.pid)

    async def _end_process(self) -> None:
        """Stop the current process, if any: SIGTERM to its group, SIGKILL after the
        grace period, until no member runs and its ledger row is gone."""
        proc = self._proc
        if proc is None:
            return
        self._expect_exit = True
        grace = self._sup.stop_grace_s
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            if not await _wait_event(self._exited, grace):
                log.warning(
                    "%s: pid %d ignored SIGTERM for %g s; killing it", self.name, proc.pid, grace
                )
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        await self._reap_group(proc.pid, grace_s=grace)
        self._proc = None
        self.port = None
        await self._await_row_gone(proc.pid)

    async def _reap_group(self, pgid: int, *, grace_s: float) -> None:
        """Wait for the other members of group `pgid` (vLLM's engine core) to exit,
        SIGKILL them after `grace_s` seconds."""
        deadline = time.monotonic() + grace_s
        killed = False
        while group_alive(pgid):
            if not killed and time.monotonic() >= deadline:
                _signal_group(pgid, signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + ROW_GONE_TIMEOUT_S
            elif killed and time.monotonic() >= deadline:
                log.error("%s: processes of group %d survive SIGKILL", self.name, pgid)
                return
            await asyncio.sleep(0.05)

    async def _await_row_gone(self, pid: int) -> None:
        """Wait until no process of group `pid` holds this model's ledger row (the
        ledger clears the rows of dead processes when rows are read)."""
        deadline = time.monotonic() + ROW_GONE_TIMEOUT_S
        while True:
            row = self._sup.ledger_row(self)
            if row is None or _group_of(row.pid) not in (pid, None):
                return
            if time.monotonic() >= deadline:
                log.error(
                    "%s: ledger row %r (pid %d) outlived engine pid %d; 'kvctl list' shows "
                    "it, 'kvctl forget %s' removes it",
                    self.name, self.row_name, row.pid, pid, self.row_name,
                )  # fmt: skip
                return
            await asyncio.sleep(0.05)

    def _failed(self, reason: str) -> None:
        """The engine failed (it exited, or never became healthy): restart it after
        the back-off, or give up (`RestartPolicy`)."""
        self.port = None
        self._wake_since = None
        self._awake_since = None
        now = time.monotonic()
        policy = self._sup.restart
        self._failures.append(now)
        while self._failures and self._failures[0] < now - policy.window_s:
            self._failures.popleft()
        count = len(self._failures)
        tail = _log_tail(self.log_path)
        told = f"\nits log {self.log_path} ends:\n{tail}" if tail else f" (log {self.log_path})"
        self._next_restart = None
        if self._closing:
            self._set_state(ModelState.FAILED, reason + told)
            return
        if count >= policy.max_failures:
            self._gave_up = True
            self._set_state(
                ModelState.FAILED,
                f"{reason}; gave up after {count} failures within {policy.window_s:g} s, "
                "no more restarts (fix the cause, then restart kvcached serve)" + told,
            )
            log.error("%s: %s; gave up after %d failures", self.name, reason, count)
            return
        delay = policy.delay(count)
        self._next_restart = now + delay
        self._set_state(
            ModelState.FAILED,
            f"{reason}; restarting in {delay:g} s (failure {count}; "
            f"{policy.max_failures} within {policy.window_s:g} s end the restarts)" + told,
        )
        log.warning("%s: %s; restarting in %g s", self.name, reason, delay)
        self._restart = asyncio.ensure_future(self._restart_after(delay))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._closing:
            return
        self._stats.restarts_total += 1
        self._next_restart = None
        await self._run(self._do_start)

    def weights_bytes(self) -> int | None:
        """What its weights hold now, by the engine's own log line (`WeightsFromLog`):
        0 with no process, or asleep at a level that let the weights go; None when the
        engine has not said."""
        state = self._state
        if state in (ModelState.STOPPED, ModelState.FAILED):
            return 0
        if state is ModelState.ASLEEP and self.spec.sleep != "kv":
            return 0
        return self._weights.read()

    def _set_state(self, state: ModelState, detail: str) -> None:
        self._state = state
        self.detail = detail
        if state is ModelState.AWAKE and self._wake_since is not None:
            self._stats.record_wake(time.monotonic() - self._wake_since)
            self._wake_since = None
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._sup.poke()

    def __repr__(self) -> str:
        return f"EngineProcess({self.name}, {self.engine}, {self._state.value}, pid {self.pid})"


class Supervisor:
    """Every configured model's engine process, the shared ledger and the policy loop;
    the `state.Models` the router serves (module docstring).

    Arguments:
        config: the validated configuration.
        launchers: launchers by `ModelSpec.engine` overriding `launchers.LAUNCHERS`
            (tests run a stand-in engine this way).
        restart: when dead engines are started again.
        tick_s: seconds between runs of the policy loop.
        stop_grace_s: seconds an engine has between SIGTERM and SIGKILL.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        launchers: Mapping[str, Launcher] | None = None,
        restart: RestartPolicy | None = None,
        tick_s: float = TICK_S,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.config = config
        self.restart = restart if restart is not None else RestartPolicy()
        self.tick_s = tick_s
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(config.log_dir).absolute()
        self.ledger_folder = ledger_dir(config.ledger_dir)
        table = {**LAUNCHERS, **(launchers or {})}
        self.processes: dict[str, EngineProcess] = {}
        for spec in config.models:
            launcher = launcher_for(spec.engine, table)
            launcher.check(spec)
            self.processes[spec.name] = EngineProcess(spec, launcher, self)
        self._keys = {
            name: p.launcher.ledger_key(self._base_env(p)) for name, p in self.processes.items()
        }
        self._ledgers: dict[str, Ledger] = {}
        self._rows: dict[str, InstanceRow] = {}  # by model name, as of the last read
        #: by ledger key, bytes held by rows that are no model's (an engine started by
        #: hand, another server): no limit of ours brings them back
        self._foreign: dict[str, int] = {}
        self._history: deque[dict[str, object]] = deque(maxlen=HISTORY_SAMPLES)
        self._last_sample = -math.inf
        self._poked = asyncio.Event()
        self._halting = False  # the policy loop ends at its next turn
        self._memory: policy.PolicyMemory | None = None
        #: how many policy decisions were carried out so far
        self.decisions = 0
        self._loop: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self._stopping: asyncio.Task[None] | None = None
        self.started = False

    # ---------------------------------------------------------------- Models
    def names(self) -> list[str]:
        return list(self.processes)

    def handle(self, name: object) -> EngineProcess:
        if isinstance(name, str) and name in self.processes:
            return self.processes[name]
        raise UnknownModel(name, self.names())

    def snapshot(self) -> ServeSnapshot:
        now = time.monotonic()
        models: list[ModelSnapshot] = []
        for name, proc in self.processes.items():
            row = self._rows.get(name)
            stats = proc.stats
            used = stats.last_used
            models.append(
                ModelSnapshot(
                    name=name,
                    engine=proc.engine,
                    state=proc.state.value,
                    detail=proc.detail
                    if proc.waiting_reason is None
                    else f"{proc.detail}; requests wait: {proc.waiting_reason}",
                    priority=proc.spec.priority,
                    min_bytes=proc.spec.min,
                    limit_bytes=row.limit if row is not None else proc.target_limit,
                    kv_reserved=row.reserved if row is not None else 0,
                    kv_used=row.used if row is not None else 0,
                    weights_bytes=proc.weights_bytes(),
                    in_flight=stats.in_flight,
                    queued=stats.queued,
                    requests_total=stats.requests_total,
                    errors_total=stats.errors_total,
                    requests_per_s=stats.requests_per_s(),
                    ttft_p50_s=stats.ttft_percentile(0.5),
                    ttft_p99_s=stats.ttft_percentile(0.99),
                    wakes_total=stats.wakes_total,
                    last_wake_s=stats.last_wake_s,
                    restarts_total=stats.restarts_total,
                    idle_s=None if used is None or proc.busy else now - used,
                    endpoint=None if proc.port is None else proc.base_url,
                    pid=proc.pid,
                )
            )
        return ServeSnapshot(
            time=time.time(),
            budget=self.config.budget,
            max_awake=self.config.max_awake,
            models=models,
            history=list(self._history),
        )

    # -------------------------------------------------------------- lifetime
    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client for health, sleep and wake calls (exists once started)."""
        if self._client is None:
            raise KVCachedError("the supervisor is not started")
        return self._client

    async def start(self, *, wait: bool = False) -> None:
        """Open the ledgers (budget = the config's), start the policy loop and the
        preloaded engines (at most `max_awake`, by priority then order); with `wait`,
        return once each of those is awake or failed."""
        import httpx

        if self.started:
            return
        self.started = True
        atexit.register(self.kill_all)  # should the loop die before `stop` ends
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.ledger_dir is not None:
            Path(self.ledger_folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        for key in sorted(set(self._keys.values())):
            self._ledgers[key] = self._open_ledger(key)
        if len(self._ledgers) > 1:
            log.warning(
                "these models charge %d ledgers (%s): each has the budget of %d bytes, so "
                "together they may hold more than it",
                len(self._ledgers), ", ".join(self._ledgers), self.config.budget,
            )  # fmt: skip
        self._client = httpx.AsyncClient(trust_env=False)
        self._read_rows()
        self._loop = asyncio.ensure_future(self._policy_loop())
        preload = sorted(
            (p for p in self.processes.values() if p.spec.preload),
            key=lambda p: -p.spec.priority,
        )
        places = self.config.max_awake
        if places is not None and len(preload) > places:
            for later in preload[places:]:
                later.detail = f"starts on its first request (max_awake {places} reached)"
            preload = preload[:places]
        starts = [self._spawn(p._run(p._do_start)) for p in preload]
        if wait and starts:
            await asyncio.wait(starts)

    def _open_ledger(self, key: str) -> Ledger:
        budget = self.config.budget
        ledger = Ledger.open(key, budget=budget, directory=self.ledger_folder)
        if ledger.budget != budget:
            change = ledger.set_budget(budget)
            log.info("ledger %s: budget %d -> %d bytes", key, change.previous, budget)
        return ledger

    async def stop(self) -> None:
        """Stop every engine and the policy loop, close the ledgers; idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        for proc in self.processes.values():
            proc._closing = True
        self._halting = True
        self.poke()
        if self._loop is not None:
            await self._loop
        await asyncio.gather(*(p.stop() for p in self.processes.values()), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._client is not None:
            await self._client.aclose()
        for ledger in self._ledgers.values():
            ledger.close()
        atexit.unregister(self.kill_all)

    def kill_all(self) -> list[int]:
        """Last resort, synchronous (no event loop needed): SIGKILL the process group of
        every engine still running; the pids of those groups. `start` registers it to
        run at exit, in case the event loop ends before `stop` has; `stop` unregisters
        it."""
        killed = []
        for proc in self.processes.values():
            pid = proc.pid
            if pid is not None and group_alive(pid):
                _signal_group(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def poke(self) -> None:
        """Run the policy loop now (a request waits, or a model changed state)."""
        self._poked.set()

    # ------------------------------------------------------------ environment
    def _base_env(self, proc: EngineProcess) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # its log is current when it dies
        env.update(proc.launcher.environment(proc.spec))
        env.update(self.config.engine_env)
        env.update(proc.spec.env)
        return env

    def engine_environment(self, proc: EngineProcess) -> dict[str, str]:
        """The environment `proc`'s engine starts with (`launchers.py` on the layers)."""
        env = self._base_env(proc)
        env.pop("KVCACHED_INSTANCE_LIMIT", None)  # limits are the supervisor's
        env.update(
            ENABLE_KVCACHED="1",
            KVCACHED_INSTANCE_NAME=proc.name,
            KVCACHED_LEDGER_DIR=str(self.ledger_folder),
            KVCACHED_BUDGET=str(self.config.budget),
        )
        first = proc.target_limit if proc.target_limit else proc.spec.limit
        if first is not None:  # its first charge already within it; the policy follows
            env["KVCACHED_INSTANCE_LIMIT"] = str(first)
        return env

    # ----------------------------------------------------------------- ledger
    def _read_rows(self) -> dict[str, InstanceRow]:
        by_key: dict[str, dict[str, InstanceRow]] = {}
        for key, ledger in self._ledgers.items():
            by_key[key] = {row.name: row for row in ledger.rows()}
        ours = {(self._keys[name], proc.row_name) for name, proc in self.processes.items()}
        self._foreign = {
            key: sum(r.reserved for r in found.values() if (key, r.name) not in ours)
            for key, found in by_key.items()
        }
        rows = {}
        for name, proc in self.processes.items():
            row = by_key.get(self._keys[name], {}).get(proc.row_name)
            if row is not None:
                rows[name] = row
                seen = proc.smallest_kv_seen
                if row.reserved > 0 and (seen is None or row.reserved < seen):
                    proc.smallest_kv_seen = row.reserved
        self._rows = rows
        return rows

    def start_room(self, proc: EngineProcess) -> int:
        """The bytes `proc` is guaranteed while it starts (policy.py, Note [room to
        start]): its `start_room`, else the estimate, lowered by what its row held."""
        return policy.start_room_for(
            self.config.budget,
            configured=proc.spec.start_room,
            smallest_seen=proc.smallest_kv_seen,
        )

    def free_bytes(self, proc: EngineProcess) -> int | None:
        """What the budget of `proc`'s ledger has free now; None without a ledger."""
        ledger = self._ledgers.get(self._keys[proc.name])
        return None if ledger is None else ledger.totals().free

    def ledger_key(self, proc: EngineProcess) -> str:
        """The key of the ledger `proc`'s engine charges (`Launcher.ledger_key`)."""
        return self._keys[proc.name]

    def ledger_row(self, proc: EngineProcess) -> InstanceRow | None:
        """The row named like `proc`'s in its ledger now, whoever holds it (the rows of
        dead processes are cleared first)."""
        ledger = self._ledgers.get(self._keys[proc.name])
        if ledger is None:
            return None
        return next((r for r in ledger.rows() if r.name == proc.row_name), None)

    def set_row_limit(self, proc: EngineProcess, nbytes: int | None) -> bool:
        """Set `proc`'s ledger limit; False when it has no row (yet)."""
        ledger = self._ledgers.get(self._keys[proc.name])
        if ledger is None:
            return False
        try:
            ledger.set_limit(proc.row_name, nbytes)
        except InvalidArgument:
            return False
        return True

    # ----------------------------------------------------------------- policy
    async def _policy_loop(self) -> None:
        while not self._halting:
            self._poked.clear()
            try:
                self._apply_policy()
            except Exception:  # a bad tick must not end the loop; the next may work
                log.exception("the serve policy loop failed; trying again")
            await _wait_event(self._poked, self.tick_s)

    def _apply_policy(self) -> None:
        """One run of the policy: read the rows, decide, carry the decisions out."""
        now = time.monotonic()
        rows = self._read_rows()
        if now - self._last_sample >= self.tick_s * 0.9:
            self._last_sample = now
            kv = {name: (rows[name].reserved if name in rows else 0) for name in self.processes}
            self._history.append({"t": time.time(), "kv": kv})
        views = {name: self._view(proc, rows.get(name)) for name, proc in self.processes.items()}
        decisions = self._decide(list(views.values()), now)
        budget = self.config.budget
        given = {n: budget if v is None else v for n, v in decisions.limits.items()}
        total = sum(given.values())
        self.decisions += 1
        for name, proc in self.processes.items():
            foreign = self._foreign.get(self._keys[name], 0)
            proc.room_left = budget - foreign - (total - given.get(name, 0))
            proc.room_decided = self.decisions
            proc.waiting_reason = decisions.waiting.get(name)
            limit = decisions.limits.get(name, proc.spec.limit)
            if name in decisions.sleep:
                continue  # its sleep sets its limit, once sure it is still idle
            if (views[name].awake and name not in decisions.reasons) or name in decisions.may_wake:
                proc.target_limit = limit  # what it holds while awake, and wakes to
            row = rows.get(name)
            if row is None or proc.state not in (*_RUNNING, ModelState.ASLEEP):
                continue
            wanted = 0 if proc.state in _KV_ASLEEP else limit
            if row.limit != wanted:
                self.set_row_limit(proc, wanted)
        for name in decisions.sleep:
            proc = self.processes[name]
            if proc.state is ModelState.AWAKE and not proc.busy:
                self._spawn(proc.sleep(decisions.reasons.get(name)))
        for name in sorted(decisions.may_wake):
            proc = self.processes[name]
            if proc.state in _WAKEABLE and not proc._closing:
                self._spawn(proc.wake())

    def _view(self, proc: EngineProcess, row: InstanceRow | None) -> policy.ModelView:
        spec = proc.spec
        return policy.view_of(
            proc.name,
            proc.state,
            proc.stats,
            priority=spec.priority,
            min=spec.min,
            limit=spec.limit,
            keep_alive=spec.keep_alive,
            sleep=spec.sleep,
            reserved=0 if row is None else row.reserved,
            denied=0 if row is None else row.denied,
            awake_since=proc._awake_since,
            start_room=self.start_room(proc),
        )

    def _decide(self, views: list[policy.ModelView], now: float) -> policy.Decisions:
        """The policy's decisions for this moment: the one place `policy.py` is called
        (its memory of the previous decision kept here)."""
        decisions = policy.decide(
            views,
            budget=self.config.budget,
            max_awake=self.config.max_awake,
            now=now,
            memory=self._memory,
        )
        self._memory = decisions.memory
        return decisions
