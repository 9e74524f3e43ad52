"""A process's state as /proc tells it (Linux), for tests that check a process ended."""

from __future__ import annotations

from pathlib import Path


def state(pid: int) -> str | None:
    """The state letter of `pid` ("R", "S", "Z", ...), None once it is gone. The command
    name in /proc/PID/stat may hold spaces and parentheses: the state follows its last ")"."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text[text.rfind(")") + 2]


def ended(pid: int) -> bool:
    """`pid` is gone, or a zombie (dead, its exit status not yet collected)."""
    return state(pid) in (None, "Z")
