"""`python -m target_service`: load the target model and serve `specdec.v1.Target`."""

from __future__ import annotations

import logging
import sys

from specdec.v1 import target_pb2, target_pb2_grpc
from specdec_core.hf_backend import HFBackend
from specdec_core.kvcache import SessionCaches
from specdec_core.models import load_causal_lm
from specdec_core.server import create_server, serve, setup_logging
from target_service.config import TargetConfig
from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

log = logging.getLogger("target_service")


def main(argv: list[str] | None = None) -> None:
    cfg = TargetConfig.from_args(argv)
    setup_logging(cfg.log_level)
    log.info("loading target model %s (%s on %s)", cfg.model, cfg.dtype, cfg.device)
    backend = HFBackend(load_causal_lm(cfg.model, cfg.dtype, cfg.device))
    verifier = Verifier(SessionCaches(backend, cfg.max_cache_tokens), backend.max_context)
    server = create_server(cfg.max_workers)
    target_pb2_grpc.add_TargetServicer_to_server(TargetServicer(verifier, cfg.model), server)
    serve(server, f"{cfg.host}:{cfg.port}", [target_pb2.DESCRIPTOR.services_by_name["Target"].full_name])


if __name__ == "__main__":
    sys.exit(main())
