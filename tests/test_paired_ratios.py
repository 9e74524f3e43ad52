"""The overhead benchmarks' verdict (benchmarks/paired_ratios.py): a median paired ratio
decides the target only with an interval that excludes the other answer."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from paired_ratios import MIN_PAIRS, bootstrap_median_interval, pair_ratios, verdict


def _noisy(center: float, spread: float, n: int, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [center + rng.uniform(-spread, spread) for _ in range(n)]


def test_tight_pairs_above_the_target_meet_it() -> None:
    said = verdict(_noisy(1.0, 0.01, 24))
    low, high = said["paired_ratio_ci95"]
    assert said["verdict"] == "met"
    assert low >= 0.98 and low <= said["paired_ratio_median"] <= high


def test_tight_pairs_below_the_target_miss_it() -> None:
    said = verdict(_noisy(0.95, 0.01, 24))
    assert said["verdict"] == "missed"
    assert said["paired_ratio_ci95"][1] < 0.99


def test_noise_wider_than_the_effect_decides_nothing() -> None:
    """The H200 0.6B runs: pairs from 0.6 to 1.3 around a median near 1."""
    said = verdict(_noisy(1.0, 0.35, 24))
    assert said["verdict"] == "undecided"
    low, high = said["paired_ratio_ci95"]
    assert low < 0.98 and high >= 0.99


def test_too_few_pairs_get_no_verdict() -> None:
    assert verdict(_noisy(1.0, 0.001, MIN_PAIRS - 1))["verdict"].startswith("too few pairs")
    assert verdict([])["verdict"].startswith("undecided")


def test_the_interval_is_seeded_and_brackets_the_median() -> None:
    ratios = _noisy(0.99, 0.05, 30, seed=7)
    first = bootstrap_median_interval(ratios)
    assert first == bootstrap_median_interval(ratios)  # a results file summarizes alike
    assert first[0] <= statistics.median(ratios) <= first[1]
    with pytest.raises(ValueError, match="no paired ratios"):
        bootstrap_median_interval([])


def test_pairs_are_the_two_sides_of_one_repeat() -> None:
    batches = [
        {"repeat": 0, "kvcached": False, "tokens_per_s": 100.0},
        {"repeat": 0, "kvcached": True, "tokens_per_s": 90.0},
        {"repeat": 1, "kvcached": True, "tokens_per_s": 110.0},
        {"repeat": 1, "kvcached": False, "tokens_per_s": 100.0},
        {"repeat": 2, "kvcached": True, "tokens_per_s": 500.0},  # its other side failed
    ]
    assert pair_ratios(batches) == [0.9, 1.1]
