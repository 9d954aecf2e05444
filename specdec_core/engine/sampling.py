"""Logit processing that draft and target must apply identically, and keyed randomness.

Processing order: the repetition penalty (transformers' and vLLM's: every token anywhere in the
context, input or output, has its logit divided by it when positive and multiplied by it when
negative), then frequency and presence penalties (OpenAI's: each token generated so far by this
request lowers its logit by frequency_penalty per occurrence plus presence_penalty once), then
logit bias, then the structured-output constraint's mask (`grammar`: tokens it forbids get -inf); then temperature, top-k, top-p and min-p (in transformers' order). Penalties depend on
the tokens before each position, the draft tokens earlier in the same block included, so draft
and target each apply them per position of the block. Everything is done in float64 so that the
probabilities the draft sends and the ones the target recomputes agree bit for bit when they come
from the same numbers.

Randomness is keyed, not stateful: every draw is a pure function of (seed, absolute position,
purpose), so a request's output does not depend on batching, retries or which replica served it.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec_core import metrics
from specdec_core.engine.grammar import Constraint, Grammars


MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 1024  # most biased tokens per request
MAX_BIAS = 100.0  # |bias| at most (OpenAI's range)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # report the chosen token's log-probability and this many alternatives
    output_start: int = 0  # position of the request's first generated token: what penalties count from
    constraint: Constraint | None = None  # structured output: what the output must match

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits depend on the context (penalties, a constraint) or are biased before anything else."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or self.constraint is not None


GREEDY = SamplingConfig()


def sampling_to_dict(cfg: SamplingConfig) -> dict:
    """What a session records of a request's sampling (JSON-ready; `sampling_from_dict` reads it)."""
    d = {name: getattr(cfg, name) for name in cfg.__dataclass_fields__ if name != "output_start"}
    return {**d, "logit_bias": [list(pair) for pair in cfg.logit_bias],
            "constraint": cfg.constraint.to_dict() if cfg.constraint else None}


def sampling_from_dict(d: dict) -> SamplingConfig:
    """Records written before a field existed get its default."""
    constraint = Constraint.from_dict(d["constraint"]) if d.get("constraint") else None
    return SamplingConfig(**{**d, "logit_bias": tuple(tuple(pair) for pair in d.get("logit_bias", ())),
                             "constraint": constraint})


def adjust_logits(logits: torch.Tensor, cfg: SamplingConfig, tokens: Sequence[int] = (),
                  grammars: Grammars | None = None) -> torch.Tensor:
    """Penalties, logit bias and the constraint's mask (compiled by `grammars`). Row j of logits [N, V] scores the token after
    tokens[:len(tokens) - N + 1 + j]: the last row follows all of `tokens`, and each earlier row
    one token fewer (a verify block's rows follow the committed tokens plus 0..K draft tokens).
    Returns logits unchanged (same tensor) when the config adjusts nothing, float64 otherwise."""
    if not cfg.adjusts_logits:
        return logits
    rows, vocab = logits.shape
    x = logits.to(torch.float64, copy=True)
    base = len(tokens) - rows + 1  # row 0's context length
    ids = torch.tensor(list(tokens), dtype=torch.long)
    ids = ids.masked_fill(ids >= vocab, -1)  # ids this model does not score count for nothing
    penalise_repeats = cfg.repetition_penalty != 1.0
    count_output = cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0
    seen = torch.zeros(vocab + 1, dtype=torch.bool)  # [V + 1]: the last slot takes the ignored ids
    counts = torch.zeros(vocab + 1, dtype=torch.float64)
    if penalise_repeats:
        seen[ids[:base]] = True
    if count_output and cfg.output_start < base:
        counts += torch.bincount(ids[cfg.output_start:base] % (vocab + 1), minlength=vocab + 1)
    for j in range(rows):
        if j:  # the token between row j-1 and row j joins the context
            token = int(ids[base + j - 1]) % (vocab + 1)
            seen[token] = True
            counts[token] += 1 if base + j - 1 >= cfg.output_start else 0
        row = x[j]
        if penalise_repeats:
            mask = seen[:vocab]
            row[mask] = torch.where(row[mask] > 0, row[mask] / cfg.repetition_penalty,
                                    row[mask] * cfg.repetition_penalty)
        if count_output:
            c = counts[:vocab]
            row -= cfg.frequency_penalty * c + cfg.presence_penalty * (c > 0).to(torch.float64)
    if cfg.logit_bias:
        bias_ids = torch.tensor([i for i, _ in cfg.logit_bias if i < vocab], dtype=torch.long)
        x[:, bias_ids] += torch.tensor([b for i, b in cfg.logit_bias if i < vocab], dtype=torch.float64)
    if cfg.constraint is not None:
        if grammars is None:
            raise ValueError("a constrained request needs the process's Grammars")
        started = time.perf_counter()
        x.masked_fill_(~grammars.masks(cfg.constraint, tokens, rows, cfg.output_start), -math.inf)
        metrics.GRAMMAR_SECONDS.labels("mask").inc(time.perf_counter() - started)
        metrics.GRAMMAR_ROWS.inc(rows)
    return x


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, tokens: Sequence[int] = (),
                   grammars: Grammars | None = None) -> torch.Tensor:
    """Turn raw logits [N, V] into sampling probabilities [N, V] (float64), rows summing to 1.
    Rows, `tokens` and `grammars` as in `adjust_logits` (needed only when the config adjusts logits)."""
    return warp(adjust_logits(logits, cfg, tokens, grammars), cfg)


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p: adjusted logits [N, V] -> probabilities [N, V] (float64)."""
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
    if cfg.min_p > 0.0:  # keep tokens at least min_p times as likely as the most likely one
        floor = cfg.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


SparseDist = tuple[list[int], list[float]]  # a distribution's support and its probabilities


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the `top` most likely tokens' (impossible ones left out)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logp: torch.Tensor, chosen: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of logp [N, V] is the log of the distribution chosen[i] came from: after every step of
    processing when sampling, the log-softmax of the penalised, biased logits when greedy."""
    out = []
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1) if top else (None, None)
    for i, token in enumerate(chosen):
        alternatives = [] if ids is None else [
            (int(t), float(v)) for t, v in zip(ids[i].tolist(), values[i].tolist()) if v != -math.inf]
        out.append(TokenLogprob(int(token), float(logp[i, token]), alternatives))
    return out


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


def draw_draft(logits: torch.Tensor, cfg: SamplingConfig, seed: int, position: int, top: int) -> tuple[int, SparseDist]:
    """A sampled draft token at `position` (what a draft model or head sends): the distribution of
    logits [V] (already penalised and biased) after temperature, top-k and top-p, truncated to its
    `top` most likely tokens, and the token drawn from it with the draft's keyed draw. That sparse
    distribution is the q sent with the token, which the accept rule verifies against."""
    ids, probs = truncate_top(warp(logits[None], cfg)[0], top)
    i = sample_index(torch.tensor(probs, dtype=torch.float64), keyed_uniform(seed, position, Purpose.DRAFT))
    return int(ids[i]), (ids, probs)


def dense_from_sparse(token_ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor:
    """The dense float64 distribution [V] a sparse one stands for (renormalised in float64)."""
    dense = torch.zeros(vocab_size, dtype=torch.float64)
    if token_ids:
        dense[torch.tensor(token_ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float64)
    return dense / dense.sum()


def validate_sampling(cfg: SamplingConfig, field: str = "sampling", vocab_size: int | None = None) -> None:
    """Raise InvalidArgument naming the offending field."""
    from specdec_core.errors import InvalidArgument

    if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
        raise InvalidArgument(f"{field}.temperature", f"must be finite and >= 0, got {cfg.temperature}")
    if cfg.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0, got {cfg.top_k}")
    if not (0.0 < cfg.top_p <= 1.0):  # also rejects NaN
        raise InvalidArgument(f"{field}.top_p", f"must be in (0, 1], got {cfg.top_p}")
    if not 0.0 <= cfg.min_p <= 1.0:
        raise InvalidArgument(f"{field}.min_p", f"must be in [0, 1], got {cfg.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(cfg, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(f"{field}.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not (math.isfinite(cfg.repetition_penalty) and cfg.repetition_penalty > 0):
        raise InvalidArgument(f"{field}.repetition_penalty", f"must be finite and > 0, got {cfg.repetition_penalty}")
    if len(cfg.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"{field}.logit_bias", f"{len(cfg.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
    for token, bias in cfg.logit_bias:
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidArgument(f"{field}.logit_bias", f"token id {token} outside the vocabulary "
                                                         f"[0, {vocab_size})")
        if not -MAX_BIAS <= bias <= MAX_BIAS:  # also rejects NaN
            raise InvalidArgument(f"{field}.logit_bias", f"bias of token {token} must be in "
                                                         f"[-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
    if cfg.logprobs is not None and not 0 <= cfg.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"{field}.logprobs", f"must be in 0..{MAX_LOGPROBS}, got {cfg.logprobs}")
    if cfg.output_start < 0:
        raise InvalidArgument(f"{field}.output_start", f"must be >= 0, got {cfg.output_start}")
    # The constraint is checked where it is compiled (grammar.check_in, beside every call of this),
    # once per constraint, not on every round.
