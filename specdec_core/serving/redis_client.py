"""The Redis client the session store (coordinator) and the KV tier (workers) use: one URL for a plain,
TLS or Sentinel-managed Redis, connection retries long enough to ride out a failover, and Redis errors as status codes."""

from __future__ import annotations

from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

import redis
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from specdec_core import metrics
from specdec_core.errors import ResourceExhausted, Unavailable
from specdec_core.serving.security import TlsFiles


@contextmanager
def redis_errors():
    """Redis unreachable or read-only (a demoted primary, before the client finds the new one) ->
    UNAVAILABLE; Redis full (maxmemory, noeviction) -> RESOURCE_EXHAUSTED. Redis 6.2 reports what a
    script's command hit only inside the script's error text."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        metrics.STORE_ERRORS.labels("unavailable").inc()
        raise Unavailable(f"session store (Redis) unavailable: {exc}") from exc
    except redis.ResponseError as exc:
        text = str(exc)
        if isinstance(exc, redis.OutOfMemoryError) or "OOM command not allowed" in text:
            metrics.STORE_ERRORS.labels("full").inc()
            raise ResourceExhausted("session store (Redis) is full (maxmemory): it refuses new writes until "
                                    "sessions end or expire") from exc
        if isinstance(exc, redis.ReadOnlyError) or "READONLY" in text:
            metrics.STORE_ERRORS.labels("unavailable").inc()
            raise Unavailable("session store (Redis) is read-only (a failover in progress?)") from exc
        raise


def connect_redis(url: str, tls: TlsFiles = TlsFiles(), retry_s: float = 5.0, timeout_s: float = 5.0) -> redis.Redis:
    """A client for `url` that retries a dropped connection with backoff for about `retry_s`
    seconds (long enough to ride out a Sentinel failover), then lets the error through (UNAVAILABLE).

    url: redis://[:password@]host:port/db, rediss://... for TLS, unix:///path, or
    redis+sentinel://[:password@]host:port[,host:port...]/master-name[/db] (rediss+sentinel:// for
    TLS): the master that the sentinels name, found again after a failover. The password is the
    same for the sentinels and the servers. tls: the CA that signed the servers' certificates, and
    a client certificate and key when Redis requires mutual TLS."""
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=min(2.0, timeout_s), health_check_interval=30,
                   retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), _retries(retry_s)),
                   retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    parts = urlsplit(url)
    secure = parts.scheme.startswith("rediss")
    if secure:
        options.update({k: v for k, v in (("ssl_ca_certs", tls.ca), ("ssl_certfile", tls.cert),
                                          ("ssl_keyfile", tls.key)) if v})
    if not parts.scheme.endswith("+sentinel"):
        return redis.Redis.from_url(url, **options)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"{url}: a redis+sentinel:// URL names the master: .../master-name[/db]")
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    hosts = [(h, p or "26379") for h, _, p in (a.partition(":") for a in parts.netloc.rpartition("@")[2].split(","))]
    sentinel_options = {"username": username, "password": password, "socket_timeout": 2, "socket_connect_timeout": 2}
    if secure:
        sentinel_options.update(ssl=True, **{k: v for k, v in options.items() if k.startswith("ssl_")})
    sentinel = redis.sentinel.Sentinel([(h, int(p)) for h, p in hosts], sentinel_kwargs=sentinel_options,
                                       username=username, password=password, ssl=secure, **options)
    return sentinel.master_for(path[0], db=int(path[1]) if len(path) > 1 else 0)


def _retries(budget_s: float) -> int:
    """Retries whose backoff (0.1, 0.2, 0.4, then 0.5 s each) adds up to about budget_s."""
    waited, retries = 0.0, 0
    while waited < budget_s:
        retries += 1
        waited += min(0.5, 0.05 * 2 ** retries)
    return max(1, retries)
