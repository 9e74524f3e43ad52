"""Shared fixtures for kvcached's own tests."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcached import registry
from kvcached.backing import BackingBuffer
from kvcached.config import reload_settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees the environment it sets, not one parsed by an earlier test."""
    reload_settings()
    yield
    reload_settings()
    registry.reset()


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ledger folder of this test's own (KVCACHED_LEDGER_DIR), the settings re-read:
    other processes on the machine may use kvcached, and must never see a test's rows."""
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    reload_settings()
    return tmp_path


def _sigint_as_in_a_terminal() -> None:
    """In a child process, before it starts: SIGINT interrupts. A test runner started
    in the background (``cmd &``, nohup) hands SIGINT down ignored, and a Python started
    with it ignored never installs its Ctrl-C handler: a test that presses Ctrl-C would
    then wait out a child that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_as_in_a_terminal() -> Callable[[], None]:
    """`preexec_fn` for a child that a test interrupts with Ctrl-C (SIGINT)."""
    return _sigint_as_in_a_terminal


@pytest.fixture
def model_folders_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvcached serve` configs that name model folders this machine has not got
    (/m/qwen): their existence check passes. Use with pytest.mark.usefixtures."""
    from kvcached.apps.serve import config

    monkeypatch.setattr(config, "folder_exists", lambda path: True)


@pytest.fixture
def backing() -> Iterator[BackingBuffer]:
    """A small KV buffer on the host backend (tests/host_backing.py: G, BPP, BLOCKS)."""
    from host_backing import host_backing  # tests/, on sys.path under pytest

    with host_backing() as buf:
        yield buf
