"""TLS, mutual TLS and bearer tokens.

- The public endpoint: TLS with the server's certificate; clients authenticate with a bearer token
  (`authorization: Bearer <token>` metadata), UNAUTHENTICATED otherwise.
- Between coordinator and workers: mutual TLS. Workers require a client certificate signed by the
  internal CA, so anything without it cannot call them.
- Health checks are exempt from the token (Kubernetes probes send none) and can be served on a
  separate plaintext port, since Kubernetes' gRPC probes do not speak TLS.
Certificates are read from files (Kubernetes Secrets mounted as files).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""  # PEM certificate chain of this side
    key: str = ""  # its private key
    ca: str = ""  # CA to check the peer against (server: require client certs signed by it)

    @property
    def enabled(self) -> bool:
        return bool(self.cert and self.key)

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


def bearer_token(metadata) -> str:
    """The token of an `authorization: Bearer <token>` header in a call's metadata ('' if none)."""
    header = dict(metadata or ()).get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " else ""


def known_token(token: str, tokens) -> str | None:
    """The one of `tokens` that `token` is (each compared in constant time), or None."""
    return next((t for t in tokens if token and hmac.compare_digest(token, t)), None)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Lets in calls that carry one of `tokens` (any collection of strings, e.g. token -> tenant)."""

    def __init__(self, tokens):
        self.tokens = tuple(tokens)

    def intercept_service(self, continuation, details):
        method = details.method
        if method.startswith(HEALTH_PREFIX) or method.startswith(REFLECTION_PREFIX):
            return continuation(details)
        token = bearer_token(details.invocation_metadata)
        if known_token(token, self.tokens) is not None:
            return continuation(details)
        return _deny(continuation(details))


def _deny(handler):
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    def unary(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
