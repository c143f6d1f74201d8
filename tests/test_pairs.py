"""bench/pairs.py's interval for the median ratio: it holds the true median as often as it says, whatever
the noise's distribution, and a verdict whose interval holds the target is called unresolved."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from pairs import median_interval, resolution  # noqa: E402


@pytest.mark.parametrize("n", [5, 8, 15])
def test_the_interval_holds_a_skewed_distributions_median_as_often_as_it_says(n):
    """Samples from a lognormal (skewed like step times on a shared disk), whose median is exp(0) = 1
    by construction: the share of intervals that hold 1 is the coverage reported, within 3 sigma."""
    rng = np.random.default_rng(n)
    trials = 4000
    held, coverages = 0, set()
    for _ in range(trials):
        low, high, coverage = median_interval(list(rng.lognormal(0.0, 0.5, n)))
        held += low <= 1.0 <= high
        coverages.add(round(coverage, 12))
    (coverage,) = coverages
    assert coverage >= 0.9
    sigma = (coverage * (1 - coverage) / trials) ** 0.5
    assert abs(held / trials - coverage) < 3 * sigma + 1e-9


def test_five_pairs_give_min_to_max_and_four_too_few():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None
    assert resolution([1.0, 2.0, 3.0, 4.0], 1.0) == "too few to say"


def test_a_target_inside_the_interval_is_unresolved_and_one_outside_is_not():
    ratios = [0.95, 0.97, 0.98, 1.01, 1.04]  # median 0.98, under a target of 1.02 that min..max holds
    assert resolution(ratios, 1.02).endswith("holds the target: unresolved")
    assert "unresolved" not in resolution(ratios, 1.10)
    assert "unresolved" not in resolution(ratios, None)
