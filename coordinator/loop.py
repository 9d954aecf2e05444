"""Rounds of speculative decoding, against small typed interfaces so that the loop runs the
same in-process (tests) and over gRPC.

    draft  = proposer.propose(x, K)          # d[0..K) and, when sampling, q[0..K)
    verdict = verifier.verify(x, d, q)       # a accepted, then a recovered or bonus token
    x += d[0..a) + [next]

K = 0 skips the draft: plain target decoding through the same path, the honest baseline. A round
may also ask the target for a few plain decoding steps after its verdict (`Decode`): one call, several
passes, so that plain decoding pays the RPC and the coordinator's round once per call.

Overlap: while the target verifies block i, the draft already proposes K + 1 tokens after x + d,
betting that all of d is accepted and that the bonus token will be the draft's own first guess.
When the bet wins, the remaining K tokens are the next block, ready before it is needed; when the
verdict shows it lost (a draft token rejected), the bet is cancelled at once, so that the draft
worker stops on it and the real next proposal does not queue behind it. Because
every draw is keyed by (seed, position, purpose), that block is exactly what a fresh proposal on
the same prefix would have returned, so overlap never changes the output, sampled or greedy.
With overlap, a greedy request's first rounds with the draft (at its start, or when the policy turns
to the draft mid-request) do not wait for the draft to prefill the context either: the target decodes
plainly meanwhile (or the policy gives those rounds to another proposer: `warming_up`), and the
draft's proposal becomes a bet like the others.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Protocol

from coordinator.cancel import CancelToken
from coordinator.request import RequestContext
from specdec_core.errors import Cancelled, NotFound, ResourceExhausted, SpecdecError
from specdec_core.logs import log_context, short_id
from specdec_core.engine.sampling import SparseDist, TokenLogprob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    dists: list[SparseDist] = field(default_factory=list)  # empty when greedy
    compute_ms: float = 0.0  # the draft worker's whole batch
    batch_size: int = 0  # sessions in that batch
    batch_prefill_tokens: int = 0  # tokens the draft worker's batch had to (re)compute before drafting
    proposed: int = 0  # tokens the worker drafted in that call (a bet's block is a part of them)
    from_worker: bool = True  # False: proposed in the coordinator (suffix decoding) or by the target's head
    from_head: bool = False  # proposed by the target worker's head with the last verdict
    drafting_meanwhile: bool = False  # a draft worker drafts for this session while this is verified

    def first(self, k: int) -> Draft:
        """Its first k tokens (and their distributions)."""
        return replace(self, token_ids=self.token_ids[:k], dists=self.dists[:k])


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token_id: int
    compute_ms: float = 0.0
    batch_size: int = 1
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per committed token, when asked for
    batch_tokens: int = 0  # tokens in the target's forward pass, all sessions together
    threads: int = 0  # the target's intra-op threads for it
    batch_prefill_tokens: int = 0  # of batch_tokens, committed tokens the target's caches did not hold
    decoded_ids: list[int] = field(default_factory=list)  # plain decoding steps' tokens, after next_token_id
    passes: int = 1  # the target's passes for the call: the verdict's, plus one per decoding step
    pass_tokens: int = 0  # tokens of all those passes, all sessions together (0: not reported)
    head: Draft | None = None  # the target's head's proposal for the next round (Decode.head_tokens asked)
    head_ms: float = 0.0  # what the head's proposal took the worker (part of compute_ms)


@dataclass(frozen=True)
class Decode:
    """Plain decoding steps the target may take after a round's verdict, in the same call (multi-step
    decoding): up to `steps` more tokens, ending after any of `stop_ids`. Each is what a K = 0 round
    at its position would commit, keyed draws included."""

    steps: int = 0
    stop_ids: frozenset[int] = frozenset()
    head_tokens: int = 0  # the target's head proposes this many tokens for the next round (no steps then)


NO_DECODE = Decode()


class Proposer(Protocol):
    def propose(self, ctx: RequestContext, committed_ids: list[int], num_tokens: int) -> Draft: ...


class Verifier(Protocol):
    def verify(self, ctx: RequestContext, committed_ids: list[int], draft: Draft, decode: Decode = NO_DECODE
               ) -> Verdict: ...


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class Round:
    new_ids: list[int]  # d[0..a) + [next], then the decoding steps' tokens
    num_drafted: int
    num_accepted: int
    draft_ms: float
    verify_ms: float
    verify_batch_size: int = 1
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token, when asked for
    draft: Draft = NO_DRAFT  # what was verified, with its worker's costs
    verdict: Verdict | None = None
    k: int = 0  # the draft tokens asked for


class Speculator:
    """The rounds of one request: draft, verify, and (with an executor) the overlapped next draft."""

    def __init__(self, ctx: RequestContext, proposer: Proposer | None, verifier: Verifier,
                 executor: Executor | None = None):
        self.ctx = ctx
        self.proposer = proposer
        self.verifier = verifier
        self.executor = executor  # None: no overlap
        self._bet: Bet | None = None
        self._warmup: _WarmUp | None = None
        self._warmed = False  # the draft has been asked for this session
        self.bets_won = 0

    def round(self, committed_ids: list[int], k: int, proposer: Proposer | None = None,
              decode: Decode = NO_DECODE) -> Round:
        """One round with K draft tokens from `proposer` (default: the speculator's own, the only one
        that overlaps: a round with another discards the bet), and `decode`'s plain steps after it."""
        started = time.perf_counter()
        proposer = proposer or self.proposer
        overlaps = proposer is self.proposer and self.executor is not None
        draft = self._take_bet(committed_ids, k if overlaps else 0)
        if draft is None and k > 0 and proposer is not None:
            draft = self._warm_up(committed_ids, k) if overlaps else None
            if draft is None:
                draft = self._propose(proposer, committed_ids, k)
        elif draft is None:
            draft = NO_DRAFT
        pending = token = None
        if overlaps and draft.token_ids:
            token = CancelToken()
            pending = self._submit(token, committed_ids + draft.token_ids, k + 1)
        if pending is not None or self.warming_up:
            draft = replace(draft, drafting_meanwhile=True)  # the target keeps to its share of the cores
        verify_started = time.perf_counter()
        verdict = self.verifier.verify(self.ctx, committed_ids, draft, decode)
        verified = time.perf_counter()
        a = verdict.num_accepted
        new_ids = draft.token_ids[:a] + [verdict.next_token_id] + verdict.decoded_ids
        if pending is not None and a < len(draft.token_ids):
            token.cancel()  # the bet assumed the whole block; don't wait for it
        elif pending is not None:
            bet = pending.result()
            prefix = committed_ids + draft.token_ids
            self._bet = Bet.made_after(prefix, bet)
        done = time.perf_counter()
        return Round(
            new_ids=new_ids,
            k=k,
            num_drafted=len(draft.token_ids),
            num_accepted=a,
            draft_ms=(verify_started - started + done - verified) * 1e3,
            verify_ms=(verified - verify_started) * 1e3,
            verify_batch_size=verdict.batch_size,
            logprobs=verdict.logprobs,
            draft=draft,
            verdict=verdict,
        )

    def _propose(self, proposer: Proposer, committed_ids: list[int], k: int, ctx: RequestContext | None = None
                 ) -> Draft:
        try:
            return proposer.propose(ctx or self.ctx, committed_ids, k)
        except Cancelled:
            return NO_DRAFT
        except (ResourceExhausted, NotFound) as exc:  # no room for this session now, or it was ended
            log.debug("no draft this round: %s", exc)
            return NO_DRAFT
        except SpecdecError as exc:  # the draft is an optimisation: without it, decode plainly
            log.warning("draft failed, verifying without draft this round: %s", exc)
            return NO_DRAFT

    def _submit(self, token: CancelToken, committed_ids: list[int], k: int) -> Future:
        """An overlapped proposal on the executor, cancelled through `token`."""
        return self.executor.submit(self._propose_cancellable, replace(self.ctx, cancel=token), committed_ids, k)

    def _propose_cancellable(self, ctx: RequestContext, committed_ids: list[int], k: int) -> Draft:
        with log_context(session=short_id(ctx.session_id)):
            return self._propose(self.proposer, committed_ids, k, ctx)

    def _warm_up(self, committed_ids: list[int], k: int) -> Draft | None:
        """With overlap, a request's first round with the draft does not wait for it: the draft
        prefills the context (proposing K + 1 tokens after it) while the target decodes plainly, and
        the rounds stay plain until it is done; its proposal is then a bet like any other. Without
        this, time to first token is draft prefill + target prefill, one after the other, and on long
        prompts the draft (a quantized model on few cores) can be the slower of the two; and when the
        policy turns to the draft mid-request (eight sessions at once when the method gate tests it),
        every session would stall for the draft's prefill of its whole context.

        Greedy only: which positions a draft covers decides which keyed draws a sampled token
        uses, so plain rounds whose number depends on timing would make a seed's output depend on
        timing (still distributed exactly as the target's, but no longer reproducible)."""
        if self.executor is None or not self.ctx.sampling.is_greedy:
            return None
        if not self._warmed:
            self._warmed = True
            token = CancelToken()
            self._warmup = _WarmUp(self._submit(token, committed_ids, k + 1), token,
                                   len(committed_ids), committed_ids[-8:])
            return NO_DRAFT
        return NO_DRAFT if self.warming_up else None

    @property
    def warming_up(self) -> bool:
        """The draft is still prefilling this session's context: a round with it now would be plain."""
        return self._warmup is not None and not self._warmup.proposal.done()

    def drop_warm_up(self) -> None:
        """Cancel a warm-up still running (the policy turned away from the draft model): the draft
        worker would go on prefilling the whole context on its core, and every batch this session is
        in would keep the target on its share of the cores meanwhile (at 8 requests on grounded
        prompts, the method gate's tests of the draft model doubled time to first token). What the
        draft cached by then stays cached; a later model round warms up again."""
        if self.warming_up:
            self._warmup.token.cancel()
            self._warmup, self._warmed = None, False

    def _take_bet(self, committed_ids: list[int], k: int) -> Draft | None:
        if self._warmup is not None and self._warmup.proposal.done():
            warmup, self._warmup = self._warmup, None
            self._bet = Bet(warmup.length, warmup.tail, warmup.proposal.result())
        bet, self._bet = self._bet, None
        if bet is None or k == 0:
            return None
        block = bet.block_after(committed_ids)
        if block is None:
            return None
        self.bets_won += 1
        return block.first(k)


@dataclass(frozen=True)
class _WarmUp:
    """The draft prefilling a session's context, proposing after a prefix of `length` tokens ending
    in `tail`; cancelled through `token`."""

    proposal: Future
    token: CancelToken
    length: int
    tail: list[int]


@dataclass(frozen=True)
class Bet:
    """A proposal made ahead of time after a prefix of `length` tokens ending in `tail`."""

    length: int
    tail: list[int]
    draft: Draft

    @classmethod
    def made_after(cls, prefix: list[int], draft: Draft) -> Bet:
        return cls(len(prefix), prefix[-8:], draft)

    def block_after(self, committed_ids: list[int]) -> Draft | None:
        """What the bet proposes after committed_ids: its tokens past the committed ones, if every
        committed token since its prefix is the one it guessed (and the prefix is the same)."""
        n, tokens = len(committed_ids), self.draft.token_ids
        if not self.length <= n < self.length + len(tokens):
            return None
        if committed_ids[self.length - len(self.tail):self.length] != self.tail:
            return None
        if committed_ids[self.length:] != tokens[:n - self.length]:
            return None
        used = n - self.length
        return replace(self.draft, token_ids=tokens[used:], dists=self.draft.dists[used:])
