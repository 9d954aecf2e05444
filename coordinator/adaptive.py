"""Choosing K per round (Leviathan et al., arXiv 2211.17192, section 3.4).

With acceptance rate alpha (probability that a draft token is accepted) and cost ratio
c = (draft time per token) / (target time per verify pass), a block of K draft tokens yields
(1 - alpha^(K+1)) / (1 - alpha) tokens per target pass, for a wall-time gain of
(1 - alpha^(K+1)) / ((1 - alpha) * (K * c + 1)) over plain decoding. K = 0 gives 1: when no K
beats it, speculation is switched off.

The paper assumes a verify pass costs the same whatever K. That holds for one sequence on a
memory-bound accelerator, not for a large batch, where every draft token of every session adds
work: the pass then costs (1 + g * K) times a plain one, with g growing with the verify batch
size (`verify_growth_per_session` per session in the pass). So at high load K falls, to 0 if
speculation would lose (vLLM's slowdowns at high QPS are this effect).
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_gain(alpha: float, cost_ratio: float, k: int, verify_growth: float = 0.0) -> float:
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + 1.0 + verify_growth * k)


def best_k(alpha: float, cost_ratio: float, max_k: int, verify_growth: float = 0.0) -> int:
    return max(range(max_k + 1), key=lambda k: (expected_gain(alpha, cost_ratio, k, verify_growth), -k))


@dataclass
class AdaptiveK:
    """Running estimates of alpha and c (exponential moving averages) and the K they imply."""

    max_k: int
    alpha: float = 0.8  # optimistic start so that speculation is tried
    cost_ratio: float = 0.1
    smoothing: float = 0.3
    probe_every: int = 8  # at K = 0 nothing is learnt; try K = 1 now and then
    verify_growth_per_session: float = 0.02
    batch_size: float = 1.0  # sessions per verify pass, smoothed
    _rounds_at_zero: int = 0

    def next_k(self) -> int:
        growth = self.verify_growth_per_session * max(0.0, self.batch_size - 1.0)
        k = best_k(self.alpha, self.cost_ratio, self.max_k, growth)
        if k == 0:
            self._rounds_at_zero += 1
            if self._rounds_at_zero >= self.probe_every:
                self._rounds_at_zero = 0
                return 1
        return k

    def observe(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float, batch_size: int = 1) -> None:
        s = self.smoothing
        self.batch_size = (1 - s) * self.batch_size + s * batch_size
        if drafted == 0 or verify_ms <= 0:
            return
        self.alpha = (1 - s) * self.alpha + s * (accepted / drafted)
        self.cost_ratio = (1 - s) * self.cost_ratio + s * (draft_ms / drafted / verify_ms)
