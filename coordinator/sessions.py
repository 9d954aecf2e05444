"""Session state in Redis: committed tokens, parameters, seed and stats.

Layout per session (both keys expire together after `ttl_seconds` of inactivity):
- `specdec:session:{id}`      hash: `version` (int, +1 per commit), `meta` (JSON)
- `specdec:session:{id}:ids`  list: every committed token id, prompt and output

Every commit is one Lua script: compare the version the writer read, append the new tokens,
bump the version, rewrite meta. Two writers racing on one session cannot both win, and a reader
never sees tokens without the version that covers them. A short lease
(`specdec:session:{id}:lease`) marks a session busy while a request runs on it; a heartbeat keeps
it alive, so a coordinator that crashes leaves its sessions locked for seconds only. The lease
holds a random token, and only its holder can renew or release it (each a compare-and-act
script): a coordinator that stalled past its lease cannot extend or drop the one another now holds.
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

from specdec_core.errors import FailedPrecondition, NotFound, Unavailable

_COMMIT = """
local version = redis.call('HGET', KEYS[1], 'version')
if version == false then version = -1 else version = tonumber(version) end
if version ~= tonumber(ARGV[1]) then return -1 end
local chunk = 4000
for i = 4, #ARGV, chunk do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + chunk - 1, #ARGV)))
end
redis.call('HSET', KEYS[1], 'version', version + 1, 'meta', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
return version + 1
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


@dataclass
class SessionStats:
    requests: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0


@dataclass
class Session:
    session_id: str
    seed: int
    token_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # chat history, when driven by messages
    sampling: dict = field(default_factory=dict)
    stats: SessionStats = field(default_factory=SessionStats)
    routes: dict = field(default_factory=dict)  # role -> the worker replica serving this session
    version: int = -1  # -1: not stored yet

    def meta_json(self) -> str:
        return json.dumps(
            {"seed": self.seed, "messages": self.messages, "sampling": self.sampling, "stats": asdict(self.stats),
             "routes": self.routes}
        )


class SessionStore:
    def __init__(self, client: redis.Redis, ttl_seconds: int = 86400, lease_seconds: float = 10):
        self.redis = client
        self.ttl_seconds = ttl_seconds
        self.lease_seconds = lease_seconds
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE_LEASE)
        self._renew = client.register_script(_RENEW_LEASE)

    @staticmethod
    def _keys(session_id: str) -> tuple[str, str, str]:
        base = f"specdec:session:{session_id}"
        return base, f"{base}:ids", f"{base}:lease"

    def new(self, seed: int | None) -> Session:
        return Session(session_id=uuid.uuid4().hex, seed=seed if seed is not None else secrets.randbits(63))

    def load(self, session_id: str) -> Session:
        meta_key, ids_key, _ = self._keys(session_id)
        with self._errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.hgetall(meta_key)
            pipe.lrange(ids_key, 0, -1)
            fields, ids = pipe.execute()
        if not fields:
            raise NotFound(f"session {session_id!r} not found (ended or expired)")
        meta = json.loads(fields[b"meta"])
        return Session(
            session_id=session_id,
            seed=meta["seed"],
            token_ids=[int(t) for t in ids],
            messages=meta["messages"],
            sampling=meta["sampling"],
            stats=SessionStats(**meta["stats"]),
            routes=meta.get("routes", {}),
            version=int(fields[b"version"]),
        )

    def commit(self, session: Session, new_ids: list[int]) -> None:
        """Append new_ids and the session's current meta atomically, if nobody else wrote since."""
        meta_key, ids_key, _ = self._keys(session.session_id)
        with self._errors():
            version = self._commit(
                keys=[meta_key, ids_key],
                args=[session.version, session.meta_json(), self.ttl_seconds, *new_ids],
            )
        if version < 0:
            raise FailedPrecondition(f"session {session.session_id!r} was changed by another request")
        session.version = version
        session.token_ids.extend(new_ids)

    def acquire(self, session_id: str) -> str:
        """Mark the session busy; FAILED_PRECONDITION if another request holds it."""
        token = secrets.token_hex(8)
        with self._errors():
            ok = self.redis.set(self._keys(session_id)[2], token, nx=True, px=self._lease_ms)
        if not ok:
            raise FailedPrecondition(f"session {session_id!r} is busy with another request")
        return token

    def renew(self, session_id: str, token: str) -> bool:
        """Extend the lease if `token` still holds it; False if it was lost (expired, perhaps taken)."""
        with self._errors():
            return bool(self._renew(keys=[self._keys(session_id)[2]], args=[token, self._lease_ms]))

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    @contextmanager
    def held(self, session_id: str) -> Iterator[None]:
        """Hold the session's lease (FAILED_PRECONDITION if busy), renewed by a heartbeat thread
        while the body runs: a round may legitimately take longer than the lease."""
        token = self.acquire(session_id)
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.lease_seconds / 3):
                try:
                    if not self.renew(session_id, token):
                        if not stop.is_set():  # not merely released as the body ended
                            log.warning("lease on session %s lost (expired, another request may hold it); "
                                        "no longer renewing it", session_id)
                        return
                except Unavailable:
                    pass  # Redis is down; the request fails on its next commit

        thread = threading.Thread(target=heartbeat, daemon=True, name="lease-heartbeat")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            self.release(session_id, token)

    def release(self, session_id: str, token: str) -> None:
        with self._errors():
            self._release(keys=[self._keys(session_id)[2]], args=[token])

    def delete(self, session_id: str) -> bool:
        with self._errors():
            return bool(self.redis.delete(*self._keys(session_id)))

    def _errors(self):
        return _RedisErrors()


class _RedisErrors:
    """Redis unreachable -> UNAVAILABLE with a clear message."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, (redis.ConnectionError, redis.TimeoutError)):
            raise Unavailable(f"session store (Redis) unavailable: {exc}") from exc
        return False
