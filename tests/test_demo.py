"""`kvcached demo` end to end, short: processes, ledger, allocator and views together."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached.demo import DemoConfig, make_load, run_demo
from kvcached.errors import InvalidArgument

pytestmark = pytest.mark.slow


def test_short_demo_serves_requests_and_keeps_the_books(tmp_path: Path) -> None:
    config = DemoConfig(instances=2, seconds=4.0, budget=512 << 20, seed=3)
    out = tmp_path / "demo.png"
    elastic, static = run_demo(config, out=out, live=False)
    assert out.stat().st_size > 10_000  # a real PNG was drawn
    share = config.budget // config.instances
    for summary in (elastic, static):
        assert summary["corrupted"] == 0  # every block read back what was written
        assert summary["served"] > 0
        assert summary["arrived"] == sum(len(make_load(config, i)) for i in range(2))
    assert all(peak <= share for peak in static["peak_reserved_bytes"].values())
    assert all(peak <= config.budget for peak in elastic["peak_reserved_bytes"].values())
    # run_mode raises if any byte stayed charged in a ledger afterwards


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown demo model 'gpt-9'"):
        run_demo(DemoConfig(model="gpt-9"), out=tmp_path / "x.png")
