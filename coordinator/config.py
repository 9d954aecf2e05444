"""The coordinator's configuration: built once in main() from flags (with env defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from specdec_core.engine.options import default_cache_dir
from specdec_core.limits import MAX_DECODE_STEPS, MAX_SPECULATIVE_TOKENS
from specdec_core.serving.security import TlsFiles
from specdec_core.serving.server import ServerOptions


@dataclass(frozen=True)
class CoordinatorConfig:
    server: ServerOptions
    target_address: str = "127.0.0.1:50052"
    draft_address: str = "127.0.0.1:50051"  # empty: no draft worker (n-gram or K = 0 only)
    redis_url: str = ""
    redis_tls: TlsFiles = TlsFiles()  # CA for rediss://, and a client certificate if Redis wants one
    redis_retry_s: float = 5.0
    redis_wait_replicas: int = 0
    redis_wait_timeout_ms: int = 1000
    tokenizer: str = "smollm2"
    cache_dir: Path = Path()  # where a GGUF model's converted tokenizer is kept (the workers' --cache-dir)
    num_speculative_tokens: int = 5
    max_new_tokens: int = 256
    session_ttl_s: int = 86400
    request_ttl_s: int = 3600
    target_retry_s: float = 30.0
    draft_retry_s: float = 2.0
    startup_timeout_s: float = 600.0
    max_concurrent_requests: int = 64
    overlap: bool = False
    decode_steps: int = 4
    auth_tokens_file: str = ""
    tenant_max_sessions: int = 0
    tenant_max_requests: int = 0
    worker_tls: TlsFiles = TlsFiles()
    worker_tls_server_name: str = ""
    suffix_max_requests: int = 256  # per tenant, in the suffix index
    suffix_max_tokens: int = 65536  # per tenant
    suffix_max_total_tokens: int = 1 << 20  # all tenants together
    suffix_share: bool = True  # every replica's finished requests in every replica's index, via Redis

    def __post_init__(self):
        if not self.redis_url:
            raise ValueError("redis_url is required (--redis-url or REDIS_URL); `specdec up` starts one for you")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be in 0..{MAX_DECODE_STEPS}")
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if self.session_ttl_s < 1 or self.request_ttl_s < 1:
            raise ValueError("session_ttl_s and request_ttl_s must be >= 1")
        for name in ("redis_wait_replicas", "tenant_max_sessions", "tenant_max_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if min(self.suffix_max_requests, self.suffix_max_tokens, self.suffix_max_total_tokens) < 1:
            raise ValueError("the suffix index's bounds must be >= 1")
        if self.redis_wait_timeout_ms < 1:
            raise ValueError("redis_wait_timeout_ms must be >= 1")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> CoordinatorConfig:
        env = os.environ.get
        p = argparse.ArgumentParser(prog="specdec coordinator",
                                    description="Run the coordinator (public Generation API, speculative loop).")
        for add_flags in (_worker_flags, _redis_flags, _generation_flags, _suffix_flags, _tenancy_flags):
            add_flags(p, env)
        ServerOptions.add_flags(p, "SPECDEC", port=50050)
        a = p.parse_args(argv)
        return cls(
            server=ServerOptions.from_args(a), target_address=a.target, draft_address=a.draft,
            redis_url=a.redis_url, redis_tls=TlsFiles(a.redis_tls_cert, a.redis_tls_key, a.redis_tls_ca),
            redis_retry_s=a.redis_retry, redis_wait_replicas=a.redis_wait_replicas,
            redis_wait_timeout_ms=a.redis_wait_timeout_ms, tokenizer=a.tokenizer, cache_dir=a.cache_dir,
            num_speculative_tokens=a.num_speculative_tokens, max_new_tokens=a.max_new_tokens,
            session_ttl_s=a.session_ttl, request_ttl_s=a.request_ttl, target_retry_s=a.target_retry,
            draft_retry_s=a.draft_retry, startup_timeout_s=a.startup_timeout,
            max_concurrent_requests=a.max_concurrent_requests, overlap=a.overlap, decode_steps=a.decode_steps,
            auth_tokens_file=a.auth_tokens_file,
            tenant_max_sessions=a.tenant_max_sessions, tenant_max_requests=a.tenant_max_requests,
            worker_tls=TlsFiles(a.worker_tls_cert, a.worker_tls_key, a.worker_tls_ca),
            worker_tls_server_name=a.worker_tls_server_name, suffix_max_requests=a.suffix_max_requests,
            suffix_max_tokens=a.suffix_max_tokens, suffix_max_total_tokens=a.suffix_max_total_tokens,
            suffix_share=a.suffix_share,
        )


def _worker_flags(p: argparse.ArgumentParser, env) -> None:
    """Where the workers are, how long to wait for them, and TLS to them."""
    p.add_argument("--target", default=env("SPECDEC_TARGET_ADDRESS", CoordinatorConfig.target_address),
                   help="target replicas: host:port[,host:port], file:///list, dns:///name:port, "
                        "k8s:///namespace/service:port")
    p.add_argument("--draft", default=env("SPECDEC_DRAFT_ADDRESS", CoordinatorConfig.draft_address),
                   help="draft replicas, same forms as --target ('' for none)")
    p.add_argument("--worker-tls-cert", default=env("SPECDEC_WORKER_TLS_CERT", ""),
                   help="client certificate for mutual TLS to the workers")
    p.add_argument("--worker-tls-key", default=env("SPECDEC_WORKER_TLS_KEY", ""))
    p.add_argument("--worker-tls-ca", default=env("SPECDEC_WORKER_TLS_CA", ""),
                   help="CA that signed the workers' certificates (enables TLS to the workers)")
    p.add_argument("--worker-tls-server-name", default=env("SPECDEC_WORKER_TLS_SERVER_NAME", ""),
                   help="name to check in the workers' certificates (default: the address' host)")


def _redis_flags(p: argparse.ArgumentParser, env) -> None:
    """Where session state lives and how each commit is made durable."""
    p.add_argument("--redis-url", default=env("REDIS_URL", ""),
                   help="redis://[:password@]host:port/db, rediss:// for TLS, unix:///path, or "
                        "redis+sentinel://[:password@]host:port[,host:port...]/master-name[/db] "
                        "(rediss+sentinel:// for TLS) for a replicated Redis under Sentinel")
    p.add_argument("--redis-tls-ca", default=env("SPECDEC_REDIS_TLS_CA", ""), help="CA for rediss://")
    p.add_argument("--redis-tls-cert", default=env("SPECDEC_REDIS_TLS_CERT", ""),
                   help="client certificate for a Redis that requires mutual TLS")
    p.add_argument("--redis-tls-key", default=env("SPECDEC_REDIS_TLS_KEY", ""))
    p.add_argument("--redis-retry", type=float,
                   default=float(env("SPECDEC_REDIS_RETRY", CoordinatorConfig.redis_retry_s)),
                   help="seconds to keep retrying a lost Redis connection (with Sentinel: long enough for a "
                        "failover) before UNAVAILABLE")
    p.add_argument("--redis-wait-replicas", type=int,
                   default=int(env("SPECDEC_REDIS_WAIT_REPLICAS", CoordinatorConfig.redis_wait_replicas)),
                   help="each commit waits until this many replicas hold it (Redis WAIT) before its tokens "
                        "go to the client, so a failover loses none of them; 0: do not wait")
    p.add_argument("--redis-wait-timeout-ms", type=int,
                   default=int(env("SPECDEC_REDIS_WAIT_TIMEOUT_MS", CoordinatorConfig.redis_wait_timeout_ms)),
                   help="how long a commit waits for its replicas before the request fails UNAVAILABLE")


def _generation_flags(p: argparse.ArgumentParser, env) -> None:
    """Requests' defaults and bounds, and how rounds run."""
    p.add_argument("--tokenizer", default=env("SPECDEC_TOKENIZER", CoordinatorConfig.tokenizer),
                   help="model reference whose tokenizer to use (the target's)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(os.environ),
                   help="where a GGUF model's converted tokenizer is kept, as the workers' --cache-dir "
                        "(env SPECDEC_CACHE_DIR; default $XDG_CACHE_HOME/specdec or ~/.cache/specdec)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=CoordinatorConfig.num_speculative_tokens,
                   help="default K (draft tokens per round)")
    p.add_argument("--max-new-tokens", type=int, default=CoordinatorConfig.max_new_tokens,
                   help="default max_new_tokens")
    p.add_argument("--session-ttl", type=int, default=int(env("SPECDEC_SESSION_TTL", CoordinatorConfig.session_ttl_s)),
                   help="seconds an idle session is kept in Redis")
    p.add_argument("--request-ttl", type=int, default=int(env("SPECDEC_REQUEST_TTL", CoordinatorConfig.request_ttl_s)),
                   help="seconds a request id is remembered: a retry within it resumes the request instead "
                        "of repeating it")
    p.add_argument("--target-retry", type=float, default=CoordinatorConfig.target_retry_s,
                   help="seconds to keep retrying an unavailable target before UNAVAILABLE")
    p.add_argument("--draft-retry", type=float, default=CoordinatorConfig.draft_retry_s,
                   help="seconds to keep retrying an unavailable draft before decoding without it")
    p.add_argument("--startup-timeout", type=float, default=CoordinatorConfig.startup_timeout_s,
                   help="seconds to wait for the target worker at start-up")
    p.add_argument("--max-concurrent-requests", type=int,
                   default=int(env("SPECDEC_MAX_CONCURRENT_REQUESTS", CoordinatorConfig.max_concurrent_requests)),
                   help="generations served at once (each holds a handler thread); more get "
                        "RESOURCE_EXHAUSTED at once")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=CoordinatorConfig.overlap,
                   help="draft the next block while the target verifies this one (default: off; it pays "
                        "when draft and target have their own cores or machines, and costs when they share)")
    p.add_argument("--decode-steps", type=int, default=int(env("SPECDEC_DECODE_STEPS", CoordinatorConfig.decode_steps)),
                   help="a round without draft tokens asks the target for up to this many more plain tokens in "
                        "the same call (multi-step decoding: one RPC and one coordinator round for several "
                        "tokens, which then stream together); 0: one token per call")


def _tenancy_flags(p: argparse.ArgumentParser, env) -> None:
    """Who may call, and how much each tenant may hold."""
    p.add_argument("--auth-tokens-file", default=env("SPECDEC_AUTH_TOKENS_FILE", ""),
                   help="require 'authorization: Bearer <token>' with a token from this file, one "
                        "'tenant:token' a line (a bare token belongs to the tenant 'default'); a session "
                        "belongs to the tenant that created it")
    p.add_argument("--tenant-max-sessions", type=int,
                   default=int(env("SPECDEC_TENANT_MAX_SESSIONS", CoordinatorConfig.tenant_max_sessions)),
                   help="live sessions per tenant (0: no limit); a new one beyond it gets RESOURCE_EXHAUSTED")
    p.add_argument("--tenant-max-requests", type=int,
                   default=int(env("SPECDEC_TENANT_MAX_REQUESTS", CoordinatorConfig.tenant_max_requests)),
                   help="generations at once per tenant in this coordinator (0: no limit but "
                        "--max-concurrent-requests)")


def _suffix_flags(p: argparse.ArgumentParser, env) -> None:
    """The suffix index: what suffix decoding drafts from besides the session's own tokens."""
    c = CoordinatorConfig
    p.add_argument("--suffix-max-requests", type=int,
                   default=int(env("SPECDEC_SUFFIX_MAX_REQUESTS", c.suffix_max_requests)),
                   help="finished requests (prompt + output) kept per tenant for suffix decoding, the oldest "
                        "out first")
    p.add_argument("--suffix-max-tokens", type=int, default=int(env("SPECDEC_SUFFIX_MAX_TOKENS", c.suffix_max_tokens)),
                   help="tokens kept per tenant (bounds a lookup: ~0.3 ms at 64k tokens)")
    p.add_argument("--suffix-max-total-tokens", type=int,
                   default=int(env("SPECDEC_SUFFIX_MAX_TOTAL_TOKENS", c.suffix_max_total_tokens)),
                   help="tokens kept over all tenants, 4 bytes each; the least recently used tenant's oldest "
                        "requests out first")
    p.add_argument("--suffix-share", action=argparse.BooleanOptionalAction,
                   default=env("SPECDEC_SUFFIX_SHARE", "1") != "0",
                   help="publish finished requests to every coordinator replica's index through Redis (one "
                        "capped stream per tenant), and read theirs; a replica that starts warms up from them")
