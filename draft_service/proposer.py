"""Proposing draft tokens with a model whose per-session KV cache follows the committed prefix.

Greedy: the argmax at each step. Sampled: the draft's distribution after the same processing the
target applies (temperature, top-k, top-p), truncated to its `sparse_top` most likely tokens; the
token is drawn from exactly that truncated distribution and the distribution is sent with it, so
verification stays exact (DESIGN.md: a draft may propose from any distribution it likes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from specdec_core import metrics
from specdec_core.errors import InvalidArgument
from specdec_core.kvcache import SessionCaches
from specdec_core.sampling import (
    Purpose,
    SamplingConfig,
    keyed_uniform,
    process_logits,
    sample_index,
    truncate_top,
    validate_sampling,
)

SparseDist = tuple[list[int], list[float]]


@dataclass(frozen=True)
class ProposeTask:
    session_id: str
    committed_ids: list[int]
    num_tokens: int
    sampling: SamplingConfig
    seed: int = 0
    min_confidence: float = 0.0  # stop the block when the next token's draft probability is lower


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    dists: list[SparseDist]  # empty when greedy
    prefill_tokens: int
    compute_ms: float


class ModelProposer:
    def __init__(self, caches: SessionCaches, max_context: int, sparse_top: int = 64):
        self.caches = caches
        self.vocab_size = caches.backend.vocab_size
        self.max_context = max_context
        self.sparse_top = sparse_top
        self._lock = threading.Lock()

    def propose(self, task: ProposeTask) -> Proposal:
        self._validate(task)
        n = len(task.committed_ids)
        k = min(task.num_tokens, self.max_context - n) if self.max_context else task.num_tokens
        token_ids: list[int] = []
        dists: list[SparseDist] = []
        with self._lock:
            started = time.perf_counter()
            with self.caches.lease(task.session_id, task.committed_ids) as seq:
                prefill = n - len(seq.token_ids)
                logits = self.caches.extend(seq, task.committed_ids[len(seq.token_ids):])[-1]  # [V]
                for i in range(k):
                    token, confidence, dist = self._choose(logits, task, n + i)
                    if i > 0 and confidence < task.min_confidence:
                        break
                    token_ids.append(token)
                    if dist is not None:
                        dists.append(dist)
                    if i + 1 < k:
                        logits = self.caches.extend(seq, [token])[-1]
            compute_ms = (time.perf_counter() - started) * 1e3
        metrics.FORWARD_SECONDS.labels("draft").observe(compute_ms / 1e3)
        return Proposal(token_ids, dists, prefill, compute_ms)

    def _choose(self, logits: torch.Tensor, task: ProposeTask, position: int) -> tuple[int, float, SparseDist | None]:
        """(token, the draft's confidence, the sparse distribution the token was drawn from).

        Confidence is the draft's largest probability at this position, known before the draw:
        stopping a block on it never conditions a sent token on its own value, which would bias
        the tokens against the distributions sent with them."""
        if task.sampling.is_greedy:
            token = int(logits.argmax())
            confidence = float(torch.softmax(logits.double(), -1)[token]) if task.min_confidence > 0 else 1.0
            return token, confidence, None
        ids, probs = truncate_top(process_logits(logits[None], task.sampling)[0], self.sparse_top)
        i = sample_index(torch.tensor(probs, dtype=torch.float64), keyed_uniform(task.seed, position, Purpose.DRAFT))
        return int(ids[i]), max(probs), (ids, probs)

    def _validate(self, task: ProposeTask) -> None:
        if not task.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if not task.committed_ids:
            raise InvalidArgument("committed_ids", "must not be empty")
        if task.num_tokens < 1:
            raise InvalidArgument("num_tokens", f"must be >= 1, got {task.num_tokens}")
        validate_sampling(task.sampling)
        bad = [t for t in task.committed_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument("committed_ids", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
