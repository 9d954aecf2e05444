"""`python -m openai_gateway`: serve the OpenAI-compatible HTTP API over a coordinator."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import grpc
import uvicorn

from openai_gateway.app import Gateway, Settings
from specdec_core.logs import setup_logging


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m openai_gateway",
        description="OpenAI-compatible HTTP API (chat completions, completions, models) over a specdec coordinator. "
                    "Bearer tokens are passed on to the coordinator, which checks them.")
    p.add_argument("--host", default=env("SPECDEC_HTTP_HOST", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=int(env("SPECDEC_HTTP_PORT", "8000")), help="HTTP port (default 8000)")
    p.add_argument("--coordinator", default=env("SPECDEC_COORDINATOR", "127.0.0.1:50050"),
                   help="host:port of the coordinator's gRPC API")
    p.add_argument("--coordinator-tls", action="store_true",
                   help="the coordinator speaks TLS (implied by --coordinator-tls-ca)")
    p.add_argument("--coordinator-tls-ca", default=env("SPECDEC_COORDINATOR_TLS_CA", ""),
                   help="CA of the coordinator's certificate; when the file does not exist (an optional "
                        "Secret key), the system CAs")
    p.add_argument("--coordinator-server-name", default=env("SPECDEC_COORDINATOR_SERVER_NAME", ""),
                   help="name to check in the coordinator's certificate, when it is not the host")
    p.add_argument("--tls-cert", default=env("SPECDEC_TLS_CERT", ""), help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", default=env("SPECDEC_TLS_KEY", ""), help="... and this key")
    p.add_argument("--served-model-name", default=env("SPECDEC_SERVED_MODEL_NAME", ""),
                   help="the model name clients ask for (default: the target's file or folder name)")
    p.add_argument("--retry", type=float, default=30.0,
                   help="seconds an outage of the coordinator (UNAVAILABLE) is retried before a 503 (default 30)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="concurrent connections; beyond them new ones get HTTP 503 (default 1024)")
    p.add_argument("--log-level", default=env("SPECDEC_LOG_LEVEL", "info"))
    p.add_argument("--log-format", default=env("SPECDEC_LOG_FORMAT", "text"), choices=["text", "json"])
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    credentials = None
    if a.coordinator_tls or a.coordinator_tls_ca:
        ca = Path(a.coordinator_tls_ca) if a.coordinator_tls_ca else None
        credentials = grpc.ssl_channel_credentials(ca.read_bytes() if ca and ca.is_file() else None)
    gateway = Gateway(Settings(a.coordinator, credentials, a.coordinator_server_name, a.served_model_name, a.retry))
    uvicorn.run(gateway.app(), host=a.host, port=a.port, log_level=a.log_level.lower(), access_log=False,
                ssl_certfile=a.tls_cert or None, ssl_keyfile=a.tls_key or None, limit_concurrency=a.max_connections,
                timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
