"""Choosing K per round (Leviathan et al., arXiv 2211.17192, section 3.4).

With acceptance rate alpha (probability that a draft token is accepted) and cost ratio
c = (draft time per token) / (target time per verify pass), a block of K draft tokens yields
(1 - alpha^(K+1)) / (1 - alpha) tokens per target pass, for a wall-time gain of
(1 - alpha^(K+1)) / ((1 - alpha) * (K * c + 1)) over plain decoding. K = 0 gives 1: when no K
beats it, speculation is switched off.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_gain(alpha: float, cost_ratio: float, k: int) -> float:
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + 1.0)


def best_k(alpha: float, cost_ratio: float, max_k: int) -> int:
    return max(range(max_k + 1), key=lambda k: (expected_gain(alpha, cost_ratio, k), -k))


@dataclass
class AdaptiveK:
    """Running estimates of alpha and c (exponential moving averages) and the K they imply."""

    max_k: int
    alpha: float = 0.8  # optimistic start so that speculation is tried
    cost_ratio: float = 0.1
    smoothing: float = 0.3
    probe_every: int = 8  # at K = 0 nothing is learnt; try K = 1 now and then
    _rounds_at_zero: int = 0

    def next_k(self) -> int:
        k = best_k(self.alpha, self.cost_ratio, self.max_k)
        if k == 0:
            self._rounds_at_zero += 1
            if self._rounds_at_zero >= self.probe_every:
                self._rounds_at_zero = 0
                return 1
        return k

    def observe(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:
        if drafted == 0 or verify_ms <= 0:
            return
        s = self.smoothing
        self.alpha = (1 - s) * self.alpha + s * (accepted / drafted)
        self.cost_ratio = (1 - s) * self.cost_ratio + s * (draft_ms / drafted / verify_ms)
