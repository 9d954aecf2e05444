"""A generation request from admission to its last streamed chunk.

    validate; take the tenant's quota and the session's lease; commit the input
    loop: choose (method, K) -> round (draft, verify) -> cut (finish rules) -> account -> commit -> yield

Committed tokens reach Redis before the client sees them: every round is committed (one atomic
compare-and-set) and only then yielded. A crash anywhere loses no acknowledged output, and any
coordinator can continue the session from Redis.

A request with a `request_id` is idempotent. Its first commit (its input) also records where the
input went; a retry with the same id finds that record and appends nothing: it replays the
request's committed output as its first chunk and then continues from there (or ends at once, if
the request had finished). Output is a function of the committed tokens and the seed, so a
resumed request yields what the uninterrupted one would have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from coordinator.drafting import Drafting, HeadProposals, fixed_choice
from coordinator.finish import StopRule
from coordinator.loop import Proposer, Round, Speculator, Verifier
from coordinator.policy import Costs, Prior, PriorCosts, SpeculationPolicy
from coordinator.policy.chooser import Lookup
from coordinator.request import (
    DEFAULT_TENANT,
    Chunk,
    DraftMethod,
    Finish,
    GenerationRequest,
    Limits,
    RequestContext,
    Stats,
)
from coordinator.sessions import RequestRecord, Session, SessionStore
from coordinator.suffix import SuffixProposer
from coordinator.tenancy import RequestQuota
from coordinator.text import OutputText, TextCodec
from coordinator.validation import validate_request
from specdec_core import metrics
from specdec_core.errors import Aborted, Cancelled, FailedPrecondition, InvalidArgument, ResourceExhausted, SpecdecError
from specdec_core.logs import log_context
from specdec_core.engine.grammar import Grammars, check_in
from specdec_core.engine.sampling import SamplingConfig, sampling_to_dict

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, store: SessionStore, codec: TextCodec, proposer: Proposer | None, suffix: SuffixProposer,
                 verifier: Verifier, limits: Limits, quota: RequestQuota | None = None, prior: Prior = Prior(),
                 grammars: Grammars | None = None):
        self.store = store
        self.grammars = grammars  # structured outputs: compiled here to check them, and to cut suffix drafts
        self.quota = quota or RequestQuota()
        self._overlap = ThreadPoolExecutor(max_workers=limits.max_concurrent_requests, thread_name_prefix="overlap")
        self.codec = codec
        self.proposer = proposer
        self.suffix = suffix  # drafts from the session's tokens and its tenant's finished requests
        self.verifier = verifier
        self.limits = limits
        self.costs = Costs(prior)  # the workers' costs as measured here, for every session's policy
        self.fixed_costs = PriorCosts(prior)  # a sampled request's: the same whatever the load

    def set_prior(self, prior: Prior) -> None:
        """The costs' prior, once the models' sizes are known (a draft that came up after this started)."""
        self.costs.prior, self.fixed_costs = prior, PriorCosts(prior)

    def run(self, req: GenerationRequest, is_cancelled: Callable[[], bool] = lambda: False,
            tenant: str = DEFAULT_TENANT, deadline: float | None = None) -> Iterator[Chunk]:
        """The request's chunks; `deadline` (time.monotonic()) bounds every worker call made for it.
        How many run at once is bounded by the server's admission lane (--max-concurrent-requests),
        which refuses the excess at once, and per tenant by the quota: the coordinator has no queue
        of its own; the workers refuse a call whose deadline their queue would miss."""
        validate_request(req, self.limits, self.codec)
        check_in(self.grammars, req.sampling.constraint)
        with self.quota.held(tenant):
            # A retry of a new-session request finds its session only through its record; any other
            # request reads the record once, under the lease (below).
            record = None if req.session_id else self._record(req, tenant)
            session_id = record.session_id if record else req.session_id
            session = self.store.load(session_id, tenant) if session_id else self.store.new(req.seed, tenant)
            with self.store.held(session.session_id, req.request_id), log_context(session=session.ref):
                if req.request_id:  # again under the lease: an earlier attempt may have gone on, or finished
                    record = self._record(req, tenant)
                    if record is not None and record.session_id != session.session_id:
                        raise Aborted(f"request {req.request_id!r} is running in another attempt; retry")
                    if record is not None:
                        session = self.store.load(session.session_id, tenant)
                try:
                    with self.costs.running():
                        yield from self._serve(req, session, record, is_cancelled, deadline)
                except (Cancelled, GeneratorExit):  # the client has gone: nobody will continue a one-shot session
                    if req.end_session:
                        self.end(session, deadline)
                    raise
            if req.end_session:  # after the lease: ending is what EndSession does
                self.end(session, deadline)

    def end(self, session: Session, deadline: float | None = None) -> None:
        """Free a session's worker caches and delete its record (EndSession, or a one-shot request),
        the workers' calls within `deadline` (time.monotonic())."""
        for worker in (self.proposer, self.verifier):
            try:
                if worker is not None:
                    worker.release(session.session_id, deadline)
            except SpecdecError as exc:  # caches are only caches; LRU frees them eventually
                log.warning("could not release a cache: %s", exc)
        self.store.delete(session)

    def _record(self, req: GenerationRequest, tenant: str) -> RequestRecord | None:
        """The record of an earlier attempt of this request, if any; INVALID_ARGUMENT if its id was
        used for other input."""
        record = self.store.request(tenant, req.request_id) if req.request_id else None
        if record is not None and (record.fingerprint != req.fingerprint()
                                   or req.session_id not in ("", record.session_id)):
            raise InvalidArgument("request_id", "already used for a different request (a retry must repeat "
                                                "its request exactly)")
        return record

    def _serve(self, req: GenerationRequest, session: Session, record: RequestRecord | None,
               is_cancelled: Callable[[], bool], deadline: float | None) -> Iterator[Chunk]:
        started = time.perf_counter()
        start, input_ids, max_new, record = self._begin(req, session, record)
        output_start = start + len(input_ids)
        ctx = RequestContext(session.session_id, self._sampling(req, output_start), session.seed,
                             session.tenant, session.routes, deadline, min_draft_confidence=req.min_draft_confidence)
        stop = StopRule(frozenset(self.codec.eos_ids | set(req.stop_token_ids)), max_new, self.limits.max_context)
        out = OutputText(self.codec, req.stop)
        done = session.token_ids[output_start:record.end if record and record.finish else None]
        if record is not None and (done or record.finish):  # a retry: its output so far, replayed
            self.store.confirm(session)  # an attempt may have committed these without its replicas' word
            text, _ = out.add(done)
            if record.finish:
                yield Chunk(session.session_id, text + out.flush(), done, Finish(record.finish), len(input_ids),
                            len(done), record.end, Stats())
                return
            yield Chunk(session.session_id, text, done)
        yield from self._decode(req, session, ctx, record, stop, out, len(input_ids), len(done), is_cancelled,
                                started)

    def _decode(self, req: GenerationRequest, session: Session, ctx: RequestContext, record: RequestRecord | None,
                stop: StopRule, out: OutputText, prompt_tokens: int, generated: int,
                is_cancelled: Callable[[], bool], started: float) -> Iterator[Chunk]:
        """The rounds: choose and run one, cut it by the finish rules, account, commit, yield."""
        drafting = self._drafting(req, ctx, stop.stop_ids)
        stats = Stats()
        while True:
            if is_cancelled():
                raise Cancelled("the client cancelled the request")
            room = stop.room(generated, len(session.token_ids))
            rnd = drafting.round(session.token_ids, room, first=not stats.rounds)
            new_ids, text, finish = stop.cut(rnd.new_ids, generated, len(session.token_ids), out)
            generated += len(new_ids)
            stats.add(rnd, len(new_ids))
            stats.wall_ms = (time.perf_counter() - started) * 1e3
            self._account(session, rnd, new_ids, out.text if req.messages is not None else None)
            if finish is not None:
                text += out.flush()
                session.stats.wall_ms += stats.wall_ms
            ended = None
            if record and finish:
                ended = replace(record, finish=finish.value, end=len(session.token_ids) + len(new_ids))
            self.store.commit(session, new_ids, ended)  # before the client sees them
            logprobs = rnd.logprobs[:len(new_ids)]
            if finish is None:
                yield Chunk(session.session_id, text, new_ids, logprobs=logprobs)
                continue
            log.info("generated %d tokens (%s) in %d rounds, %.0f ms", generated, finish.value, stats.rounds,
                     stats.wall_ms)
            self.suffix.finished(ctx.tenant, session.token_ids[-(prompt_tokens + generated):])
            yield Chunk(session.session_id, text, new_ids, finish, prompt_tokens, generated,
                        len(session.token_ids), stats, logprobs)
            return

    def _begin(self, req: GenerationRequest, session: Session, record: RequestRecord | None
               ) -> tuple[int, list[int], int, RequestRecord | None]:
        """Where the request's input starts in the session, the input, the most tokens it may
        generate, and its record: a first attempt commits its input (and record) here; a retry finds
        them committed."""
        if record is None:
            start, input_ids = len(session.token_ids), self._input_ids(req, session)
        else:  # a retry: the input is in the session already
            if not record.finish and session.request_id != record.request_id:
                raise FailedPrecondition(f"request {record.request_id!r} was interrupted and the session has had "
                                         "other requests since: it cannot be resumed")
            start = record.start
            input_ids = session.token_ids[start:start + record.input_tokens]
        room = self.limits.max_context - start - len(input_ids)
        if room < 1:
            raise ResourceExhausted(
                f"input: the session would hold {start + len(input_ids)} tokens, "
                f"the model's context is {self.limits.max_context}"
            )
        if req.max_new_tokens is not None and req.max_new_tokens > room:
            raise InvalidArgument("max_new_tokens",
                                  f"{req.max_new_tokens} exceeds the {room} tokens left in the context")
        max_new = req.max_new_tokens or min(self.limits.default_max_new_tokens, room)
        if record is None:
            if req.seed is not None:
                session.seed = req.seed
            session.sampling = sampling_to_dict(req.sampling)
            if req.messages is not None:
                session.messages += [*req.messages, {"role": "assistant", "content": ""}]
            session.stats.requests += 1
            session.request_id = req.request_id
            if req.request_id:
                record = RequestRecord(req.request_id, session.session_id, req.fingerprint(), start, len(input_ids))
            self.store.commit(session, input_ids, record, new_request=True)
        return start, input_ids, max_new, record

    @staticmethod
    def _account(session: Session, rnd: Round, new_ids: list[int], assistant_text: str | None) -> None:
        """The round in the session's stats (and chat history) and in the metrics."""
        session.stats.add(rnd, len(new_ids))
        if assistant_text is not None:
            session.messages[-1]["content"] = assistant_text
        metrics.ROUNDS.inc()
        metrics.TOKENS.inc(len(new_ids))
        metrics.DRAFT_TOKENS.inc(rnd.num_drafted)
        metrics.ACCEPTED_TOKENS.inc(rnd.num_accepted)
        for position in range(rnd.num_accepted):
            metrics.ACCEPTED_AT.labels(str(position)).inc()
        metrics.ROUND_SECONDS.labels("draft").observe(rnd.draft_ms / 1e3)
        metrics.ROUND_SECONDS.labels("verify").observe(rnd.verify_ms / 1e3)

    def _sampling(self, req: GenerationRequest, output_start: int) -> SamplingConfig:
        """The request's sampling as the workers get it: where its output starts, and which tokens end
        a constrained output."""
        c = req.sampling.constraint
        c = c and replace(c, end_ids=tuple(sorted(self.codec.eos_ids)))
        return replace(req.sampling, output_start=output_start, constraint=c)

    def _drafting(self, req: GenerationRequest, ctx: RequestContext, stop_ids: frozenset[int]) -> Drafting:
        overlap = self.limits.overlap if req.overlap is None else req.overlap
        decode_steps = self.limits.decode_steps if req.decode_steps is None else req.decode_steps
        proposers = {DraftMethod.MODEL: self.proposer, DraftMethod.SUFFIX: self.suffix,
                     DraftMethod.HEAD: HeadProposals() if self.limits.has_head else None}
        greedy = req.sampling.is_greedy  # a sampled request looks up its own tokens alone (SuffixProposer.propose)

        def lookup(ids: list[int], k: int) -> list[int]:
            return self.suffix.allowed(ctx.sampling, ids, self.suffix.continuation(ids, k, ctx.tenant,
                                                                                   own_only=not greedy))

        policy = self._policy(req, lookup, overlap, decode_steps)
        fixed = fixed_choice(req, self.limits.default_k, self.proposer is not None)
        if policy is not None:  # the speculator's own proposer is the one that overlaps
            own = self.proposer if DraftMethod.MODEL in policy.methods else None
        else:
            own = proposers.get(fixed[0])
        executor = self._overlap if overlap and own is self.proposer else None
        return Drafting(Speculator(ctx, own, self.verifier, executor), proposers, policy, fixed, decode_steps,
                        stop_ids, lookup)

    def _policy(self, req: GenerationRequest, lookup: Lookup, overlap: bool, decode_steps: int
                ) -> SpeculationPolicy | None:
        """The per-round choice of draft method and K, for a request that fixes neither (or asks for
        `adaptive`: then among its method and none). Sampled requests choose from fixed costs and
        look up their own tokens alone, so that a seed gives the same tokens whatever the load and
        whatever else has finished."""
        fixed = req.method is not None or req.num_speculative_tokens is not None
        if req.method is DraftMethod.NONE or (fixed and not req.adaptive):
            return None
        methods = {DraftMethod.MODEL, DraftMethod.SUFFIX, DraftMethod.HEAD} if req.method is None else {req.method}
        if self.proposer is None:
            methods.discard(DraftMethod.MODEL)
        if not self.limits.has_head:
            methods.discard(DraftMethod.HEAD)
        costs = self.costs if req.sampling.is_greedy else self.fixed_costs
        return SpeculationPolicy(costs, frozenset(methods), overlap, req.num_speculative_tokens, lookup, decode_steps)

    def _input_ids(self, req: GenerationRequest, session: Session) -> list[int]:
        if req.token_ids is not None:
            return list(req.token_ids)
        if req.prompt is not None:
            return self.codec.encode_prompt(req.prompt, is_first_turn=not session.token_ids)
        return self.codec.encode_chat(session.token_ids, session.messages, req.messages, req.tools)
