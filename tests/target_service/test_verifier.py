"""The verifier's batches under a full KV cache: a session that does not fit is refused alone,
the sessions batched with it get exactly the verdicts they get on their own, and nothing is left
counted that the pool did not hand out."""

from __future__ import annotations

import pytest
import torch

from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.sampling import SamplingConfig
from specdec_core.errors import ResourceExhausted
from specdec_core.logs import short_id
from target_service.verifier import (ALONE_TOKENS, BatchVerifier, CoreShare, PassCost, PrefillBudget, VerifyResult,
                                     VerifyTask)
from tiny_models import tiny_llama

pytestmark = pytest.mark.capacity
VOCAB = 256
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_session_that_does_not_fit_is_refused_alone(model):
    tasks = [VerifyTask("a", ids(10, 1), [5, 6], SamplingConfig()),
             VerifyTask("big", ids(60, 2), [7], SamplingConfig()),  # 4 blocks: more than is left
             VerifyTask("b", ids(12, 3), [8], SamplingConfig())]
    pool = BatchedBackend(model, max_tokens=64, block_size=16)  # 4 blocks of 16 tokens
    caches = SessionCaches(pool)
    results = BatchVerifier(caches, max_context=512)._verify_batch(tasks)

    assert isinstance(results[1], ResourceExhausted) and short_id("big") in str(results[1])
    for i in (0, 2):  # the others: the verdict each gets alone, in a roomy cache
        alone = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=1024)), max_context=512)
        expected = alone._verify_batch([tasks[i]])[0]
        assert (results[i].num_accepted, results[i].next_token_id) == (expected.num_accepted, expected.next_token_id)
        assert results[i].batch_size == 2
        assert results[i].batch_tokens == 10 + 2 + 12 + 1  # what the pass computed: both sessions' tokens
        assert results[i].batch_prefill_tokens == 10 + 12  # of which their prompts
    assert caches.num_free_units == pool.num_free_blocks
    again = BatchVerifier(caches, max_context=512)._verify_batch([tasks[1]])  # alone, after a and b are idle
    assert not isinstance(again[0], BaseException)  # a and b were evicted to make room


def test_core_share_gives_the_target_every_core_while_no_draft_worker_drafts():
    """`--solo-threads`: a batch sent while a coordinator had a draft call in flight runs on the
    target's share, and so do batches for quiet_s after; the others on every core (plain and n-gram
    rounds, and rounds whose draft has finished). A fake clock: no test waits."""
    now = [100.0]
    cores = CoreShare(threads=1, solo=2, quiet_s=0.1, clock=lambda: now[0])
    before = torch.get_num_threads()
    try:
        plain = VerifyTask("a", [1, 2], [], GREEDY)
        drafted = VerifyTask("b", [1, 2], [3, 4], GREEDY)  # its draft has finished: the draft's cores are idle
        drafting = VerifyTask("c", [1, 2], [3, 4], GREEDY, draft_in_flight=True)
        assert cores.for_batch([plain, drafted]) == 2 and torch.get_num_threads() == 2
        assert cores.for_batch([plain, drafting]) == 1 and torch.get_num_threads() == 1
        now[0] += 0.05
        assert cores.for_batch([plain]) == 1  # a draft may have started just after
        now[0] += 0.06
        assert cores.for_batch([plain]) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_long_prefill_goes_through_in_chunks_between_the_other_sessions_rounds(model):
    """Chunked prefill: beside a short session's verify, a pass takes 64 tokens of long prompts, all
    of them together (the first 64 of the first; the second waits); the short session is answered at
    once, not after the prefills; a pass without its round while it still decodes (a round in the last
    `decoding_s`: its next call is on its way) takes 64 too, later passes of the prefills alone 256
    (ALONE_TOKENS); and each long session's verdict, when it comes, is the one an unchunked pass gives."""
    from specdec_core.engine.batching import AGAIN

    long = VerifyTask("long", ids(1000, 7), [11, 12, 13], GREEDY)
    other = VerifyTask("other", ids(300, 9), [4], GREEDY)
    short = VerifyTask("short", ids(9, 8), [5], GREEDY)
    now = [0.0]
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                             prefill_chunk=64, decoding_s=0.25, clock=lambda: now[0])
    first = verifier._verify_batch([long, other, short])
    assert first[:2] == [AGAIN, AGAIN] and isinstance(first[2], VerifyResult)
    assert first[2].batch_tokens == 64 + 9 + 1 and first[2].batch_prefill_tokens == 64 + 9
    now[0] = 0.2  # short still decoding
    passes = [verifier._verify_batch([long, other])]
    now[0] = 0.5  # no longer
    while AGAIN in passes[-1]:
        passes.append(verifier._verify_batch([t for t, r in zip((long, other), passes[-1]) if r is AGAIN]))
    # alone: 64 tokens in the pass while short still decodes, then 256 per pass: long's 872 left in
    # four (its verdict then, beside other's first 152), then other's remaining 148
    assert ALONE_TOKENS == 256
    assert [[isinstance(r, VerifyResult) for r in p] for p in passes] == [[False, False]] * 4 + [[True, False], [True]]
    assert passes[4][0].prefill_tokens == 1000 - 2 * 64 - 3 * 256 and passes[4][0].batch_tokens == 104 + 3 + 152
    whole = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024)
    for task, result in ((long, passes[4][0]), (other, passes[5][0])):
        alone = whole._verify_batch([task])[0]
        assert (result.num_accepted, result.next_token_id) == (alone.num_accepted, alone.next_token_id)


def rounds_alone(budget: PrefillBudget, fixed: float, per_token: float, sizes=(4, 12)) -> None:
    """Passes of rounds alone of each size in turn, each costing fixed + per_token a token."""
    for _ in range(30):
        for n in sizes:
            budget.observe(fixed + per_token * n, rounds=n, round_tokens=n, prefill=0)


def measured(budget: PrefillBudget, token_ms: float, fixed: float = 10.0) -> None:
    """A CPU's costs, whatever the verifier's own passes measured: passes of rounds alone at `fixed` ms
    plus 1 ms a token, and a prompt token at `token_ms` beside them."""
    budget.rounds = PassCost()
    rounds_alone(budget, fixed=fixed, per_token=1.0, sizes=(2, 12))
    budget.observe(fixed + 2 + 8 * token_ms, rounds=1, round_tokens=2, prefill=8)


def test_a_pass_of_rounds_costs_a_fixed_part_plus_a_part_per_token():
    """PassCost: nothing before a pass; the mean of passes all one size; the line through passes of
    different sizes; and a later stretch of one size moves the level, not the slope."""
    cost = PassCost()
    assert cost.ms(4) is None
    for _ in range(5):
        cost.observe(4, 14.0)
    assert cost.ms(4) == cost.ms(20) == pytest.approx(14.0)  # one size: no slope to go by
    for _ in range(40):
        cost.observe(4, 14.0)
        cost.observe(12, 22.0)
    assert cost.ms(4) == pytest.approx(14.0) and cost.ms(20) == pytest.approx(30.0)  # 10 ms + 1 ms a token
    for _ in range(300):
        cost.observe(8, 20.0)  # slower now, all one size
    assert cost.ms(8) == pytest.approx(20.0) and cost.ms(18) == pytest.approx(30.0, abs=0.2)  # the slope kept


def test_the_prefill_budget_keeps_a_pass_within_its_stall_by_measured_costs():
    """The chunk beside other sessions' rounds: `chunk` until passes of rounds alone and a pass with
    prefill tokens have been measured, then as many tokens as cost (stall - 1) times what the pass's
    rounds cost alone (by their tokens: 4 decoding sessions cost less than 8): few where a token costs
    a lot beside them (a CPU), ALONE_TOKENS where it costs nearly nothing (a GPU); passes of prefills
    alone change nothing; stall 0 is a fixed chunk; `chunk` is no floor while no more wait than decode."""
    cpu = PrefillBudget(16, stall=2.0)
    cpu.observe(300.0, rounds=0, round_tokens=0, prefill=256)  # prefills alone: no measure of the rounds'
    assert cpu.tokens() == 16
    rounds_alone(cpu, fixed=10.0, per_token=1.0)  # 4 sessions 14 ms, 12 sessions 22 ms
    assert cpu.tokens() == 16  # a prompt token's cost not yet measured
    cpu.observe(14.0 + 10 * 2.5, rounds=4, round_tokens=4, prefill=10)  # 2.5 ms a token beside 4 sessions
    assert cpu.tokens(waiting=1, rounds=4, round_tokens=4) == 5  # 14 ms of stall: 5.6 tokens
    assert cpu.tokens(waiting=1, rounds=8, round_tokens=8) == 7  # 18 ms: 7.2
    assert cpu.tokens(waiting=1, rounds=4, round_tokens=24) == 13  # K = 5 rounds, 34 ms: 13.6
    slower = PrefillBudget(16, stall=1.5)
    rounds_alone(slower, fixed=10.0, per_token=1.0)
    slower.observe(39.0, rounds=4, round_tokens=4, prefill=10)
    assert slower.tokens(waiting=1, rounds=4, round_tokens=4) == 2  # 7 ms: 2.8
    gpu = PrefillBudget(16, stall=2.0)
    rounds_alone(gpu, fixed=10.0, per_token=0.01)
    gpu.observe(10.2, rounds=4, round_tokens=4, prefill=16)
    assert gpu.tokens() == ALONE_TOKENS
    gpu.observe(9.0, rounds=4, round_tokens=4, prefill=16)  # faster than the rounds alone (noise): costs nothing
    assert gpu.tokens() == ALONE_TOKENS
    fast = PrefillBudget(16, stall=2.0)
    rounds_alone(fast, fixed=10.0, per_token=1.5)
    fast.observe(16.0, rounds=4, round_tokens=4, prefill=10)  # no slower than the rounds alone (noise)
    assert fast.tokens(waiting=1, rounds=4, round_tokens=4) == 10  # at a round's 1.5 ms a token, not ALONE_TOKENS
    fixed = PrefillBudget(16, stall=0)
    rounds_alone(fixed, fixed=10.0, per_token=1.0)
    fixed.observe(90.0, rounds=4, round_tokens=4, prefill=16)
    assert fixed.tokens() == 16


def test_a_verifier_chunks_by_what_its_prefill_budget_measured(model):
    """The verifier takes the budget's current figure, not its starting chunk."""
    from specdec_core.engine.batching import AGAIN

    long = VerifyTask("long", ids(500, 7), [11], GREEDY)
    short = VerifyTask("short", ids(6, 8), [5], GREEDY)
    other = VerifyTask("other", ids(6, 9), [5], GREEDY)
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                             prefill_chunk=16, prefill_stall=2.0)
    measured(verifier.prefill, token_ms=2.5)
    first = verifier._verify_batch([long, short, other])  # two rounds of 7 tokens, 24 ms: 9.6 tokens within 2x
    assert first[0] is AGAIN and first[1].batch_tokens == 9 + 7 + 7


def test_the_prefill_budget_grows_with_the_sessions_waiting_for_their_prefill():
    """Seven prompts waiting beside one decoding session get seven times the allowance of one
    waiting beside it (a small chunk would hold seven sessions to stall one less), and at least
    `chunk` where as many wait as decode; never more than ALONE_TOKENS."""
    budget = PrefillBudget(16, stall=2.0)
    rounds_alone(budget, fixed=10.0, per_token=1.0, sizes=(1, 8))
    budget.observe(11.0 + 10 * 1.25, rounds=1, round_tokens=1, prefill=10)  # 1.25 ms a token beside one round
    assert budget.tokens(waiting=7, rounds=1) == 61  # 77 ms
    assert budget.tokens(waiting=2, rounds=1) == 17  # 22 ms
    assert budget.tokens(waiting=1, rounds=8, round_tokens=8) == 14  # 18 ms
    assert budget.tokens(waiting=2, rounds=4, round_tokens=4) == 11  # fewer waiting than decoding: no floor
    assert budget.tokens(waiting=4, rounds=4, round_tokens=4) == 16  # as many: the floor (11.2 by the stall)
    assert budget.tokens(waiting=1, rounds=1) == 16  # (8.8)
    assert budget.tokens(waiting=100, rounds=1) == ALONE_TOKENS


def test_a_pass_is_measured_by_its_rounds_and_all_the_prefill_it_took(model):
    """What the budget learns from a pass: the sessions' rounds, and every token of long prefills
    it took, a prompt's last chunk included (a long prompt that ends in the pass is no round)."""
    a = VerifyTask("a", ids(9, 1), [11], GREEDY)
    b = VerifyTask("b", ids(20, 2), [12], GREEDY)
    short = VerifyTask("short", ids(6, 3), [5], GREEDY)
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                             prefill_chunk=8, prefill_stall=2.0)
    measured(verifier.prefill, token_ms=2.4, fixed=13.0)  # beside short's round (20 ms), 16 with two waiting
    seen = []
    verifier.prefill.observe = lambda ms, rounds, round_tokens, prefill: seen.append((rounds, round_tokens, prefill))
    results = verifier._verify_batch([a, b, short])
    assert isinstance(results[0], VerifyResult) and results[0].prefill_tokens == 9  # a's 9 fit
    assert seen == [(1, 7, 9 + 7)]  # b took the other 7; one round: short's, its 6 tokens and a draft


def test_sessions_between_calls_still_count_as_decoding(model):
    """A pass carrying one round while three more sessions decoded 0.1 s ago budgets for four
    decoding (their next calls are on their way): fewer wait than decode, so the stall sizes the
    chunk, not the floor; 0.5 s later only this pass's round counts, and the floor is back."""
    from specdec_core.engine.batching import AGAIN

    now = [0.0]
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                             prefill_chunk=16, prefill_stall=2.0, decoding_s=0.25, clock=lambda: now[0])
    short = [VerifyTask(f"s{n}", ids(6, 10 + n), [5], GREEDY) for n in range(6)]
    verifier._verify_batch(short[:4])
    measured(verifier.prefill, token_ms=2.5)
    long = VerifyTask("long", ids(500, 7), [11], GREEDY)
    now[0] = 0.1
    beside_four = verifier._verify_batch([long, short[4]])  # 5 decoding, 11 tokens, 21 ms: 8.4 tokens within 2x
    assert beside_four[0] is AGAIN and beside_four[1].batch_tokens == 8 + 7
    now[0] = 0.5
    beside_one = verifier._verify_batch([long, short[5]])  # as many waiting as decoding: the floor
    assert beside_one[0] is AGAIN and beside_one[1].batch_tokens == 16 + 7


def test_a_decoding_session_that_sends_a_long_prompt_waits_and_decodes_no_more(model):
    """A session with a round 0.1 s ago that now sends a long prompt counts as waiting, not as
    decoding: beside one other session's round, as many wait as decode, and the floor holds (were it
    still counted as decoding, the stall would size the chunk: 7 tokens)."""
    now = [0.0]
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                             prefill_chunk=16, prefill_stall=2.0, decoding_s=0.25, clock=lambda: now[0])
    verifier._verify_batch([VerifyTask("s0", ids(6, 10), [5], GREEDY)])
    measured(verifier.prefill, token_ms=2.5)
    now[0] = 0.1
    turn = VerifyTask("s0", ids(6, 10) + ids(100, 99), [], GREEDY)
    other = VerifyTask("s1", ids(6, 11), [5], GREEDY)
    results = verifier._verify_batch([turn, other])
    assert results[1].batch_tokens == 16 + 7
