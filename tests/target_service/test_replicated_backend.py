"""Rank 0's ReplicatedBackend refuses a call on a handle it does not hold before any follower sees
it, and a follower survives a call that fails: followers only ever replay what rank 0 accepted.
One real gloo process group of one rank (a follower is driven by hand, in-process)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from target_service import tensor_parallel as tp

pytestmark = pytest.mark.capacity


class Local:
    name, vocab_size, max_context, dtype, device, capacity, num_parameters = "local", 8, 64, "float32", "cpu", 10, 0

    def __init__(self):
        self.calls = []

    def units_for(self, length):
        return length

    def allocate(self):
        self.calls.append("allocate")
        return len(self.calls)

    def crop(self, handle, length):
        self.calls.append(("crop", handle, length))

    def free(self, handle):
        self.calls.append(("free", handle))

    def forward(self, handle, token_ids, start, num_logits=None):
        raise ValueError("forward failed")


@pytest.fixture(scope="module")
def group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()  # later tests in this process load models without one


def test_rank_0_refuses_an_unknown_handle_before_broadcasting(group, monkeypatch):
    sent = []
    backend = tp.ReplicatedBackend(Local(), group, on_failure=pytest.fail, ping_every_s=3600)
    monkeypatch.setattr(backend, "_broadcast", sent.append)
    handle = backend.allocate()
    for call in (lambda: backend.crop(handle + 1, 0), lambda: backend.free(handle + 1),
                 lambda: backend.forward_batch([(handle + 1, [1], 0)])):
        with pytest.raises(ValueError, match="not allocated"):
            call()
    assert sent == [("allocate", handle)]  # nothing rank 0 refused reached a follower
    backend.crop(handle, 0)
    assert sent[-1] == ("crop", handle, 0)


def test_a_follower_survives_failing_and_unknown_calls(group, monkeypatch):
    local = Local()
    script = iter([("allocate", 0), ("forward", 0, [1], 0, None), ("crop", 7, 0), ("free", 7), ("crop", 0, 0),
                   ("stop",)])

    def receive(box, src, group):
        box[0] = next(script)

    monkeypatch.setattr(dist, "broadcast_object_list", receive)
    tp.follow(local, group)  # returns at "stop" instead of dying on the failing ones
    assert local.calls == ["allocate", ("crop", 1, 0)]
