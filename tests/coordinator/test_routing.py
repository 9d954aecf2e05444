"""Finding replicas and routing sessions: unit checks of rendezvous, stickiness and discovery
(the Kubernetes watch is fed the official client's own objects), and a run with real processes
where target replicas come and go while sessions continue."""

from __future__ import annotations

import json
import time

import pytest
import redis
from kubernetes import client as k8s

from stacks import start_stack
from coordinator.routing import EndpointSliceWatch, ReplicaPool, from_dns, from_file, rendezvous, static
from specdec import Client
from specdec.launcher import free_port
from specdec_core.errors import ResourceExhausted, Unavailable

pytestmark = pytest.mark.routing


def test_rendezvous_is_stable_and_moves_few_sessions():
    three = ["a:1", "b:1", "c:1"]
    sessions = [f"s{i}" for i in range(300)]
    before = {s: rendezvous(s, three) for s in sessions}
    assert before == {s: rendezvous(s, list(reversed(three))) for s in sessions}  # order-free
    assert all(sum(v == a for v in before.values()) > 60 for a in three)  # spread
    after = {s: rendezvous(s, three + ["d:1"]) for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    assert all(after[s] == "d:1" for s in moved) and len(moved) < 120  # only to the newcomer


def test_pool_keeps_a_live_choice_and_moves_a_dead_one():
    d = static(["a:1", "b:1"])
    pool = ReplicaPool("target", d, make_client=lambda a: a, retry_budget_s=1)
    assert pool.choose("s", preferred="b:1") == "b:1"
    d.set(["a:1", "c:1"])
    assert pool.choose("s", preferred="b:1") == rendezvous("s", ["a:1", "c:1"])


def test_pool_call_moves_the_session_on_unavailable():
    d = static(["a:1", "b:1"])
    pool = ReplicaPool("target", d, make_client=lambda a: a, retry_budget_s=5)
    routes = {"target": "a:1"}

    def fn(address):
        if address == "a:1":
            raise Unavailable("down")
        return address

    assert pool.call("s", routes, fn) == "b:1" and routes["target"] == "b:1"


@pytest.mark.capacity
def test_a_replica_without_room_for_one_session_is_not_down():
    """A worker's RESOURCE_EXHAUSTED (no room for this session now) goes to the caller (the draft:
    that round runs without a draft), the session stays, and neither the replica nor drafting for
    everyone is switched off."""
    d = static(["a:1", "b:1"])
    pool = ReplicaPool("draft", d, make_client=lambda a: a, retry_budget_s=5, fail_fast=True)
    routes = {"draft": "a:1"}

    def full(address):
        raise ResourceExhausted("draft KV cache full")

    for _ in range(5):
        with pytest.raises(ResourceExhausted):
            pool.call("s", routes, full)
    assert routes["draft"] == "a:1" and not pool.all_down() and pool.choose("t", None) in ("a:1", "b:1")
    assert pool.call("s", routes, lambda address: address) == "a:1"


def _slice(name: str, ready: list[str], not_ready: list[str] = ()) -> k8s.V1EndpointSlice:
    endpoints = [k8s.V1Endpoint(addresses=[ip], conditions=k8s.V1EndpointConditions(ready=True)) for ip in ready]
    endpoints += [k8s.V1Endpoint(addresses=[ip], conditions=k8s.V1EndpointConditions(ready=False)) for ip in not_ready]
    return k8s.V1EndpointSlice(address_type="IPv4", endpoints=endpoints,
                               metadata=k8s.V1ObjectMeta(name=name, labels={"kubernetes.io/service-name": "target"}))


def test_endpointslice_watch_follows_the_official_event_objects():
    watch = EndpointSliceWatch("inference", "target", 50052)
    watch.apply({"type": "ADDED", "object": _slice("target-abc", ["10.0.0.1", "10.0.0.2"], ["10.0.0.9"])})
    assert watch.addresses() == ["10.0.0.1:50052", "10.0.0.2:50052"]
    watch.apply({"type": "ADDED", "object": _slice("target-def", ["10.0.1.1"])})
    watch.apply({"type": "MODIFIED", "object": _slice("target-abc", ["10.0.0.2"])})
    assert watch.addresses() == ["10.0.0.2:50052", "10.0.1.1:50052"]
    watch.apply({"type": "DELETED", "object": _slice("target-def", [])})
    assert watch.addresses() == ["10.0.0.2:50052"]


def test_dns_and_file_discovery(tmp_path):
    assert "127.0.0.1:5000" in from_dns("localhost", 5000).addresses()
    path = tmp_path / "targets"
    path.write_text("127.0.0.1:1\n")
    d = from_file(str(path), every_s=0.1)
    assert d.addresses() == ["127.0.0.1:1"]
    path.write_text("127.0.0.1:1\n127.0.0.1:2\n")
    deadline = time.monotonic() + 5
    while d.addresses() != ["127.0.0.1:1", "127.0.0.1:2"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.addresses() == ["127.0.0.1:1", "127.0.0.1:2"]


@pytest.mark.e2e
def test_replicas_come_and_go_while_sessions_continue(tiny_pair, hf_greedy, tmp_path):
    targets = tmp_path / "targets"
    first = f"127.0.0.1:{free_port()}"
    targets.write_text(first + "\n")
    stack = start_stack(*tiny_pair, tmp_path / "logs", args={"coordinator": ["--target", f"file://{targets}"]},
                        ports={"target": int(first.rsplit(":", 1)[1])})
    try:
        r = redis.Redis.from_url(stack.redis_url)

        def route(session_id: str) -> str:
            return json.loads(r.hget(f"specdec:session:{session_id}", "meta"))["routes"]["target"]

        with Client(stack.address("coordinator"), timeout_s=120) as c:
            history = {}
            for i in range(4):
                ids = [100 + i, 200 + i, 300 + i]
                res = c.generate(ids, max_new_tokens=6, k=3)
                history[res.session_id] = ids + res.token_ids
            assert {route(s) for s in history} == {first}

            stack.start("target#2")  # a replica joins
            targets.write_text(f"{first}\n{stack.address('target#2')}\n")
            time.sleep(2.5)
            for s in history:  # existing sessions stay where they are
                res = c.generate([7], max_new_tokens=6, k=3, session_id=s)
                assert res.token_ids == hf_greedy(history[s] + [7], 6)
                history[s] += [7] + res.token_ids
                assert route(s) == first
            live = [first, stack.address("target#2")]
            for i in range(6):  # new sessions spread by rendezvous hashing
                res = c.generate([400 + i, 5], max_new_tokens=4, k=3)
                assert route(res.session_id) == rendezvous(res.session_id, live)

            stack.stop("target")  # the first replica dies, still listed: its sessions move
            for s in history:
                res = c.generate([8], max_new_tokens=6, k=3, session_id=s)
                assert res.token_ids == hf_greedy(history[s] + [8], 6)
                history[s] += [8] + res.token_ids
                assert route(s) == stack.address("target#2")
    finally:
        stack.down()
