"""Tenants: whom a call is from, and how much each may hold at once.

A bearer token maps to a tenant (`--auth-tokens-file`, one `tenant:token` a line; a bare token
belongs to the tenant "default"). Without tokens, a client certificate's common name names the
tenant when the public endpoint requires mutual TLS; otherwise every call is the tenant "default",
as in a single-tenant deployment. A session belongs to the tenant that created it: the session
store answers NOT_FOUND to any other.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from coordinator.request import DEFAULT_TENANT
from specdec_core import metrics
from specdec_core.errors import ResourceExhausted, Unauthenticated
from specdec_core.serving.security import bearer_token, known_token

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def read_tenant_tokens(path: str) -> dict[str, str]:
    """{token: tenant} from a file of `tenant:token` lines (a bare token, without ':', belongs to
    the tenant "default"; '#' starts a comment line)."""
    tokens = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, colon, token = line.partition(":")  # tenants have no ':'; tokens may
        if not colon:
            tenant, token = DEFAULT_TENANT, line
        if not TENANT_NAME.fullmatch(tenant) or not token:
            raise ValueError(f"{path}:{number}: expected 'tenant:token' (tenant: 1-64 of A-Z a-z 0-9 . _ -) "
                             "or a bare token")
        tokens[token] = tenant
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


class Tenants:
    """The tenant of an authenticated call (the bearer-token interceptor has already let it in)."""

    def __init__(self, tokens: Mapping[str, str] | None = None):
        self.tokens = dict(tokens or {})

    def __call__(self, context) -> str:
        if self.tokens:
            known = known_token(bearer_token(context.invocation_metadata()), self.tokens)
            if known is None:  # the interceptor refuses these first
                raise Unauthenticated("missing or invalid bearer token")
            return self.tokens[known]
        names = (context.auth_context() or {}).get("x509_common_name")
        if names:
            return tenant_of_certificate(names[0].decode(errors="replace"))
        return DEFAULT_TENANT


def tenant_of_certificate(common_name: str) -> str:
    """A client certificate's common name as a tenant: itself when it is a valid tenant name (and
    does not start with 'cn-'), otherwise 'cn-' and a digest of it, so two names never share one."""
    if TENANT_NAME.fullmatch(common_name) and not common_name.startswith("cn-"):
        return common_name
    return "cn-" + hashlib.blake2b(common_name.encode(), digest_size=12).hexdigest()


class RequestQuota:
    """At most `limit` generations at once per tenant in this coordinator (0: no limit beyond the
    coordinator's own --max-concurrent-requests); the excess gets RESOURCE_EXHAUSTED at once."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def held(self, tenant: str) -> Iterator[None]:
        with self._lock:
            running = self._running.get(tenant, 0)
            if self.limit and running >= self.limit:
                metrics.ADMISSION_REFUSED.labels("tenant").inc()
                raise ResourceExhausted(f"tenant {tenant!r} has {running} generations running, its limit "
                                        f"(--tenant-max-requests {self.limit}); retry later")
            self._running[tenant] = running + 1
        try:
            yield
        finally:
            with self._lock:
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
