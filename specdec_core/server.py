"""gRPC server bootstrap shared by every service: health, reflection, message limits, and a
graceful stop on SIGTERM/SIGINT (in-flight calls get a grace period, new ones are refused)."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)


def create_server(max_workers: int, max_message_bytes: int = 16 * 1024 * 1024) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )


def serve(
    server: grpc.Server,
    address: str,
    service_full_names: list[str],
    grace_seconds: float = 10.0,
) -> None:
    """Add health and reflection, bind, start, and block until SIGTERM/SIGINT."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"cannot bind {address}")
    server.start()
    for name in ["", *service_full_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s", ", ".join(service_full_names), address)

    stopping = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: draining for up to %.0f s", signum, grace_seconds)
        health_servicer.enter_graceful_shutdown()
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping.wait()
    server.stop(grace_seconds).wait()
    log.info("stopped")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
