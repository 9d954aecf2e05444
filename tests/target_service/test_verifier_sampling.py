"""The verifier applies context-dependent processing per position of a block: row i of a verify
block sees the committed tokens and the first i draft tokens (penalties count them), exactly as a
target decoding one token at a time would; and it reports log-probabilities for every committed
token (accepted and the recovered or bonus one)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.sampling import SamplingConfig, adjust_logits
from target_service.verifier import BatchVerifier, VerifyTask
from tiny_models import tiny_config

pytestmark = [pytest.mark.openai, pytest.mark.lossless]
VOCAB = 64
PROMPT = [5, 9, 5, 17, 3, 9, 22]
# Strong enough to change the greedy path: seen tokens are boosted, generated ones pushed down.
CFG = SamplingConfig(repetition_penalty=0.4, presence_penalty=1.5, frequency_penalty=0.7,
                     logit_bias=((11, -3.0),), logprobs=3, output_start=len(PROMPT))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_config(VOCAB)).eval()


def one_at_a_time(model, cfg: SamplingConfig, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The target alone: each next token from a full forward over everything before it."""
    tokens, rows = list(PROMPT), []
    with torch.inference_mode():
        for _ in range(n):
            row = adjust_logits(model(torch.tensor([tokens])).logits[0, -1:], cfg, tokens)[0]
            rows.append(torch.log_softmax(row.to(torch.float64), -1))
            tokens.append(int(row.argmax()))
    return tokens[len(PROMPT):], rows


def verify(model, draft: list[int], cfg: SamplingConfig):
    verifier = BatchVerifier(SessionCaches(BatchedBackend(model, max_tokens=1024)), max_context=256)
    (result,) = verifier._verify_batch([VerifyTask("s", PROMPT, draft, cfg)])
    return result


def test_a_block_of_the_penalised_greedy_path_is_accepted_whole(model):
    expected, rows = one_at_a_time(model, CFG, 7)
    plain, _ = one_at_a_time(model, SamplingConfig(), 7)
    assert expected != plain  # the penalties matter on this path
    result = verify(model, expected[:6], CFG)
    assert (result.num_accepted, result.next_token_id) == (6, expected[6])
    assert [lp.token_id for lp in result.logprobs] == expected  # accepted ones, then the bonus
    for lp, row in zip(result.logprobs, rows):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-5)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_the_unpenalised_path_is_rejected_where_it_parts(model):
    expected, _ = one_at_a_time(model, CFG, 7)
    plain, _ = one_at_a_time(model, SamplingConfig(), 7)
    first = next(i for i, (a, b) in enumerate(zip(expected, plain)) if a != b)
    result = verify(model, plain[:6], CFG)
    assert (result.num_accepted, result.next_token_id) == (first, expected[first])
    assert len(result.logprobs) == first + 1  # the accepted tokens and the recovered one
