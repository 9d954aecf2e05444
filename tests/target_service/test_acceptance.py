"""The accept/reject rule of speculative sampling is lossless.

(a) Exact enumeration: on a tiny vocabulary, every draft outcome and every accept/reject branch of
    one round is enumerated with the implementation's own `accept_probabilities` and
    `recovered_distribution`; the round's output, completed to K+1 tokens by the target itself,
    must have exactly the target's joint distribution. Wrong rules fed to the same harness must
    fail it (negative controls).
(b) `verify_sampled` follows those formulas draw by draw (controlled uniforms).
(c) Monte Carlo of `verify_sampled` end to end.
(d) `verify_greedy` on literal tables.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import pytest
import torch

from specdec_core.engine.sampling import (
    SamplingConfig,
    dense_from_sparse,
    process_logits,
    sample_index,
    truncate_top,
)
from target_service.acceptance import (
    accept_probabilities,
    recovered_distribution,
    verify_greedy,
    verify_sampled,
)

pytestmark = pytest.mark.lossless

Prefix = tuple[int, ...]
Table = dict[Prefix, torch.Tensor]  # prefix of tokens -> distribution [V] (float64)

CONFIGS = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7-k2": SamplingConfig(temperature=0.7, top_k=2),
    "t1.3-p0.8": SamplingConfig(temperature=1.3, top_p=0.8),
    "t1.0-k3-p0.9": SamplingConfig(temperature=1.0, top_k=3, top_p=0.9),
}
DRAFT_KINDS = ("sampled", "greedy", "truncated", "same_as_target")
TOL = 1e-9


# ----------------------------------------------------------------------------------------------
# Tables p(.|prefix), q(.|prefix)


def all_prefixes(vocab: int, max_len: int) -> list[Prefix]:
    return [s for n in range(max_len + 1) for s in itertools.product(range(vocab), repeat=n)]


def random_logits(vocab: int, max_len: int, seed: int) -> dict[Prefix, torch.Tensor]:
    """Raw logits [V] for every prefix of length <= max_len (depend on the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = all_prefixes(vocab, max_len)
    logits = torch.randn(len(prefixes), vocab, generator=gen, dtype=torch.float64) * 1.5
    return {s: logits[i] for i, s in enumerate(prefixes)}


def target_table(logits: dict[Prefix, torch.Tensor], cfg: SamplingConfig) -> Table:
    keys = list(logits)
    probs = process_logits(torch.stack([logits[s] for s in keys]), cfg)
    return {s: probs[i] for i, s in enumerate(keys)}


def draft_table(
    logits: dict[Prefix, torch.Tensor], cfg: SamplingConfig, kind: str, target_logits: dict[Prefix, torch.Tensor]
) -> Table:
    vocab = next(iter(logits.values())).shape[0]
    if kind == "same_as_target":  # q == p exactly: every draft token is accepted
        return target_table({s: target_logits[s] for s in logits}, cfg)
    if kind == "greedy":  # one-hot at the argmax of the raw draft logits
        return {s: torch.nn.functional.one_hot(x.argmax(), vocab).to(torch.float64) for s, x in logits.items()}
    table = target_table(logits, cfg)
    if kind == "sampled":
        return table
    if kind == "truncated":  # what the proposer sends with sparse_top = 2
        return {s: dense_from_sparse(*truncate_top(q, 2), vocab) for s, q in table.items()}
    raise AssertionError(kind)


# ----------------------------------------------------------------------------------------------
# The harness


AcceptFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RecoverFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def impl_recover(p_i: torch.Tensor, q_i: torch.Tensor, d_i: int) -> torch.Tensor:
    return recovered_distribution(p_i, q_i)


def round_output(p: Table, q: Table, vocab: int, k: int, accept_fn: AcceptFn, recover_fn: RecoverFn) -> dict[Prefix, float]:
    """Exact distribution of the tokens one round emits (accepted drafts + recovered/bonus)."""
    out: dict[Prefix, float] = {}

    def emit(seq: Prefix, mass: float) -> None:
        out[seq] = out.get(seq, 0.0) + mass

    for d in itertools.product(range(vocab), repeat=k):
        p_draft = math.prod(float(q[d[:i]][d[i]]) for i in range(k))
        if p_draft == 0.0:  # the draft never proposes it
            continue
        p_rows = torch.stack([p[d[:i]] for i in range(k + 1)])  # [K+1, V]
        q_rows = torch.stack([q[d[:i]] for i in range(k)]) if k else p_rows[:0]  # [K, V]
        acc = accept_fn(p_rows, q_rows, torch.tensor(d, dtype=torch.long)).tolist() if k else []
        reach = p_draft  # probability of this draft and all of d[:i] accepted
        for i in range(k):
            rec = recover_fn(p_rows[i], q_rows[i], d[i]).tolist()
            for v in range(vocab):
                if rec[v]:
                    emit(d[:i] + (v,), reach * (1.0 - acc[i]) * rec[v])
            reach *= acc[i]
        bonus = p_rows[k].tolist()
        for v in range(vocab):
            if bonus[v]:
                emit(d + (v,), reach * bonus[v])
    return out


def max_joint_error(p: Table, emitted: dict[Prefix, float], vocab: int, k: int) -> float:
    """Completes every emitted prefix to K+1 tokens with the target's own conditionals and returns
    max |P_round(s) - P_target(s)| over s in V^(K+1)."""
    plist = {s: row.tolist() for s, row in p.items()}
    worst = 0.0
    for s in itertools.product(range(vocab), repeat=k + 1):
        conditionals = [plist[s[:j]][s[j]] for j in range(k + 1)]
        target = math.prod(conditionals)
        got = 0.0
        for length in range(1, k + 2):
            mass = emitted.get(s[:length], 0.0)
            if mass:
                got += mass * math.prod(conditionals[length:])
        worst = max(worst, abs(got - target))
    # Every emitted prefix has length 1..K+1 and the round's mass is 1.
    assert all(1 <= len(s) <= k + 1 for s in emitted)
    assert abs(sum(emitted.values()) - 1.0) < TOL
    return worst


def tables(vocab: int, k: int, cfg: SamplingConfig, kind: str, seed: int) -> tuple[Table, Table]:
    t_logits = random_logits(vocab, k, seed)
    d_logits = random_logits(vocab, max(k - 1, 0), seed + 1000)
    return target_table(t_logits, cfg), draft_table(d_logits, cfg, kind, t_logits)


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("k,vocab", [(0, 5), (1, 5), (2, 5), (3, 5)])
def test_round_output_is_exactly_the_target_distribution(k, vocab, cfg_name, kind):
    cfg = CONFIGS[cfg_name]
    seed = 17 * k + 3 * list(CONFIGS).index(cfg_name) + 101 * DRAFT_KINDS.index(kind)
    p, q = tables(vocab, k, cfg, kind, seed)
    emitted = round_output(p, q, vocab, k, accept_probabilities, impl_recover)
    err = max_joint_error(p, emitted, vocab, k)
    assert err <= TOL, f"round output differs from the target's joint by {err:.3e}"


def test_enumeration_uses_nontrivial_branches():
    """The harness exercises rejections, recoveries and bonuses (not only the trivial paths)."""
    cfg = CONFIGS["t1.0"]
    p, q = tables(5, 2, cfg, "sampled", seed=7)
    emitted = round_output(p, q, 5, 2, accept_probabilities, impl_recover)
    by_length = [sum(m for s, m in emitted.items() if len(s) == n) for n in (1, 2, 3)]
    assert all(0.05 < m < 0.95 for m in by_length), by_length


# Negative controls: the same harness catches known-wrong rules.


def classic_bug_recover(p_i: torch.Tensor, q_i: torch.Tensor, d_i: int) -> torch.Tensor:
    """Subtracts only q(d) at the drafted token instead of the whole q."""
    r = p_i.clone()
    r[d_i] = max(0.0, float(p_i[d_i] - q_i[d_i]))
    return r / r.sum()


def resample_from_p_recover(p_i: torch.Tensor, q_i: torch.Tensor, d_i: int) -> torch.Tensor:
    return p_i


def swapped_ratio_accept(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(d.shape[0])
    return torch.clamp(q[rows, d] / p[rows, d], max=1.0).nan_to_num(0.0)


@pytest.mark.parametrize(
    "accept_fn,recover_fn,kind",
    [
        (accept_probabilities, classic_bug_recover, "sampled"),
        (accept_probabilities, classic_bug_recover, "truncated"),
        (accept_probabilities, resample_from_p_recover, "sampled"),
        (accept_probabilities, resample_from_p_recover, "greedy"),
        (swapped_ratio_accept, impl_recover, "sampled"),
    ],
    ids=["residual-only-at-d/sampled", "residual-only-at-d/truncated", "recover-from-p/sampled",
         "recover-from-p/greedy", "swapped-ratio"],
)
def test_harness_detects_wrong_rules(accept_fn, recover_fn, kind):
    cfg = CONFIGS["t1.0"]
    p, q = tables(5, 2, cfg, kind, seed=7)
    assert max_joint_error(p, round_output(p, q, 5, 2, accept_probabilities, impl_recover), 5, 2) <= TOL
    err = max_joint_error(p, round_output(p, q, 5, 2, accept_fn, recover_fn), 5, 2)
    assert err > 1e-3, f"a wrong rule went unnoticed (error {err:.3e})"


# ----------------------------------------------------------------------------------------------
# (b) verify_sampled with controlled uniforms


def controlled_case(k: int = 3, vocab: int = 5, seed: int = 0):
    """p [K+1, V], q [K, V] and draft ids whose accept probabilities are strictly inside (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SamplingConfig(temperature=1.0)
    p = process_logits(torch.randn(k + 1, vocab, generator=gen, dtype=torch.float64), cfg)
    q = process_logits(torch.randn(k, vocab, generator=gen, dtype=torch.float64), cfg)
    d = (q / p[:k]).argmax(dim=-1)  # q/p > 1 there, so 0 < p/q < 1
    acc = accept_probabilities(p, q, d)
    assert bool(((acc > 0) & (acc < 1)).all())
    return p, q, d, acc.tolist()


def interior_points(probs: torch.Tensor) -> dict[int, list[float]]:
    """For every token with positive mass, uniforms well inside (and at the left end of) its CDF
    interval [cdf_before, cdf_through) / total."""
    total = float(probs.sum())
    cdf = torch.cumsum(probs, 0).tolist()
    points = {}
    before = 0.0
    for v, through in enumerate(cdf):
        if probs[v] > 0:
            lo, hi = before / total, through / total
            points[v] = [lo + f * (hi - lo) for f in (0.01, 0.5, 0.99)]
        before = through
    return points


def test_accept_coin_threshold_at_each_position():
    p, q, d, acc = controlled_case()
    k = len(acc)
    for i in range(k):
        before = [0.0] * i
        for u, accepted in ((acc[i] - 1e-9, True), (math.nextafter(acc[i], 0.0), True),
                            (acc[i], False), (acc[i] + 1e-9, False)):
            draws = before + [u] + [0.0] * (k - i - 1)
            samples = [0.5] * (k + 1)
            a, _ = verify_sampled(p, q, d, draws, samples)
            if accepted:
                assert a > i, (i, u, acc[i])
            else:
                assert a == i, (i, u, acc[i])


def test_accept_probability_formula():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]], dtype=torch.float64)
    q = torch.tensor([[0.4, 0.3, 0.3], [0.5, 0.0, 0.5]], dtype=torch.float64)
    acc = accept_probabilities(p, q, torch.tensor([0, 2])).tolist()
    assert acc == pytest.approx([0.25, 0.5], abs=1e-15)
    acc = accept_probabilities(p, q, torch.tensor([1, 0])).tolist()
    assert acc == [1.0, 1.0]  # p >= q: capped at 1


def test_recovered_distribution_formula():
    p = torch.tensor([0.1, 0.6, 0.3, 0.0], dtype=torch.float64)
    q = torch.tensor([0.4, 0.2, 0.1, 0.3], dtype=torch.float64)
    r = recovered_distribution(p, q)
    assert r.tolist() == pytest.approx([0.0, 0.4 / 0.6, 0.2 / 0.6, 0.0], abs=1e-15)
    # q == p: a rejection cannot happen; p comes back to keep the function total.
    assert torch.equal(recovered_distribution(p, p.clone()), p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovered_token_covers_its_cdf_interval(seed):
    p, q, d, acc = controlled_case(seed=seed)
    k = len(acc)
    for i in range(k):
        rec = recovered_distribution(p[i], q[i])
        points = interior_points(rec)
        assert set(points) == {v for v in range(p.shape[1]) if rec[v] > 0}
        assert int(d[i]) not in points  # q(d) > p(d): the rejected token cannot be recovered
        accept_draws = [0.0] * i + [0.999999] + [0.0] * (k - i - 1)
        for v, us in points.items():
            for u in us:
                samples = [0.5] * (k + 1)
                samples[i] = u
                assert verify_sampled(p, q, d, accept_draws, samples) == (i, v)


@pytest.mark.parametrize("seed", [0, 1])
def test_bonus_token_is_drawn_from_p_k(seed):
    p, q, d, acc = controlled_case(seed=seed)
    k = len(acc)
    for v, us in interior_points(p[k]).items():
        for u in us:
            samples = [0.5] * k + [u]
            assert verify_sampled(p, q, d, [0.0] * k, samples) == (k, v)


def test_draws_past_the_first_rejection_are_not_consulted():
    p, q, d, acc = controlled_case(seed=3)
    k = len(acc)
    nan = math.nan
    for i in range(k):
        accept_draws = [0.0] * i + [0.999999] + [0.0] * (k - i - 1)
        samples = [0.3] * (k + 1)
        expected = verify_sampled(p, q, d, accept_draws, samples)
        assert expected[0] == i
        nan_accept = accept_draws[: i + 1] + [nan] * (k - i - 1)
        nan_samples = [nan] * (k + 1)
        nan_samples[i] = 0.3
        assert verify_sampled(p, q, d, nan_accept, nan_samples) == expected
    # All accepted: only the bonus draw is consulted.
    expected = verify_sampled(p, q, d, [0.0] * k, [0.3] * (k + 1))
    assert expected[0] == k
    assert verify_sampled(p, q, d, [0.0] * k, [nan] * k + [0.3]) == expected


def test_k0_samples_from_p0():
    p = torch.tensor([[0.2, 0.0, 0.5, 0.3]], dtype=torch.float64)
    q = torch.zeros(0, 4, dtype=torch.float64)
    empty = torch.zeros(0, dtype=torch.long)
    assert verify_sampled(p, q, empty, [], [0.1]) == (0, 0)
    assert verify_sampled(p, q, empty, [], [0.2]) == (0, 2)
    assert verify_sampled(p, q, empty, [], [0.69]) == (0, 2)
    assert verify_sampled(p, q, empty, [], [0.71]) == (0, 3)


# ----------------------------------------------------------------------------------------------
# (c) Monte Carlo end to end


def sample_drafts(q_tab: Table, u: torch.Tensor, k: int) -> list[Prefix]:
    """Draft tokens for every trial (rows of u [N, K]): the inverse-CDF rule of `sample_index`,
    vectorised over trials (cross-checked against `sample_index` on a slice by the caller)."""
    drafts = torch.zeros(u.shape[0], k, dtype=torch.long)
    for i in range(k):
        for prefix in {tuple(r) for r in drafts[:, :i].tolist()}:
            rows = (drafts[:, :i] == torch.tensor(prefix, dtype=torch.long)).all(dim=1)
            cdf = torch.cumsum(q_tab[prefix], 0)
            idx = torch.searchsorted(cdf, (u[rows, i] * cdf[-1]).contiguous(), right=True)
            drafts[rows, i] = idx.clamp(max=cdf.shape[0] - 1)
    return [tuple(r) for r in drafts.tolist()]


def test_monte_carlo_first_token_matches_target():
    vocab, k, trials = 4, 2, 20_000
    cfg = SamplingConfig(temperature=1.0)
    p_tab, q_tab = tables(vocab, k, cfg, "sampled", seed=42)
    gen = torch.Generator().manual_seed(1234)
    u_draft = torch.rand(trials, k, generator=gen, dtype=torch.float64)
    u = torch.rand(trials, k + k + 1, generator=gen, dtype=torch.float64).tolist()
    drafts = sample_drafts(q_tab, u_draft, k)
    for t in range(300):  # the vectorised draft sampler is sample_index
        d: Prefix = ()
        for i in range(k):
            d += (sample_index(q_tab[d], float(u_draft[t, i])),)
        assert d == drafts[t]
    first = [0] * vocab
    accepted_total = 0
    cache: dict[Prefix, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for d, row in zip(drafts, u):
        if d not in cache:
            cache[d] = (
                torch.stack([p_tab[d[:i]] for i in range(k + 1)]),
                torch.stack([q_tab[d[:i]] for i in range(k)]),
                torch.tensor(d, dtype=torch.long),
            )
        p_rows, q_rows, d_ids = cache[d]
        a, token = verify_sampled(p_rows, q_rows, d_ids, row[:k], row[k:])
        accepted_total += a
        first[d[0] if a > 0 else token] += 1
    empirical = [c / trials for c in first]
    expected = p_tab[()].tolist()
    assert max(abs(e - x) for e, x in zip(empirical, expected)) < 0.02, (empirical, expected)
    # The mean number of accepted tokens matches the enumerated one.
    emitted = round_output(p_tab, q_tab, vocab, k, accept_probabilities, impl_recover)
    mean_accepted = sum((len(s) - 1) * m for s, m in emitted.items())
    assert abs(accepted_total / trials - mean_accepted) < 0.03, (accepted_total / trials, mean_accepted)


# ----------------------------------------------------------------------------------------------
# (d) Greedy on literal tables


def greedy(argmax: list[int], draft: list[int]) -> tuple[int, int]:
    return verify_greedy(torch.tensor(argmax, dtype=torch.long), torch.tensor(draft, dtype=torch.long))


def test_greedy_perfect_match_takes_bonus():
    assert greedy([5, 3, 9, 7], [5, 3, 9]) == (3, 7)


def test_greedy_mismatch_at_first_position():
    assert greedy([5, 3, 9, 7], [4, 3, 9]) == (0, 5)


def test_greedy_mismatch_in_the_middle():
    assert greedy([5, 3, 9, 7], [5, 2, 9]) == (1, 3)
    assert greedy([5, 3, 9, 7], [5, 3, 1]) == (2, 9)


def test_greedy_mismatch_after_mismatch_uses_the_first():
    assert greedy([5, 3, 9, 7], [5, 0, 0]) == (1, 3)


def test_greedy_k0():
    assert greedy([8], []) == (0, 8)


def test_greedy_from_logits_like_the_verifier():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5], [0.0, 0.2, 0.1]])
    assert verify_greedy(logits.argmax(dim=-1), torch.tensor([1, 0])) == (2, 1)
    assert verify_greedy(logits.argmax(dim=-1), torch.tensor([1, 2])) == (1, 0)


# ----------------------------------------------------------------------------------------------
# The same enumeration with the sampling parameters whose distribution depends on the tokens before
# each position: every row of a block (target and draft) is processed with the context before it,
# the block's earlier draft tokens included, as the verifier and the proposer do.

PROMPT = (1, 3, 3, 0)  # the round starts after these; the request's output started at position 2
PENALTY_CONFIGS = {
    "rep1.5": SamplingConfig(temperature=1.0, repetition_penalty=1.5, output_start=2),
    "freq0.9-pres0.6": SamplingConfig(temperature=1.0, frequency_penalty=0.9, presence_penalty=0.6, output_start=2),
    "pres-1.2-k3": SamplingConfig(temperature=0.8, top_k=3, presence_penalty=-1.2, output_start=2),
    "minp0.15-bias": SamplingConfig(temperature=1.2, min_p=0.15, logit_bias=((0, 1.5), (4, -2.0)), output_start=2),
    "all": SamplingConfig(temperature=1.1, top_p=0.9, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                          presence_penalty=0.4, logit_bias=((2, 0.7),), output_start=2),
}


def context_table(logits: dict[Prefix, torch.Tensor], cfg: SamplingConfig) -> Table:
    """p(.|PROMPT + prefix) with the context-dependent processing, one prefix at a time."""
    return {s: process_logits(x[None], cfg, PROMPT + s)[0] for s, x in logits.items()}


@pytest.mark.openai
@pytest.mark.parametrize("kind", ["sampled", "truncated", "same_as_target"])
@pytest.mark.parametrize("cfg_name", list(PENALTY_CONFIGS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_round_output_is_exact_with_penalties_across_the_block(k, cfg_name, kind):
    cfg = PENALTY_CONFIGS[cfg_name]
    vocab = 5
    t_logits = random_logits(vocab, k, 7 * k + list(PENALTY_CONFIGS).index(cfg_name))
    d_logits = random_logits(vocab, k - 1, 500 + k)
    p = context_table(t_logits, cfg)
    if kind == "same_as_target":
        q = {s: p[s] for s in d_logits}
    else:
        q = context_table(d_logits, cfg)
        if kind == "truncated":
            q = {s: dense_from_sparse(*truncate_top(row, 2), vocab) for s, row in q.items()}
    emitted = round_output(p, q, vocab, k, accept_probabilities, impl_recover)
    err = max_joint_error(p, emitted, vocab, k)
    assert err <= TOL, f"round output differs from the target's joint by {err:.3e}"
    # Penalties did depend on the block: some row differs from the same logits without its prefix.
    plain = {s: process_logits(x[None], cfg, PROMPT)[0] for s, x in t_logits.items()}
    if cfg.repetition_penalty != 1.0 or cfg.presence_penalty or cfg.frequency_penalty:
        assert any(not torch.allclose(p[s], plain[s]) for s in p if s)


@pytest.mark.openai
def test_block_rows_equal_one_row_at_a_time():
    """What the verifier computes for a block at once (rows [K+1, V] with the block as context)
    equals each position computed alone with its own context: draft tokens earlier in the block
    are penalised exactly as committed ones would be."""
    cfg = PENALTY_CONFIGS["all"]
    gen = torch.Generator().manual_seed(3)
    committed, draft = [1, 3, 3, 0, 2], [2, 2, 4]
    rows = torch.randn(len(draft) + 1, 5, generator=gen)
    block = process_logits(rows, cfg, committed + draft)
    for j in range(len(draft) + 1):
        alone = process_logits(rows[j:j + 1], cfg, committed + draft[:j])[0]
        assert torch.allclose(block[j], alone, atol=1e-15, rtol=0)
