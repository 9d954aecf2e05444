"""`specdec up` as a user (or a supervisor) runs it: SIGTERM and SIGHUP stop its whole process tree
as Ctrl-C does, and when it is SIGKILLed its services still die with it (parent-death signal).

SIGHUP takes the same path as SIGTERM (both raise KeyboardInterrupt); it is checked in-process,
since every real stack costs about a minute on a 2-core runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from specdec.cli import _stop_on_signals
from specdec.launcher import free_port, wait_serving

pytestmark = pytest.mark.capacity


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_and_sighup_interrupt_like_ctrl_c(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _stop_on_signals()
        with pytest.raises(KeyboardInterrupt, match=sig.name):
            os.kill(os.getpid(), sig)
            time.sleep(10)  # the handler raises here at once
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below root, with its start time (so a reused pid is not mistaken for it)."""
    procs = {int(e): _stat(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, stat in procs.items():
            if stat is not None and stat[0] == parent and pid not in found:
                found[pid] = stat[2]
                frontier.append(pid)
    return found


def _alive(pids: dict[int, str]) -> list[int]:
    out = []
    for pid, started in pids.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] != "Z":  # a zombie has exited
            out.append(pid)
    return out


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_specdec_up_leaves_no_process_of_the_stack(sig, tiny_pair, tmp_path):
    target, draft = tiny_pair
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # it starts its own redis-server
    stderr = open(tmp_path / "up.err", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "up", "--target-model", target, "--draft-model", draft,
         "--draft-backend", "transformers", "--port", str(port), "--openai-port", str(free_port()),
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.DEVNULL, stderr=stderr, env=env,
    )
    pids: dict[int, str] = {}
    try:
        wait_serving(f"127.0.0.1:{port}", 300, up, "specdec up")
        deadline = time.monotonic() + 60  # up prints this once it is done starting: signal it after
        while b"specdec: try" not in (tmp_path / "up.err").read_bytes():
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.err").read_text()
            time.sleep(0.1)
        pids = _descendants(up.pid)
        assert len(pids) >= 5, pids  # redis-server, draft, target, coordinator, the OpenAI gateway
        up.send_signal(sig)
        code = up.wait(timeout=120)
        if sig != signal.SIGKILL:
            assert code == 0, (tmp_path / "up.err").read_text()
        deadline = time.monotonic() + 60
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pids), (tmp_path / "up.err").read_text()
    finally:
        stderr.close()
        for pid in _alive(pids):  # never leave a stack behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()
            up.wait()
