"""The speculative loop's overlap bookkeeping, against in-process Proposer/Verifier objects (the
Protocols the gRPC clients implement): the first round with the draft (at the start or mid-request)
decodes while the draft warms up, a warm-up the policy turned away from is cancelled, a lost
bet is cancelled without waiting for it, a won bet becomes the next block."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.loop import NO_DECODE, Draft, Speculator, Verdict, Bet
from coordinator.request import RequestContext
from specdec_core.engine.sampling import SamplingConfig
from specdec_core.errors import ResourceExhausted

GREEDY = SamplingConfig()


class ScriptedProposer:
    """Proposes 10, 11, 12, ... after any prefix. An overlapped call (it runs under a CancelToken)
    blocks while `release` is clear, until cancelled, like a gRPC call to a busy draft worker."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (prefix length, k)
        self.bets_cancelled = 0
        self.release = threading.Event()

    def propose(self, ctx, committed_ids, num_tokens):
        self.calls.append((len(committed_ids), num_tokens))
        token = ctx.cancel
        if token is not None:
            while not self.release.is_set():
                if token.is_cancelled:
                    self.bets_cancelled += 1
                    return Draft([])
                time.sleep(0.001)
        return Draft([10 + i for i in range(num_tokens)])


class ScriptedVerifier:
    """Accepts `accepted` draft tokens (at most), then answers the next of `next_tokens`."""

    def __init__(self, accepted: int, next_tokens: list[int]):
        self.accepted, self.next_tokens = accepted, list(next_tokens)

    def verify(self, ctx, committed_ids, draft, decode=NO_DECODE):
        return Verdict(min(self.accepted, len(draft.token_ids)), self.next_tokens.pop(0))


def wait_warm(spec: Speculator) -> None:
    deadline = time.monotonic() + 5
    while spec.warming_up:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_first_rounds_decode_plainly_while_the_draft_warms_up():
    proposer = ScriptedProposer()
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(3, [10, 11, 14, 15]), pool)
        first = spec.round([1, 2, 3], 3)  # the draft is prefilling: nothing to verify yet
        second = spec.round([1, 2, 3, 10], 3)  # still prefilling
        proposer.release.set()
        wait_warm(spec)
        third = spec.round([1, 2, 3, 10, 11], 3)  # the warm-up's proposal (10..13 after 3 tokens) is the block
    assert (first.num_drafted, first.new_ids) == (0, [10]) and (second.num_drafted, second.new_ids) == (0, [11])
    assert proposer.calls[0] == (3, 4)
    assert third.num_drafted == 2 and third.new_ids == [12, 13, 14]
    assert spec.bets_won == 1


def test_turning_to_the_draft_mid_request_decodes_plainly_while_it_catches_up():
    """The policy decoded plainly, then chooses the draft: the draft has never seen this context, and
    the round must not wait for its prefill (the method gate turns every session to it at once)."""
    proposer = ScriptedProposer()  # the warm-up blocks until released: a round that waited would hang
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(3, [10, 11, 12, 16]), pool)
        plain = [spec.round([1, 2, 3], 0), spec.round([1, 2, 3, 10], 0)]
        turned = spec.round([1, 2, 3, 10, 11], 3)
        proposer.release.set()
        wait_warm(spec)
        block = spec.round([1, 2, 3, 10, 11, 12], 3)
    assert [r.num_drafted for r in plain] == [0, 0] and proposer.calls[0] == (5, 4)
    assert (turned.num_drafted, turned.new_ids) == (0, [12])
    assert block.num_drafted == 3 and block.new_ids == [10, 11, 12, 16]  # drafting again once it caught up


def test_turning_away_from_the_draft_cancels_its_warm_up():
    """The policy chose the draft (its warm-up starts), then plain decoding again: the coordinator
    cancels the warm-up rather than leave it prefilling on the draft's core while the target keeps
    to its share of the cores, and a later turn to the draft warms up again."""
    proposer = ScriptedProposer()  # the warm-up blocks until released or cancelled
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(3, [10, 11, 12]), pool)
        turned = spec.round([1, 2, 3], 3)
        assert turned.draft.drafting_meanwhile  # the warm-up runs: the target keeps to its share
        spec.drop_warm_up()  # what the coordinator does when its policy chooses another method
        plain = spec.round([1, 2, 3, 10], 0)
        assert not plain.draft.drafting_meanwhile and spec._warmup is None
        deadline = time.monotonic() + 5
        while proposer.bets_cancelled < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        again = spec.round([1, 2, 3, 10, 11], 3)
        proposer.release.set()
    assert again.num_drafted == 0 and [c[0] for c in proposer.calls] == [3, 5]  # warming up anew


class Lookup:
    """Another proposer (as the coordinator's n-gram lookup): proposes 10, 11, ... at once."""

    def propose(self, ctx, committed_ids, num_tokens):
        return Draft([10 + i for i in range(num_tokens)], from_worker=False)


def test_a_stand_in_round_while_the_draft_warms_up_leaves_the_warm_up_running():
    """The policy's model round while the draft prefills goes to another method (a stand-in): that
    round must neither wait for the warm-up nor cancel it, and the warm-up's proposal is used once
    ready."""
    proposer = ScriptedProposer()
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(0, [10, 13, 14, 15]), pool)
        assert not spec.warming_up
        first = spec.round([1, 2, 3], 3)  # the warm-up starts: plain
        assert spec.warming_up
        stand_in = spec.round([1, 2, 3, 10], 2, Lookup())  # verified at once, the target rejecting both
        assert spec.warming_up and proposer.bets_cancelled == 0
        proposer.release.set()
        wait_warm(spec)
        assert not spec.warming_up
        block = spec.round([1, 2, 3, 10, 13], 3)
    assert first.num_drafted == 0 and stand_in.num_drafted == 2 and stand_in.new_ids == [13]
    assert block.num_drafted == 3 and proposer.calls[:2] == [(3, 4), (5, 3)]  # drafting once warm


def test_sampled_requests_wait_for_the_draft_so_that_seeds_stay_reproducible():
    proposer = ScriptedProposer()
    proposer.release.set()
    sampled = SamplingConfig(temperature=1.0)
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", sampled), proposer, ScriptedVerifier(3, [10]), pool)
        first = spec.round([1, 2, 3], 3)
    assert first.num_drafted == 3 and spec._warmup is None


def test_a_lost_bet_is_cancelled_not_awaited():
    proposer = ScriptedProposer()
    proposer.release.set()
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(1, [10, 99]), pool)
        spec.round([1, 2, 3], 3)
        wait_warm(spec)
        proposer.release.clear()
        started = time.perf_counter()
        rnd = spec.round([1, 2, 3, 10], 3)  # block 11, 12, 13; its bet never returns by itself
        assert time.perf_counter() - started < 5
    assert rnd.num_drafted == 3 and rnd.new_ids == [11, 99] and rnd.num_accepted == 1
    assert proposer.calls == [(3, 4), (7, 4)]
    assert proposer.bets_cancelled == 1
    assert spec._bet is None


def test_a_won_bet_is_the_next_block():
    proposer = ScriptedProposer()
    proposer.release.set()
    # every draft accepted; the bonus token is each bet's first guess
    with ThreadPoolExecutor(2) as pool:
        spec = Speculator(RequestContext("s", GREEDY), proposer, ScriptedVerifier(3, [10, 10, 10]), pool)
        spec.round([1, 2, 3], 3)
        wait_warm(spec)
        second = spec.round([1, 2, 3, 10], 3)
        third = spec.round([1, 2, 3, 10, *second.new_ids], 3)
    assert second.new_ids == [11, 12, 13, 10]
    assert third.num_drafted == 3 and third.new_ids == [11, 12, 13, 10]
    assert spec.bets_won == 2
    # nothing drafted in the foreground: the warm-up, then each round's bet
    assert proposer.calls == [(3, 4), (7, 4), (11, 4)]


def test_a_bet_applies_only_to_the_prefix_it_assumed():
    bet = Bet(3, [1, 2, 3], Draft([7, 8, 9]))
    assert bet.block_after([1, 2, 3]).token_ids == [7, 8, 9]
    assert bet.block_after([1, 2, 3, 7, 8]).token_ids == [9]
    assert bet.block_after([1, 2, 3, 7, 8, 9]) is None  # nothing left
    assert bet.block_after([1, 2, 3, 8]) is None  # a guess was wrong
    assert bet.block_after([0, 2, 3, 7]) is None  # another prefix
    assert bet.block_after([1, 2]) is None


@pytest.mark.capacity
def test_a_draft_without_room_makes_that_round_plain():
    class Full:
        def propose(self, *args, **kwargs):
            raise ResourceExhausted("draft KV cache full: no room for session 's' now")

    spec = Speculator(RequestContext("s", GREEDY), Full(), ScriptedVerifier(3, [42]))
    rnd = spec.round([1, 2, 3], 4)
    assert rnd.new_ids == [42] and rnd.num_drafted == 0  # K = 0 for this session, this round
