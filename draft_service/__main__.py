"""`python -m draft_service`: load the draft model and serve `specdec.v1.Draft`."""

from __future__ import annotations

import logging
import sys

from draft_service.config import DraftConfig
from draft_service.proposer import ModelProposer
from draft_service.servicer import DraftServicer
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec_core.engine.grammar import Grammars
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.models import load_tokenizer
from specdec_core.logs import setup_logging
from specdec_core.serving.admission import Lanes
from specdec_core.serving.kvstore import open_tier
from specdec_core.serving.server import create_server, serve

log = logging.getLogger("draft_service")


def load_backend(cfg: DraftConfig):
    backend = cfg.resolved_backend
    log.info("loading draft model %s with %s", cfg.model, backend)
    if backend == "llama.cpp":
        from draft_service.llama_backend import LlamaCppBackend
        from specdec_core.engine.models import gguf_path

        path = gguf_path(cfg.model)
        if path is None:
            raise SystemExit("--backend llama.cpp needs a .gguf model (or 'smollm2')")
        return LlamaCppBackend(str(path), n_ctx=cfg.context_tokens, max_sequences=cfg.max_sessions,
                               n_threads=cfg.threads or None)
    import torch

    from specdec_core.engine.batched_backend import BatchedBackend
    from specdec_core.engine.models import load_causal_lm

    if cfg.threads:  # the cores `specdec up` gives the draft, as for llama.cpp
        torch.set_num_threads(cfg.threads)
    model = load_causal_lm(cfg.model, cfg.engine, cfg.dtype, cfg.device, int8_inputs=cfg.quantize_inputs)
    return BatchedBackend(model, max_tokens=cfg.max_cache_tokens)


def model_path(cfg: DraftConfig) -> str:
    """The weights the draft runs (what the KV tier's keys are fingerprinted from)."""
    from specdec_core.engine.models import gguf_path, resolve_model

    if cfg.resolved_backend == "llama.cpp":
        return str(gguf_path(cfg.model))
    return resolve_model(cfg.model, cfg.engine.cache_dir)


def main(argv: list[str] | None = None) -> None:
    cfg = DraftConfig.from_args(argv)
    setup_logging(cfg.server.log_level, cfg.server.log_format)
    backend = load_backend(cfg)
    caches = SessionCaches(backend, role="draft", tier=open_tier(cfg.kv_store, backend, model_path(cfg), "draft"),
                           share_prefixes=cfg.kv_store.prefix_sharing)
    proposer = ModelProposer(caches, backend.max_context, cfg.sparse_top, max_queue=cfg.max_queue,
                             prefill_chunk=cfg.prefill_chunk, grammars=Grammars(
                                 lambda: load_tokenizer(cfg.model, cfg.engine.cache_dir), backend.vocab_size).warm())
    service = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
    server = create_server(Lanes(frozenset({f"/{service}/Propose"}), work=cfg.max_queue))
    draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(proposer, cfg.model), server)
    serve(server, cfg.server, [service])


if __name__ == "__main__":
    sys.exit(main())
