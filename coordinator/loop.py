"""One round of speculative decoding, against small typed interfaces so that the loop runs the
same in-process (tests) and over gRPC.

    draft  = proposer.propose(x, K)          # d[0..K) and, when sampling, q[0..K)
    verdict = verifier.verify(x, d, q)       # a accepted, then a recovered or bonus token
    x += d[0..a) + [next]

K = 0 skips the draft: plain target decoding through the same path, the honest baseline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from specdec_core.errors import SpecdecError
from specdec_core.sampling import SamplingConfig

log = logging.getLogger(__name__)

SparseDist = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    dists: list[SparseDist] = field(default_factory=list)  # empty when greedy
    compute_ms: float = 0.0


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token_id: int
    compute_ms: float = 0.0
    batch_size: int = 1


class Proposer(Protocol):
    def propose(
        self, session_id: str, committed_ids: list[int], num_tokens: int, sampling: SamplingConfig, seed: int
    ) -> Draft: ...


class Verifier(Protocol):
    def verify(
        self, session_id: str, committed_ids: list[int], draft: Draft, sampling: SamplingConfig, seed: int
    ) -> Verdict: ...


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class Round:
    new_ids: list[int]  # d[0..a) + [next]
    num_drafted: int
    num_accepted: int
    draft_ms: float
    verify_ms: float


def run_round(
    session_id: str,
    committed_ids: list[int],
    k: int,
    sampling: SamplingConfig,
    seed: int,
    proposer: Proposer | None,
    verifier: Verifier,
) -> Round:
    started = time.perf_counter()
    draft = NO_DRAFT
    if k > 0 and proposer is not None:
        try:
            draft = proposer.propose(session_id, committed_ids, k, sampling, seed)
        except SpecdecError as exc:  # the draft is an optimisation: without it, decode plainly
            log.warning("draft failed, verifying without draft this round: %s", exc)
    verify_started = time.perf_counter()
    verdict = verifier.verify(session_id, committed_ids, draft, sampling, seed)
    done = time.perf_counter()
    a = verdict.num_accepted
    return Round(
        new_ids=draft.token_ids[:a] + [verdict.next_token_id],
        num_drafted=len(draft.token_ids),
        num_accepted=a,
        draft_ms=(verify_started - started) * 1e3,
        verify_ms=(done - verify_started) * 1e3,
    )
