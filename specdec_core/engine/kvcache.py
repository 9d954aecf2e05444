"""Per-session KV caches that are only caches.

A worker never trusts its cache: each request carries the committed sequence, the cache is cut
back to the longest prefix it shares with it (rolled-back draft tokens and anything a restart or a
re-route left behind disappear here), and the rest is recomputed.

Room: a backend has a fixed `capacity` in its own units (blocks of the paged pool, llama.cpp
sequence slots, tokens of DynamicCaches) and says how many units a sequence of L tokens holds
(`units_for`). `SessionCaches` counts what every session really holds and admits work only into
room that exists: when a new session or a batch needs more, least-recently-used idle sessions are
evicted (routine: clients rarely end sessions, and an evicted session is rebuilt from the committed
tokens its next request carries); what still does not fit is refused for that session alone
(RESOURCE_EXHAUSTED), never for the sessions batched with it.

Release is safe at any time: a session released while its round runs is freed when that round
ends, and an ended session id is remembered for a while so that a late request for it (an
overlapped proposal still on the wire) cannot bring its cache back.

A `CacheBackend` owns the actual tensors (a transformers `DynamicCache`, a llama.cpp sequence
slot, ...); `SessionCaches` does the bookkeeping that is the same for all of them.

With a KV tier (`specdec_core.serving.kvstore`), a lease that finds the cache short of the committed
tokens first restores what the tier holds of them, and a lease that ends well hands the chunks its
committed tokens completed to the tier.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec_core import metrics
from specdec_core.errors import FailedPrecondition, NotFound, ResourceExhausted
from specdec_core.logs import short_id


class CacheBackend(Protocol):
    """A model whose KV cache can be held per sequence, extended, and cut back."""

    vocab_size: int
    capacity: int  # units of KV memory in all (blocks, sequence slots, tokens)

    def units_for(self, length: int) -> int:
        """Units a sequence holding `length` tokens occupies (an allocated empty one: units_for(0))."""

    def allocate(self) -> Any:
        """A new, empty cache handle."""

    def crop(self, handle: Any, length: int) -> None:
        """Cut the handle's cache back to its first `length` tokens."""

    def free(self, handle: Any) -> None:
        """Release the handle's memory."""

    def forward(self, handle: Any, token_ids: list[int], start: int, num_logits: int | None = None) -> torch.Tensor:
        """Append token_ids at positions start.. (the cache holds exactly `start` tokens) and
        return the next-token logits of the last `num_logits` of them (default all)
        [num_logits, V] (float32)."""


def logits_per_item(items: list[tuple[Any, list[int], int]], num_logits: list[int] | None) -> list[int]:
    """For a backend's forward_batch: per item (handle, token_ids, start), how many trailing rows of
    logits to return, num_logits[i] clamped to [0, len(token_ids)] (all of them when not given)."""
    if num_logits is None:
        return [len(ids) for _, ids, _ in items]
    if len(num_logits) != len(items):
        raise ValueError(f"num_logits has {len(num_logits)} entries for {len(items)} items")
    return [max(0, min(int(k), len(ids))) for (_, ids, _), k in zip(items, num_logits)]


@dataclass
class CachedSequence:
    handle: Any
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the handle holds
    units: int = 0  # capacity units the handle holds (backend.units_for(len(token_ids)))
    last_used: float = 0.0
    is_in_use: bool = False
    is_released: bool = False  # released while in use: freed when its lease ends
    saved: int = 0  # tokens whose KV chunks went to the KV tier (a multiple of its chunk size)
    head: Any = None  # the target worker's draft head's cache for the session (target_service/head_drafter.py)


def prefix_hash(prev: bytes, tokens: list[int]) -> bytes:
    """A chain hash over a token sequence cut into pieces (the paged pool's blocks, the KV tier's
    chunks): the previous piece's hash (b"" for the first) and this piece's tokens, so a hash names
    the piece and everything before it."""
    return hashlib.blake2b(prev + struct.pack(f"<{len(tokens)}i", *tokens), digest_size=16).digest()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one C-level comparison
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class SessionCaches:
    def __init__(self, backend: CacheBackend, role: str = "worker", remember_ended: int = 4096, tier=None,
                 share_prefixes: bool = True):
        self.backend = backend
        self.tier = tier  # a kvstore.KVTier (or its tensor-parallel wrapper), or None
        self.share_prefixes = share_prefixes  # adopt identical prefix blocks other sessions hold
        self.role = role
        self.capacity = int(backend.capacity)
        self._sequences: dict[str, CachedSequence] = {}
        self._held = 0  # units held by all sequences
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently released session ids
        self._remember_ended = remember_ended
        self._lock = threading.Lock()
        # computed when scraped, under the lock
        metrics.CACHE_TOKENS.labels(role).set_function(lambda: self._locked(lambda: self.num_tokens))
        metrics.CACHE_SESSIONS.labels(role).set_function(lambda: self._locked(lambda: self.num_sessions))
        metrics.CACHE_FREE_UNITS.labels(role).set_function(lambda: self._locked(lambda: self.num_free_units))

    @contextmanager
    def lease(self, session_id: str, committed_ids: list[int]) -> Iterator[CachedSequence]:
        """The session's cache, cut back to what agrees with committed_ids, with at least the last
        committed token left uncached (its logits are needed to predict what follows).
        RESOURCE_EXHAUSTED if a new session finds no room even after evicting idle ones."""
        with self._lock:
            if session_id in self._ended:
                raise NotFound(f"session {short_id(session_id)} was ended")
            seq = self._sequences.get(session_id)
            if seq is None:
                if not self._make_room(self.backend.units_for(0)):
                    raise ResourceExhausted(f"{self.role} KV cache: no room for a new session, all "
                                            f"{len(self._sequences)} cached sessions are in use")
                seq = CachedSequence(handle=self.backend.allocate())
                self._sequences[session_id] = seq
                self._account(seq)
            elif seq.is_in_use:
                raise FailedPrecondition(f"session {short_id(session_id)} is busy on this worker")
            seq.is_in_use = True
        try:
            keep = min(common_prefix_len(seq.token_ids, committed_ids), len(committed_ids) - 1)
            self.crop(seq, keep)
            hooked = time.perf_counter()
            self._share(seq, committed_ids)
            if self.tier is not None:
                self._restore(seq, committed_ids)
            hooked = time.perf_counter() - hooked
            prefill = len(committed_ids) - len(seq.token_ids)
            yield seq
        except BaseException:
            self._reset(seq)  # a half-done forward pass leaves the cache in an unknown state
            raise
        else:
            if self.tier is not None:
                started = time.perf_counter()
                self._save(seq, committed_ids, prefill)
                metrics.KV_HOOK_SECONDS.labels(self.role).observe(hooked + time.perf_counter() - started)
        finally:
            with self._lock:
                seq.is_in_use = False
                seq.last_used = time.monotonic()
                if seq.is_released:
                    self._drop(session_id, seq)

    def reserve(self, items: list[tuple[CachedSequence, int]]) -> list[bool]:
        """Make room for leased sequences to grow to the given lengths, in order, evicting
        least-recently-used idle sessions as needed; per item whether it fits. Items that do not
        fit take no room, so the others run; the caller refuses those alone. Room made here
        stays free until the caller's forward passes (one engine thread per worker)."""
        admitted, need = [], 0
        blocks_needed = getattr(self.backend, "blocks_needed", None)  # counts copy-on-write of shared blocks
        with self._lock:
            for seq, length in items:
                extra = (blocks_needed(seq.handle, length) if blocks_needed is not None
                         else max(0, self.backend.units_for(length) - seq.units))
                fits = self._make_room(need + extra)
                admitted.append(fits)
                need += extra if fits else 0
        return admitted

    def extend(self, seq: CachedSequence, token_ids: list[int], num_logits: int | None = None) -> torch.Tensor:
        """Feed token_ids after the cached ones; the next-token logits of the last `num_logits`
        of them (default all) [num_logits, V]."""
        return self.extend_batch([(seq, token_ids)], None if num_logits is None else [num_logits])[0]

    def extend_batch(self, items: list[tuple[CachedSequence, list[int]]],
                     num_logits: list[int] | None = None) -> list[torch.Tensor]:
        """Several sessions' extensions in one model step when the backend can batch; per item the
        logits of its last `num_logits[i]` tokens (default all)."""
        forward_batch = getattr(self.backend, "forward_batch", None)
        if forward_batch is None:  # one at a time, each counted as soon as its cache has grown
            keep = num_logits or [None] * len(items)
            return [self._extended(seq, ids, self.backend.forward(seq.handle, ids, len(seq.token_ids), k))
                    for (seq, ids), k in zip(items, keep)]
        logits = forward_batch([(seq.handle, ids, len(seq.token_ids)) for seq, ids in items], num_logits)
        for seq, ids in items:
            self._extended(seq, ids)
        return logits

    def _extended(self, seq: CachedSequence, token_ids: list[int], logits: torch.Tensor | None = None):
        with self._lock:
            seq.token_ids.extend(token_ids)
            self._account(seq)
        return logits

    def crop(self, seq: CachedSequence, length: int) -> None:
        if length < len(seq.token_ids):
            self.backend.crop(seq.handle, length)
            with self._lock:
                del seq.token_ids[length:]
                self._account(seq)

    def _share(self, seq: CachedSequence, committed_ids: list[int]) -> None:
        """Adopt the blocks of the committed prefix that other sessions already hold (a backend
        that shares identical prefix blocks: no compute, no copy)."""
        share = getattr(self.backend, "share_prefix", None) if self.share_prefixes else None
        limit = len(committed_ids) - 1
        if share is None or len(seq.token_ids) >= limit:
            return
        length = share(seq.handle, committed_ids, limit)
        if length != len(seq.token_ids):
            with self._lock:
                seq.token_ids[:] = committed_ids[:length]
                seq.saved = min(seq.saved, length)
                self._account(seq)

    def _restore(self, seq: CachedSequence, committed_ids: list[int]) -> None:
        """Bring the leased cache up to the whole chunks of committed_ids (all but the last token)
        that the KV tier holds, if there is room for them."""
        limit = len(committed_ids) - 1
        have = len(seq.token_ids)
        if limit // self.tier.chunk * self.tier.chunk <= have:
            return
        with self._lock:
            if not self._make_room(self.backend.units_for(limit) - seq.units):
                return
        length = self.tier.restore(seq.handle, committed_ids, have, limit)
        if length != have:
            with self._lock:
                seq.token_ids[:] = committed_ids[:length]
                seq.saved = length // self.tier.chunk * self.tier.chunk
                self._account(seq)

    def _save(self, seq: CachedSequence, committed_ids: list[int], prefill: int) -> None:
        """Hand the chunks that the committed tokens in the cache completed to the KV tier: at once
        after a prefill of a chunk or more (a prompt), else every `save_every` chunks."""
        upto = min(len(seq.token_ids), len(committed_ids))
        saved = min(seq.saved, upto)
        pending = upto // self.tier.chunk - saved // self.tier.chunk
        if pending >= self.tier.save_every or (pending and prefill >= self.tier.chunk):
            seq.saved = self.tier.save(seq.handle, committed_ids, saved, upto)
        else:
            seq.saved = saved // self.tier.chunk * self.tier.chunk

    def _reset(self, seq: CachedSequence) -> None:
        """Empty the cache whatever the bookkeeping says (it may lag a failed forward pass)."""
        try:
            self.backend.crop(seq.handle, 0)
        finally:
            with self._lock:
                seq.token_ids.clear()
                self._account(seq)

    def release(self, session_id: str) -> bool:
        """Forget the session's cache (at the end of its round if one is running) and refuse
        later requests for it. Whether it had one."""
        with self._lock:
            self._ended[session_id] = None
            if len(self._ended) > self._remember_ended:
                self._ended.popitem(last=False)
            seq = self._sequences.get(session_id)
            if seq is None:
                return False
            if seq.is_in_use:
                seq.is_released = True
            else:
                self._drop(session_id, seq)
            return True

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self._sequences.values())

    @property
    def num_sessions(self) -> int:
        return len(self._sequences)

    @property
    def num_free_units(self) -> int:
        """Free room: the backend's own count when it has one (sessions that share prefix blocks
        hold them once), else capacity minus what the sessions hold."""
        real = getattr(self.backend, "num_free_blocks", None)
        return self.capacity - self._held if real is None else int(real)

    # Internals (the caller holds the lock)

    def _account(self, seq: CachedSequence) -> None:
        units = self.backend.units_for(len(seq.token_ids))
        self._held += units - seq.units
        seq.units = units

    def _drop(self, session_id: str, seq: CachedSequence) -> None:
        if self._sequences.get(session_id) is seq:
            del self._sequences[session_id]
        self._held -= seq.units  # counted free even if the backend fails to free it
        seq.units = 0
        seq.token_ids.clear()
        self.backend.free(seq.handle)

    def _make_room(self, units: int) -> bool:
        """Evict idle sessions, least recently used first, until `units` are free; evict nothing
        when even all of them would not make enough room."""
        free = self.num_free_units
        if free >= units:
            return True
        idle = sorted((s.last_used, sid) for sid, s in self._sequences.items() if not s.is_in_use)
        if free + sum(self._sequences[sid].units for _, sid in idle) < units:
            return False
        for _, sid in idle:
            self._drop(sid, self._sequences[sid])
            metrics.CACHE_EVICTIONS.labels(self.role).inc()
            if self.num_free_units >= units:
                return True
        return False

    def _locked(self, fn):
        with self._lock:
            return fn()
