"""Is ROCm usable here? Answered without a HIP runtime in this process.

Three questions, cheapest first, each with its own answer for `kvcached info`:

1. Is hip-python installed? (a module lookup; nothing is imported)
2. Can the HIP runtime library hip-python will use be loaded? hip-python opens
   libamdhip64.so lazily, on its first call, and reports a failure only then; here the
   same file is opened with ctypes, which runs the library's loader but initialises no
   device, so "libamdhip64.so cannot be loaded: <the loader's message>" comes back early.
3. Is there a device, is the configured one among them, and does it support virtual
   memory management? That needs the runtime initialised, which, as with CUDA, must not
   happen in a process that later forks engine workers, so it is asked in a child
   process (probe.py) that exits afterwards.

The answer depends on the environment (ROCM_PATH, LD_LIBRARY_PATH, HIP_VISIBLE_DEVICES,
...), so it is cached per environment and ordinal, not once per process.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from kvcached.backends.rocm import bindings

PROBE = Path(__file__).with_name("probe.py")
PROBE_TIMEOUT_S = 120  # first HIP initialisation on a large node takes seconds


def rocm_unavailable_reason(ordinal: int = 0) -> str | None:
    """None when device `ordinal` can run the ROCm backend, else why not. Never raises."""
    try:
        return _cached_reason(ordinal, frozenset(os.environ.items()))
    except Exception as exc:  # detection must answer, whatever goes wrong
        return f"ROCm detection failed: {type(exc).__name__}: {exc}"


def clear_cache() -> None:
    """Forget earlier answers (tests; a process that changed its environment)."""
    _cached_reason.cache_clear()


@functools.lru_cache(maxsize=16)
def _cached_reason(ordinal: int, environment: frozenset[tuple[str, str]]) -> str | None:
    del environment  # only part of the cache key
    if not bindings.bindings_installed():
        return "hip-python is not installed (pip install hip-python)"
    path = bindings.library_path()
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        return (
            f"{bindings.LIBRARY_NAME} cannot be loaded: {exc} (install ROCm, or point "
            "ROCM_PATH at a ROCm installation)"
        )
    return _probe(ordinal)


def _probe(ordinal: int) -> str | None:
    env = dict(os.environ)
    # The child must import the same hip-python this process would.
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    try:
        done = subprocess.run(
            [sys.executable, str(PROBE), str(ordinal)],
            capture_output=True,
            text=True,
            env=env,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"the HIP device probe did not answer within {PROBE_TIMEOUT_S} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        how = (
            f"was killed by signal {-done.returncode}"
            if done.returncode < 0
            else f"exited with status {done.returncode}"
        )
        tail = done.stderr.strip().splitlines()[-3:]
        return f"the HIP device probe {how}" + (f": {' / '.join(tail)}" if tail else "")
    answer = json.loads(lines[-1])
    reason = answer.get("reason")
    return None if reason is None else str(reason)
