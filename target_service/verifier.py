"""Verification: one forward pass over the uncached tail of the committed sequence plus the
draft tokens, then the exact rule from `acceptance`. K = 0 is plain target decoding."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from specdec_core import metrics
from specdec_core.errors import InvalidArgument
from specdec_core.kvcache import SessionCaches
from specdec_core.sampling import (
    Purpose,
    SamplingConfig,
    dense_from_sparse,
    keyed_uniform,
    process_logits,
    validate_sampling,
)
from target_service.acceptance import verify_greedy, verify_sampled


@dataclass(frozen=True)
class VerifyTask:
    session_id: str
    committed_ids: list[int]
    draft_ids: list[int]
    sampling: SamplingConfig
    seed: int = 0
    # Sparse (token_ids, probs) per draft token when sampling; empty when greedy.
    draft_dists: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token_id: int
    prefill_tokens: int
    compute_ms: float
    batch_size: int = 1


class Verifier:
    def __init__(self, caches: SessionCaches, max_context: int):
        self.caches = caches
        self.vocab_size = caches.backend.vocab_size
        self.max_context = max_context
        self._lock = threading.Lock()  # one forward pass at a time

    def verify(self, task: VerifyTask) -> VerifyResult:
        self._validate(task)
        n, k = len(task.committed_ids), len(task.draft_ids)
        with self._lock:
            started = time.perf_counter()
            with self.caches.lease(task.session_id, task.committed_ids) as seq:
                prefill = n - len(seq.token_ids)
                logits = self.caches.extend(seq, task.committed_ids[len(seq.token_ids):] + task.draft_ids)
                logits = logits[-(k + 1):]  # [K+1, V]: after x[n-1], d[0], ..., d[K-1]
                num_accepted, next_token = self._decide(task, logits, n)
                self.caches.crop(seq, n + num_accepted)  # rejected drafts never stay cached
            compute_ms = (time.perf_counter() - started) * 1e3
        metrics.FORWARD_SECONDS.labels("target").observe(compute_ms / 1e3)
        metrics.VERIFY_BATCH.observe(1)
        return VerifyResult(num_accepted, next_token, prefill, compute_ms)

    def _decide(self, task: VerifyTask, logits: torch.Tensor, n: int) -> tuple[int, int]:
        draft_ids = torch.tensor(task.draft_ids, dtype=torch.long)  # [K]
        if task.sampling.is_greedy:
            return verify_greedy(logits.argmax(dim=-1), draft_ids)
        k = len(task.draft_ids)
        p = process_logits(logits, task.sampling)  # [K+1, V]
        q = torch.stack([dense_from_sparse(ids, probs, self.vocab_size) for ids, probs in task.draft_dists]) if k else p[:0]
        accept_draws = [keyed_uniform(task.seed, n + i, Purpose.ACCEPT) for i in range(k)]
        sample_draws = [keyed_uniform(task.seed, n + i, Purpose.TARGET) for i in range(k + 1)]
        return verify_sampled(p, q, draft_ids, accept_draws, sample_draws)

    def _validate(self, task: VerifyTask) -> None:
        if not task.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if not task.committed_ids:
            raise InvalidArgument("committed_ids", "must not be empty")
        validate_sampling(task.sampling)
        for name, ids in (("committed_ids", task.committed_ids), ("draft_ids", task.draft_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument(name, f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(task.committed_ids) + len(task.draft_ids) > self.max_context:
            raise InvalidArgument("draft_ids", f"sequence would exceed the model's context of {self.max_context}")
        if task.sampling.is_greedy:
            return
        if len(task.draft_dists) != len(task.draft_ids):
            raise InvalidArgument("draft_distributions", "need one distribution per draft token when sampling")
        for i, (token, (ids, probs)) in enumerate(zip(task.draft_ids, task.draft_dists)):
            if len(ids) != len(probs) or len(set(ids)) != len(ids) or not all(p >= 0 for p in probs) or sum(probs) <= 0:
                raise InvalidArgument(f"draft_distributions[{i}]", "token_ids (distinct) and probs must pair up, probs >= 0")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidArgument(f"draft_distributions[{i}].token_ids", "token id outside the vocabulary")
            if token not in ids or probs[ids.index(token)] <= 0:
                raise InvalidArgument(f"draft_distributions[{i}]", f"draft token {token} has probability 0 in it")
