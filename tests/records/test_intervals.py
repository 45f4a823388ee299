"""Bootstrap intervals over prompts: what they cover, how they pool, what they refuse."""

from __future__ import annotations

import random

import pytest

from prunewatch.records.intervals import bootstrap_rate, bootstrap_share


def test_pooled_share_weighs_prompts_by_their_tokens():
    interval = bootstrap_share([9, 30], [10, 40])
    assert interval.estimate == pytest.approx(39 / 50)
    assert (interval.prompts, interval.tokens) == (2, 50)
    assert 0.75 <= interval.low <= interval.estimate <= interval.high <= 0.9


def test_identical_prompts_give_a_point_and_one_prompt_gives_no_spread_to_trust():
    same = bootstrap_share([8, 8, 8], [10, 10, 10])
    assert (same.low, same.estimate, same.high) == (0.8, 0.8, 0.8)
    one = bootstrap_share([8], [10])
    assert (one.estimate, one.low, one.high, one.prompts) == (0.8, 0.0, 1.0, 1)


def test_the_interval_is_reproducible_and_narrows_with_more_prompts():
    rng = random.Random(1)
    few = [rng.randint(30, 40) for _ in range(5)]
    many = few * 8
    a, b = bootstrap_share(few, [40] * 5), bootstrap_share(few, [40] * 5)
    assert a == b  # fixed seed: a stored decision can be recomputed
    wide, narrow = a, bootstrap_share(many, [40] * len(many))
    assert narrow.high - narrow.low < wide.high - wide.low


def test_the_interval_covers_the_truth_about_95_percent_of_the_time():
    """Prompts drawn from a population whose pooled agreement is 0.9: the interval covers it in most draws."""
    rng = random.Random(3)
    covered = 0
    for _ in range(200):
        matches = [sum(rng.random() < rng.choice((0.8, 0.9, 1.0)) for _ in range(30)) for _ in range(20)]
        interval = bootstrap_share(matches, [30] * 20, resamples=500)
        covered += interval.low <= 0.9 <= interval.high
    assert 0.85 <= covered / 200 <= 0.99


def test_prompts_with_no_tokens_are_no_evidence_and_bad_counts_are_refused():
    assert bootstrap_share([], []) is None
    assert bootstrap_share([0], [0]) is None
    assert bootstrap_share([3, 0], [4, 0]).prompts == 1
    with pytest.raises(ValueError, match="0 <= matches <= total"):
        bootstrap_share([5], [4])
    with pytest.raises(ValueError, match="2 match counts for 1 totals"):
        bootstrap_share([1, 2], [4])


def test_a_pass_rate_is_a_share_of_prompts():
    rate = bootstrap_rate([True, True, False, True])
    assert (rate.estimate, rate.prompts, rate.tokens) == (0.75, 4, 4)
    assert bootstrap_rate([]) is None


def test_separation_is_claimed_only_when_intervals_do_not_overlap():
    high = bootstrap_share([39] * 10, [40] * 10)
    low = bootstrap_share([20] * 10, [40] * 10)
    mixed = bootstrap_share([39] * 9 + [20], [40] * 10)  # reaches up to the all-39 resample
    assert high.separated_from(low) and not high.separated_from(mixed)
