"""KV-cache bookkeeping: prefix rollback, room counted in the backend's units with LRU eviction
(never a session in flight), refusal of only what does not fit, safe release, busy sessions."""

from __future__ import annotations

import pytest
import torch

from specdec_core.engine.kvcache import SessionCaches, common_prefix_len
from specdec_core.errors import FailedPrecondition, NotFound, ResourceExhausted


class RecordingBackend:
    """A stand-in for a model (the bookkeeping is what is under test): logits are a function of
    (position, token) and every call is recorded."""

    vocab_size = 16

    def __init__(self, capacity: int = 1000, block: int = 1, slot: int = 0):
        self.capacity = capacity
        self.block = block  # units_for(L) = ceil(L / block) + slot (0: tokens take no room)
        self.slot = slot
        self.lengths: dict[int, int] = {}
        self.freed: list[int] = []
        self._next = 0

    def units_for(self, length):
        return (-(-length // self.block) if self.block else 0) + self.slot

    def allocate(self):
        self._next += 1
        self.lengths[self._next] = 0
        return self._next

    def crop(self, handle, length):
        assert length <= self.lengths[handle]
        self.lengths[handle] = length

    def free(self, handle):
        self.freed.append(handle)
        del self.lengths[handle]

    def forward(self, handle, token_ids, start, num_logits=None):
        assert self.lengths[handle] == start
        self.lengths[handle] += len(token_ids)
        return torch.zeros(len(token_ids) if num_logits is None else num_logits, self.vocab_size)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_lease_rolls_back_to_the_committed_prefix_and_keeps_the_last_token_uncached():
    backend = RecordingBackend()
    caches = SessionCaches(backend)
    with caches.lease("s", [1, 2, 3]) as seq:
        caches.extend(seq, [1, 2, 3, 9, 9])  # committed + two drafts
    with caches.lease("s", [1, 2, 3, 9, 5]) as seq:  # one draft accepted, one rejected
        assert seq.token_ids == [1, 2, 3, 9]
        assert backend.lengths[seq.handle] == 4
    with caches.lease("s", [1, 2, 3, 9]) as seq:  # fully cached: the last token is recomputed
        assert seq.token_ids == [1, 2, 3]


def _fill(caches, name, ids):
    with caches.lease(name, ids) as seq:
        assert caches.reserve([(seq, len(ids))]) == [True]
        caches.extend(seq, ids)


def test_room_is_counted_in_whole_blocks_and_made_by_evicting_the_least_recently_used_idle_session():
    caches = SessionCaches(RecordingBackend(capacity=4, block=4), role="t")  # 4 blocks of 4 tokens
    _fill(caches, "a", [1, 2, 3, 4, 5])  # 5 tokens hold 2 blocks
    _fill(caches, "b", [1])  # 1 block
    assert caches.num_free_units == 1
    with caches.lease("c", [7, 7, 7, 7, 7, 7]) as seq:  # needs 2 blocks: a (oldest) goes
        assert caches.reserve([(seq, 6)]) == [True]
        caches.extend(seq, [7] * 6)
    assert set(caches._sequences) == {"b", "c"}
    assert caches.num_free_units == 1


def test_a_batch_admits_what_fits_and_refuses_only_the_rest():
    caches = SessionCaches(RecordingBackend(capacity=4, block=4))
    _fill(caches, "idle", [1, 2, 3, 4])
    with caches.lease("a", [1]) as a, caches.lease("b", [1]) as b, caches.lease("c", [1]) as c:
        caches.extend(a, [1, 2, 3])  # a holds 1 block and is in the batch
        fits = caches.reserve([(a, 8), (b, 12), (c, 8)])  # +1, +3 (too many even after evicting), +2 blocks
        assert fits == [True, False, True]
        assert "idle" not in caches._sequences  # evicted for c, not for b, which could not fit anyway
        assert a.token_ids == [1, 2, 3]  # a co-batched session is never cropped for another's room


def test_slot_backend_evicts_idle_and_refuses_only_the_new_session_when_every_slot_is_busy():
    caches = SessionCaches(RecordingBackend(capacity=2, block=0, slot=1))  # one unit per session
    with caches.lease("a", [1]):
        pass
    with caches.lease("b", [1]):
        with caches.lease("c", [1]):  # evicts a (idle)
            assert set(caches._sequences) == {"b", "c"}
            with pytest.raises(ResourceExhausted, match="no room"):
                with caches.lease("d", [1]):
                    pass
            assert set(caches._sequences) == {"b", "c"}


@pytest.mark.capacity
def test_sessions_that_are_never_ended_cycle_through_a_small_cache_forever():
    backend = RecordingBackend(capacity=8, block=4)
    caches = SessionCaches(backend)
    for i in range(500):  # ~200x what the cache holds at once
        _fill(caches, f"s{i}", [i % 16] * (1 + i % 9))
        assert 0 <= caches.num_free_units <= 8
    assert caches.num_sessions <= 8
    assert len(backend.lengths) == caches.num_sessions  # every evicted handle was freed


def test_a_session_in_flight_is_busy():
    caches = SessionCaches(RecordingBackend())
    with caches.lease("a", [1]):
        with pytest.raises(FailedPrecondition, match="busy"):
            with caches.lease("a", [1]):
                pass


def test_a_request_that_cannot_fit_evicts_nobody():
    caches = SessionCaches(RecordingBackend(capacity=4, block=4))
    _fill(caches, "a", [1, 2, 3, 4])
    _fill(caches, "b", [1, 2, 3, 4])
    with caches.lease("huge", [1]) as seq:
        assert caches.reserve([(seq, 100)]) == [False]
    assert {"a", "b"} <= set(caches._sequences)


class BatchlessFailing(RecordingBackend):
    """No forward_batch: items run one by one, and the second one's forward fails midway (after
    its cache has grown)."""

    def forward(self, handle, token_ids, start, num_logits=None):
        out = super().forward(handle, token_ids, start, num_logits)
        if token_ids == [666]:
            raise RuntimeError("forward blew up")
        return out


def test_a_failed_item_of_an_unbatched_backend_leaves_every_cache_consistent():
    backend = BatchlessFailing()
    caches = SessionCaches(backend)
    with pytest.raises(RuntimeError):
        with caches.lease("a", [1, 2]) as a, caches.lease("b", [3]) as b:
            caches.extend_batch([(a, [1, 2]), (b, [666])])
    for name, seq_ids in (("a", [1, 2, 5]), ("b", [3, 4])):  # both usable afterwards
        with caches.lease(name, seq_ids) as seq:
            assert backend.lengths[seq.handle] == len(seq.token_ids)
            caches.extend(seq, seq_ids[len(seq.token_ids):])
    assert caches.num_free_units == backend.capacity - sum(backend.lengths.values())


def test_a_failed_forward_empties_the_cache():
    backend = RecordingBackend()
    caches = SessionCaches(backend)
    with pytest.raises(RuntimeError):
        with caches.lease("a", [1, 2, 3]) as seq:
            caches.extend(seq, [1, 2])
            raise RuntimeError("forward blew up")
    with caches.lease("a", [1, 2, 3]) as seq:
        assert seq.token_ids == []


def test_release_frees_and_refuses_the_ended_session_afterwards():
    backend = RecordingBackend()
    caches = SessionCaches(backend)
    with caches.lease("a", [1, 2]) as seq:
        caches.extend(seq, [1])
    assert caches.release("a") and not caches.release("a")
    assert backend.freed == [1]
    with pytest.raises(NotFound):  # a late request (an overlapped proposal) cannot bring it back
        with caches.lease("a", [1, 2]):
            pass
    assert caches.num_sessions == 0


@pytest.mark.capacity
def test_release_during_a_round_frees_when_the_round_ends():
    backend = RecordingBackend(capacity=10)
    caches = SessionCaches(backend)
    with caches.lease("a", [1, 2, 3]) as seq, caches.lease("b", [4, 5]) as other:
        caches.extend(seq, [1, 2, 3])
        assert caches.release("a")
        assert backend.freed == []  # not under the running forward pass
        caches.extend(seq, [9])  # the round goes on
        caches.extend(other, [4, 5])
    assert backend.freed == [seq.handle]
    assert set(caches._sequences) == {"b"} and caches.num_free_units == 10 - 2
