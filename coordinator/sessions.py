"""Session state in Redis: committed tokens, parameters, seed, stats, owner and request records.

Layout (every key but request records expires after `ttl_seconds` without a commit):
- `specdec:session:{id}`          hash: `version` (+1 per commit), `meta` (JSON), `tenant` (the
                                  owner), `commit` (the id of the last commit)
- `specdec:session:{id}:ids`      list: every committed token id, prompt and output
- `specdec:session:{id}:lease`    the busy lease (below)
- `specdec:tenant:{t}:sessions`   sorted set: the tenant's sessions, scored by when they expire
- `specdec:request:{t}:{rid}`     a request record: where a client-supplied request id's input
                                  starts in which session, and how it finished (idempotent retries);
                                  kept `request_ttl_seconds` (an hour: retries come within minutes)

Every commit is one script: compare the version the writer read, append the new tokens, bump the
version, rewrite meta, and (first commit of a request) create the request record. Two writers
racing on one session cannot both win, and a reader never sees tokens without the version that
covers them. A commit carries an id, so a commit that Redis applied but whose reply was lost (a
dropped connection, a failover) is recognised when the client library retries it, not refused as a
conflict. The first write of the script is one that Redis refuses when it is over `maxmemory`
(RPUSH), so a full Redis refuses a commit whole: RESOURCE_EXHAUSTED, nothing written.

With `wait_replicas` > 0, each commit then waits (Redis WAIT, on the same connection) until that
many replicas hold it; fewer in time is UNAVAILABLE, and the tokens are not sent to the client.

A short lease marks a session busy while a request runs on it; a heartbeat keeps it alive, so a
coordinator that crashes leaves its sessions locked for seconds only. The lease holds a random
token, and only its holder can renew or release it (each a compare-and-act script): a coordinator
that stalled past its lease cannot extend or drop the one another now holds. A lease taken for a
request id may be taken over by a retry of that same request (its first attempt is gone or will
lose its next commit to the retry's).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import redis

from coordinator.request import DEFAULT_TENANT, Stats
from specdec_core.serving.redis_client import redis_errors
from specdec_core import metrics
from specdec_core.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from specdec_core.logs import short_id


# KEYS: meta, ids, tenant's sessions, request record.
# ARGV: expected version, meta, ttl, commit id, tenant, max sessions, session id, request record
# ('' for none), '1' when the record must be new, the record's ttl, then the token ids.
# Returns the new version; -1 another writer won; -2 the tenant's session cap; -3 the request id
# is taken; -4 the session is gone (ended, or expired) since it was read.
_COMMIT = """
local version = redis.call('HGET', KEYS[1], 'version')
if version == false then version = -1 else version = tonumber(version) end
local expected = tonumber(ARGV[1])
if version ~= expected then
  if version == -1 then return -4 end
  if version == expected + 1 and redis.call('HGET', KEYS[1], 'commit') == ARGV[4] then
    redis.call('EXPIRE', KEYS[1], ARGV[3])  -- a write on this connection: the WAIT after it covers the commit
    return version
  end
  return -1
end
if ARGV[9] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then return -3 end
local now = tonumber(redis.call('TIME')[1])
if version == -1 and tonumber(ARGV[6]) > 0 and redis.call('ZCOUNT', KEYS[3], now, '+inf') >= tonumber(ARGV[6]) then
  return -2
end
local chunk = 4000
for i = 11, #ARGV, chunk do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + chunk - 1, #ARGV)))
end
redis.call('HSET', KEYS[1], 'version', version + 1, 'meta', ARGV[2], 'commit', ARGV[4], 'tenant', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
if version == -1 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - 1) end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[7])
redis.call('EXPIRE', KEYS[3], ARGV[3])
if ARGV[8] ~= '' then redis.call('SET', KEYS[4], ARGV[8], 'EX', ARGV[10]) end
return version + 1
"""

# Read a session whole (a script, not MULTI: Redis refuses every MULTI while over maxmemory).
_LOAD = """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""

# KEYS: lease. ARGV: new holder token, lease ms, request id prefix ('' for none).
_ACQUIRE_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] or (ARGV[3] ~= '' and string.sub(holder, 1, #ARGV[3]) == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

log = logging.getLogger(__name__)

# What a session's stats keep in Redis (the per-round details stay with each request's own stats);
# the fields every coordinator version reads, so that replicas of two versions share sessions.
SESSION_STATS = ("requests", "rounds", "drafted", "accepted", "generated", "wall_ms", "draft_ms", "verify_ms")


@dataclass
class Session:
    session_id: str
    seed: int
    tenant: str = DEFAULT_TENANT
    token_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # chat history, when driven by messages
    sampling: dict = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    routes: dict = field(default_factory=dict)  # role -> the worker replica serving this session
    request_id: str = ""  # of the request that last added input
    version: int = -1  # -1: not stored yet

    @property
    def ref(self) -> str:
        """What logs and error messages call it: a digest, never the id (a bearer capability)."""
        return short_id(self.session_id)

    def meta_json(self) -> str:
        return json.dumps(
            {"seed": self.seed, "messages": self.messages, "sampling": self.sampling,
             "stats": {name: getattr(self.stats, name) for name in SESSION_STATS},
             "routes": self.routes, "request": self.request_id}
        )


@dataclass(frozen=True)
class RequestRecord:
    """Where a request's input went and how it ended: its retries resume it instead of repeating it."""

    request_id: str
    session_id: str
    fingerprint: str  # digest of everything the request asked for: a reused id with other input is refused
    start: int  # session tokens before the request's input
    input_tokens: int
    finish: str = ""  # empty while it runs
    end: int = 0  # session tokens when it finished

    def json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "request_id"})


class SessionStore:
    def __init__(self, client: redis.Redis, ttl_seconds: int = 86400, lease_seconds: float = 10,
                 wait_replicas: int = 0, wait_timeout_ms: int = 1000, max_sessions_per_tenant: int = 0,
                 request_ttl_seconds: int = 3600):
        self.redis = client
        self.ttl_seconds = ttl_seconds
        self.request_ttl_seconds = request_ttl_seconds  # how long a request id can be retried
        self.lease_seconds = lease_seconds
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self._load = client.register_script(_LOAD)
        self._acquire = client.register_script(_ACQUIRE_LEASE)
        self._release = client.register_script(_RELEASE_LEASE)
        self._renew = client.register_script(_RENEW_LEASE)

    @staticmethod
    def _keys(session_id: str) -> tuple[str, str, str]:
        base = f"specdec:session:{session_id}"
        return base, f"{base}:ids", f"{base}:lease"

    @staticmethod
    def _tenant_key(tenant: str) -> str:
        return f"specdec:tenant:{tenant}:sessions"

    @staticmethod
    def _request_key(tenant: str, request_id: str) -> str:
        return f"specdec:request:{tenant}:{request_id}"

    def new(self, seed: int | None, tenant: str = DEFAULT_TENANT) -> Session:
        return Session(session_id=uuid.uuid4().hex, seed=seed if seed is not None else secrets.randbits(63),
                       tenant=tenant)

    def load(self, session_id: str, tenant: str = DEFAULT_TENANT) -> Session:
        """The session, if `tenant` owns it; NOT_FOUND otherwise, the same answer as for a session
        that does not exist (no existence oracle)."""
        meta_key, ids_key, _ = self._keys(session_id)
        with redis_errors():
            flat, ids = self._load(keys=[meta_key, ids_key])
        fields = dict(zip(flat[::2], flat[1::2]))
        owner = fields.get(b"tenant", DEFAULT_TENANT.encode()).decode() if fields else None
        if owner != tenant:
            raise NotFound(f"session {short_id(session_id)} not found (ended, expired, or not yours)")
        meta = json.loads(fields[b"meta"])
        return Session(
            session_id=session_id,
            seed=meta["seed"],
            tenant=owner,
            token_ids=[int(t) for t in ids],
            messages=meta["messages"],
            sampling=meta["sampling"],
            stats=Stats(**{name: value for name, value in meta["stats"].items() if name in SESSION_STATS}),
            routes=meta.get("routes", {}),
            request_id=meta.get("request", ""),
            version=int(fields[b"version"]),
        )

    def request(self, tenant: str, request_id: str) -> RequestRecord | None:
        with redis_errors():
            raw = self.redis.get(self._request_key(tenant, request_id))
        return RequestRecord(request_id, **json.loads(raw)) if raw else None

    def commit(self, session: Session, new_ids: list[int], request: RequestRecord | None = None,
               new_request: bool = False) -> None:
        """Append new_ids and the session's current meta atomically, if nobody else wrote since;
        with `request`, write its record too (`new_request`: only if its id is not taken yet)."""
        meta_key, ids_key, _ = self._keys(session.session_id)
        request_key = self._request_key(session.tenant, request.request_id) if request else meta_key
        args = [session.version, session.meta_json(), self.ttl_seconds, secrets.token_hex(8), session.tenant,
                self.max_sessions_per_tenant, session.session_id, request.json() if request else "",
                "1" if request and new_request else "0", self.request_ttl_seconds, *new_ids]
        with redis_errors():
            pipe = self.redis.pipeline(transaction=False)  # one connection: WAIT counts this commit
            pipe.eval(_COMMIT, 4, meta_key, ids_key, self._tenant_key(session.tenant), request_key, *args)
            if self.wait_replicas:
                pipe.wait(self.wait_replicas, self.wait_timeout_ms)
            version, *acked = pipe.execute()
        if version == -4:
            raise NotFound(f"session {session.ref} was ended (or expired) during the request")
        if version == -1:
            raise Aborted(f"session {session.ref} was changed by another request; retry")
        if version == -2:
            metrics.STORE_ERRORS.labels("tenant_cap").inc()
            raise ResourceExhausted(f"tenant {session.tenant!r} has {self.max_sessions_per_tenant} live sessions, "
                                    "its limit: end some (EndSession) or wait for idle ones to expire")
        if version == -3:
            raise Aborted(f"request {request.request_id!r} is already running in another attempt; retry")
        self._check_acked(acked)
        session.version = version
        session.token_ids.extend(new_ids)

    def confirm(self, session: Session) -> None:
        """With `wait_replicas`, wait until that many replicas hold everything written so far (a
        write on one connection, then WAIT on it): before a retry replays tokens an earlier attempt
        committed but never confirmed."""
        if not self.wait_replicas:
            return
        with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.expire(self._keys(session.session_id)[0], self.ttl_seconds)
            pipe.wait(self.wait_replicas, self.wait_timeout_ms)
            _, acked = pipe.execute()
        self._check_acked([acked])

    def _check_acked(self, acked: list[int]) -> None:
        if acked and acked[0] < self.wait_replicas:
            metrics.STORE_ERRORS.labels("replicas").inc()
            raise Unavailable(f"session store (Redis): a commit reached {acked[0]} of {self.wait_replicas} "
                              f"replicas in {self.wait_timeout_ms} ms")

    def acquire(self, session_id: str, request_id: str = "") -> str:
        """Mark the session busy; FAILED_PRECONDITION if another request holds it. A lease taken
        for `request_id` can be taken over by a retry of the same request."""
        prefix = f"{request_id}|" if request_id else ""
        token = prefix + secrets.token_hex(8)
        with redis_errors():
            ok = self._acquire(keys=[self._keys(session_id)[2]], args=[token, self._lease_ms, prefix])
        if not ok:
            raise FailedPrecondition(f"session {short_id(session_id)} is busy with another request")
        return token

    def renew(self, session_id: str, token: str) -> bool:
        """Extend the lease if `token` still holds it; False if it was lost (expired, perhaps taken)."""
        with redis_errors():
            return bool(self._renew(keys=[self._keys(session_id)[2]], args=[token, self._lease_ms]))

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    @contextmanager
    def held(self, session_id: str, request_id: str = "") -> Iterator[None]:
        """Hold the session's lease (FAILED_PRECONDITION if busy), renewed by a heartbeat thread
        while the body runs: a round may legitimately take longer than the lease."""
        token = self.acquire(session_id, request_id)
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.lease_seconds / 3):
                try:
                    if not self.renew(session_id, token):
                        if not stop.is_set():  # not merely released as the body ended
                            log.warning("lease on session %s lost (expired, another request may hold it); "
                                        "no longer renewing it", short_id(session_id))
                        return
                except Unavailable:
                    pass  # Redis is down; the request fails on its next commit

        thread = threading.Thread(target=heartbeat, daemon=True, name="lease-heartbeat")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            try:
                self.release(session_id, token)
            except Unavailable as exc:  # the lease expires by itself; keep the body's own outcome
                log.warning("could not release the lease on session %s: %s", short_id(session_id), exc)

    def release(self, session_id: str, token: str) -> None:
        with redis_errors():
            self._release(keys=[self._keys(session_id)[2]], args=[token])

    def delete(self, session: Session) -> bool:
        with redis_errors():  # two commands, not MULTI (refused while Redis is full): ending must work then
            deleted = self.redis.delete(*self._keys(session.session_id))
            self.redis.zrem(self._tenant_key(session.tenant), session.session_id)
        return bool(deleted)
