"""Logit processing that draft and target must apply identically, and keyed randomness.

Processing order (as transformers' generate): temperature, then top-k, then top-p. Everything is
done in float64 so that the probabilities the draft sends and the ones the target recomputes agree
bit for bit when they come from the same numbers.

Randomness is keyed, not stateful: every draw is a pure function of (seed, absolute position,
purpose), so a request's output does not depend on batching, retries or which replica served it.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingConfig()


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn raw logits [N, V] into sampling probabilities [N, V] (float64), rows summing to 1."""
    if cfg.is_greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    x = logits.to(torch.float64) / cfg.temperature  # [N, V]
    vocab_size = x.shape[-1]
    if 0 < cfg.top_k < vocab_size:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]  # [N, 1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [N, V]
        drop_sorted = mass_before >= cfg.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Purpose(enum.IntEnum):
    """What a random draw is for; part of its key, so different uses never share a draw."""

    DRAFT = 1  # the draft samples its token at a position
    ACCEPT = 2  # the target's accept/reject coin at a position
    TARGET = 3  # the target samples a recovered or bonus token at a position


def keyed_uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position, purpose)."""
    key = struct.pack("<QQI", seed & 0xFFFFFFFFFFFFFFFF, position, int(purpose))
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11
    return bits / float(1 << 53)


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from a 1-D probability vector with the uniform draw u.

    Token v is chosen iff the cumulative mass before it is <= u * total < the mass through it,
    so every token with positive probability gets exactly its share of [0, 1).
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    target = u * cdf[-1].item()
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True).item())
    index = min(index, probs.shape[0] - 1)
    while probs[index] <= 0 and index > 0:  # u * total landed on the boundary of a zero tail
        index -= 1
    return index


def truncate_top(probs: torch.Tensor, max_tokens: int) -> tuple[list[int], list[float]]:
    """Keep the `max_tokens` most likely tokens of a 1-D distribution (sparse, ids ascending).

    The draft samples from the truncated, renormalised distribution and sends exactly it, which
    keeps messages small without giving up exactness (the target verifies against what was sent).
    Probabilities are rounded to float32 here, once, because that is what travels on the wire.
    """
    nonzero = int((probs > 0).sum().item())
    keep = min(max_tokens, nonzero) if max_tokens > 0 else nonzero
    values, ids = torch.topk(probs, keep)
    ids, order = torch.sort(ids)
    values = values[order].to(torch.float32)
    values = values / values.sum()
    return ids.tolist(), values.tolist()


def dense_from_sparse(token_ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor:
    """The dense float64 distribution [V] a sparse one stands for (renormalised in float64)."""
    dense = torch.zeros(vocab_size, dtype=torch.float64)
    if token_ids:
        dense[torch.tensor(token_ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float64)
    return dense / dense.sum()


def validate_sampling(cfg: SamplingConfig, field: str = "sampling") -> None:
    """Raise InvalidArgument naming the offending field."""
    from specdec_core.errors import InvalidArgument

    if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
        raise InvalidArgument(f"{field}.temperature", f"must be finite and >= 0, got {cfg.temperature}")
    if cfg.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0, got {cfg.top_k}")
    if not (0.0 < cfg.top_p <= 1.0):  # also rejects NaN
        raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {cfg.top_p}")
