"""`python -m target_service`: load the target model and serve `specdec.v1.Target`.

With --tensor-parallel-size N > 1 it re-executes itself under torchrun with N ranks; rank 0
serves gRPC, the others follow (see `tensor_parallel`).
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from specdec.v1 import target_pb2, target_pb2_grpc
from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.hf_backend import HFBackend
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.engine.grammar import Grammars
from specdec_core.engine.models import EMBEDDED_MODEL, load_causal_lm, load_tokenizer, resolve_model
from specdec_core.logs import setup_logging
from specdec_core.serving.admission import Lanes
from specdec_core.serving.kvstore import open_tier
from specdec_core.serving.server import create_server, serve
from target_service import tensor_parallel as tp
from target_service.config import TargetConfig
from target_service.head import EMBEDDED_HEAD, HeadError, load_head
from target_service.head_drafter import HeadDrafter
from target_service.servicer import TargetServicer
from target_service.verifier import BatchVerifier, CoreShare

log = logging.getLogger("target_service")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = TargetConfig.from_args(argv)
    if cfg.tensor_parallel_size > 1 and tp.world_size() == 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.tensor_parallel_size),
                    "--standalone", "-m", "target_service", *argv]
        os.execv(sys.executable, torchrun)
    setup_logging(cfg.server.log_level, cfg.server.log_format)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if tp.world_size() > 1:
        return serve_tensor_parallel(cfg)
    log.info("loading target model %s (%s on %s)", cfg.model, cfg.dtype, cfg.device)
    backend = make_backend(cfg, load_causal_lm(cfg.model, cfg.engine, cfg.dtype, cfg.device))
    tier = open_tier(cfg.kv_store, backend, resolve_model(cfg.model, cfg.engine.cache_dir), "target")
    run_server(cfg, backend, tier)


def make_backend(cfg: TargetConfig, model):
    if cfg.kv_cache == "paged":
        return BatchedBackend(model, max_tokens=cfg.max_cache_tokens)
    return HFBackend(model, max_tokens=cfg.max_cache_tokens)


def serve_tensor_parallel(cfg: TargetConfig) -> None:
    if tp.world_size() != cfg.tensor_parallel_size:
        raise SystemExit(f"WORLD_SIZE {tp.world_size()} != --tensor-parallel-size {cfg.tensor_parallel_size}")
    tp.die_with_parent()
    device, control = tp.init(cfg.device, cfg.dist_timeout_s)
    log.info("rank %d/%d: loading target model %s (%s on %s)", tp.rank(), tp.world_size(), cfg.model, cfg.dtype, device)
    local = make_backend(cfg, load_causal_lm(cfg.model, cfg.engine, cfg.dtype, device, tensor_parallel=True))
    tier = open_tier(cfg.kv_store, local, resolve_model(cfg.model, cfg.engine.cache_dir), "target", tp.world_size(),
                     tp.rank(), agree=tp.agree_min(control))
    if tp.rank() > 0:
        tp.follow(local, control, tier)
        return
    backend = tp.ReplicatedBackend(local, control, on_failure=_die, tier=tier)
    try:
        run_server(cfg, backend, backend.tier)
    finally:
        backend.shutdown()


def _die(exc: BaseException) -> None:
    log.critical("a tensor-parallel rank failed (%s); exiting", exc)
    logging.shutdown()
    os._exit(3)


def load_drafter(cfg: TargetConfig, backend, grammars: Grammars) -> HeadDrafter | None:
    """The draft head --head names, checked against the target (a mismatch stops the worker here)."""
    ref = head_reference(cfg)
    if ref is None:
        return None
    if not isinstance(backend, BatchedBackend):
        raise SystemExit("--head needs the paged KV cache on one process (not --kv-cache dynamic nor tensor "
                         "parallelism yet); --head none runs without it")
    try:
        head = load_head(ref, backend.model, dtype=backend.torch_dtype)
    except HeadError as e:
        raise SystemExit(f"--head {ref}: {e}") from None
    if backend.device.type == "cpu":
        head = head.for_cpu()
    log.info("draft head %s: EAGLE-3, layers %s, draft vocabulary %d%s", ref, list(head.config.aux_layer_ids),
             head.config.draft_vocab_size, ", int8 linears" if backend.device.type == "cpu" else "")
    return HeadDrafter(head, backend.vocab_size, grammars=grammars)


def head_reference(cfg: TargetConfig) -> str | None:
    if cfg.head == "none" or not cfg.head:
        return None
    if cfg.head == "auto":  # the shipped head, where it can run
        fits = cfg.model == EMBEDDED_MODEL and cfg.kv_cache == "paged" and cfg.tensor_parallel_size == 1
        return str(EMBEDDED_HEAD) if fits and EMBEDDED_HEAD.is_dir() else None
    return cfg.head


def run_server(cfg: TargetConfig, backend, tier=None) -> None:
    caches = SessionCaches(backend, role="target", tier=tier, share_prefixes=cfg.kv_store.prefix_sharing)
    cores = None
    if cfg.solo_threads and cfg.threads and cfg.tensor_parallel_size == 1:
        cores = CoreShare(cfg.threads, cfg.solo_threads)
    grammars = Grammars(lambda: load_tokenizer(cfg.model, cfg.engine.cache_dir), backend.vocab_size).warm()
    verifier = BatchVerifier(caches, backend.max_context, cfg.batch_window_ms / 1e3, cfg.max_batch, cfg.max_queue,
                             cores, cfg.prefill_chunk, cfg.prefill_stall, grammars=grammars,
                             head=load_drafter(cfg, backend, grammars))
    service = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
    server = create_server(Lanes(frozenset({f"/{service}/Verify"}), work=cfg.max_queue))
    target_pb2_grpc.add_TargetServicer_to_server(
        TargetServicer(verifier, cfg.model, cfg.tensor_parallel_size, head_reference(cfg)), server)
    serve(server, cfg.server, [service])


if __name__ == "__main__":
    sys.exit(main())
