"""BatchQueue admission: a full queue and an unmeetable deadline are refused at once, and the
engine thread outlives a batch that raises."""

from __future__ import annotations

import threading
import time

import pytest

from specdec_core.engine.batching import BatchQueue
from specdec_core.errors import ResourceExhausted

pytestmark = pytest.mark.capacity


def test_a_deadline_the_queue_cannot_meet_is_refused_before_queueing():
    release = threading.Event()

    def process(tasks):
        release.wait(10)
        return tasks

    q = BatchQueue(process, window_s=0.0, max_batch=1, max_queue=8)
    release.set()
    assert q.submit("warm", "a") == "warm"  # one batch measured
    q._batch_s = 0.5  # as if batches took half a second (the measured average is not under test)
    release.clear()
    busy = threading.Thread(target=q.submit, args=("busy", "b"))
    busy.start()
    wait_until(lambda: q._running_since is not None)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="deadline"):
        q.submit("late", "c", deadline=time.monotonic() + 0.2)
    assert time.monotonic() - started < 0.2  # refused without waiting
    assert q._queue.qsize() <= 1  # "late" never entered the queue (only "busy" may wait there)
    release.set()
    busy.join(10)
    assert q.submit("in time", "d", deadline=time.monotonic() + 60) == "in time"


def test_an_idle_worker_admits_whatever_its_last_batches_took():
    q = BatchQueue(lambda tasks: tasks, window_s=0.0, max_batch=1)
    q._batch_s = 30.0  # one very slow batch (a cold start, a long prefill) must not shut the door
    assert q.submit("short deadline", "a", deadline=time.monotonic() + 0.5) == "short deadline"


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_full_queue_refuses_at_once():
    release = threading.Event()
    q = BatchQueue(lambda tasks: (release.wait(10), tasks)[1], window_s=0.0, max_batch=1, max_queue=2)
    threads = [threading.Thread(target=q.submit, args=(i, str(i))) for i in range(3)]  # 1 running + 2 queued
    for t in threads:
        t.start()
    wait_until(lambda: q._queue.qsize() == 2)
    with pytest.raises(ResourceExhausted, match="2 requests queued"):
        q.submit("one too many", "x")
    release.set()
    for t in threads:
        t.join(10)


def test_the_engine_thread_survives_a_failing_batch():
    calls = []

    def process(tasks):
        calls.append(tasks)
        if tasks == ["boom"]:
            raise RuntimeError("model step failed")
        return tasks

    q = BatchQueue(process, window_s=0.0, max_batch=1)
    with pytest.raises(RuntimeError):
        q.submit("boom", "a")
    q._dropped = None  # a failure outside the model step (here: while dropping cancelled tasks)
    with pytest.raises(TypeError):
        q.submit("x", "b")
    del q._dropped
    assert q.submit("fine", "c") == "fine"


def test_a_batch_waits_for_the_members_of_the_last_one():
    """Regrouping: sessions of one batch that come back one by one run as one batch again (not as
    two that alternate for good); a session that does not come back is waited for at most
    regroup_s. Ordered by events, not by sleeps: the engine could not run the second round without
    waiting, since its members are submitted one at a time."""
    gate, batches = threading.Event(), []

    def process(tasks):
        if tasks == ["gate"]:
            gate.wait(30)
        batches.append(sorted(tasks))
        return tasks

    q = BatchQueue(process, window_s=0.0, max_batch=8, regroup_s=0.0)

    def submit_all(tasks):
        threads = [threading.Thread(target=q.submit, args=(t, t)) for t in tasks]
        for t in threads:
            t.start()
        return threads

    first = submit_all(["gate"])
    while q._running_since is None:  # the gate batch is running
        time.sleep(0.001)
    members = submit_all(["a", "b", "c"])
    while q._queue.qsize() < 3:
        time.sleep(0.001)
    gate.set()
    for t in first + members:
        t.join(30)
    assert batches == [["gate"], ["a", "b", "c"]]

    q.regroup_s = 60.0
    one_by_one = []
    puts = q._queue.unfinished_tasks  # every put counts (nothing calls task_done)
    for name in ("c", "a", "b"):
        one_by_one += submit_all([name])
        puts += 1
        while q._queue.unfinished_tasks < puts or q._queue.qsize():  # until the engine took it
            time.sleep(0.001)
    for t in one_by_one:
        t.join(30)
    assert batches[2] == ["a", "b", "c"]

    q.regroup_s = 0.05  # c has finished: a and b wait for it no longer than this
    for t in submit_all(["a", "b"]):
        t.join(30)
        assert not t.is_alive()
    assert sorted(sum(batches[3:], [])) == ["a", "b"]


def test_a_task_answered_again_runs_in_the_next_batch_beside_the_new_ones():
    """Chunked work: a step that answers AGAIN for a task has done a part of it; the task runs again
    in the next batch (with what arrived meanwhile), and its caller gets the last answer."""
    from specdec_core.engine.batching import AGAIN

    batches, parts = [], {"long": 3}

    def process(tasks):
        batches.append(sorted(tasks))
        out = []
        for t in tasks:
            parts[t] = parts.get(t, 1) - 1
            out.append(AGAIN if parts[t] > 0 else f"{t} done")
            if t == "long" and parts[t] == 2:  # while the long task is between parts, a short one arrives
                threading.Thread(target=lambda: answers.append(q.submit("short", "short"))).start()
                while q._queue.qsize() < 1:
                    time.sleep(0.001)
        return out

    answers = []
    q = BatchQueue(process, window_s=0.0, max_batch=8, regroup_s=0.0)
    assert q.submit("long", "long") == "long done"
    assert batches == [["long"], ["long", "short"], ["long"]]  # the short one did not wait for the long one
    deadline = time.monotonic() + 30
    while not answers and time.monotonic() < deadline:
        time.sleep(0.001)
    assert answers == ["short done"]


def test_a_task_answered_again_with_its_rest_runs_as_that_next():
    """Multi-step work: `Again(rest)` replaces the task by what is left of it; the caller gets the
    answer of the last part."""
    from specdec_core.engine.batching import Again

    seen = []

    def process(tasks):
        seen.extend(tasks)
        return [Again(t - 1) if t > 0 else "done" for t in tasks]

    q = BatchQueue(process, window_s=0.0, max_batch=8, regroup_s=0.0)
    assert q.submit(3, "countdown") == "done"
    assert seen == [3, 2, 1, 0]
