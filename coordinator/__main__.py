"""`python -m coordinator`: serve the public `specdec.v1.Generation` API."""

from __future__ import annotations

import logging
import sys

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation, Limits
from coordinator.ngram import NgramProposer
from coordinator.routing import ReplicaPool, Routed, discover
from coordinator.servicer import GenerationServicer
from coordinator.sessions import SessionStore
from coordinator.text import TextCodec
from coordinator.workers import DraftClient, TargetClient
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from specdec_core.errors import FailedPrecondition
from specdec_core.models import load_tokenizer
from specdec_core.server import create_server, serve, setup_logging

log = logging.getLogger("coordinator")


def connect_redis(url: str) -> redis.Redis:
    """A client that retries a few times with backoff, then lets the error through (UNAVAILABLE)."""
    return redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


def main(argv: list[str] | None = None) -> None:
    cfg = CoordinatorConfig.from_args(argv)
    setup_logging(cfg.log_level)
    routes: dict[str, dict[str, str]] = {}
    target = Routed(ReplicaPool("target", discover(cfg.target_address),
                                lambda a: TargetClient(a, retry_budget_s=min(2.0, cfg.target_retry_s)),
                                cfg.target_retry_s), routes)
    draft = None
    if cfg.draft_address:
        draft = Routed(ReplicaPool("draft", discover(cfg.draft_address),
                                   lambda a: DraftClient(a, retry_budget_s=min(1.0, cfg.draft_retry_s)),
                                   cfg.draft_retry_s), routes)
    log.info("waiting for the target worker at %s", cfg.target_address)
    target_info = target.model_info(cfg.startup_timeout_s)
    draft_info = draft.model_info(cfg.startup_timeout_s) if draft else None
    codec = TextCodec(load_tokenizer(cfg.tokenizer), cfg.tokenizer)
    if len(codec.tokenizer) > target_info.vocab_size:
        raise FailedPrecondition(f"tokenizer {cfg.tokenizer} has {len(codec.tokenizer)} tokens, "
                                 f"the target model only {target_info.vocab_size}")
    if draft_info is not None and draft_info.vocab_size != target_info.vocab_size:
        log.warning("draft vocabulary (%d) differs from the target's (%d)", draft_info.vocab_size,
                    target_info.vocab_size)
    limits = Limits(target_info.vocab_size, target_info.max_context, cfg.max_new_tokens, cfg.num_speculative_tokens)
    store = SessionStore(connect_redis(cfg.redis_url), ttl_seconds=cfg.session_ttl_s)
    generation = Generation(store, codec, draft, NgramProposer(), target, limits, routes)
    describe = pb.DescribeModelsResponse(
        target=target_info, draft=draft_info, tokenizer=cfg.tokenizer,
        default_num_speculative_tokens=cfg.num_speculative_tokens, default_max_new_tokens=cfg.max_new_tokens,
    )
    server = create_server(cfg.max_workers)
    workers = [w for w in (draft, target) if w is not None]
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(generation, workers, describe), server)
    serve(server, f"{cfg.host}:{cfg.port}", [pb.DESCRIPTOR.services_by_name["Generation"].full_name])


if __name__ == "__main__":
    sys.exit(main())
