"""ModelProposer on a tiny model: a proposal whose caller goes away mid-block stops at the next
draft step (the coordinator cancels an overlapped draft the target has already refuted), and the
session's cache stays right for the next proposal; a long prefill goes through in chunks beside
the other sessions' proposals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_service.proposer import ModelProposer, ProposeTask
from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.batching import AGAIN
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.sampling import SamplingConfig
from tiny_models import tiny_config

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return LlamaForCausalLM(tiny_config(VOCAB)).eval()


@pytest.fixture(scope="module")
def proposer(model):
    return ModelProposer(SessionCaches(BatchedBackend(model, max_tokens=8192)), max_context=1024)


def cancelled_after(checks: int):
    """An is_cancelled that turns True after `checks` calls."""
    count = [0]

    def is_cancelled() -> bool:
        count[0] += 1
        return count[0] > checks

    return is_cancelled


def test_a_cancelled_proposal_stops_at_the_next_step(proposer):
    prompt = list(range(3, 40))
    whole = proposer.propose(ProposeTask("a", prompt, 8, SamplingConfig()))
    assert len(whole.token_ids) == 8
    # one check when the batch is collected, then one after every draft step
    cut = proposer.propose(ProposeTask("b", prompt, 8, SamplingConfig()), cancelled_after(3))
    assert cut.token_ids == whole.token_ids[:3]
    # b's cache holds the cut proposal's tokens; the next proposal crops what it must and agrees
    after = proposer.propose(ProposeTask("b", prompt + whole.token_ids[:2], 6, SamplingConfig()))
    assert after.token_ids == whole.token_ids[2:8]


def test_a_long_prefill_goes_through_in_chunks_beside_the_other_sessions_proposals(model):
    """A 300-token context takes batches of at most 64 of its tokens; a short session's proposal in
    the same batch is answered at once, not after the whole prefill; and the long session's
    proposal, when it comes, is the one an unchunked batch gives."""
    long = ProposeTask("long", [(7 * i) % VOCAB for i in range(300)], 5, SamplingConfig())
    short = ProposeTask("short", list(range(3, 12)), 4, SamplingConfig())
    chunking = ModelProposer(SessionCaches(BatchedBackend(model, max_tokens=8192)), max_context=1024, prefill_chunk=64)
    batches = [chunking._propose_batch([long, short])]
    while batches[-1][0] is AGAIN:
        batches.append(chunking._propose_batch([long]))
    assert len(batches) == 5  # 64 + 64 + 64 + 64 cached, then the last 44 and the block
    first = batches[0][1]
    assert len(first.token_ids) == 4 and (first.batch_size, first.batch_prefill_tokens) == (2, 64 + 9)
    whole = ModelProposer(SessionCaches(BatchedBackend(model, max_tokens=8192)), max_context=1024)._propose_batch([long])[0]
    assert batches[-1][0].token_ids == whole.token_ids and len(whole.token_ids) == 5
    assert batches[-1][0].prefill_tokens == 300 - 4 * 64
