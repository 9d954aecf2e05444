"""gRPC server bootstrap shared by every service: health, reflection, message limits, TLS, an
optional plaintext health port (Kubernetes gRPC probes do not speak TLS), metrics, bounded
concurrency (`admission`), and a graceful drain on SIGTERM/SIGINT: health turns NOT_SERVING, new
calls are refused, in-flight calls get `drain_seconds` to finish.

Health: the service names and "" say SERVING while the service can do its work, judged every
`HEALTH_EVERY_S` by a `readiness` check the service supplies (the coordinator: Redis answers and a
target replica is up), NOT_SERVING when a dependency is gone — never merely because it is busy.
"liveness" says SERVING for as long as the process serves at all: that is what a liveness probe
asks, so that a Redis outage makes pods unready, not restarted."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec_core.metrics import start_metrics_server
from specdec_core.serving.admission import AdmissionInterceptor, Lanes
from specdec_core.serving.security import TlsFiles

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
LIVENESS = "liveness"
HEALTH_EVERY_S = 2.0
NOT_READY_AFTER = 2  # failed readiness checks in a row


@dataclass(frozen=True)
class ServerOptions:
    """Flags every service shares."""

    host: str = "127.0.0.1"
    port: int = 0
    tls: TlsFiles = TlsFiles()
    health_port: int = 0  # 0: health only on the main port
    metrics_port: int = 0  # 0: no metrics endpoint
    drain_seconds: float = 30.0
    log_level: str = "info"
    log_format: str = "text"

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log format must be text or json, got {self.log_format!r}")
        if bool(self.tls.cert) != bool(self.tls.key):
            raise ValueError("--tls-cert and --tls-key go together")

    @staticmethod
    def add_flags(p: argparse.ArgumentParser, env_prefix: str, port: int) -> None:
        env = os.environ.get
        g = p.add_argument_group("server")
        g.add_argument("--host", default=env(f"{env_prefix}_HOST", "127.0.0.1"), help="address to bind")
        g.add_argument("--port", type=int, default=int(env(f"{env_prefix}_PORT", port)))
        g.add_argument("--tls-cert", default=env(f"{env_prefix}_TLS_CERT", ""), help="PEM certificate (enables TLS)")
        g.add_argument("--tls-key", default=env(f"{env_prefix}_TLS_KEY", ""), help="PEM private key")
        g.add_argument("--tls-client-ca", default=env(f"{env_prefix}_TLS_CLIENT_CA", ""),
                       help="require client certificates signed by this CA (mutual TLS)")
        g.add_argument("--health-port", type=int, default=int(env(f"{env_prefix}_HEALTH_PORT", 0)),
                       help="also serve grpc.health.v1 in plaintext on this port (for Kubernetes probes)")
        g.add_argument("--metrics-port", type=int, default=int(env("SPECDEC_METRICS_PORT", 0)),
                       help="serve Prometheus metrics over HTTP on this port (0: off)")
        g.add_argument("--drain-seconds", type=float, default=30.0,
                       help="on SIGTERM, how long in-flight calls may take to finish")
        g.add_argument("--log-level", default=env("SPECDEC_LOG_LEVEL", "info"))
        g.add_argument("--log-format", choices=["text", "json"], default=env("SPECDEC_LOG_FORMAT", "text"))

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ServerOptions:
        return cls(a.host, a.port, TlsFiles(a.tls_cert, a.tls_key, a.tls_client_ca), a.health_port, a.metrics_port,
                   a.drain_seconds, a.log_level, a.log_format)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class ParseRequestsInterceptor(grpc.ServerInterceptor):
    """grpcio answers INTERNAL when a request's bytes do not parse; bad input must get
    INVALID_ARGUMENT. The handler receives the raw bytes and parses them itself here."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary or handler.unary_stream

        def parsed(raw: bytes, context):
            try:
                request = parse(raw)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid protobuf message")
            return behavior(request, context)

        if handler.response_streaming:
            def stream(raw, context):
                yield from parsed(raw, context)

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(parsed, None, handler.response_serializer)


def create_server(lanes: Lanes, interceptors: tuple = ()) -> grpc.Server:
    """A server with one handler thread for every call its lanes admit, plus health's own.
    grpc's own limit on calls in progress is a backstop against floods of calls that are refused
    (each holds a thread briefly) or that are slow to send their request (a thread waits for the
    body before any lane sees the call): beyond it grpc refuses before any thread is used. Probes
    that must never wait belong on `--health-port`, whose server has threads of its own."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=lanes.threads, thread_name_prefix="grpc"),
        interceptors=(*interceptors, AdmissionInterceptor(lanes), ParseRequestsInterceptor()),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=4 * lanes.threads,
    )


def call_deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline as a time.monotonic() value, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def serve(server: grpc.Server, opts: ServerOptions, service_full_names: list[str],
          readiness: Callable[[], bool] | None = None) -> None:
    """Add health and reflection, bind, start, and block until SIGTERM/SIGINT, then drain."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    if opts.tls.enabled:
        bound = server.add_secure_port(opts.address, opts.tls.server_credentials())
    else:
        bound = server.add_insecure_port(opts.address)
    if bound == 0:
        raise SystemExit(f"cannot bind {opts.address}")
    probe_server = None
    if opts.health_port:
        probe_server = create_server(Lanes(frozenset(), work=1, streams=2, control=1))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe_server)
        probe_server.add_insecure_port(f"{opts.host}:{opts.health_port}")
        probe_server.start()
    start_metrics_server(opts.metrics_port, opts.host)
    server.start()
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    stopping = threading.Event()
    _report_readiness(health_servicer, ["", *service_full_names], readiness or (lambda: True), stopping)
    log.info("serving %s on %s%s", ", ".join(service_full_names), opts.address, " (TLS)" if opts.tls.enabled else "")

    def on_signal(signum, _frame):
        log.info("signal %d: draining for up to %.0f s", signum, opts.drain_seconds)
        health_servicer.enter_graceful_shutdown()
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping.wait()
    server.stop(opts.drain_seconds).wait()
    if probe_server is not None:
        probe_server.stop(0)
    log.info("stopped")


def _report_readiness(health_servicer, names: list[str], readiness: Callable[[], bool],
                      stopping: threading.Event) -> None:
    """Set names SERVING or NOT_SERVING from readiness(), now and every HEALTH_EVERY_S until
    stopping. Once serving, it takes NOT_READY_AFTER failed checks in a row to say NOT_SERVING: one
    slow answer from a busy dependency is not an outage."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    def check() -> bool:
        try:
            return bool(readiness())
        except Exception:  # noqa: BLE001 - a failing check means not ready
            log.exception("readiness check failed")
            return False

    def report(ready: bool) -> None:
        if not stopping.is_set():
            for name in names:
                health_servicer.set(name, serving if ready else not_serving)

    def loop(ready: bool) -> None:
        failures = 0
        while not stopping.wait(HEALTH_EVERY_S):
            failures = 0 if check() else failures + 1
            now = failures < NOT_READY_AFTER if ready else failures == 0
            if now != ready:
                log.warning("readiness: %s", "SERVING again" if now else "NOT_SERVING (a dependency is down)")
                report(now)
            ready = now

    ready = check()
    report(ready)
    threading.Thread(target=loop, args=(ready,), daemon=True, name="readiness").start()
