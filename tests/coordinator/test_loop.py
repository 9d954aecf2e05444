"""The speculative loop's overlap bookkeeping, against in-process Proposer/Verifier objects (the
Protocols the gRPC clients implement): a lost bet is cancelled without waiting for it, a won bet
becomes the next block."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from coordinator.cancel import call_cancel
from coordinator.loop import Draft, Speculator, Verdict
from specdec_core.sampling import SamplingConfig

GREEDY = SamplingConfig()


class ScriptedProposer:
    """Proposes 10, 11, 12, ... after any prefix. An overlapped call (it runs under a CancelToken)
    blocks until cancelled or released, like a gRPC call to a busy draft worker."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (prefix length, k)
        self.bets_cancelled = 0
        self.release = threading.Event()

    def propose(self, session_id, committed_ids, num_tokens, sampling, seed, min_confidence=0.0):
        self.calls.append((len(committed_ids), num_tokens))
        token = call_cancel.get()
        if token is not None:
            while not self.release.is_set():
                if token.is_cancelled:
                    self.bets_cancelled += 1
                    return Draft([])
                time.sleep(0.001)
        return Draft([10 + i for i in range(num_tokens)])


class FixedVerifier:
    def __init__(self, accepted: int, next_token: int):
        self.accepted, self.next_token = accepted, next_token

    def verify(self, session_id, committed_ids, draft, sampling, seed):
        return Verdict(min(self.accepted, len(draft.token_ids)), self.next_token)


def test_a_lost_bet_is_cancelled_not_awaited():
    proposer = ScriptedProposer()
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator("s", GREEDY, 0, proposer, FixedVerifier(accepted=1, next_token=99), pool)
        started = time.perf_counter()
        rnd = spec.round([1, 2, 3], 3)  # the bet (prefix + 3 drafts, K + 1) never returns by itself
        assert time.perf_counter() - started < 5
    assert rnd.new_ids == [10, 99] and rnd.num_accepted == 1
    assert proposer.calls == [(3, 3), (6, 4)]
    assert proposer.bets_cancelled == 1
    assert spec._prefetched is None and spec.prefetch_hits == 0


def test_a_won_bet_is_the_next_block():
    proposer = ScriptedProposer()
    proposer.release.set()
    # all 3 drafts accepted and the bonus token is the bet's first token (10): the bet's 11, 12, 13 are next
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator("s", GREEDY, 0, proposer, FixedVerifier(accepted=3, next_token=10), pool)
        first = spec.round([1, 2, 3], 3)
        second = spec.round([1, 2, 3, *first.new_ids], 3)
    assert first.new_ids == [10, 11, 12, 10]
    assert spec.prefetch_hits == 1
    # round 2 drafted nothing itself: its block was round 1's bet; only its own bet was proposed
    assert proposer.calls == [(3, 3), (6, 4), (10, 4)]
    assert second.num_drafted == 3 and second.new_ids == [11, 12, 13, 10]
