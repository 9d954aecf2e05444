"""The two layouts of the local stack, requests against it (one at a time, or c client threads), and
a private Redis that can be killed and brought back.

- main: `specdec.launcher.Stack` as `specdec up` starts it (draft = the GGUF on the backend `auto` picks);
- pinned: the draft on one core with one thread, the target on another with one torch
  thread, so that overlapping draft and verify has a core to gain (on 2 shared cores, unpinned,
  they just take turns).

Every request is sent with the bearer token of a tenant (`TenantTokens`): the coordinator's suffix
index is per tenant, so the tenant decides which earlier requests a request may draft from.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import redis

from measure import MemoryProbe, Request
from specdec import Client
from specdec.client import stats_dict
from specdec.launcher import Stack, _wait_port, free_port, redis_server_binary, spawn

T = TypeVar("T")

CLIENT_TIMEOUT_S = 1800.0


@dataclass
class PinnedStack(Stack):
    """A Stack whose services' command lines get a prefix (taskset, env) per role."""

    prefixes: dict[str, list[str]] = field(default_factory=dict)

    def command(self, name: str) -> list[str]:
        return self.prefixes.get(name.split("#")[0], []) + super().command(name)


class RedisProcess:
    """A private redis-server on a loopback port with its data in `directory` (RDB snapshots off;
    `args` are more flags). start() after kill() comes back on the same port and data, once its
    append-only file has loaded."""

    def __init__(self, directory: Path, *args: str):
        self.port, self.dir, self.args, self.proc = free_port(), directory, args, None
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.proc = spawn([redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                           "--dir", str(self.dir), *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, 30)
        client = redis.Redis.from_url(self.url)
        while True:
            try:
                client.ping()
                return self
            except redis.BusyLoadingError:
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


class TenantTokens:
    """One bearer token per tenant, written to `path` as the coordinator's --auth-tokens-file. The
    coordinator reads the file once, at its start, so every tenant a run will use is named up front."""

    def __init__(self, tenants: Iterable[str], path: Path):
        self.tokens = {tenant: f"bench-{tenant}" for tenant in sorted(set(tenants))}
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{tenant}:{token}\n" for tenant, token in self.tokens.items()))

    def __call__(self, tenant: str) -> str:
        """The tenant's token."""
        if tenant not in self.tokens:
            raise KeyError(f"tenant {tenant!r} has no token (the run's tenants are named before the stack starts)")
        return self.tokens[tenant]

    @property
    def coordinator_args(self) -> list[str]:
        return ["--auth-tokens-file", str(self.path)]


class TenantClients:
    """An open Client per tenant, connected before its first request (no measured request pays for
    a connection). close() closes them all."""

    def __init__(self, address: str, tokens: TenantTokens):
        self.address, self.tokens, self.clients = address, tokens, {}

    def __call__(self, tenant: str) -> Client:
        if tenant not in self.clients:
            client = Client(self.address, timeout_s=CLIENT_TIMEOUT_S, token=self.tokens(tenant))
            grpc.channel_ready_future(client.channel).result(timeout=60)
            self.clients[tenant] = client
        return self.clients[tenant]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()


def main_stack(log_dir: Path, device: str, draft_backend: str, tokens: TenantTokens) -> Stack:
    target = ["--device", device] if device != "cpu" else []
    return Stack(log_dir=log_dir, args={"draft": ["--backend", draft_backend], "target": target,
                                        "coordinator": tokens.coordinator_args})


def pinned_stack(log_dir: Path, device: str, draft_backend: str, tokens: TenantTokens) -> PinnedStack:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the pinned layout needs two cores")
    one_thread = ["env", "OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1"]  # torch reads these at import
    target = ["--device", device] if device != "cpu" else []
    return PinnedStack(log_dir=log_dir, args={"draft": ["--backend", draft_backend, "--threads", "1"], "target": target,
                                              "coordinator": tokens.coordinator_args},
                       prefixes={"draft": ["taskset", "-c", str(cores[0])],
                                 "target": one_thread + ["taskset", "-c", str(cores[1])]})


def quiet(stack: Stack, window_s: float = 0.1, timeout_s: float = 3.0) -> Callable[[], None]:
    """A wait, before each measured request or wave, until the draft worker's CPU time stands still
    for `window_s` (at most `timeout_s`): what one configuration leaves running on the draft (a
    cancelled block or warm-up finishing its chunk, its sessions ending) must not run into the next
    configuration's requests, whose target prefill then has one core instead of two (measured: +~280
    ms TTFT for the request after a model-draft one at c1, and chat c8 TTFT p50 494 ms for the
    policy's wave, which followed model-draft waves, against 212 for K = 0, which followed it)."""
    proc = stack.processes.get("draft")

    def cpu_ticks() -> int:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    def wait() -> None:
        if proc is None or not Path(f"/proc/{proc.pid}/stat").exists():
            return
        deadline, last = time.monotonic() + timeout_s, cpu_ticks()
        while time.monotonic() < deadline:
            time.sleep(window_s)
            now = cpu_ticks()
            if now - last <= 1:  # at most one clock tick (10 ms) of CPU in the window: idle
                return
            last = now
    return wait


def service_probe(stack: Stack) -> MemoryProbe:
    """VmHWM of every service process (env and taskset exec the service, so the pid is its own)."""
    return MemoryProbe({name: proc.pid for name, proc in stack.processes.items()})


def specdec_request(client: Client, index: int, messages: list[dict], options: dict) -> Request:
    """One streamed generation; the session is ended afterwards (outside the timing) so that
    worker caches do not fill with finished sessions."""
    request = Request(index)
    last = None
    for chunk in client.stream(messages, **options):
        request.arrive(list(chunk.token_ids))
        last = chunk
    request.finish()
    request.stats = {**stats_dict(last.stats), "session_tokens": last.usage.session_tokens}
    client.end_session(last.session_id)
    return request


def specdec_runner(clients: TenantClients, options: dict) -> Callable[[int, list[dict], int, str], Request]:
    """(prompt index, messages, max new tokens, tenant) -> the request, sent as that tenant."""
    def run(index: int, messages: list[dict], max_new_tokens: int, tenant: str) -> Request:
        return specdec_request(clients(tenant), index, messages, {**options, "max_new_tokens": max_new_tokens})

    return run


def run_batch(address: str, jobs: list[tuple[int, list[dict]]], concurrency: int, options: dict,
              on_done: Callable[[Request, float], None], start_after: dict[int, float] | None = None,
              token: str = "") -> tuple[list[Request], float]:
    """c client threads against a specdec stack (see run_concurrently), sending as the tenant of
    `token`. start_after: prompt index -> seconds its thread waits before sending it."""
    clients = [Client(address, timeout_s=CLIENT_TIMEOUT_S, token=token) for _ in range(concurrency)]

    def send(t: int, index: int, messages: list[dict]) -> Request:
        time.sleep((start_after or {}).get(index, 0.0))
        return specdec_request(clients[t], index, messages, options)

    try:
        return run_concurrently(jobs, concurrency, send, on_done)
    finally:
        for client in clients:
            client.close()


def run_concurrently(jobs: list[tuple[int, T]], concurrency: int, send: Callable[[int, int, T], Request],
                     on_done: Callable[[Request, float], None]) -> tuple[list[Request], float]:
    """c threads, thread t sending jobs[t::c] one after another with send(t, index, job), all
    released together. Returns the requests and the wall time of the whole batch."""
    barrier = threading.Barrier(concurrency + 1)
    done: list[Request] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        barrier.wait()
        try:
            for index, job in jobs[t::concurrency]:
                request = send(t, index, job)
                with lock:
                    done.append(request)
                    on_done(request, started)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(concurrency)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return done, wall
