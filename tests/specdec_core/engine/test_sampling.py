"""specdec_core.engine.sampling: logit processing, keyed randomness, inverse-CDF sampling, sparse
distributions and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_core.engine.sampling import (
    GREEDY,
    Purpose,
    SamplingConfig,
    dense_from_sparse,
    keyed_uniform,
    process_logits,
    sample_index,
    truncate_top,
    validate_sampling,
)
from specdec_core.errors import InvalidArgument

# ----------------------------------------------------------------------------------------------
# process_logits


def reference_process(row: list[float], cfg: SamplingConfig) -> list[float]:
    """Straightforward per-row reference: temperature, top-k (ties with the k-th kept), softmax,
    then top-p = the smallest set of most likely tokens whose mass reaches top_p."""
    x = [v / cfg.temperature for v in row]
    vocab = len(x)
    keep = set(range(vocab))
    if 0 < cfg.top_k < vocab:
        kth = sorted(x, reverse=True)[cfg.top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    m = max(x[i] for i in keep)
    e = [math.exp(x[i] - m) if i in keep else 0.0 for i in range(vocab)]
    total = sum(e)
    probs = [v / total for v in e]
    if cfg.top_p < 1.0:
        kept, mass = set(), 0.0
        for i in sorted(range(vocab), key=lambda i: -probs[i]):
            if mass >= cfg.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [probs[i] if i in kept else 0.0 for i in range(vocab)]
        total = sum(probs)
        probs = [v / total for v in probs]
    return probs


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.5),
    SamplingConfig(temperature=2.0, top_k=1),
    SamplingConfig(temperature=0.7, top_k=3),
    SamplingConfig(temperature=1.0, top_k=20),  # top_k >= V: off
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=1.0, top_p=0.3),
    SamplingConfig(temperature=0.9, top_k=4, top_p=0.9),
    SamplingConfig(temperature=1.0, top_p=1e-9),  # keeps only the most likely token
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_process_logits_matches_reference(cfg):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 10, generator=gen) * 3  # float32 in, float64 out
    probs = process_logits(logits, cfg)
    assert probs.dtype == torch.float64 and probs.shape == (16, 10)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(16, dtype=torch.float64), atol=1e-12, rtol=0)
    assert bool((probs >= 0).all())
    for row_in, row_out in zip(logits.to(torch.float64).tolist(), probs.tolist()):
        ref = reference_process(row_in, cfg)
        assert row_out == pytest.approx(ref, abs=1e-12)
        assert [v > 0 for v in row_out] == [v > 0 for v in ref]  # the same support


def test_top_p_literal():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]], dtype=torch.float64)
    support = lambda top_p: (process_logits(logits, SamplingConfig(1.0, 0, top_p))[0] > 0).tolist()  # noqa: E731
    assert support(0.4) == [True, False, False, False]
    assert support(0.7) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert support(0.9) == [True, True, True, False]
    assert support(0.99) == [True, True, True, True]
    kept = process_logits(logits, SamplingConfig(1.0, 0, 0.7))[0]
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-12)


def test_top_p_mass_exactly_at_top_p_is_enough():
    """Dyadic probabilities (exact in float64): a prefix whose mass equals top_p already reaches it."""
    logits = torch.tensor([[0.0, -math.log(2), -2 * math.log(2), -2 * math.log(2)]], dtype=torch.float64)
    assert process_logits(logits, SamplingConfig(1.0))[0].tolist() == [0.5, 0.25, 0.125, 0.125]
    assert process_logits(logits, SamplingConfig(1.0, 0, 0.5))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert process_logits(logits, SamplingConfig(1.0, 0, 0.75))[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0], abs=1e-15)
    kept = process_logits(logits, SamplingConfig(1.0, 0, 0.875))[0].tolist()
    assert kept[:2] == pytest.approx([4 / 7, 2 / 7], abs=1e-15)
    assert sorted(kept[2:]) == pytest.approx([0.0, 1 / 7], abs=1e-15)  # one of the tied tokens


def test_top_k_literal_and_temperature():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.float64)
    probs = process_logits(logits, SamplingConfig(temperature=0.5, top_k=2))[0]
    e = [math.exp(6.0), math.exp(4.0)]
    assert probs.tolist() == pytest.approx([0.0, e[0] / sum(e), e[1] / sum(e), 0.0], abs=1e-12)


def test_process_logits_refuses_greedy():
    with pytest.raises(ValueError):
        process_logits(torch.zeros(1, 4), GREEDY)
    assert GREEDY.is_greedy and not SamplingConfig(temperature=0.1).is_greedy


# ----------------------------------------------------------------------------------------------
# keyed_uniform


def test_keyed_uniform_deterministic_and_in_range():
    for seed in (0, 1, 2**63 + 5, -1):
        for position in (0, 1, 1000, 2**40):
            for purpose in Purpose:
                u = keyed_uniform(seed, position, purpose)
                assert 0.0 <= u < 1.0
                assert u == keyed_uniform(seed, position, purpose)


def test_keyed_uniform_differs_across_keys():
    base = keyed_uniform(7, 10, Purpose.ACCEPT)
    assert keyed_uniform(7, 11, Purpose.ACCEPT) != base
    assert keyed_uniform(8, 10, Purpose.ACCEPT) != base
    assert keyed_uniform(7, 10, Purpose.TARGET) != base
    assert keyed_uniform(7, 10, Purpose.DRAFT) != base
    draws = {keyed_uniform(seed, pos, purpose) for seed in range(5) for pos in range(50) for purpose in Purpose}
    assert len(draws) == 5 * 50 * len(Purpose)  # no collisions


def test_keyed_uniform_roughly_uniform():
    draws = [keyed_uniform(3, position, Purpose.TARGET) for position in range(10_000)]
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.5) < 0.01  # std of the mean ~ 0.0029
    deciles = [0] * 10
    for u in draws:
        deciles[int(u * 10)] += 1
    assert all(900 < c < 1100 for c in deciles), deciles


# ----------------------------------------------------------------------------------------------
# sample_index


def intervals(probs: list[float]) -> list[tuple[float, float]]:
    cdf, acc = [], 0.0
    for v in probs:
        cdf.append((acc, acc + v))
        acc += v
    return cdf


def test_sample_index_literal_boundaries():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    below = lambda x: math.nextafter(x, 0.0)  # noqa: E731
    cases = {
        0.0: 1, 0.1: 1, below(0.25): 1,
        0.25: 3, 0.5: 3, below(0.75): 3,
        0.75: 4, 0.9: 4, below(1.0): 4,
    }
    for u, expected in cases.items():
        assert sample_index(probs, u) == expected, u


def test_sample_index_unnormalised_and_trailing_zeros():
    probs = torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=torch.float64)  # total 3
    assert sample_index(probs, 0.0) == 0
    assert sample_index(probs, math.nextafter(1 / 3, 0.0)) == 0
    assert sample_index(probs, 0.34) == 1
    assert sample_index(probs, math.nextafter(1.0, 0.0)) == 1  # never a zero-probability tail token
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for u in (0.0, 0.5, math.nextafter(1.0, 0.0)):
        assert sample_index(one_hot, u) == 2


@pytest.mark.parametrize("seed", range(4))
def test_sample_index_exact_intervals_random(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(12, generator=gen, dtype=torch.float64)
    probs[torch.rand(12, generator=gen) < 0.4] = 0.0
    probs[0] = 0.0
    probs[-1] = 0.0
    probs[5] = 0.3
    total = float(probs.sum())
    for v, (lo, hi) in enumerate(intervals(probs.tolist())):
        if probs[v] == 0:
            continue
        for f in (0.001, 0.25, 0.5, 0.75, 0.999):
            assert sample_index(probs, (lo + f * (hi - lo)) / total) == v
    # Near boundaries and extremes: always a positive-probability token, consistent with its interval.
    cdf = torch.cumsum(probs, 0).tolist()
    us = [0.0, math.nextafter(1.0, 0.0), 1 - 1e-12]
    for c in cdf:
        us += [c / total, math.nextafter(c / total, 0.0), math.nextafter(c / total, 1.0)]
    for u in us:
        if not 0.0 <= u < 1.0:
            continue
        v = sample_index(probs, u)
        assert probs[v] > 0, (u, v)
        lo, hi = intervals(probs.tolist())[v]
        assert lo - 1e-12 <= u * total <= hi + 1e-12


def test_sample_index_frequencies():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    n = 2000
    counts = [0, 0, 0, 0]
    for j in range(n):
        counts[sample_index(probs, (j + 0.5) / n)] += 1  # a regular grid: exact shares
    assert counts == [200, 0, 1200, 600]


# ----------------------------------------------------------------------------------------------
# truncate_top / dense_from_sparse


def test_truncate_top_keeps_top_n_ascending():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.25, 0.1, 0.3 - 1e-3, 0.001], dtype=torch.float64)
    probs = probs / probs.sum()
    ids, values = truncate_top(probs, 3)
    assert ids == [1, 3, 5]
    assert abs(sum(values) - 1.0) < 1e-6
    for v in values:
        assert float(torch.tensor(v, dtype=torch.float32)) == v  # float32-representable
    kept = probs[ids] / probs[ids].sum()
    assert values == pytest.approx(kept.tolist(), rel=1e-6)


def test_truncate_top_never_keeps_zeros_and_zero_means_all():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3], dtype=torch.float64)
    assert truncate_top(probs, 5)[0] == [1, 3]
    assert truncate_top(probs, 0)[0] == [1, 3]
    ids, values = truncate_top(probs, 1)
    assert ids == [1] and values == [1.0]


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_dense_from_sparse_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    probs = torch.softmax(torch.randn(8, generator=gen, dtype=torch.float64), 0)
    ids, values = truncate_top(probs, n)
    dense = dense_from_sparse(ids, values, 8)
    assert dense.dtype == torch.float64 and dense.shape == (8,)
    assert abs(float(dense.sum()) - 1.0) < 1e-12
    support = [i for i in range(8) if dense[i] > 0]
    assert support == ids
    total = sum(values)
    assert dense[ids].tolist() == pytest.approx([v / total for v in values], abs=1e-15)
    again_ids, again_values = truncate_top(dense, n)  # back again: same ids, same float32 values
    assert again_ids == ids
    assert again_values == pytest.approx(values, abs=2e-7)
    # The draft samples from its float32 values (scaled by their total); the target reads the dense
    # distribution: both pick the same token for the same draw.
    for j in range(500):
        u = (j + 0.37) / 500
        assert ids[sample_index(torch.tensor(values, dtype=torch.float64), u)] == sample_index(dense, u)
    if n in (0, 8):
        assert torch.allclose(dense, probs, atol=1e-7, rtol=0)


def test_dense_from_sparse_renormalises():
    dense = dense_from_sparse([3, 0], [0.2, 0.6], 5)
    assert dense.tolist() == pytest.approx([0.75, 0.0, 0.0, 0.25, 0.0], abs=1e-15)


# ----------------------------------------------------------------------------------------------
# validate_sampling


@pytest.mark.parametrize(
    "cfg,field",
    [
        (SamplingConfig(temperature=-0.1), "sampling.temperature"),
        (SamplingConfig(temperature=math.nan), "sampling.temperature"),
        (SamplingConfig(temperature=math.inf), "sampling.temperature"),
        (SamplingConfig(temperature=-math.inf), "sampling.temperature"),
        (SamplingConfig(temperature=1.0, top_k=-1), "sampling.top_k"),
        (SamplingConfig(temperature=1.0, top_p=0.0), "sampling.top_p"),
        (SamplingConfig(temperature=1.0, top_p=-0.5), "sampling.top_p"),
        (SamplingConfig(temperature=1.0, top_p=1.0000001), "sampling.top_p"),
        (SamplingConfig(temperature=1.0, top_p=math.nan), "sampling.top_p"),
    ],
    ids=lambda x: str(x),
)
def test_validate_sampling_rejects(cfg, field):
    with pytest.raises(InvalidArgument) as info:
        validate_sampling(cfg)
    assert info.value.field == field
    assert field in str(info.value)


def test_validate_sampling_field_prefix():
    with pytest.raises(InvalidArgument) as info:
        validate_sampling(SamplingConfig(temperature=1.0, top_p=2.0), field="request.sampling")
    assert info.value.field == "request.sampling.top_p"


@pytest.mark.parametrize(
    "cfg",
    [GREEDY, SamplingConfig(temperature=1.0), SamplingConfig(0.7, 50, 0.9), SamplingConfig(2.0, 0, 1.0),
     SamplingConfig(1e-6, 1, 1e-6)],
    ids=str,
)
def test_validate_sampling_accepts(cfg):
    assert validate_sampling(cfg) is None


# ----------------------------------------------------------------------------------------------
# Penalties, logit bias, min-p and log-probabilities, against transformers' own processors (an
# independent implementation) and OpenAI's formula written out.


def openai_penalised(row: torch.Tensor, context: list[int], output_start: int, cfg: SamplingConfig) -> torch.Tensor:
    """One row by hand: transformers' repetition penalty over the whole context, then OpenAI's
    frequency/presence penalties over the output part, then the bias."""
    from transformers import RepetitionPenaltyLogitsProcessor

    x = row.to(torch.float64)[None]
    if cfg.repetition_penalty != 1.0 and context:
        x = RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty)(torch.tensor([context]), x)
    x = x[0].clone()
    for token in set(context[output_start:]):
        count = context[output_start:].count(token)
        x[token] -= cfg.frequency_penalty * count + cfg.presence_penalty
    for token, bias in cfg.logit_bias:
        x[token] += bias
    return x


PENALTY_CONFIGS = [
    SamplingConfig(repetition_penalty=1.7),
    SamplingConfig(repetition_penalty=0.6),
    SamplingConfig(presence_penalty=1.5),
    SamplingConfig(frequency_penalty=-0.8, presence_penalty=0.3),
    SamplingConfig(logit_bias=((1, 5.0), (7, -100.0))),
    SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.9, presence_penalty=-0.4, logit_bias=((3, 2.5),)),
]


@pytest.mark.openai
@pytest.mark.parametrize("output_start", [0, 3, 9])
@pytest.mark.parametrize("cfg", PENALTY_CONFIGS, ids=str)
def test_adjust_logits_rows_follow_their_own_context(cfg, output_start):
    """Row j of a block follows the context plus the block's first j tokens; each row equals the
    hand-written reference on exactly that context (so draft tokens earlier in a block count)."""
    from specdec_core.engine.sampling import adjust_logits

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 10, (12,), generator=gen).tolist()  # 12 tokens, repeats guaranteed
    logits = torch.randn(5, 10, generator=gen) * 3  # rows follow tokens[:8] .. tokens[:12]
    cfg = SamplingConfig(**{**cfg.__dict__, "output_start": output_start})
    got = adjust_logits(logits, cfg, tokens)
    for j in range(5):
        context = tokens[:8 + j]
        assert got[j].tolist() == pytest.approx(openai_penalised(logits[j], context, output_start, cfg).tolist(),
                                                abs=1e-12)
    assert not torch.equal(got, logits.to(torch.float64))  # the configs do change something


def test_adjust_logits_is_the_identity_without_penalties():
    from specdec_core.engine.sampling import adjust_logits

    logits = torch.randn(3, 10)
    assert adjust_logits(logits, SamplingConfig(temperature=0.7, top_k=3, min_p=0.2), [1, 2, 3]) is logits


@pytest.mark.openai
@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_transformers(min_p):
    from transformers import MinPLogitsWarper

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 20, generator=gen, dtype=torch.float64) * 2
    cfg = SamplingConfig(temperature=0.8, min_p=min_p)
    ours = process_logits(logits, cfg)
    theirs = torch.softmax(MinPLogitsWarper(min_p)(None, logits / 0.8), dim=-1)
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    assert bool(((ours > 0).sum(dim=-1) < 20).any())  # something was cut


@pytest.mark.openai
def test_token_logprobs():
    from specdec_core.engine.sampling import token_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0]])
    sampled = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2)).log()
    out = token_logprobs(sampled, [0, 1], top=3)
    assert [t.token_id for t in out] == [0, 1]
    assert out[0].logprob == pytest.approx(math.log(math.e ** 2 / (math.e ** 2 + math.e)))
    assert [t for t, _ in out[0].top] == [0, 1]  # the impossible tokens are left out, not -inf
    assert [t for t, _ in out[1].top] == [1, 2, 3] or [t for t, _ in out[1].top] == [1, 3, 2]  # ties with the k-th kept


@pytest.mark.openai
@pytest.mark.parametrize("cfg,field", [
    (SamplingConfig(temperature=1.0, min_p=1.5), "sampling.min_p"),
    (SamplingConfig(presence_penalty=2.5), "sampling.presence_penalty"),
    (SamplingConfig(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    (SamplingConfig(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (SamplingConfig(logit_bias=((5, 101.0),)), "sampling.logit_bias"),
    (SamplingConfig(logit_bias=((50, 1.0),)), "sampling.logit_bias"),  # outside a 10-token vocabulary
    (SamplingConfig(logprobs=21), "sampling.logprobs"),
])
def test_validate_new_sampling_fields(cfg, field):
    with pytest.raises(InvalidArgument) as err:
        validate_sampling(cfg, vocab_size=10)
    assert err.value.field == field
