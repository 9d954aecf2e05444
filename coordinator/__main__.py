"""`python -m coordinator`: serve the public `specdec.v1.Generation` API."""

from __future__ import annotations

import logging
import sys
import threading

import redis

from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation
from coordinator.policy import Prior
from coordinator.request import Limits
from specdec_core.serving.redis_client import connect_redis
from coordinator.routing import ReplicaPool, Routed, discover
from coordinator.servicer import GenerationServicer
from coordinator.sessions import SessionStore
from coordinator.suffix import SuffixIndex, SuffixProposer
from coordinator.suffix_share import SuffixShare
from coordinator.tenancy import RequestQuota, Tenants, read_tenant_tokens
from coordinator.text import TextCodec
from coordinator.workers import ChannelSettings, DraftClient, DraftsInFlight, TargetClient
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from specdec_core.errors import FailedPrecondition, Unavailable
from specdec_core.serving.admission import Lanes
from specdec_core.logs import setup_logging
from specdec_core.engine.grammar import Grammars
from specdec_core.engine.models import load_tokenizer
from specdec_core.serving.security import BearerTokenInterceptor
from specdec_core.serving.server import create_server, serve

log = logging.getLogger("coordinator")


def worker_pools(cfg: CoordinatorConfig) -> tuple[Routed, Routed | None]:
    tls = cfg.worker_tls
    channel = ChannelSettings(tls.channel_credentials() if tls.ca else None, cfg.worker_tls_server_name)
    drafts = DraftsInFlight()  # the draft clients count their calls, the target clients tell the target
    target = Routed(ReplicaPool("target", discover(cfg.target_address),
                                lambda a: TargetClient(a, retry_budget_s=min(2.0, cfg.target_retry_s), channel=channel,
                                                       drafts=drafts),
                                cfg.target_retry_s))
    draft = None
    if cfg.draft_address:
        draft = Routed(ReplicaPool("draft", discover(cfg.draft_address),
                                   lambda a: DraftClient(a, retry_budget_s=min(1.0, cfg.draft_retry_s), channel=channel,
                                                         in_flight=drafts),
                                   cfg.draft_retry_s, fail_fast=True))
    return target, draft


def suffix_proposer(cfg: CoordinatorConfig, client: redis.Redis, grammars: Grammars | None = None) -> SuffixProposer:
    """Suffix decoding over the session and its tenant's finished requests (every replica's, with
    --suffix-share)."""
    index = SuffixIndex(cfg.suffix_max_requests, cfg.suffix_max_tokens, cfg.suffix_max_total_tokens)
    share = SuffixShare(client, index, ttl_s=cfg.session_ttl_s).start() if cfg.suffix_share else None
    return SuffixProposer(index, publish=share.publish if share else None, grammars=grammars)


def _draft_info(draft: Routed, wait_s: float):
    """The draft's model info, or None if it is not up yet: the draft is optional (without it
    generation runs at K = 0), so a coordinator must be able to start during a draft outage."""
    try:
        return draft.model_info(wait_s)
    except Unavailable as exc:
        log.warning("draft worker not available yet (%s); serving without it until it is", exc)
        return None


def main(argv: list[str] | None = None) -> None:
    cfg = CoordinatorConfig.from_args(argv)
    setup_logging(cfg.server.log_level, cfg.server.log_format)
    target, draft = worker_pools(cfg)
    log.info("waiting for the target worker at %s", cfg.target_address)
    target_info = target.model_info(cfg.startup_timeout_s)
    draft_info = _draft_info(draft, wait_s=min(30.0, cfg.startup_timeout_s)) if draft else None
    codec = TextCodec(load_tokenizer(cfg.tokenizer, cfg.cache_dir), cfg.tokenizer)
    if len(codec.tokenizer) > target_info.vocab_size:
        raise FailedPrecondition(f"tokenizer {cfg.tokenizer} has {len(codec.tokenizer)} tokens, "
                                 f"the target model only {target_info.vocab_size}")
    if draft_info is not None and draft_info.vocab_size != target_info.vocab_size:
        log.warning("draft vocabulary (%d) differs from the target's (%d)", draft_info.vocab_size,
                    target_info.vocab_size)
    limits = Limits(vocab_size=target_info.vocab_size, max_context=target_info.max_context,
                    default_max_new_tokens=cfg.max_new_tokens, default_k=cfg.num_speculative_tokens,
                    max_concurrent_requests=cfg.max_concurrent_requests, overlap=cfg.overlap,
                    decode_steps=cfg.decode_steps, has_head=bool(target_info.head))
    store = SessionStore(connect_redis(cfg.redis_url, cfg.redis_tls, cfg.redis_retry_s), ttl_seconds=cfg.session_ttl_s,
                         wait_replicas=cfg.redis_wait_replicas, wait_timeout_ms=cfg.redis_wait_timeout_ms,
                         max_sessions_per_tenant=cfg.tenant_max_sessions, request_ttl_seconds=cfg.request_ttl_s)
    grammars = Grammars(lambda: codec.tokenizer, target_info.vocab_size)
    generation = Generation(store, codec, draft, suffix_proposer(cfg, store.redis, grammars), target, limits,
                            RequestQuota(cfg.tenant_max_requests), Prior.for_models(
                                target_info.num_parameters, draft_info.num_parameters if draft_info else 0),
                            grammars)
    describe = pb.DescribeModelsResponse(
        target=target_info, draft=draft_info, tokenizer=cfg.tokenizer,
        default_num_speculative_tokens=cfg.num_speculative_tokens, default_max_new_tokens=cfg.max_new_tokens,
    )
    if draft is not None and draft_info is None:  # serve now; describe the draft once it is up
        def draft_came_up() -> None:
            info = draft.model_info(float("inf"))
            describe.draft.CopyFrom(info)
            generation.set_prior(Prior.for_models(target_info.num_parameters, info.num_parameters))

        threading.Thread(target=draft_came_up, daemon=True).start()
    tokens = read_tenant_tokens(cfg.auth_tokens_file) if cfg.auth_tokens_file else {}
    interceptors = (BearerTokenInterceptor(tokens),) if tokens else ()
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    lanes = Lanes(frozenset({f"/{service}/Generate", f"/{service}/GenerateStream"}), work=cfg.max_concurrent_requests)
    server = create_server(lanes, interceptors)
    servicer = GenerationServicer(generation, describe, Tenants(tokens))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    serve(server, cfg.server, [service], readiness=lambda: _ready(store, target))


def _ready(store: SessionStore, target: Routed) -> bool:
    """Serving needs Redis and a target replica; a busy one is fine, a missing draft is too."""
    try:
        store.redis.ping()
    except redis.RedisError as exc:
        log.warning("readiness: Redis does not answer: %s", exc)
        return False
    if not target.pool.any_serving(timeout_s=2.0):
        log.warning("readiness: no target replica is serving")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
