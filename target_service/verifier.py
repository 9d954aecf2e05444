"""Verification: one forward pass over the uncached tail of the committed sequence plus the
draft tokens, then the exact rule from `acceptance`. K = 0 is plain target decoding. A call may ask
for a few plain decoding steps after its verdict (multi-step decoding, as vLLM's multi-step
scheduling does): each is one more pass, batched with the other sessions' rounds, so that plain
decoding pays the RPC and the coordinator's round once per call instead of once per token.

Concurrent requests from different sessions are verified together: their tails go through the
model in one batched pass (each with its own cache length and K) when the backend can batch.

A long prefill goes through in chunks, between the other sessions' rounds (chunked prefill, as vLLM
and SGLang do): without it, a session that sends a 2,000-token prompt stalls every session decoding
beside it for the whole prefill. While sessions decode (a round in the last `decoding_s`), a pass takes
as many tokens of long prefills, all of them together, as keep it within `prefill_stall` (1.6) times
what their rounds cost alone, by measured costs (`PrefillBudget`), more in proportion where more
sessions wait than decode, and at least `prefill_chunk` (16) where as many wait as decode; a pass
while none decode takes ALONE_TOKENS. On this CPU that is 3-6 tokens beside 4 decoding sessions
(~14 ms, a prompt token ~2.4 ms): the mixed-load benchmark's chat ITL p99 at 1.2-1.7x its value
without the long prompts (2.1-2.5x with a fixed 16), grounded c8 5-15% slower."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from specdec_core import metrics
from specdec_core.engine.batching import AGAIN, Again, BatchQueue
from specdec_core.engine.grammar import Grammars, check_in
from specdec_core.engine.kvcache import CachedSequence, SessionCaches
from specdec_core.engine.sampling import (
    Purpose,
    SamplingConfig,
    TokenLogprob,
    adjust_logits,
    dense_from_sparse,
    keyed_uniform,
    process_logits,
    token_logprobs,
    validate_sampling,
)
from specdec_core.errors import InvalidArgument, ResourceExhausted, SpecdecError
from specdec_core.limits import MAX_DECODE_STEPS, MAX_HEAD_TOKENS, check_token_ids
from specdec_core.logs import short_id
from target_service.acceptance import verify_greedy, verify_sampled
from target_service.head_drafter import HeadDrafter

ALONE_TOKENS = 256  # a pass of long prefills alone takes this many prompt tokens (or --prefill-chunk, if more)
DECODING_S = 0.25  # a session with a round this recently is decoding: its next call is on its way


class PassCost:
    """What a pass of rounds costs by its tokens: a fixed part (the weights read once) plus a part per
    token (its rows' arithmetic), fitted by least squares over recent passes (exponentially weighted
    moments). Until passes of different sizes have been seen (a spread of `min_spread` tokens) it is
    their mean; a later stretch of passes all one size keeps the last slope rather than one fitted to
    noise."""

    def __init__(self, weight: float = 0.05, min_spread: float = 2.0):
        self.weight, self.min_var = weight, min_spread ** 2
        self._moments: list[float] | None = None  # E[x], E[y], E[x^2], E[xy]
        self.token_ms = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        x = [tokens, ms, tokens * tokens, tokens * ms]
        m = self._moments = x if self._moments is None else [a + self.weight * (b - a) for a, b in zip(self._moments, x)]
        var = m[2] - m[0] * m[0]
        if var > 0 and var >= self.min_var:
            self.token_ms = max((m[3] - m[0] * m[1]) / var, 0.0)

    def ms(self, tokens: int) -> float | None:
        if self._moments is None:
            return None
        mean_tokens, mean_ms = self._moments[:2]
        return max(mean_ms + self.token_ms * (tokens - mean_tokens), 0.0)


class PrefillBudget:
    """How many tokens of long prefills a pass beside other sessions' rounds takes: as many as keep
    the pass within `stall` times what the rounds alone cost, from what passes of rounds alone cost
    by their tokens (`PassCost`) and a moving average of what a prompt token adds to such a pass; in
    proportion more where more sessions wait for their prefill than there are rounds in the pass (a
    small chunk would stall the waiting sessions far longer than a larger one stalls the decoding
    few); never more than ALONE_TOKENS (unless `chunk` is more), and at least `chunk` where as many
    wait as decode.

    On this CPU a pass of 4 decoding sessions costs ~14 ms and a prompt token adds ~2.4 ms: a stall of
    1.6 allows 3-4 tokens a pass beside them; seven prompts waiting beside one decoding session
    (~10 ms) take ~30. On a GPU, where a pass of 100 tokens costs about what a pass of 4 does, the
    chunk is ALONE_TOKENS. `stall` 0: always `chunk`."""

    def __init__(self, chunk: int, stall: float = 1.6, weight: float = 0.2):
        self.chunk, self.stall, self.weight = chunk, stall, weight
        self.rounds = PassCost()
        self.token_ms: float | None = None

    def observe(self, ms: float, rounds: int, round_tokens: int, prefill: int) -> None:
        """A pass took `ms` for `rounds` sessions' rounds (`round_tokens` tokens) and `prefill`
        tokens of long prefills."""
        if not rounds:  # prefills alone say nothing about what the rounds pay
            return
        if not prefill:
            self.rounds.observe(round_tokens, ms)
        elif (alone := self.rounds.ms(round_tokens)) is not None:
            x = max(ms - alone, 0.0) / prefill
            self.token_ms = x if self.token_ms is None else self.token_ms + self.weight * (x - self.token_ms)

    def tokens(self, waiting: int = 1, rounds: int = 1, round_tokens: int | None = None) -> int:
        """The chunk for a pass of `rounds` sessions' rounds (`round_tokens` tokens, default one
        each) while `waiting` sessions wait for their prefill."""
        alone = self.rounds.ms(rounds if round_tokens is None else round_tokens)
        if not self.stall or alone is None or self.token_ms is None:
            return self.chunk
        share = waiting / max(rounds, 1)
        floor = self.chunk if share >= 1 else 1
        allowed = (self.stall - 1) * alone * max(1.0, share)
        per_token = max(self.token_ms, self.rounds.token_ms)  # no cheaper than a round's token (one fast
        # pass, the first measured, would make prompt tokens free and the next pass take ALONE_TOKENS)
        tokens = int(allowed / per_token) if per_token > 0 else ALONE_TOKENS
        return max(floor, min(ALONE_TOKENS, tokens))


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token_id: int
    prefill_tokens: int
    compute_ms: float  # every pass of the call
    batch_size: int = 1
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per committed token, when asked for
    batch_tokens: int = 0  # tokens in the verdict's forward pass, all sessions together
    threads: int = 0  # intra-op threads it ran on
    batch_prefill_tokens: int = 0  # of batch_tokens, committed tokens the caches did not hold
    decoded_ids: list[int] = field(default_factory=list)  # the decoding steps' tokens, after next_token_id
    passes: int = 1  # the verdict's, plus one per decoding step
    pass_tokens: int = 0  # tokens of all the call's passes, all sessions together
    head_ids: list[int] = field(default_factory=list)  # the head's proposal for the next round
    head_dists: list[tuple[list[int], list[float]]] = field(default_factory=list)  # when sampling
    head_ms: float = 0.0  # what drafting them took

    def then(self, step: VerifyResult) -> VerifyResult:
        """This result followed by a decoding step's token."""
        return replace(self, decoded_ids=self.decoded_ids + [step.next_token_id], logprobs=self.logprobs + step.logprobs,
                       compute_ms=self.compute_ms + step.compute_ms, passes=self.passes + 1,
                       pass_tokens=self.pass_tokens + step.batch_tokens)


@dataclass(frozen=True)
class VerifyTask:
    session_id: str
    committed_ids: list[int]
    draft_ids: list[int]
    sampling: SamplingConfig
    seed: int = 0
    # Sparse (token_ids, probs) per draft token when sampling; empty when greedy.
    draft_dists: list[tuple[list[int], list[float]]] = field(default_factory=list)
    draft_in_flight: bool = False  # the coordinator had a draft worker's call in flight when it sent this
    decode_steps: int = 0  # after the verdict, up to this many plain decoding steps, one pass each
    stop_ids: frozenset[int] = frozenset()  # tokens that end the decoding steps
    so_far: VerifyResult | None = None  # a decoding step's: what the call's earlier passes committed
    head_tokens: int = 0  # after the verdict, the head proposes this many tokens for the next round


class CoreShare:
    """Intra-op threads per batch on a machine the target shares with a draft worker: `threads`
    while a draft worker drafts (the coordinators say so in each Verify: a call to a draft worker
    was in flight when they sent it), and for `quiet_s` after (a draft that starts just after the
    pass began), `solo` otherwise: plain or n-gram decoding, and rounds whose draft has finished,
    leave the draft's cores idle; 8 plain decodes on 2 threads cost about 0.6 of what they cost on 1.
    With the draft busy too, a 2-thread team on 2 cores is preempted at every barrier and runs slower
    than on 1. The thread count does not change any result: oneDNN and SDPA split rows and heads
    across threads, never a sum."""

    def __init__(self, threads: int, solo: int, quiet_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.threads, self.solo, self.quiet_s, self.clock = threads, solo, quiet_s, clock
        self._last_draft = -float("inf")

    def for_batch(self, tasks: list[VerifyTask]) -> int:
        now = self.clock()
        if any(t.draft_in_flight for t in tasks):
            self._last_draft = now
        n = self.solo if now - self._last_draft >= self.quiet_s else self.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


class BatchVerifier:
    """The target worker's Verify calls: validated, queued, and verified together in batched passes
    on the engine thread (see the module docstring)."""

    def __init__(self, caches: SessionCaches, max_context: int, window_s: float = 0.001, max_batch: int = 32,
                 max_queue: int = 64, cores: CoreShare | None = None, prefill_chunk: int = 0,
                 prefill_stall: float = 0.0, decoding_s: float = DECODING_S, clock: Callable[[], float] = time.monotonic,
                 grammars: Grammars | None = None, head: HeadDrafter | None = None):
        self.caches = caches
        self.head = head  # an EAGLE-3 head beside the target (None: head_tokens are refused)
        if head is not None:
            caches.backend.capture = head.layer_ids
        self.grammars = grammars  # structured outputs' constraints (None: constrained calls are refused)
        self.prefill = PrefillBudget(prefill_chunk, prefill_stall)  # chunk 0: whole prompts in one pass
        self.decoding_s, self.clock = decoding_s, clock
        self._decoding: dict[str, float] = {}  # session -> when a pass last carried its round
        self.vocab_size = caches.backend.vocab_size
        self.max_context = max_context
        self.cores = cores
        self.queue = BatchQueue(self._verify_batch, window_s, max_batch, max_queue, name="verify")

    def verify(self, task: VerifyTask, is_cancelled: Callable[[], bool] = lambda: False,
               deadline: float | None = None) -> VerifyResult:
        self._validate(task)
        return self.queue.submit(task, task.session_id, is_cancelled, deadline)

    def _verify_batch(self, tasks: list[VerifyTask]) -> list[VerifyResult | BaseException]:
        started = time.perf_counter()
        if self.cores is not None:
            metrics.TARGET_THREADS.set(self.cores.for_batch(tasks))
        threads = torch.get_num_threads()
        results: list[VerifyResult | BaseException | None] = [None] * len(tasks)
        with ExitStack() as stack:
            leased = []
            for i, task in enumerate(tasks):
                try:
                    leased.append((i, stack.enter_context(self.caches.lease(task.session_id, task.committed_ids))))
                except Exception as exc:  # noqa: BLE001 - that session alone fails, never its batch
                    results[i] = exc if task.so_far is None else task.so_far  # a decoding step: what it has
            leased = self._admit(tasks, leased, results)
            if not leased:
                return results
            prefill = {i: len(tasks[i].committed_ids) - len(seq.token_ids) for i, seq in leased}
            chunk = max(self.prefill.chunk, self.prefill.tokens()) if self.prefill.chunk else 0  # none shorter is split
            long = [(i, seq) for i, seq in leased if 0 < chunk < prefill[i]]
            leased = [(i, seq) for i, seq in leased if not 0 < chunk < prefill[i]]
            # what this pass takes of long prefills: a chunk while sessions decode (had a round in the
            # last `decoding_s`: the others' next calls are on their way, and a pass of ALONE_TOKENS,
            # ~350 ms on a CPU, would hold every one of them), else ALONE_TOKENS
            own_rounds = len(leased)
            own_tokens = sum(prefill[i] + len(tasks[i].draft_ids) for i, _ in leased)
            rounds = self._decoding_now([tasks[i].session_id for i, _ in leased], {tasks[i].session_id for i, _ in long})
            # sessions decoding but not in this pass: one token each
            budget = (self.prefill.tokens(len(long), rounds, own_tokens + rounds - own_rounds) if rounds
                      else max(chunk, ALONE_TOKENS))
            taken = 0  # tokens of long prefills in this pass, the ones that end in it included
            chunked = []  # (i, seq, tokens this pass): the rest in the next passes, between others' rounds
            for i, seq in long:
                take = min(budget, prefill[i])
                budget -= take
                taken += take
                if take == prefill[i]:  # the rest fits: its verdict in this pass
                    leased.append((i, seq))
                elif take:
                    chunked.append((i, seq, take))
                else:  # waits for the next pass
                    results[i] = AGAIN
            feeds = [(seq, tasks[i].committed_ids[len(seq.token_ids):] + tasks[i].draft_ids) for i, seq in leased]
            feeds += [(seq, tasks[i].committed_ids[len(seq.token_ids):][:take]) for i, seq, take in chunked]
            fed_from = [len(seq.token_ids) for seq, _ in feeds]
            if self.head is not None:
                self.caches.backend.captured.clear()
            batch_tokens = sum(len(ids) for _, ids in feeds)
            batch_prefill = batch_tokens - sum(len(tasks[i].draft_ids) for i, _ in leased)
            logits = self.caches.extend_batch(  # logits only where the rule reads them: the last K+1
                feeds, [len(tasks[i].draft_ids) + 1 for i, _ in leased] + [1] * len(chunked))
            for i, _, _ in chunked:
                results[i] = AGAIN
            decided = []
            for (i, seq), rows in zip(leased, logits):
                task = tasks[i]
                n, k = len(task.committed_ids), len(task.draft_ids)
                try:
                    num_accepted, next_token, logprobs = self._decide(task, rows[-(k + 1):], n)  # [K+1, V]
                except SpecdecError as exc:  # e.g. its constraint failed: that session alone, never its batch
                    self.caches.crop(seq, n)
                    results[i] = exc
                    continue
                self.caches.crop(seq, n + num_accepted)  # rejected drafts never stay cached
                decided.append((i, num_accepted, next_token, logprobs))
            proposals = self._head_rounds(tasks, leased, chunked, fed_from, decided) if self.head is not None else {}
        compute_ms = (time.perf_counter() - started) * 1e3
        self.prefill.observe(compute_ms, own_rounds, own_tokens, taken)
        metrics.FORWARD_SECONDS.labels("target").observe(compute_ms / 1e3)
        metrics.VERIFY_BATCH.observe(len(leased) + len(chunked))
        for i, num_accepted, next_token, logprobs in decided:
            head_ids, head_dists, head_ms = proposals.get(i, ([], [], 0.0))
            result = VerifyResult(num_accepted, next_token, prefill[i], compute_ms, len(leased) + len(chunked),
                                  logprobs, batch_tokens, threads, batch_prefill, pass_tokens=batch_tokens,
                                  head_ids=head_ids, head_dists=head_dists, head_ms=head_ms)
            results[i] = self._next_step(tasks[i], result if tasks[i].so_far is None else tasks[i].so_far.then(result))
        return self._end_together(tasks, results)

    def _head_rounds(self, tasks: list[VerifyTask], leased, chunked, fed_from: list[int], decided
                     ) -> dict[int, tuple[list[int], list, float]]:
        """The head takes every fed session's new pairs (the target's features of this pass), then
        proposes for the calls that asked (a call with head_tokens takes no decoding steps, so its
        verdict is its answer): {task index: (token ids, distributions, ms)}."""
        verdicts = {i: (a, token) for i, a, token, _ in decided}
        items = [(i, seq) for i, seq in leased] + [(i, seq) for i, seq, _ in chunked]
        captured = self.caches.backend.captured
        proposals = {}
        for (i, seq), start, aux in zip(items, fed_from, captured):
            task = tasks[i]
            known = task.committed_ids
            if i in verdicts:
                a, token = verdicts[i]
                known = known + task.draft_ids[:a] + [token]
            wants = i in verdicts and task.head_tokens > 0
            self.head.absorb(seq, start, aux, known, now=wants)
            if wants:
                started = time.perf_counter()
                ids, dists = self.head.propose(seq, known, task.head_tokens, task.sampling, task.seed)
                proposals[i] = ids, dists, (time.perf_counter() - started) * 1e3
        captured.clear()
        return proposals

    def _decoding_now(self, rounds: list[str], waiting: set[str]) -> int:
        """Sessions decoding: those with a round in this pass or in the last `decoding_s`, less those
        now waiting for a long prefill of their own. A pass's own rounds undercount them: the others
        may be between calls, or their calls a pass behind."""
        now = self.clock()
        self._decoding.update((session, now) for session in rounds)
        for session, seen in list(self._decoding.items()):
            if now - seen > self.decoding_s or session in waiting:
                del self._decoding[session]
        return len(self._decoding)

    @staticmethod
    def _end_together(tasks: list[VerifyTask], results: list) -> list:
        """Where a call of this pass ends, the greedy calls that would take another step end too."""
        if not any(isinstance(r, VerifyResult) for r in results):
            return results
        return [r.rest.so_far if isinstance(r, Again) and isinstance(r.rest, VerifyTask) and t.sampling.is_greedy
                else r for t, r in zip(tasks, results)]

    def _next_step(self, task: VerifyTask, result: VerifyResult) -> VerifyResult | Again:
        """Multi-step decoding: the call's answer, or (while it has decoding steps left, no stop token
        came, and the context has room) its next step, a K = 0 round on what this pass committed. It
        runs in the next batch, beside the other sessions' rounds, and draws its token exactly as a
        K = 0 round at its position would: one call saves the RPC and the coordinator's round trip
        of every step but the last.

        Calls end together: when a call in a pass ends, the greedy calls in their decoding steps end
        with it (`_end_together`). Sessions then go back to their coordinators, and come back, at
        the same time, and the engine waits for them once per call instead of at every pass: out of
        step (8 sessions whose calls end at different passes) the engine waited at nearly every pass
        for a session that was just then in its coordinator. Sampled calls always take all their steps:
        where a round ends decides which keyed draws make their tokens, and that must not depend on
        timing, for a seed to give the same tokens."""
        last = result.decoded_ids[-1] if result.decoded_ids else result.next_token_id
        committed = task.committed_ids + task.draft_ids[:result.num_accepted] + [last]  # (a step has no draft)
        if task.decode_steps <= 0 or last in task.stop_ids or len(committed) >= self.max_context:
            return result
        return Again(replace(task, committed_ids=committed, draft_ids=[], draft_dists=[],
                             decode_steps=task.decode_steps - 1, so_far=result))

    def _admit(self, tasks: list[VerifyTask], leased: list[tuple[int, CachedSequence]],
               results: list) -> list[tuple[int, CachedSequence]]:
        """The leased sessions whose blocks fit in the KV cache (after evicting idle ones); the
        others are refused alone, so that one session's admission never fails its batch."""
        fits = self.caches.reserve([(seq, len(tasks[i].committed_ids) + len(tasks[i].draft_ids)) for i, seq in leased])
        for (i, _), ok in zip(leased, fits):
            if not ok and tasks[i].so_far is not None:  # a decoding step: the call answers what it has
                results[i] = tasks[i].so_far
            elif not ok:
                results[i] = ResourceExhausted(
                    f"target KV cache full: no room for session {short_id(tasks[i].session_id)} now, every cached "
                    f"session is in use (capacity {self.caches.capacity} units); retry")
        return [item for item, ok in zip(leased, fits) if ok]

    def _decide(self, task: VerifyTask, logits: torch.Tensor, n: int) -> tuple[int, int, list[TokenLogprob]]:
        """(accepted, next token, their log-probabilities if asked for) from the block's logits [K+1, V].
        Row i follows the committed tokens and the first i draft tokens: penalties see both."""
        cfg = task.sampling
        draft_ids = torch.tensor(task.draft_ids, dtype=torch.long)  # [K]
        context = task.committed_ids + task.draft_ids if cfg.adjusts_logits else ()
        if cfg.is_greedy:
            logits = adjust_logits(logits, cfg, context, self.grammars)
            num_accepted, token = verify_greedy(logits.argmax(dim=-1), draft_ids)
            p = None
        else:
            k = len(task.draft_ids)
            p = process_logits(logits, cfg, context, self.grammars)  # [K+1, V]
            q = torch.stack([dense_from_sparse(ids, probs, self.vocab_size) for ids, probs in task.draft_dists]) if k else p[:0]
            accept_draws = [keyed_uniform(task.seed, n + i, Purpose.ACCEPT) for i in range(k)]
            sample_draws = [keyed_uniform(task.seed, n + i, Purpose.TARGET) for i in range(k + 1)]
            num_accepted, token = verify_sampled(p, q, draft_ids, accept_draws, sample_draws)
        if cfg.logprobs is None:
            return num_accepted, token, []
        rows = slice(0, num_accepted + 1)
        logp = torch.log_softmax(logits[rows].to(torch.float64), dim=-1) if p is None else p[rows].log()
        return num_accepted, token, token_logprobs(logp, task.draft_ids[:num_accepted] + [token], cfg.logprobs)

    def _validate(self, task: VerifyTask) -> None:
        if not task.session_id:
            raise InvalidArgument("session_id", "must not be empty")
        if not task.committed_ids:
            raise InvalidArgument("committed_ids", "must not be empty")
        validate_sampling(task.sampling, vocab_size=self.vocab_size)
        check_in(self.grammars, task.sampling.constraint)
        check_token_ids("committed_ids", task.committed_ids, self.vocab_size)
        check_token_ids("draft_ids", task.draft_ids, self.vocab_size)
        check_token_ids("stop_token_ids", sorted(task.stop_ids), self.vocab_size)
        if len(task.committed_ids) + len(task.draft_ids) > self.max_context:
            raise InvalidArgument("draft_ids", f"sequence would exceed the model's context of {self.max_context}")
        if not 0 <= task.decode_steps <= MAX_DECODE_STEPS:
            raise InvalidArgument("decode_steps", f"must be in 0..{MAX_DECODE_STEPS}, got {task.decode_steps}")
        if task.head_tokens:
            if self.head is None:
                raise InvalidArgument("head_tokens", "this target worker has no draft head (start it with --head)")
            if not 0 < task.head_tokens <= MAX_HEAD_TOKENS:
                raise InvalidArgument("head_tokens", f"must be in 0..{MAX_HEAD_TOKENS}, got {task.head_tokens}")
            if task.decode_steps:
                raise InvalidArgument("head_tokens", "a call cannot take both decoding steps and a head proposal")

        if task.sampling.is_greedy:
            return
        if len(task.draft_dists) != len(task.draft_ids):
            raise InvalidArgument("draft_distributions", "need one distribution per draft token when sampling")
        for i, (token, (ids, probs)) in enumerate(zip(task.draft_ids, task.draft_dists)):
            if len(ids) != len(probs) or len(set(ids)) != len(ids) or not all(p >= 0 for p in probs) or sum(probs) <= 0:
                raise InvalidArgument(f"draft_distributions[{i}]", "token_ids (distinct) and probs must pair up, probs >= 0")
            check_token_ids(f"draft_distributions[{i}].token_ids", ids, self.vocab_size)
            if token not in ids or probs[ids.index(token)] <= 0:
                raise InvalidArgument(f"draft_distributions[{i}]", f"draft token {token} has probability 0 in it")
