"""A generation request from validation to the last streamed chunk.

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

import enum
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from coordinator.loop import NO_DECODE, Decode, Proposer, Speculator, Verifier
from coordinator.policy import FIXED, MODEL, NGRAM, Costs, SpeculationPolicy
from coordinator.sessions import DEFAULT_TENANT, RequestRecord, Session, SessionStats, SessionStore
from coordinator.tenancy import RequestQuota
from coordinator.text import OutputText, TextCodec
from specdec_core import metrics
from specdec_core.errors import (
    Aborted,
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    SpecdecError,
)
from specdec_core.limits import MAX_DECODE_STEPS, validate_request_id, validate_session_id
from specdec_core.logs import log_context
from specdec_core.sampling import SamplingConfig, TokenLogprob, sampling_to_dict, validate_sampling

log = logging.getLogger(__name__)

MAX_K = 32
ROLES = ("system", "user", "assistant")
# Input limits, each checked before what it bounds is read any further, so that an oversized
# request is refused at no cost. Text is bounded per token of the model's context: text longer than
# CHARS_PER_TOKEN characters for every token of the context could not fit in it.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
CHARS_PER_TOKEN = 32


class Method(enum.Enum):
    DEFAULT = "default"
    MODEL = "model"
    NGRAM = "ngram"
    NONE = "none"


class Finish(enum.Enum):
    LENGTH = "length"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    CONTEXT = "context"


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    method: Method = Method.DEFAULT
    num_speculative_tokens: int | None = None
    adaptive: bool = False
    overlap: bool | None = None  # None: the server default
    decode_steps: int | None = None  # None: the server default
    min_draft_confidence: float = 0.0
    session_id: str = ""
    request_id: str = ""  # makes retries idempotent; empty: none
    end_session: bool = False  # end the session when the request has finished

    def fingerprint(self) -> str:
        """What a retry with the same request id must ask for again (the session is checked apart)."""
        return hashlib.blake2b(repr(replace(self, request_id="", session_id="")).encode(), digest_size=12).hexdigest()


@dataclass
class RequestStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    last_k: int = 0
    max_verify_batch_size: int = 0
    model_rounds: int = 0  # rounds drafted by the draft model
    ngram_rounds: int = 0  # by n-gram lookup
    decoded: int = 0  # tokens the target decoded in plain steps after a verdict (one pass each)


@dataclass(frozen=True)
class Chunk:
    session_id: str
    text: str
    token_ids: list[int]
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    session_tokens: int = 0
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token id, when asked for


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    default_max_new_tokens: int
    default_k: int
    max_concurrent_requests: int = 64  # sizes the overlapped-drafting pool (one bet per request)
    overlap: bool = False
    decode_steps: int = 0  # plain tokens a round without a draft asks the target for after its verdict


class Generation:
    def __init__(self, store: SessionStore, codec: TextCodec, proposer: Proposer | None, ngram: Proposer,
                 verifier: Verifier, limits: Limits, routes: dict[str, dict[str, str]] | None = None,
                 quota: RequestQuota | None = None):
        self.store = store
        self.quota = quota or RequestQuota()
        self.routes = routes if routes is not None else {}  # sessions in flight -> their replicas
        self._prefetch = ThreadPoolExecutor(max_workers=limits.max_concurrent_requests, thread_name_prefix="prefetch")
        self.codec = codec
        self.proposer = proposer
        self.ngram = ngram
        self.verifier = verifier
        self.limits = limits
        self.costs = Costs()  # the workers' costs as measured here, for every session's policy

    def run(self, req: GenerationRequest, is_cancelled: Callable[[], bool] = lambda: False,
            tenant: str = DEFAULT_TENANT) -> Iterator[Chunk]:
        """The request's chunks. How many run at once is bounded by the server's admission lane
        (--max-concurrent-requests), which refuses the excess at once, and per tenant by the
        quota: the coordinator has no queue of its own; the workers refuse a call whose deadline
        their queue would miss."""
        self._validate(req)
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
                self.routes[session.session_id] = session.routes  # routed workers update it in place
                try:
                    with self.costs.running():
                        yield from self._run(req, session, record, is_cancelled)
                except (Cancelled, GeneratorExit):  # the client has gone: nobody will continue a one-shot session
                    if req.end_session:
                        self.end(session)
                    raise
                finally:
                    if self.routes.get(session.session_id) is session.routes:  # not a later attempt's
                        del self.routes[session.session_id]
            if req.end_session:  # after the lease: ending is what EndSession does
                self.end(session)

    def end(self, session: Session) -> None:
        """Free a session's worker caches and delete its record (EndSession, or a one-shot request)."""
        for worker in (self.proposer, self.verifier):
            try:
                if worker is not None:
                    worker.release(session.session_id)
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

    def _run(self, req: GenerationRequest, session: Session, record: RequestRecord | None,
             is_cancelled: Callable[[], bool]) -> Iterator[Chunk]:
        started = time.perf_counter()
        start, input_ids, max_new, record = self._begin(req, session, record)

        proposer, k_fixed = self._drafting(req)
        overlap = self.limits.overlap if req.overlap is None else req.overlap
        decode_steps = self.limits.decode_steps if req.decode_steps is None else req.decode_steps
        policy = self._policy(req, overlap, decode_steps)
        proposers = {MODEL: self.proposer, NGRAM: self.ngram}
        if policy is not None:
            proposer = self.proposer if MODEL in policy.methods else None
        sampling = replace(req.sampling, output_start=start + len(input_ids))  # penalties count from there
        speculator = Speculator(session.session_id, sampling, session.seed, proposer, self.verifier,
                                self._prefetch if overlap and proposer is self.proposer else None,
                                req.min_draft_confidence)
        stop_ids = frozenset(self.codec.eos_ids | set(req.stop_token_ids))
        out = OutputText(self.codec, req.stop)
        stats = RequestStats()
        done = session.token_ids[start + len(input_ids):record.end if record and record.finish else None]
        # (a retry's output so far, replayed)
        generated = len(done)
        if record is not None and (done or record.finish):
            self.store.confirm(session)  # an attempt may have committed these without its replicas' word
            text, _ = out.add(done)
            if record.finish:
                yield Chunk(session.session_id, text + out.flush(), done, Finish(record.finish), len(input_ids),
                            generated, record.end, stats)
                return
            yield Chunk(session.session_id, text, done)
        while True:
            if is_cancelled():
                raise Cancelled("the client cancelled the request")
            remaining = max_new - generated
            cap = min(remaining - 1, self.limits.max_context - len(session.token_ids) - 1)
            if policy is not None:
                # not the draft model in a request's first round: that round prefills, and a warm-up
                # started with it would keep the target to its share of the cores for the prefill of
                # every session in its batch (chat c8: TTFT p50 567 ms against 266 for K = 0, when the
                # first request of a burst, alone for a moment, started one), and on long prompts
                # the draft prefills for longer than the target anyway
                ready = stats.rounds > 0 and not speculator.warming_up
                choice = policy.choose(session.token_ids, cap, model_ready=ready)
                k, chosen, stand_in = choice.k, proposers.get(choice.method), choice.stand_in
                if choice.method != MODEL and not stand_in:
                    speculator.drop_warm_up()
            else:
                k, chosen, stand_in = max(0, min(k_fixed, cap)), proposer, False
            # multi-step plain decoding after plain and n-gram rounds (their steps keep the batch in
            # step; a model round's next block is drafting), but not in a request's first round (its
            # first token would wait) nor in a stand-in's (the draft's warm-up may end within a step)
            plain = k == 0 or chosen is self.ngram
            steps = min(decode_steps, cap - k) if plain and stats.rounds and not stand_in else 0
            decode = Decode(steps, stop_ids) if steps > 0 else NO_DECODE
            rnd = speculator.round(session.token_ids, k, chosen, decode)
            if policy is not None:
                policy.observe(rnd)
            new_ids, finish = self._cut(rnd.new_ids, remaining, stop_ids)
            text, keep = out.add(new_ids)
            if keep is not None:
                new_ids, finish = new_ids[:keep], Finish.STOP_STRING
            logprobs = rnd.logprobs[:len(new_ids)]
            generated += len(new_ids)
            if finish is None and generated >= max_new:
                finish = Finish.LENGTH
            if finish is None and len(session.token_ids) + len(new_ids) >= self.limits.max_context:
                finish = Finish.CONTEXT
            _count_round(stats, rnd)
            stats.last_k = k
            stats.decoded += len(rnd.verdict.decoded_ids)
            if rnd.num_drafted:
                stats.model_rounds += rnd.draft.from_worker
                stats.ngram_rounds += not rnd.draft.from_worker
            stats.max_verify_batch_size = max(stats.max_verify_batch_size, rnd.verify_batch_size)
            stats.wall_ms = (time.perf_counter() - started) * 1e3
            self._account(session, rnd, len(new_ids), out.text if req.messages is not None else None)
            record_round(rnd, len(new_ids))
            if finish is not None:
                text += out.flush()
                session.stats.wall_ms += stats.wall_ms
            ended = None
            if record and finish:
                ended = replace(record, finish=finish.value, end=len(session.token_ids) + len(new_ids))
            self.store.commit(session, new_ids, ended)  # before the client sees them
            if finish is None:
                yield Chunk(session.session_id, text, new_ids, logprobs=logprobs)
                continue
            log.info("generated %d tokens (%s) in %d rounds, %.0f ms", generated, finish.value, stats.rounds,
                     stats.wall_ms)
            yield Chunk(session.session_id, text, new_ids, finish, len(input_ids), generated,
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
            raise InvalidArgument("max_new_tokens", f"{req.max_new_tokens} exceeds the {room} tokens left in the context")
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
    def _cut(new_ids: list[int], remaining: int, stop_ids: set[int]) -> tuple[list[int], Finish | None]:
        new_ids = new_ids[:remaining]
        for j, token in enumerate(new_ids):
            if token in stop_ids:
                return new_ids[:j + 1], Finish.STOP_TOKEN
        return new_ids, None

    @staticmethod
    def _account(session: Session, rnd, num_new: int, assistant_text: str | None) -> None:
        _count_round(session.stats, rnd)
        session.stats.generated += num_new
        if assistant_text is not None:
            session.messages[-1]["content"] = assistant_text

    def _policy(self, req: GenerationRequest, overlap: bool, decode_steps: int) -> SpeculationPolicy | None:
        """The per-round choice of draft method and K, for a request that fixes neither (or asks for
        `adaptive`: then among its method and none). Sampled requests choose from fixed costs, so
        that a seed gives the same tokens whatever the load."""
        if req.method == Method.NONE or (not req.adaptive and (req.method != Method.DEFAULT
                                                               or req.num_speculative_tokens is not None)):
            return None
        methods = {MODEL, NGRAM} if req.method == Method.DEFAULT else {
            MODEL if req.method == Method.MODEL else NGRAM}
        if self.proposer is None:
            methods.discard(MODEL)
        costs = self.costs if req.sampling.is_greedy else FIXED
        return SpeculationPolicy(costs, frozenset(methods), overlap, req.num_speculative_tokens, self.ngram,
                                 decode_steps)

    def _drafting(self, req: GenerationRequest) -> tuple[Proposer | None, int]:
        k = self.limits.default_k if req.num_speculative_tokens is None else req.num_speculative_tokens
        if req.method == Method.NONE or k == 0:
            return None, 0
        if req.method == Method.NGRAM:
            return self.ngram, k
        return self.proposer, k if self.proposer is not None else 0

    def _input_ids(self, req: GenerationRequest, session: Session) -> list[int]:
        if req.token_ids is not None:
            return list(req.token_ids)
        if req.prompt is not None:
            return self.codec.encode_prompt(req.prompt, is_first_turn=not session.token_ids)
        return self.codec.encode_chat(session.token_ids, session.messages, req.messages)

    def _validate(self, req: GenerationRequest) -> None:
        max_tokens = self.limits.max_context
        max_chars = max_tokens * CHARS_PER_TOKEN
        per_context = f"{CHARS_PER_TOKEN} per token of the {max_tokens}-token context"
        given = [x for x in (req.prompt, req.messages, req.token_ids) if x is not None]
        if not given:
            raise InvalidArgument("input", "one of prompt, messages or token_ids is required")
        if req.prompt is not None:
            if not req.prompt:
                raise InvalidArgument("prompt", "must not be empty")
            if len(req.prompt) > max_chars:
                raise InvalidArgument("prompt", f"{len(req.prompt)} characters; at most {max_chars} ({per_context})")
        if req.messages is not None:
            if not req.messages:
                raise InvalidArgument("messages", "must not be empty")
            if len(req.messages) > max_tokens:
                raise InvalidArgument("messages", f"{len(req.messages)} messages; at most {max_tokens}, "
                                                  "the model's context in tokens")
            if not self.codec.has_chat_template:
                raise InvalidArgument("messages", f"the tokenizer {self.codec.name} has no chat template")
            for i, m in enumerate(req.messages):
                if m["role"] not in ROLES:
                    raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
            size = sum(len(m["content"]) for m in req.messages)
            if size > max_chars:
                raise InvalidArgument("messages", f"{size} characters of content; at most {max_chars} ({per_context})")
        if req.token_ids is not None:
            if not req.token_ids:
                raise InvalidArgument("token_ids", "must not be empty")
            self._check_ids("token_ids", req.token_ids, max_tokens)
        self._check_ids("stop_token_ids", req.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if len(req.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"{len(req.stop)} stop strings; at most {MAX_STOP_STRINGS}")
        for i, s in enumerate(req.stop):
            if not s:
                raise InvalidArgument("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidArgument("stop", f"stop string {i} has {len(s)} characters; at most {MAX_STOP_CHARS}")
        validate_sampling(req.sampling, vocab_size=self.limits.vocab_size)
        if req.max_new_tokens is not None and req.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens", f"must be >= 1, got {req.max_new_tokens}")
        k = req.num_speculative_tokens
        if not 0.0 <= req.min_draft_confidence < 1.0:  # also rejects NaN
            raise InvalidArgument("speculation.min_draft_confidence", f"must be in [0, 1), got {req.min_draft_confidence}")
        if k is not None and not 0 <= k <= MAX_K:
            raise InvalidArgument("speculation.num_speculative_tokens", f"must be in 0..{MAX_K}, got {k}")
        if req.decode_steps is not None and not 0 <= req.decode_steps <= MAX_DECODE_STEPS:
            raise InvalidArgument("speculation.decode_steps", f"must be in 0..{MAX_DECODE_STEPS}, got {req.decode_steps}")
        if req.session_id:  # empty: a new session
            validate_session_id(req.session_id)
        if req.request_id:
            validate_request_id(req.request_id)

    def _check_ids(self, name: str, ids: list[int], max_count: int) -> None:
        if len(ids) > max_count:
            raise InvalidArgument(name, f"{len(ids)} ids; at most {max_count}")
        bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise InvalidArgument(name, f"token id {bad[0]} outside the vocabulary [0, {self.limits.vocab_size})")


def _count_round(stats: RequestStats | SessionStats, rnd) -> None:
    """Add one round to a request's or a session's running totals."""
    stats.rounds += 1
    stats.drafted += rnd.num_drafted
    stats.accepted += rnd.num_accepted
    stats.draft_ms += rnd.draft_ms
    stats.verify_ms += rnd.verify_ms


def record_round(rnd, num_committed: int) -> None:
    metrics.ROUNDS.inc()
    metrics.TOKENS.inc(num_committed)
    metrics.DRAFT_TOKENS.inc(rnd.num_drafted)
    metrics.ACCEPTED_TOKENS.inc(rnd.num_accepted)
    for position in range(rnd.num_accepted):
        metrics.ACCEPTED_AT.labels(str(position)).inc()
    metrics.ROUND_SECONDS.labels("draft").observe(rnd.draft_ms / 1e3)
    metrics.ROUND_SECONDS.labels("verify").observe(rnd.verify_ms / 1e3)
