"""Every coordinator replica's finished requests in every replica's suffix index, through Redis.

A replica indexes a finished request itself at once (`SuffixProposer.finished`) and publishes it
here: one Redis stream per tenant (`specdec:suffix:<tenant>`, each entry a request's tokens and the
replica that published it), capped at the index's per-tenant sequence bound (XADD MAXLEN ~), and the
set of tenants with a stream (`specdec:suffix:tenants`). One thread per replica sends what was
published and reads the other replicas' entries into its own index; a replica that starts (or
scales out) reads every stream from its beginning, which is its warm-up.

Redis is not on a request's path: publishing only queues (a full queue drops the oldest), and while
Redis is down the thread retries with backoff; lookups keep the local index, and generation goes on.
A tenant's entries go only to that tenant's index (the stream is the tenant's).
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
BLOCK_MS = 500  # how long one read waits for new entries
MAX_BACKOFF_S = 5.0


def stream_key(tenant: str) -> str:
    return f"specdec:suffix:{tenant}"


class SuffixShare:
    def __init__(self, client: redis.Redis, index: SuffixIndex, max_pending: int = 1024,
                 replica: str | None = None):
        self.redis, self.index = client, index
        self.replica = (replica or uuid.uuid4().hex).encode()
        self._pending: queue.Queue[tuple[str, list[int]]] = queue.Queue(max_pending)
        self._read_from: dict[str, bytes] = {}  # tenant -> the last entry id read from its stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, tenant: str, token_ids: list[int]) -> None:
        """Queue a finished request for the other replicas; never blocks, never raises."""
        while True:
            try:
                self._pending.put_nowait((tenant, list(token_ids)))
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
            except redis.RedisError as exc:
                log.warning("suffix index sharing: Redis unavailable (%s); retrying in %.1f s", exc, backoff)
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
            tenant = key.decode().removeprefix("specdec:suffix:")
            for entry_id, fields in entries:
                self._read_from[tenant] = entry_id
                if fields.get(b"from") != self.replica:
                    self.index.add(tenant, array("I", fields[b"ids"]).tolist())
                    indexed += 1
        metrics.SUFFIX_SHARED.labels("received").inc(indexed)
        metrics.SUFFIX_INDEX_TOKENS.set(self.index.num_tokens())
        return indexed

    def _send(self) -> None:
        while True:
            try:
                tenant, ids = self._pending.get_nowait()
            except queue.Empty:
                return
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(stream_key(tenant), {"ids": array("I", ids).tobytes(), "from": self.replica},
                          maxlen=self.index.max_sequences, approximate=True)
                pipe.sadd(TENANTS_KEY, tenant)
                pipe.execute()
                metrics.SUFFIX_SHARED.labels("sent").inc()
            except redis.RedisError:
                self.publish(tenant, ids)  # again when Redis is back
                raise
