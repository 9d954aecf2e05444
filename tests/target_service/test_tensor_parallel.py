"""Tensor-parallel target: two gloo ranks under torchrun on CPU, through the full service path."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

import redis

from stacks import assert_no_cache_left, end_stream, scrape, start_stack
from specdec import Client
from specdec.launcher import free_port

pytestmark = [pytest.mark.tp, pytest.mark.e2e]

PROMPTS = [[504, 3458, 282, 4649, 314], [1073, 2102, 30, 9, 17, 3365, 11, 4500]]


@pytest.fixture(scope="module")
def tp_stack(tiny_pair, tmp_path_factory):
    metrics_port = free_port()
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), kv_store_mb=64,
                        args={"target": ["--tensor-parallel-size", "2", "--dist-timeout", "20",
                                         "--kv-chunk-tokens", "16", "--metrics-port", str(metrics_port)]})
    stack.metrics_port = metrics_port
    yield stack
    stack.down()


@pytest.mark.lossless
def test_tp2_greedy_identical_to_tp1(tp_stack, hf_greedy):
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:
        assert client.describe().target.tensor_parallel_size == 2
        for ids in PROMPTS:
            expected = hf_greedy(ids, 32)  # one process, no sharding
            for k in (0, 4):
                assert client.generate(ids, max_new_tokens=32, k=k).token_ids == expected
        first = client.generate(PROMPTS[0], max_new_tokens=8, k=4)  # caches roll back on every rank
        second = client.generate([42], max_new_tokens=8, k=4, session_id=first.session_id)
        assert second.token_ids == hf_greedy(PROMPTS[0] + first.token_ids + [42], 8)


@pytest.mark.capacity
def test_end_session_during_rounds_keeps_every_rank_alive_and_frees_caches(tp_stack, hf_greedy):
    torchrun = tp_stack.processes["target"]
    ranks = _children(torchrun.pid)
    ended = []
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:
        for i in range(4):
            stream = client.stream(PROMPTS[i % 2], max_new_tokens=300, k=4)
            ended.append(next(stream).session_id)  # its rounds are running
            client.end_session(ended[-1])
            end_stream(stream)
        assert client.generate(PROMPTS[0], max_new_tokens=32, k=4).token_ids == hf_greedy(PROMPTS[0], 32)
    assert_no_cache_left(tp_stack, ended + ["never-seen"])  # releasing what no rank holds is harmless
    assert torchrun.poll() is None and all(os.path.exists(f"/proc/{r}") for r in ranks)
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:  # and every rank still works
        assert client.generate(PROMPTS[1], max_new_tokens=16, k=4).token_ids == hf_greedy(PROMPTS[1], 16)


@pytest.mark.kvstore
@pytest.mark.lossless
def test_ranks_store_and_restore_their_own_kv_shards(tp_stack, hf_greedy):
    """Each rank writes its shard's chunks under its own keys; a restarted target's ranks agree on
    what they restore and the output stays identical."""
    ids = [(7 * i) % 4000 + 100 for i in range(100)]
    kv = redis.Redis.from_url(tp_stack.kv_store_url)
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:
        first = client.generate(ids, max_new_tokens=8, k=4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # written behind the rounds
        digests = {}
        for key in kv.scan_iter("specdec:kv:*"):
            digests[key.split(b":")[2]] = digests.get(key.split(b":")[2], 0) + 1
        # the draft's (64-token chunks) and each target rank's own (16-token chunks)
        if len(digests) == 3 and sorted(digests.values())[-2] >= 100 // 16:
            break
        time.sleep(0.2)
    assert len(digests) == 3 and sorted(digests.values())[-2] >= 100 // 16, digests
    tp_stack.restart("target")
    tp_stack.restart("coordinator")
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:
        second = client.generate([42], max_new_tokens=8, k=4, session_id=first.session_id)
    assert second.token_ids == hf_greedy(ids + first.token_ids + [42], 8)
    assert scrape(tp_stack.metrics_port)['specdec_kv_store_restored_tokens_total{role="target"}'] >= 96


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_a_dead_rank_takes_the_service_down_cleanly(tp_stack):
    torchrun = tp_stack.processes["target"]
    ranks = _children(torchrun.pid)
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGKILL)  # the second rank
    started = time.monotonic()
    code = torchrun.wait(timeout=120)
    assert code != 0
    assert time.monotonic() - started < 120
    with Client(tp_stack.address("coordinator"), timeout_s=120) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[0], max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
