"""Multi-step decoding: a Verify call that asks for decoding steps after its verdict gets, in one
call, exactly the tokens that as many K = 0 rounds after it would commit (greedy and sampled, keyed
draws), stops after a stop token or at the context's end, and answers what it has when a later
step cannot keep the session's cache. Through the verifier's own batch queue, as the servicer calls it."""

from __future__ import annotations

import pytest
import torch

from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.sampling import SamplingConfig
from specdec_core.errors import InvalidArgument
from target_service.verifier import BatchVerifier, VerifyResult, VerifyTask
from tiny_models import tiny_llama

pytestmark = pytest.mark.lossless
VOCAB = 256
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, logprobs=2)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


def verifier(model, max_context: int = 512, max_tokens: int = 4096) -> BatchVerifier:
    return BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=max_tokens)), max_context=max_context)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_rounds(v: BatchVerifier, committed: list[int], draft: list[int], sampling: SamplingConfig, rounds: int,
                 dists=()) -> tuple[list[int], list]:
    """The tokens (and logprobs) of a verify round with `draft`, then `rounds` - 1 K = 0 rounds, one call each."""
    tokens, logprobs = [], []
    for r in range(rounds):
        result = v.verify(VerifyTask("ref", committed + tokens, draft if r == 0 else [], sampling, seed=7,
                                     draft_dists=list(dists) if r == 0 else []))
        tokens += (draft[:result.num_accepted] if r == 0 else []) + [result.next_token_id]
        logprobs += result.logprobs
    return tokens, logprobs


def one_call(v: BatchVerifier, committed: list[int], draft: list[int], sampling: SamplingConfig, steps: int,
             stop_ids=frozenset(), dists=()) -> tuple[list[int], VerifyResult]:
    result = v.verify(VerifyTask("multi", committed, draft, sampling, seed=7, draft_dists=list(dists),
                                 decode_steps=steps, stop_ids=stop_ids))
    return draft[:result.num_accepted] + [result.next_token_id] + result.decoded_ids, result


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_decoding_steps_commit_what_plain_rounds_would(model, sampling):
    prompt = ids(20, 1)
    expected, expected_logprobs = plain_rounds(verifier(model), prompt, [], sampling, 9)
    tokens, result = one_call(verifier(model), prompt, [], sampling, 8)
    assert tokens == expected
    assert result.passes == 9 and len(result.decoded_ids) == 8
    if sampling.logprobs is not None:  # one entry a token, the same as the plain rounds'
        assert [(lp.token_id, round(lp.logprob, 6)) for lp in result.logprobs] == \
               [(lp.token_id, round(lp.logprob, 6)) for lp in expected_logprobs]


def test_decoding_steps_follow_a_verified_draft(model):
    prompt = ids(15, 2)
    alone, _ = plain_rounds(verifier(model), prompt, [], GREEDY, 3)
    draft = alone[:2] + [(alone[2] + 1) % VOCAB]  # two right, the third wrong: 2 accepted, then recovered
    expected, _ = plain_rounds(verifier(model), prompt, draft, GREEDY, 5)
    tokens, result = one_call(verifier(model), prompt, draft, GREEDY, 4)
    assert result.num_accepted == 2 and tokens == expected and len(tokens) == 3 + 4
    # the verdict's pass read the uncached prompt and the block; each step, one token
    assert result.batch_tokens == len(prompt) + 3 and result.pass_tokens == len(prompt) + 3 + 4


def test_decoding_steps_end_after_a_stop_token(model):
    prompt = ids(12, 3)
    expected, _ = plain_rounds(verifier(model), prompt, [], GREEDY, 10)
    stop = expected[4]
    tokens, result = one_call(verifier(model), prompt, [], GREEDY, 20, stop_ids=frozenset({stop}))
    assert tokens == expected[:expected.index(stop) + 1]
    assert result.passes == len(tokens)


def test_decoding_steps_end_at_the_context(model):
    prompt = ids(30, 4)
    tokens, result = one_call(verifier(model, max_context=33), prompt, [], GREEDY, 10)
    assert len(prompt) + len(tokens) == 33 and result.passes == 3


def test_a_step_that_cannot_keep_the_cache_answers_what_it_has(model):
    """A decoding step that does not fit in the KV cache (every block in use by the sessions batched
    with it) ends the call with the tokens decoded so far, instead of failing it."""
    pool = BatchedBackend(model, max_tokens=64, block_size=16)  # 4 blocks
    v = BatchVerifier(SessionCaches(pool), max_context=512)
    prompt = ids(16, 5)
    first = v._verify_batch([VerifyTask("a", prompt, [], GREEDY, decode_steps=3)])[0]  # a fills one block
    step = first.rest
    assert step.so_far is not None and step.committed_ids == prompt + [step.so_far.next_token_id]
    big = VerifyTask("big", ids(47, 6), [], GREEDY)  # 3 blocks, and a's 17th token needs a second
    results = v._verify_batch([big, step])
    assert isinstance(results[0], VerifyResult)
    assert results[1] == step.so_far  # the call answers its first token


def test_bad_decode_requests_name_their_field(model):
    v = verifier(model)
    with pytest.raises(InvalidArgument, match="decode_steps"):
        v.verify(VerifyTask("x", [1, 2, 3], [], GREEDY, decode_steps=65))
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        v.verify(VerifyTask("x", [1, 2, 3], [], GREEDY, decode_steps=2, stop_ids=frozenset({VOCAB})))


def test_greedy_calls_end_with_the_call_beside_them_and_sampled_ones_take_every_step(model):
    """Calls end together: where a call in a pass ends, a greedy call in its decoding steps ends
    with it (its tokens so far are its answer; the next call goes on from them, so the output is
    the same), so that the sessions come back to the engine together. A sampled call takes all its
    steps: where its rounds end must not depend on what it was batched with."""
    from specdec_core.engine.batching import Again

    v = verifier(model)
    greedy = VerifyTask("g", ids(10, 8), [], GREEDY, decode_steps=6)
    sampled = VerifyTask("s", ids(11, 9), [], SAMPLED, seed=3, decode_steps=6)
    first = v._verify_batch([greedy, sampled])  # nothing ends here: both go on
    assert all(isinstance(r, Again) for r in first)
    ending = VerifyTask("e", ids(12, 10), [], GREEDY)  # a call of one pass
    second = v._verify_batch([first[0].rest, first[1].rest, ending])
    assert isinstance(second[0], VerifyResult) and second[0].passes == 2  # ended with "e"
    assert isinstance(second[1], Again) and second[1].rest.so_far.passes == 2  # goes on
    expected, _ = plain_rounds(verifier(model), greedy.committed_ids, [], GREEDY, 2)
    assert [second[0].next_token_id, *second[0].decoded_ids] == expected
