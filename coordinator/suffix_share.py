"""Every coordinator replica's finished requests in every replica's suffix index, through Redis.

A replica indexes a finished request itself at once (`SuffixProposer.finished`) and publishes it
here: one Redis stream per tenant (`specdec:suffix:stream:<tenant>`, each entry a request's tokens
and the replica that published it) and the set of tenants with a stream (`specdec:suffix:tenants`).
A stream holds about what one tenant's index holds (at most its sequence bound, and about its token
bound: a request's entry keeps its last `max_tokens` tokens) and expires `ttl_s` after its last
entry, so a tenant's text stays in Redis no longer than an idle session does. One thread per replica
sends what was published and reads the other replicas' entries into its own index; a replica that
starts (or scales out) reads every stream from its beginning before it serves: its warm-up.

Redis is not on a request's path: publishing only queues (bounded; a full queue drops the oldest),
and while Redis is down the thread retries with backoff; lookups keep the local index, and
generation goes on. A tenant's entries go only to that tenant's index (the stream is the tenant's).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from array import array

import redis

from coordinator.suffix import SuffixIndex
from specdec_core import metrics

log = logging.getLogger(__name__)

TENANTS_KEY = "specdec:suffix:tenants"
STREAM_PREFIX = "specdec:suffix:stream:"  # + the tenant (tenant names have no ':')
BLOCK_MS = 500  # how long one read waits for new entries
MAX_BACKOFF_S = 5.0


def stream_key(tenant: str) -> str:
    return STREAM_PREFIX + tenant


class SuffixShare:
    def __init__(self, client: redis.Redis, index: SuffixIndex, ttl_s: int = 86400, max_pending: int = 256,
                 replica: str | None = None):
        self.redis, self.index, self.ttl_s = client, index, ttl_s
        self.replica = (replica or uuid.uuid4().hex).encode()
        self._pending: queue.Queue[tuple[str, bytes]] = queue.Queue(max_pending)
        self._read_from: dict[str, bytes] = {}  # tenant -> the last entry id read from its stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, tenant: str, token_ids: list[int]) -> None:
        """Queue a finished request for the other replicas; never blocks, never raises."""
        if token_ids:
            self._queue(tenant, array("I", token_ids[-self.index.max_tokens:]).tobytes())

    def _queue(self, tenant: str, ids: bytes) -> None:
        while True:
            try:
                self._pending.put_nowait((tenant, ids))
                return
            except queue.Full:
                try:
                    self._pending.get_nowait()  # the oldest goes: the index keeps the newest anyway
                    metrics.SUFFIX_SHARED.labels("dropped").inc()
                except queue.Empty:
                    pass

    def start(self) -> SuffixShare:
        """Read what the other replicas have published so far (the warm-up: before this replica
        serves, so its first requests find it), then keep exchanging in a thread."""
        try:
            while self.sync(block_ms=0):
                pass
        except redis.RedisError as exc:
            log.warning("suffix index sharing: no warm-up, Redis unavailable (%s)", exc)
        self._thread = threading.Thread(target=self._run, daemon=True, name="suffix-share")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self.sync()
                backoff = 0.1
            except Exception as exc:  # noqa: BLE001 - Redis down, or anything else: the thread goes on
                log.warning("suffix index sharing: %s; retrying in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def sync(self, block_ms: int = BLOCK_MS) -> int:
        """Send what was published, then read the other replicas' new entries (waiting up to block_ms
        for some); the entries indexed."""
        self._send()
        for tenant in self.redis.smembers(TENANTS_KEY):
            self._read_from.setdefault(tenant.decode(), b"0")
        if not self._read_from:
            self._stop.wait(block_ms / 1e3)
            return 0
        streams = {stream_key(t): last for t, last in self._read_from.items()}
        indexed = 0
        for key, entries in self.redis.xread(streams, count=256, block=block_ms or None) or []:
            tenant = key.decode().removeprefix(STREAM_PREFIX)
            for entry_id, fields in entries:
                self._read_from[tenant] = entry_id
                indexed += self._index(tenant, entry_id, fields)
        metrics.SUFFIX_SHARED.labels("received").inc(indexed)
        metrics.SUFFIX_INDEX_TOKENS.set(self.index.num_tokens())
        return indexed

    def _index(self, tenant: str, entry_id: bytes, fields: dict[bytes, bytes]) -> int:
        """Index another replica's entry (1), or skip this replica's own or a malformed one (0)."""
        ids = fields.get(b"ids", b"")
        if fields.get(b"from") == self.replica:
            return 0
        if not ids or len(ids) % 4:
            log.warning("suffix index sharing: skipped a malformed entry %s of a stream", entry_id.decode())
            return 0
        self.index.add(tenant, array("I", ids).tolist())
        return 1

    def _send(self) -> None:
        while True:
            try:
                tenant, ids = self._pending.get_nowait()
            except queue.Empty:
                return
            key = stream_key(tenant)
            # about the tenant's index: its sequence bound, and entries enough for its token bound
            entries = max(1, min(self.index.max_sequences, self.index.max_tokens * 4 // len(ids)))
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(key, {"ids": ids, "from": self.replica}, maxlen=entries, approximate=False)
                pipe.expire(key, self.ttl_s)
                pipe.sadd(TENANTS_KEY, tenant)
                pipe.expire(TENANTS_KEY, self.ttl_s)
                pipe.execute()
                metrics.SUFFIX_SHARED.labels("sent").inc()
            except (redis.ConnectionError, redis.TimeoutError):
                self._queue(tenant, ids)  # again when Redis is back
                raise
            except redis.RedisError as exc:  # refused (full, or a key of another type): not again
                log.warning("suffix index sharing: Redis refused an entry (%s); dropped", exc)
                metrics.SUFFIX_SHARED.labels("dropped").inc()
