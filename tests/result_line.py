"""What the tests' helper programs print: one line ``RESULT {json}`` on stdout (vLLM's
own log lines go to stdout too, around it)."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def result_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The last RESULT line of a finished run, asserting the run succeeded and printed
    one (a failure shows the output's tails); the run's whole output under "log"."""
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["log"] = done.stdout + done.stderr
    return result
