"""The suffix proposer (SuffixDecoding): lookups over the session's own tokens and its tenant's
finished requests, the scoring rule, the index's bounds, tenant isolation, threads."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import pytest

from coordinator.request import RequestContext
from coordinator.suffix import SuffixIndex, SuffixProposer
from specdec_core.engine.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from suffix_lookup import ngram_continuation  # noqa: E402  the n-gram rule suffix decoding replaced

GREEDY = RequestContext("s", SamplingConfig(), tenant="a")
SAMPLED = RequestContext("s", SamplingConfig(temperature=1.0), tenant="a")
P = [101, 102, 103, 104]  # a shared prefix: a template's fixed text


def proposer(**kwargs) -> SuffixProposer:
    return SuffixProposer(SuffixIndex(), **kwargs)


def test_proposes_a_previous_requests_continuation():
    p = proposer()
    p.finished("a", [7, 8, *P, 201, 202, 203, 204, 205, 206, 207, 208, 209])
    assert p.continuation([9, *P], 5, tenant="a") == [201, 202, 203, 204, 205]
    assert p.continuation([9, *P, 201, 202], 3, tenant="a") == [203, 204, 205]
    assert p.continuation([9, 8, 7], 5, tenant="a") == []  # no match
    assert p.continuation([9, *P], 0, tenant="a") == []


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_latest():
    p = proposer()
    for _ in range(3):
        p.finished("a", [*P, 301, 302, 303])
    p.finished("a", [*P, 401, 402, 403])  # the latest, but rarer
    assert p.continuation([9, *P], 3, tenant="a") == [301, 302, 303]
    q = proposer()
    q.finished("a", [*P, 301, 302, 303])
    q.finished("a", [*P, 401, 402, 403])
    assert q.continuation([9, *P], 3, tenant="a") == [401, 402, 403]


def test_the_proposal_grows_with_the_match():
    """K_m = floor(alpha * m): the evidence buys the length."""
    p = proposer(alpha=2.0)
    p.finished("a", [*range(1000, 1008), *range(2000, 2020)])
    tail = list(range(1000, 1008))
    assert len(p.continuation([5, *tail[-2:]], 20, tenant="a")) == 4  # m = 2
    assert len(p.continuation([5, *tail[-3:]], 20, tenant="a")) == 6  # m = 3
    assert len(p.continuation([5, *tail[-6:]], 20, tenant="a")) == 12  # m = 6
    assert p.continuation([5, *tail], 20, tenant="a") == list(range(2000, 2016))  # m = 8
    assert p.continuation([5, *tail], 4, tenant="a") == list(range(2000, 2004))  # at most num_tokens


def test_nothing_below_the_minimum_match_or_probability():
    p = proposer(min_match=2, min_prob=0.2)
    p.finished("a", [*P, 501, 502, 503])
    assert p.continuation([9, 104], 3, tenant="a") == []  # a one-token match
    q = proposer(min_prob=0.2)
    for t in range(600, 606):  # six continuations, each 1/6 < 0.2
        q.finished("a", [*P, t, t + 1])
    assert q.continuation([9, *P], 3, tenant="a") == []
    assert len(proposer(min_prob=0.1).continuation([9, *P], 3)) == 0  # another tenant ("default")


def test_the_path_stops_where_its_probability_falls_below_the_minimum():
    p = proposer(min_prob=0.2)
    for t in range(700, 706):  # all agree on 650, then split six ways
        p.finished("a", [*P, 650, t])
    assert p.continuation([9, *P], 4, tenant="a") == [650]


def test_a_shorter_match_that_many_agree_on_beats_a_longer_rare_one():
    """score = expected accepted tokens: 1 for the 4-token match (its sequence ends after one token),
    4 for the 2-token match that five occurrences agree on."""
    p = proposer(alpha=2.0)
    for _ in range(5):
        p.finished("a", [1, 2, 103, 104, 801, 802, 803, 804])
    p.finished("a", [*P, 900])
    assert p.continuation([9, *P], 8, tenant="a") == [801, 802, 803, 804]
    for _ in range(2):  # now the long match's path is worth more: 1 + 7 * 2/3 against 4 * 5/8
        p.finished("a", [*P, *range(900, 908)])
    assert p.continuation([9, *P], 8, tenant="a") == list(range(900, 908))


def reference(seqs: list[list[int]], ids: list[int], k: int, p: SuffixProposer) -> list[int]:
    """The module docstring's rule by brute force, every occurrence counted: the session's own
    tokens, then the tenant's sequences (oldest first)."""
    tail = ids[-p.max_match:]
    best: list[int] = []
    best_score = 0.0
    for source, ends in (([ids], 0), (seqs, 1)):
        matches = brute_matches(source, tail, ends, p.min_match)
        for rung in reversed(p.rungs):
            occurrences = sorted((o for o, m in matches.items() if m >= rung), reverse=True)
            if occurrences:
                cap = min(k, int(p.alpha * min(matches[o] for o in occurrences) + 1e-9))
                path, score = brute_walk(source, occurrences, cap, p.min_prob)
                if score > best_score:
                    best, best_score = path, score
    return best


def brute_matches(source: list[list[int]], tail: list[int], ends: int, min_match: int) -> dict:
    """(sequence, next token's index) -> match length, for every match of at least min_match; one
    that ends a sequence counts when `ends` (the tenant's), the own tail itself does not."""
    matches = {}
    for s, seq in enumerate(source):
        for e in range(1, len(seq) + ends):
            longest = min(len(tail), e)
            m = next((m for m in range(longest) if seq[e - 1 - m] != tail[-1 - m]), longest)
            if m >= min_match:
                matches[s, e] = m
    return matches


def brute_walk(source: list[list[int]], occurrences: list, cap: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path from the occurrences (newest first) and the sum of its probabilities."""
    path: list[int] = []
    score, live = 0.0, occurrences
    while len(path) < cap:
        j = len(path)
        nexts = [source[s][e + j] for s, e in live if e + j < len(source[s])]
        if not nexts:
            break
        token = max(dict.fromkeys(nexts), key=nexts.count)  # the newest of the most frequent
        if nexts.count(token) / len(occurrences) < min_prob:
            break
        score += nexts.count(token) / len(occurrences)
        path.append(token)
        live = [(s, e) for s, e in live if e + j < len(source[s]) and source[s][e + j] == token]
    return path, score


@pytest.mark.parametrize("seed", range(4))
def test_the_rule_as_written_with_every_occurrence_counted(seed: int):
    """Small vocabularies, so matches repeat, tie and branch; every occurrence is under the cap."""
    rng = random.Random(seed)
    for _ in range(150):
        p = proposer(alpha=rng.choice([1.0, 1.5, 2.0, 3.0]), min_prob=rng.choice([0.1, 0.2, 0.35]),
                     max_occurrences=10_000, max_match=rng.choice([4, 8, 32]))
        vocab = rng.randint(2, 5)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(0, 6))]
        for seq in seqs:
            p.finished("a", seq)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 12)
        assert p.continuation(ids, k, tenant="a") == reference(seqs, ids, k, p)


def test_eviction_by_sequence_count():
    index = SuffixIndex(max_sequences=3)
    p = SuffixProposer(index)
    for i in range(50):
        p.finished("a", [*P, 10_000 + i, 20_000 + i])
        assert index.num_sequences("a") <= 3
    assert index.num_sequences("a") == 3 and index.num_tokens("a") == 3 * 6
    assert p.continuation([9, *P, 10_046], 1, tenant="a") == []  # evicted
    assert p.continuation([9, *P, 10_049], 1, tenant="a") == [20_049]


def test_eviction_by_tokens_per_tenant():
    index = SuffixIndex(max_tokens=100)
    p = SuffixProposer(index)
    for i in range(80):
        p.finished("a", [*P, *range(30_000 + 30 * i, 30_000 + 30 * i + 26)])
        assert index.num_tokens("a") <= 100
        assert len(index.tape("a")) == 4 * (index.num_tokens("a") + index.num_sequences("a") + 1)
    assert index.num_sequences("a") == 3
    index.add("a", list(range(40_000, 40_500)))  # longer than the bound: its end is kept
    assert index.num_sequences("a") == 1 and index.num_tokens("a") == 100
    assert p.continuation([40_450, 40_451], 2, tenant="a") == [40_452, 40_453]
    assert p.continuation([40_350, 40_351], 2, tenant="a") == []


def test_eviction_in_total_takes_the_least_recently_used_tenants_oldest_first():
    index = SuffixIndex(max_tokens=100, max_total_tokens=115)
    p = SuffixProposer(index)
    index.add("a", [*P, 1, 2, 3, 4, 5, 6])  # 10 tokens each
    index.add("b", [*P, 11, 12, 13, 14, 15, 16])
    p.continuation([9, *P], 2, tenant="a")  # a is used: b is now the least recently used
    index.add("c", list(range(50_000, 50_100)))
    assert index.num_tokens("b") == 0 and index.num_tokens("a") == 10 and index.num_tokens() == 110
    rng = random.Random(0)
    for i in range(300):
        index.add(rng.choice("abcdef"), list(range(rng.randrange(1, 90))))
        assert index.num_tokens() <= 115
        assert index.num_tokens() == sum(index.num_tokens(t) for t in "abcdef")


def test_tenants_are_isolated():
    """B's text is never proposed to A, even after identical prefixes."""
    p = proposer()
    secret = list(range(60_000, 60_010))
    for _ in range(5):
        p.finished("b", [*P, *secret])
    assert p.continuation([9, *P], 8, tenant="a") == []
    assert p.propose(GREEDY, [9, *P], 8).token_ids == []
    p.finished("a", [*P, 70_000, 70_001])
    assert p.propose(GREEDY, [9, *P], 8).token_ids == [70_000, 70_001]
    assert p.continuation([9, *P], 8, tenant="b") == secret[:8]


def test_one_hot_distributions_when_sampling_and_only_the_sessions_own_tokens():
    """A sampled request drafts from its own tokens alone (which positions are drafted decides which
    keyed draws make its tokens: its seed must give the same output whatever else has finished),
    and sends the one-hot distribution it drafted from."""
    p = proposer()
    p.finished("a", [*P, 801, 802, 803])
    assert p.propose(GREEDY, [9, *P], 3).token_ids == [801, 802, 803]
    assert p.propose(SAMPLED, [9, *P], 3).token_ids == []  # the index is not the session's
    own = [*P, 801, 802, 803, 7, *P]
    greedy, sampled = p.propose(GREEDY, own, 3), p.propose(SAMPLED, own, 3)
    assert greedy.token_ids == sampled.token_ids == [801, 802, 803]
    assert greedy.dists == [] and sampled.dists == [([801], [1.0]), ([802], [1.0]), ([803], [1.0])]
    assert not greedy.from_worker and not sampled.from_worker


@pytest.mark.parametrize(("ids", "k"), [
    ([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3], 3),  # test_ngram's: the latest match
    ([5, 1, 2, 7, 5, 1], 4),  # a two-token match
    ([*range(300, 340), 7, *range(310, 316)], 10),  # copying a span of the prompt
    ([*range(300, 340), 7, *range(300, 340), 8, *range(320, 325)], 10),  # two earlier copies
    ([11, 12, 13, 14, 40, 41, 11, 12, 13, 50, 60, 11, 12, 13, 14], 6),  # the longest match wins
])
def test_own_tokens_alone_propose_at_least_what_ngram_proposes(ids: list[int], k: int):
    """On the session's own tokens, no index: n-gram lookup's proposal is a prefix of ours (where
    the match is short, ours is no longer than alpha * m: still a prefix of n-gram's)."""
    ngram = ngram_continuation(ids, k)
    ours = proposer().continuation(ids, k)
    assert ngram and ours[:len(ngram)] == ngram


def test_the_sessions_own_tokens_are_searched_but_not_indexed():
    p = proposer()
    ids = [*range(300, 340), 7, 300, 301]
    assert p.propose(GREEDY, ids, 3).token_ids == [302, 303, 304]
    assert p.index.num_tokens() == 0
    assert p.continuation([9, 300, 301], 3, tenant="a") == []


def test_concurrent_adds_and_lookups():
    index = SuffixIndex(max_sequences=8, max_tokens=400, max_total_tokens=1000)
    p = SuffixProposer(index)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                tenant = rng.choice("abc")
                ids = [rng.randrange(50) for _ in range(rng.randrange(1, 120))]
                if rng.random() < 0.5:
                    p.finished(tenant, ids)
                else:
                    p.continuation(ids, 8, tenant=tenant)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert index.num_tokens() <= 1000 and all(index.num_sequences(t) <= 8 for t in "abc")
