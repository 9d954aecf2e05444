"""The exact accept/reject rule of speculative sampling (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318). Tensors in, tensors out: no I/O, no protobuf, no config object.

Terms (as in vLLM's rejection sampler):
- *accepted* tokens: a prefix of the draft tokens that the target keeps;
- *recovered* token: at the first rejection, a token drawn from norm(max(0, p_i - q_i)) instead;
- *bonus* token: when all K draft tokens are accepted, a token drawn from the target's
  distribution after the last draft token, p_K.
Each round therefore commits accepted + 1 tokens. Only the accepted ones count as accepted.

Why the output has exactly the target's distribution: at position i the draft token d ~ q_i is
kept with probability min(1, p_i(d) / q_i(d)), so token v comes out of the accept branch with
probability min(q_i(v), p_i(v)); the reject branch has total probability 1 - sum_v min(p_i, q_i)
= sum_v max(0, p_i - q_i) and then emits v with probability max(0, p_i(v) - q_i(v)) / that sum.
Adding the two: min(p, q) + max(0, p - q) = p_i(v).
"""

from __future__ import annotations

import torch

from specdec_core.engine.sampling import sample_index


def accept_probabilities(p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """min(1, p_i(d_i) / q_i(d_i)) for each draft position.

    p: [K(+1), V] target probabilities, q: [K, V] draft probabilities, draft_ids: [K] -> [K].
    """
    k = draft_ids.shape[0]
    rows = torch.arange(k)
    p_d = p[rows, draft_ids]  # [K]
    q_d = q[rows, draft_ids]  # [K]; > 0 since the draft sampled d_i from q_i
    return torch.clamp(p_d / q_d, max=1.0)


def recovered_distribution(p_i: torch.Tensor, q_i: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_i - q_i)) over the vocabulary [V]: what to draw from after a rejection.

    The whole draft distribution is subtracted, not only the rejected token's probability.
    A rejection has probability 0 when p_i == q_i, so the zero vector cannot be reached; p_i is
    returned for it to keep the function total.
    """
    residual = torch.clamp(p_i - q_i, min=0.0)  # [V]
    total = residual.sum()
    return residual / total if total > 0 else p_i


def verify_sampled(
    p: torch.Tensor,  # [K+1, V] target probabilities after each committed/draft token
    q: torch.Tensor,  # [K, V] the draft distributions the draft tokens were sampled from
    draft_ids: torch.Tensor,  # [K]
    accept_draws: list[float],  # [K] uniform draws for the accept coins
    sample_draws: list[float],  # [K+1] uniform draws for a recovered/bonus token at each position
) -> tuple[int, int]:
    """Returns (number of accepted draft tokens a, the recovered or bonus token).

    Accept d_i while u_i < min(1, p_i(d_i)/q_i(d_i)); at the first rejection draw the recovered
    token from norm(max(0, p_i - q_i)); if all K are accepted draw the bonus token from p_K.
    Draws past the first rejection are never consulted.
    """
    k = draft_ids.shape[0]
    if k:
        accepted = torch.tensor(accept_draws[:k], dtype=p.dtype) < accept_probabilities(p, q, draft_ids)
        rejected = (~accepted).nonzero()
        if rejected.numel():
            a = int(rejected[0, 0])
            return a, sample_index(recovered_distribution(p[a], q[a]), sample_draws[a])
    return k, sample_index(p[k], sample_draws[k])


def verify_greedy(target_argmax: torch.Tensor, draft_ids: torch.Tensor) -> tuple[int, int]:
    """Greedy: accept while d_i == argmax p_i; then emit argmax p at the first mismatch (or the
    bonus argmax p_K). target_argmax: [K+1], draft_ids: [K]."""
    k = draft_ids.shape[0]
    mismatch = (target_argmax[:k] != draft_ids).nonzero()
    a = int(mismatch[0, 0]) if mismatch.numel() else k
    return a, int(target_argmax[a])
