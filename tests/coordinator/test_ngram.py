"""The n-gram proposer."""

from __future__ import annotations

from coordinator.ngram import NgramProposer, lookup
from coordinator.request import RequestContext
from specdec_core.engine.sampling import SamplingConfig

GREEDY = RequestContext("s", SamplingConfig())
SAMPLED = RequestContext("s", SamplingConfig(temperature=1.0))


def test_lookup_continues_the_latest_match_of_the_longest_ngram():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert lookup(ids, 3, max_ngram=3, min_ngram=1) == [4, 5, 6]
    assert lookup([7, 8, 9], 3, 3, 1) == []
    assert lookup([5, 1, 2, 5], 2, 3, 1) == [1, 2]  # falls back to a 1-gram


def test_ngram_proposes_nothing_on_a_one_token_match_by_default():
    """A 1-gram match is wrong too often to pay for a verify of several tokens (see ngram.py)."""
    assert NgramProposer().propose(GREEDY, [5, 1, 2, 5], 4).token_ids == []
    assert NgramProposer().propose(GREEDY, [5, 1, 2, 7, 5, 1], 4).token_ids == [2, 7, 5, 1]
    assert NgramProposer(min_ngram=1).propose(GREEDY, [5, 1, 2, 5], 4).token_ids == [1, 2, 5]


def test_ngram_sends_one_hot_distributions_when_sampling():
    ids = [1, 2, 3, 1, 2]
    greedy = NgramProposer().propose(GREEDY, ids, 2)
    sampled = NgramProposer().propose(SAMPLED, ids, 2)
    assert greedy.token_ids == sampled.token_ids == [3, 1]
    assert greedy.dists == [] and sampled.dists == [([3], [1.0]), ([1], [1.0])]
