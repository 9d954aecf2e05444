"""A generation request as the coordinator sees it: what was asked (`GenerationRequest`), what each
round needs from it on its way to the workers (`RequestContext`), and what goes back (`Chunk`,
`Stats`, `Finish`)."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specdec_core.errors import DeadlineExceeded
from specdec_core.engine.sampling import SamplingConfig, TokenLogprob

if TYPE_CHECKING:
    from coordinator.cancel import CancelToken
    from coordinator.loop import Round


DEFAULT_TENANT = "default"  # a caller without a tenant of its own (no bearer token, no certificate)


class DraftMethod(enum.Enum):
    """Where a round's draft tokens come from. A request names one or leaves the choice to the
    server's speculation policy (`None`), which chooses among them round by round."""

    MODEL = "model"  # the draft worker's model
    SUFFIX = "suffix"  # suffix decoding in the coordinator: the session's tokens and its tenant's earlier requests
    HEAD = "head"  # the target worker's EAGLE-3 head: its proposal comes back with each verdict
    NONE = "none"  # no draft: plain target decoding (K = 0)


class Finish(enum.Enum):
    LENGTH = "length"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    CONTEXT = "context"


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    messages: list[dict] | None = None  # {"role", "content"}, and "tool_calls" / "tool_call_id" / "name" when set
    token_ids: list[int] | None = None
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    method: DraftMethod | None = None  # None: the server's policy chooses
    num_speculative_tokens: int | None = None
    adaptive: bool = False
    overlap: bool | None = None  # None: the server default
    decode_steps: int | None = None  # None: the server default
    min_draft_confidence: float = 0.0
    session_id: str = ""
    request_id: str = ""  # makes retries idempotent; empty: none
    end_session: bool = False  # end the session when the request has finished
    tools: list[dict] | None = None  # functions the model may call: {"name", "description", "parameters" (JSON text)}

    def fingerprint(self) -> str:
        """What a retry with the same request id must ask for again (the session is checked apart)."""
        return hashlib.blake2b(repr(replace(self, request_id="", session_id="")).encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Limits:
    """What this coordinator allows a request, and its defaults for what a request leaves unset."""

    vocab_size: int
    max_context: int
    default_max_new_tokens: int
    default_k: int
    max_concurrent_requests: int = 64  # sizes the overlapped-drafting pool (one bet per request)
    overlap: bool = False
    decode_steps: int = 0  # plain tokens a round without a draft asks the target for after its verdict
    has_head: bool = False  # the target workers have a draft head (ModelInfo.head)


@dataclass(frozen=True)
class RequestContext:
    """What every worker call made for one request carries: the session and its sampling, where the
    session's replicas are (`routes`, the dict stored with the session, updated in place as calls
    move it), when the client stops waiting (`deadline`, time.monotonic()), and the token that
    cancels an overlapped draft (`cancel`, None for calls nobody cancels)."""

    session_id: str
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    tenant: str = DEFAULT_TENANT
    routes: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None
    cancel: CancelToken | None = None
    min_draft_confidence: float = 0.0

    def timeout(self, default_s: float) -> float:
        """A worker call's timeout: default_s, or less so as not to outlive the client's deadline."""
        if self.deadline is None:
            return default_s
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return min(default_s, remaining)


@dataclass
class Stats:
    """Running totals of rounds: one request's (returned with its last chunk) or a whole session's
    (stored with it in Redis)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    last_k: int = 0
    max_verify_batch_size: int = 0
    model_rounds: int = 0  # rounds drafted by the draft model
    suffix_rounds: int = 0  # by suffix decoding
    head_rounds: int = 0  # by the target worker's head
    decoded: int = 0  # tokens the target decoded in plain steps after a verdict (one pass each)
    generated: int = 0  # tokens committed
    requests: int = 0  # requests served (a session's count)

    def add(self, rnd: Round, num_committed: int) -> None:
        self.rounds += 1
        self.drafted += rnd.num_drafted
        self.accepted += rnd.num_accepted
        self.draft_ms += rnd.draft_ms
        self.verify_ms += rnd.verify_ms
        self.last_k = rnd.k
        self.max_verify_batch_size = max(self.max_verify_batch_size, rnd.verify_batch_size)
        if rnd.num_drafted:
            self.model_rounds += rnd.draft.from_worker
            self.head_rounds += rnd.draft.from_head
            self.suffix_rounds += not (rnd.draft.from_worker or rnd.draft.from_head)
        self.decoded += len(rnd.verdict.decoded_ids) if rnd.verdict is not None else 0
        self.generated += num_committed


@dataclass(frozen=True)
class Chunk:
    session_id: str
    text: str
    token_ids: list[int]
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    session_tokens: int = 0
    stats: Stats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token id, when asked for
