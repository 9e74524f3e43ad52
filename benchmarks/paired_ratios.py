"""The verdict of a side-by-side overhead run: the median of its paired ratios, a bootstrap
95 % interval around that median, and whether the target is met (issue 22).

A pair is two batches run back to back, one per engine, alternating which goes first; its
ratio (kvcached / engine alone) is the least exposed to the device's drift, which moved
throughput up to 1.6x within a minute on the H200. A single median of pairs can still
land anywhere inside the noise, so the interval decides: the target is **met** only when
its lower bound is >= 0.98 and the median >= 0.99, **missed** when its upper bound is
below 0.99, and otherwise **undecided** (more pairs, or a workload with less noise). Under
`MIN_PAIRS` pairs a percentile bootstrap only restates the few values seen, so no verdict
is given at all; the benchmarks that decide run >= 20.

A percentile bootstrap: resample the pairs with replacement, take each resample's median,
and read the 2.5th and 97.5th percentiles of those medians. Seeded, so a results file
summarizes to the same figures every time.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

TARGET_MEDIAN = 0.99
TARGET_LOWER = 0.98
RESAMPLES = 10_000
MIN_PAIRS = 10


def pair_ratios(batches: Sequence[dict[str, Any]], key: str = "tokens_per_s") -> list[float]:
    """kvcached / engine alone of `key` for each repeat that has one batch of each side
    (`kvcached` true or false, the same `repeat`), in the order of the repeats."""
    ratios = []
    for repeat in sorted({b["repeat"] for b in batches}):
        on = [b for b in batches if b["repeat"] == repeat and b["kvcached"]]
        off = [b for b in batches if b["repeat"] == repeat and not b["kvcached"]]
        ratios += [float(x[key]) / float(y[key]) for x in on for y in off]
    return ratios


def bootstrap_median_interval(
    ratios: Sequence[float], resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The percentile-bootstrap 95 % interval of the median of `ratios`."""
    if not ratios:
        raise ValueError("no paired ratios to bootstrap")
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[min(resamples - 1, int(0.975 * resamples))]


def verdict(ratios: Sequence[float]) -> dict[str, Any]:
    """The summary fields every overhead benchmark reports for its paired ratios."""
    if not ratios:
        return {"pairs": 0, "verdict": "undecided: no pairs"}
    median = statistics.median(ratios)
    low, high = bootstrap_median_interval(ratios)
    if len(ratios) < MIN_PAIRS:
        said = f"too few pairs to decide (< {MIN_PAIRS})"
    elif low >= TARGET_LOWER and median >= TARGET_MEDIAN:
        said = "met"
    elif high < TARGET_MEDIAN:
        said = "missed"
    else:
        said = "undecided"
    return {
        "pairs": len(ratios),
        "paired_ratio_median": round(median, 4),
        "paired_ratio_ci95": [round(low, 4), round(high, 4)],
        "verdict": said,
        "target": f"median >= {TARGET_MEDIAN} and 95 % lower bound >= {TARGET_LOWER}",
    }
