"""The n-gram proposer and the choice of K."""

from __future__ import annotations

import pytest

from coordinator.adaptive import AdaptiveK, best_k, expected_gain, expected_tokens_per_pass
from coordinator.ngram import NgramProposer, lookup
from specdec_core.sampling import SamplingConfig


def test_lookup_continues_the_latest_match_of_the_longest_ngram():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert lookup(ids, 3, max_ngram=3, min_ngram=1) == [4, 5, 6]
    assert lookup([7, 8, 9], 3, 3, 1) == []
    assert lookup([5, 1, 2, 5], 2, 3, 1) == [1, 2]  # falls back to a 1-gram


def test_ngram_proposes_nothing_on_a_one_token_match_by_default():
    """A 1-gram match is wrong too often to pay for a verify of several tokens (see ngram.py)."""
    assert NgramProposer().propose("s", [5, 1, 2, 5], 4, SamplingConfig(), 0).token_ids == []
    assert NgramProposer().propose("s", [5, 1, 2, 7, 5, 1], 4, SamplingConfig(), 0).token_ids == [2, 7, 5, 1]
    assert NgramProposer(min_ngram=1).propose("s", [5, 1, 2, 5], 4, SamplingConfig(), 0).token_ids == [1, 2, 5]


def test_ngram_sends_one_hot_distributions_when_sampling():
    ids = [1, 2, 3, 1, 2]
    greedy = NgramProposer().propose("s", ids, 2, SamplingConfig(), 0)
    sampled = NgramProposer().propose("s", ids, 2, SamplingConfig(temperature=1.0), 0)
    assert greedy.token_ids == sampled.token_ids == [3, 1]
    assert greedy.dists == [] and sampled.dists == [([3], [1.0]), ([1], [1.0])]


def test_leviathan_formulas():
    assert expected_tokens_per_pass(0.0, 5) == 1.0
    assert expected_tokens_per_pass(1.0, 5) == 6.0
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_gain(0.8, 0.1, 0) == 1.0


def test_best_k_falls_to_zero_when_speculation_loses():
    assert best_k(alpha=0.1, cost_ratio=0.9, max_k=8) == 0
    assert best_k(alpha=0.95, cost_ratio=0.05, max_k=8) >= 6
    assert 0 < best_k(alpha=0.7, cost_ratio=0.2, max_k=8) < 8


def test_adaptive_k_tracks_measurements_and_probes_from_zero():
    adaptive = AdaptiveK(max_k=8)
    for _ in range(20):
        adaptive.observe(drafted=4, accepted=0, draft_ms=40, verify_ms=50)
    ks = [adaptive.next_k() for _ in range(16)]
    assert ks.count(0) >= 12 and 1 in ks  # off, but probing now and then
    for _ in range(20):
        adaptive.observe(drafted=4, accepted=4, draft_ms=2, verify_ms=50)
    assert adaptive.next_k() >= 6


def test_adaptive_k_falls_with_the_verify_batch_size():
    alone, crowded = AdaptiveK(max_k=8), AdaptiveK(max_k=8)
    for _ in range(30):
        alone.observe(drafted=4, accepted=3, draft_ms=8, verify_ms=100, batch_size=1)
        crowded.observe(drafted=4, accepted=3, draft_ms=8, verify_ms=100, batch_size=32)
    assert alone.next_k() > crowded.next_k()
    assert best_k(alpha=0.6, cost_ratio=0.05, max_k=8, verify_growth=2.0) == 0
