"""Proposing draft tokens with a model whose per-session KV cache follows the committed prefix.

Greedy: the argmax at each step (after the same penalties and bias the target applies). Sampled:
the draft's distribution after the same processing the target applies, truncated to its `sparse_top` most likely tokens; the
token is drawn from exactly that truncated distribution and the distribution is sent with it, so
verification stays exact (DESIGN.md: a draft may propose from any distribution it likes).

Concurrent proposals from different sessions run in lockstep: their prefills share one model
step, then each further draft step feeds every still-drafting session's last token together.

A long prefill goes through in chunks of at most `prefill_chunk` tokens, one per batch, beside the
other sessions' blocks (as in the target): without it, a session whose context the draft has not
seen (a long prompt, or a session the policy turns to the draft mid-request) holds every other
session's proposal for its whole prefill: 1.8 s on one core for the benchmark's longest prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from specdec_core import metrics
from specdec_core.engine.batching import AGAIN, BatchQueue
from specdec_core.engine.grammar import Grammars, check_in
from specdec_core.engine.kvcache import CachedSequence, SessionCaches
from specdec_core.engine.sampling import SamplingConfig, SparseDist, adjust_logits, draw_draft, validate_sampling
from specdec_core.errors import InvalidArgument, ResourceExhausted, SpecdecError
from specdec_core.limits import check_token_ids
from specdec_core.logs import short_id


@dataclass(frozen=True)
class ProposeTask:
    session_id: str
    committed_ids: list[int]
    num_tokens: int
    sampling: SamplingConfig
    seed: int = 0
    min_confidence: float = 0.0  # stop the block when the draft's confidence falls below this
    # True once the caller has gone away (e.g. an overlapped draft the coordinator cancelled):
    # the session then drops out of the lockstep at the next step
    is_cancelled: Callable[[], bool] = field(default=lambda: False, compare=False, repr=False)


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    dists: list[SparseDist]  # empty when greedy
    prefill_tokens: int
    compute_ms: float  # the batch's
    batch_size: int = 1
    batch_prefill_tokens: int = 0  # the batch's prefill, all sessions together


@dataclass
class _Drafting:
    task: ProposeTask
    seq: CachedSequence
    k: int
    prefill: int
    token_ids: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)
    is_done: bool = False


class ModelProposer:
    def __init__(self, caches: SessionCaches, max_context: int, sparse_top: int = 64, window_s: float = 0.001,
                 max_batch: int = 32, max_queue: int = 64, prefill_chunk: int = 0, grammars: Grammars | None = None):
        self.caches = caches
        self.grammars = grammars  # structured outputs' constraints (None: constrained calls are refused)
        self.prefill_chunk = prefill_chunk  # most uncached tokens of a session per batch (0: no limit)
        self.vocab_size = caches.backend.vocab_size
        self.max_context = max_context
        self.sparse_top = sparse_top
        self.queue = BatchQueue(self._propose_batch, window_s, max_batch, max_queue, name="propose")

    def propose(self, task: ProposeTask, is_cancelled: Callable[[], bool] = lambda: False,
                deadline: float | None = None) -> Proposal:
        self._validate(task)
        return self.queue.submit(replace(task, is_cancelled=is_cancelled), task.session_id, is_cancelled, deadline)

    def _propose_batch(self, tasks: list[ProposeTask]) -> list[Proposal | BaseException]:
        started = time.perf_counter()
        results: list[Proposal | BaseException | None] = [None] * len(tasks)
        with ExitStack() as stack:
            drafting: dict[int, _Drafting] = {}
            for i, task in enumerate(tasks):
                n = len(task.committed_ids)
                k = min(task.num_tokens, self.max_context - n) if self.max_context else task.num_tokens
                if k <= 0:  # past the draft's context: no proposal, the session decodes plainly
                    results[i] = Proposal([], [], 0, 0.0)
                    continue
                try:
                    seq = stack.enter_context(self.caches.lease(task.session_id, task.committed_ids))
                except Exception as exc:  # noqa: BLE001 - that session alone fails, never its batch
                    results[i] = exc
                    continue
                drafting[i] = _Drafting(task, seq, k, n - len(seq.token_ids))
            self._admit(drafting, results)
            chunked = {i: drafting.pop(i) for i in list(drafting) if 0 < self.prefill_chunk < drafting[i].prefill}
            for i in chunked:  # a chunk of a long prefill: the rest in the next batches, beside others' blocks
                results[i] = AGAIN
            chunks = [(d.seq, d.task.committed_ids[len(d.seq.token_ids):][:self.prefill_chunk])
                      for d in chunked.values()]
            feeds = [(d, d.task.committed_ids[len(d.seq.token_ids):]) for d in drafting.values()]
            batch_prefill = sum(d.prefill for d in drafting.values()) + sum(len(ids) for _, ids in chunks)
            while feeds or chunks:  # the chunks go with the first step (their logits are not read)
                logits = self.caches.extend_batch([(d.seq, ids) for d, ids in feeds] + chunks,
                                                  [1] * (len(feeds) + len(chunks)))
                feeds = [(d, [token]) for (d, _), rows in zip(feeds, logits)
                         if (token := self._step(d, rows[-1])) is not None and not d.task.is_cancelled()]
                chunks = []
        compute_ms = (time.perf_counter() - started) * 1e3
        metrics.FORWARD_SECONDS.labels("draft").observe(compute_ms / 1e3)
        for i, d in drafting.items():
            results[i] = Proposal(d.token_ids, d.dists, d.prefill, compute_ms, len(drafting) + len(chunked),
                                  batch_prefill)
        return results

    def _admit(self, drafting: dict[int, _Drafting], results: list) -> None:
        """Keep the sessions whose whole block fits in the KV cache (after evicting idle ones): a
        block grows to n + k - 1 cached tokens. The others are refused alone (the coordinator then
        verifies them without a draft); their batch runs on."""
        fits = self.caches.reserve([(d.seq, len(d.task.committed_ids) + d.k - 1) for d in drafting.values()])
        for i, ok in zip(list(drafting), fits):
            if not ok:
                results[i] = ResourceExhausted(f"draft KV cache full: no room for session {short_id(drafting[i].task.session_id)} now")
                del drafting[i]

    def _step(self, d: _Drafting, logits: torch.Tensor) -> int | None:
        """Choose d's next token from logits [V]; the token to feed next, or None when d is done."""
        if d.k <= 0:
            return None
        position = len(d.task.committed_ids) + len(d.token_ids)
        context = d.task.committed_ids + d.token_ids if d.task.sampling.adjusts_logits else ()
        try:
            logits = adjust_logits(logits[None], d.task.sampling, context, self.grammars)[0]
        except SpecdecError:  # its constraint failed here: the proposal ends (the target's verdict says why)
            return None
        token, confidence, dist = self._choose(logits, d.task, position)
        if d.token_ids and confidence < d.task.min_confidence:
            return None
        d.token_ids.append(token)
        if dist is not None:
            d.dists.append(dist)
        return token if len(d.token_ids) < d.k else None

    def _choose(self, logits: torch.Tensor, task: ProposeTask, position: int) -> tuple[int, float, SparseDist | None]:
        """(token, the draft's confidence, the sparse distribution the token was drawn from), from
        logits [V] already penalised and biased.

        Confidence is the draft's largest probability at this position, known before the draw:
        stopping a block on it never conditions a sent token on its own value, which would bias
        the tokens against the distributions sent with them."""
        if task.sampling.is_greedy:
            token = int(logits.argmax())
            confidence = float(torch.softmax(logits.double(), -1)[token]) if task.min_confidence > 0 else 1.0
            return token, confidence, None
        token, dist = draw_draft(logits, task.sampling, task.seed, position, self.sparse_top)
        return token, max(dist[1]), dist

    def _validate(self, task: ProposeTask) -> None:
        if not task.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if not task.committed_ids:
            raise InvalidArgument("committed_ids", "must not be empty")
        if task.num_tokens < 1:
            raise InvalidArgument("num_tokens", f"must be >= 1, got {task.num_tokens}")
        validate_sampling(task.sampling, vocab_size=self.vocab_size)
        check_in(self.grammars, task.sampling.constraint)
        check_token_ids("committed_ids", task.committed_ids, self.vocab_size)
