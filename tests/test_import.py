"""`import kvcached` must be cheap and side-effect free (engines import it in every
process, some before forking workers)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "cuda", "hip", "mlx", "pydantic", "pydantic_settings", "typer", "rich"]


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout


def test_import_loads_no_driver_framework_or_cli_library() -> None:
    loaded = json.loads(
        _run(
            "import sys, json, kvcached; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
        )
    )
    assert loaded == []


def test_detection_does_not_initialise_a_driver() -> None:
    """Resolving the backend consults NVML/device files only: cuda.bindings is never
    imported, so no cuInit can run before an engine forks."""
    out = _run(
        "import sys, kvcached; kvcached.availability(); "
        "print('cuda.bindings.driver' in sys.modules, 'torch' in sys.modules)"
    )
    assert out.split() == ["False", "False"]
