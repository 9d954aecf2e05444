"""The verifier's batches under a full KV cache: a session that does not fit is refused alone,
the sessions batched with it get exactly the verdicts they get on their own, and nothing is left
counted that the pool did not hand out."""

from __future__ import annotations

import pytest
import torch

from specdec_core.batched_backend import BatchedBackend
from specdec_core.errors import ResourceExhausted
from specdec_core.kvcache import SessionCaches
from specdec_core.logs import short_id
from specdec_core.sampling import SamplingConfig
from target_service.verifier import ALONE_TOKENS, CoreShare, PrefillBudget, Verifier, VerifyResult, VerifyTask
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
    results = Verifier(caches, max_context=512)._verify_batch(tasks)

    assert isinstance(results[1], ResourceExhausted) and short_id("big") in str(results[1])
    for i in (0, 2):  # the others: the verdict each gets alone, in a roomy cache
        alone = Verifier(SessionCaches(BatchedBackend(model, max_tokens=1024)), max_context=512)
        expected = alone._verify_batch([tasks[i]])[0]
        assert (results[i].num_accepted, results[i].next_token_id) == (expected.num_accepted, expected.next_token_id)
        assert results[i].batch_size == 2
        assert results[i].batch_tokens == 10 + 2 + 12 + 1  # what the pass computed: both sessions' tokens
        assert results[i].batch_prefill_tokens == 10 + 12  # of which their prompts
    assert caches.num_free_units == pool.num_free_blocks
    again = Verifier(caches, max_context=512)._verify_batch([tasks[1]])  # alone, after a and b are idle
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
    once, not after the prefills; the pass right after one with other rounds takes 64 too (those sessions are
    on their way back), later passes of the prefills alone 256 (ALONE_TOKENS); and each long session's
    verdict, when it comes, is the one an unchunked pass gives."""
    from specdec_core.batching import AGAIN

    long = VerifyTask("long", ids(1000, 7), [11, 12, 13], GREEDY)
    other = VerifyTask("other", ids(300, 9), [4], GREEDY)
    short = VerifyTask("short", ids(9, 8), [5], GREEDY)
    verifier = Verifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024, prefill_chunk=64)
    first = verifier._verify_batch([long, other, short])
    assert first[:2] == [AGAIN, AGAIN] and isinstance(first[2], VerifyResult)
    assert first[2].batch_tokens == 64 + 9 + 1 and first[2].batch_prefill_tokens == 64 + 9
    passes = [verifier._verify_batch([long, other])]
    while AGAIN in passes[-1]:
        passes.append(verifier._verify_batch([t for t, r in zip((long, other), passes[-1]) if r is AGAIN]))
    # alone: 64 tokens in the pass right after the short session's, then 256 per pass: long's 872 left in
    # four (its verdict then, beside other's first 152), then other's remaining 148
    assert ALONE_TOKENS == 256
    assert [[isinstance(r, VerifyResult) for r in p] for p in passes] == [[False, False]] * 4 + [[True, False], [True]]
    assert passes[4][0].prefill_tokens == 1000 - 2 * 64 - 3 * 256 and passes[4][0].batch_tokens == 104 + 3 + 152
    whole = Verifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024)
    for task, result in ((long, passes[4][0]), (other, passes[5][0])):
        alone = whole._verify_batch([task])[0]
        assert (result.num_accepted, result.next_token_id) == (alone.num_accepted, alone.next_token_id)


def test_the_prefill_budget_keeps_a_pass_within_its_stall_by_measured_costs():
    """The chunk beside other sessions' rounds: `chunk` until a pass of rounds alone and a pass with
    prefill tokens have been measured, then as many tokens as cost (stall - 1) times the rounds'
    pass, never fewer than `chunk`: few where a token costs a lot beside them (a CPU), up to
    ALONE_TOKENS where it costs nearly nothing (a GPU); passes of prefills alone change nothing;
    stall 0 is a fixed chunk."""
    cpu = PrefillBudget(4, stall=2.0)
    cpu.observe(300.0, rounds=0, prefill=256)  # prefills alone: no measure of the rounds'
    assert cpu.tokens() == 4
    cpu.observe(18.0, rounds=4, prefill=0)
    assert cpu.tokens() == 4  # a prompt token's cost not yet measured
    cpu.observe(36.0, rounds=4, prefill=10)  # 1.8 ms a token beside a pass of 18 ms
    assert cpu.tokens() == 10
    slower = PrefillBudget(4, stall=1.5)
    slower.observe(18.0, rounds=4, prefill=0)
    slower.observe(36.0, rounds=4, prefill=10)
    assert slower.tokens() == 5
    floor = PrefillBudget(16, stall=2.0)
    floor.observe(18.0, rounds=4, prefill=0)
    floor.observe(36.0, rounds=4, prefill=10)
    assert floor.tokens() == 16
    gpu = PrefillBudget(16, stall=2.0)
    gpu.observe(10.0, rounds=4, prefill=0)
    gpu.observe(10.5, rounds=4, prefill=16)
    assert gpu.tokens() == ALONE_TOKENS
    gpu.observe(9.0, rounds=4, prefill=16)  # faster than the rounds alone (noise): costs nothing
    assert gpu.tokens() == ALONE_TOKENS
    fixed = PrefillBudget(16, stall=0)
    fixed.observe(18.0, rounds=4, prefill=0)
    fixed.observe(90.0, rounds=4, prefill=16)
    assert fixed.tokens() == 16


def test_a_verifier_chunks_by_what_its_prefill_budget_measured(model):
    """The verifier takes the budget's current figure, not its starting chunk."""
    from specdec_core.batching import AGAIN

    long = VerifyTask("long", ids(500, 7), [11], GREEDY)
    short = VerifyTask("short", ids(6, 8), [5], GREEDY)
    verifier = Verifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                        prefill_chunk=4, prefill_stall=2.0)
    verifier.prefill.observe(20.0, rounds=1, prefill=0)
    verifier.prefill.observe(40.0, rounds=1, prefill=8)  # 2.5 ms a token: 8 tokens keep the pass within 2x
    first = verifier._verify_batch([long, short])
    assert first[0] is AGAIN and first[1].batch_tokens == 8 + 6 + 1


def test_the_prefill_budget_grows_with_the_sessions_waiting_for_their_prefill():
    """Seven prompts waiting beside one decoding session get seven times the allowance of one
    waiting beside it (a small chunk would hold seven sessions to stall one less), never less
    than one waiting; never more than ALONE_TOKENS."""
    budget = PrefillBudget(4, stall=2.0)
    budget.observe(18.0, rounds=1, prefill=0)
    budget.observe(36.0, rounds=1, prefill=10)
    assert budget.tokens(waiting=1, rounds=1) == budget.tokens(waiting=1, rounds=8) == 10
    assert budget.tokens(waiting=7, rounds=1) == 70
    assert budget.tokens(waiting=4, rounds=2) == 20
    assert budget.tokens(waiting=100, rounds=1) == ALONE_TOKENS


def test_a_pass_is_measured_by_its_rounds_and_all_the_prefill_it_took(model):
    """What the budget learns from a pass: the sessions' rounds, and every token of long prefills
    it took, a prompt's last chunk included (a long prompt that ends in the pass is no round)."""
    a = VerifyTask("a", ids(9, 1), [11], GREEDY)
    b = VerifyTask("b", ids(20, 2), [12], GREEDY)
    short = VerifyTask("short", ids(6, 3), [5], GREEDY)
    verifier = Verifier(SessionCaches(BatchedBackend(model, max_tokens=4096)), max_context=1024,
                        prefill_chunk=4, prefill_stall=2.0)
    verifier.prefill.observe(20.0, rounds=1, prefill=0)
    verifier.prefill.observe(40.0, rounds=1, prefill=8)  # 8 tokens beside one round, 16 with two waiting
    seen = []
    verifier.prefill.observe = lambda ms, rounds, prefill: seen.append((rounds, prefill))
    results = verifier._verify_batch([a, b, short])
    assert isinstance(results[0], VerifyResult) and results[0].prefill_tokens == 9  # a's 9 fit
    assert seen == [(1, 9 + 7)]  # b took the other 7; one round: short's
