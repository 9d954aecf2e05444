"""ModelProposer on a tiny model: a proposal whose caller goes away mid-block stops at the next
draft step (the coordinator cancels an overlapped draft the target has already refuted), and the
session's cache stays right for the next proposal."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_service.proposer import ModelProposer, ProposeTask
from specdec_core.batched_backend import BatchedBackend
from specdec_core.kvcache import SessionCaches
from specdec_core.sampling import SamplingConfig
from tiny_models import tiny_config

VOCAB = 512


@pytest.fixture(scope="module")
def proposer():
    torch.manual_seed(3)
    model = LlamaForCausalLM(tiny_config(VOCAB)).eval()
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
