"""Finding worker replicas and sending each session to the same one while it lives.

Discovery (one per role), from the address given on the command line:
- `host:port[,host:port...]`  a static list;
- `file:///path`              a static list in a file (one address a line), re-read when it changes;
- `dns:///name:port`          the A/AAAA records of a (headless) Service name, re-resolved;
- `k8s:///namespace/service:port`  the Service's EndpointSlices, watched with the Kubernetes API.

Routing: a session keeps the replica it was first sent to for as long as that replica is alive
(the choice is stored with the session in Redis, so every coordinator agrees); a new session, or
one whose replica is gone, goes to the rendezvous-hash winner among the live replicas, so that
coordinators agree without talking to each other and a change of replicas moves few sessions.
A moved session costs a cache rebuild from its committed tokens, never correctness.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from coordinator.loop import NO_DECODE, Decode, Draft, Verdict
from coordinator.request import RequestContext
from specdec_core.errors import Unavailable
from specdec_core.logs import short_id

log = logging.getLogger(__name__)


def rendezvous(session_id: str, addresses: list[str]) -> str:
    """The address with the highest hash of (session, address): stable, and evenly spread."""
    return max(addresses, key=lambda a: hashlib.blake2b(f"{session_id}|{a}".encode(), digest_size=8).digest())


class Discovery:
    """A live set of addresses, kept current by a background refresh (or a watch)."""

    def __init__(self) -> None:
        self._addresses: list[str] = []
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._addresses)

    def set(self, addresses: list[str]) -> None:
        addresses = sorted(set(addresses))
        with self._lock:
            if addresses == self._addresses:
                return
            log.info("replicas now: %s", ", ".join(addresses) or "none")
            self._addresses = addresses
        self._changed.set()

    def wait_changed(self, timeout_s: float) -> bool:
        changed = self._changed.wait(timeout_s)
        self._changed.clear()
        return changed

    def start_polling(self, refresh: Callable[[], list[str] | None], every_s: float) -> None:
        def loop() -> None:
            while True:
                try:
                    found = refresh()
                    if found is not None:
                        self.set(found)
                except Exception as exc:  # noqa: BLE001 - keep the last known set
                    log.warning("discovery refresh failed: %s", exc)
                time.sleep(every_s)

        threading.Thread(target=loop, daemon=True, name="discovery").start()


def static(addresses: list[str]) -> Discovery:
    d = Discovery()
    d.set(addresses)
    return d


def from_file(path: str, every_s: float = 1.0) -> Discovery:
    d = Discovery()

    def read() -> list[str] | None:
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return [line.strip() for line in f if line.strip() and not line.startswith("#")]

    d.set(read() or [])
    d.start_polling(read, every_s)
    return d


def from_dns(name: str, port: int, every_s: float = 2.0) -> Discovery:
    d = Discovery()

    def resolve() -> list[str]:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for *_, (ip, *_) in infos]

    try:
        d.set(resolve())
    except OSError as exc:
        log.warning("cannot resolve %s yet: %s", name, exc)
    d.start_polling(resolve, every_s)
    return d


class EndpointSliceWatch(Discovery):
    """Ready endpoints of a Service, from its EndpointSlices (discovery.k8s.io/v1)."""

    def __init__(self, namespace: str, service: str, port: int):
        super().__init__()
        self.namespace, self.service, self.port = namespace, service, port
        self._slices: dict[str, list[str]] = {}

    def apply(self, event: dict) -> None:
        """One watch event, as `kubernetes.watch.Watch().stream` yields it."""
        kind, obj = event["type"], event["object"]
        name = obj.metadata.name
        if kind == "DELETED":
            self._slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[name] = [
                f"{address}:{self.port}"
                for endpoint in obj.endpoints or []
                if endpoint.conditions is None or endpoint.conditions.ready is not False
                for address in endpoint.addresses or []
            ]
        self.set([a for addresses in self._slices.values() for a in addresses])

    def run(self) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self.service}"
        while True:
            try:
                self._slices.clear()
                for event in watch.Watch().stream(api.list_namespaced_endpoint_slice, self.namespace,
                                                  label_selector=selector, timeout_seconds=300):
                    self.apply(event)
            except Exception as exc:  # noqa: BLE001 - reconnect after API server hiccups
                log.warning("EndpointSlice watch for %s/%s failed: %s", self.namespace, self.service, exc)
                time.sleep(2)

    def start(self) -> EndpointSliceWatch:
        threading.Thread(target=self.run, daemon=True, name="endpointslices").start()
        return self


def discover(spec: str) -> Discovery:
    """A Discovery for an address spec (see the module docstring)."""
    if spec.startswith("file://"):
        return from_file(spec.removeprefix("file://"))
    if spec.startswith("dns:///"):
        name, port = spec.removeprefix("dns:///").rsplit(":", 1)
        return from_dns(name, int(port))
    if spec.startswith("k8s:///"):
        path, port = spec.removeprefix("k8s:///").rsplit(":", 1)
        namespace, service = path.split("/", 1)
        return EndpointSliceWatch(namespace, service, int(port)).start()
    return static([a.strip() for a in spec.split(",") if a.strip()])


class ReplicaPool:
    """The live replicas of one role, a client per replica, and the session -> replica choice."""

    def __init__(self, role: str, discovery: Discovery, make_client: Callable[[str], object],
                 retry_budget_s: float, down_for_s: float = 1.0, max_down_for_s: float = 30.0,
                 fail_fast: bool = False):
        self.role = role
        self.discovery = discovery
        self.make_client = make_client
        self.retry_budget_s = retry_budget_s
        self.down_for_s = down_for_s
        self.max_down_for_s = max_down_for_s
        # fail_fast: while every replica is marked down, fail at once instead of retrying (for an
        # optional role such as the draft: decoding goes on without it, and one call in each
        # back-off period probes whether it is back).
        self.fail_fast = fail_fast
        self._clients: dict[str, object] = {}
        self._down_until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._lock = threading.Lock()

    def choose(self, session_id: str, preferred: str | None) -> str:
        live = self.discovery.addresses()
        if not live:
            raise Unavailable(f"no {self.role} replicas")
        now = time.monotonic()
        up = [a for a in live if self._down_until.get(a, 0) <= now] or live
        return preferred if preferred in up else rendezvous(session_id, up)

    def client(self, address: str):
        with self._lock:
            if address not in self._clients:
                self._clients[address] = self.make_client(address)
            return self._clients[address]

    def mark_down(self, address: str) -> None:
        """Avoid the replica for a while; the while doubles with each failure in a row."""
        failures = self._failures.get(address, 0) + 1
        self._failures[address] = failures
        backoff = min(self.max_down_for_s, self.down_for_s * 2 ** (failures - 1))
        self._down_until[address] = time.monotonic() + backoff

    def mark_up(self, address: str) -> None:
        if self._failures.pop(address, None):
            self._down_until.pop(address, None)

    def all_down(self) -> bool:
        now = time.monotonic()
        live = self.discovery.addresses()
        return bool(live) and all(self._down_until.get(a, 0) > now for a in live)

    def call(self, session_id: str, routes: dict[str, str], fn: Callable):
        """fn(client) on the session's replica; on UNAVAILABLE move the session to another live
        replica, until the retry budget is spent. routes[role] is updated with the replica used."""
        if self.fail_fast and self.all_down():
            raise Unavailable(f"every {self.role} replica is down (backing off)")
        deadline = time.monotonic() + self.retry_budget_s
        while True:
            address = self.choose(session_id, routes.get(self.role))
            routes[self.role] = address
            try:
                result = fn(self.client(address))
            except Unavailable:
                self.mark_down(address)
                if time.monotonic() >= deadline or (self.fail_fast and self.all_down()):
                    raise
                log.info("%s replica %s unavailable; session %s moves", self.role, address, short_id(session_id))
                continue
            self.mark_up(address)
            return result

    def addresses(self) -> list[str]:
        return self.discovery.addresses()

    def any_serving(self, timeout_s: float = 1.0) -> bool:
        """Whether some replica's health service says SERVING (busy replicas do: health never queues)."""
        return any(self.client(a).is_serving(timeout_s) for a in self.addresses())

    def clients(self) -> list:
        return [self.client(a) for a in self.addresses()]


class Routed:
    """A `Proposer` or `Verifier` over a pool of replicas. A call goes to the replica in its request
    context's `routes` (the dict stored with the session, so choices persist with it)."""

    def __init__(self, pool: ReplicaPool):
        self.pool = pool
        self.role = pool.role

    def propose(self, ctx: RequestContext, committed_ids: list[int], num_tokens: int) -> Draft:
        return self.pool.call(ctx.session_id, ctx.routes, lambda c: c.propose(ctx, committed_ids, num_tokens))

    def verify(self, ctx: RequestContext, committed_ids: list[int], draft: Draft, decode: Decode = NO_DECODE
               ) -> Verdict:
        return self.pool.call(ctx.session_id, ctx.routes, lambda c: c.verify(ctx, committed_ids, draft, decode))

    def release(self, session_id: str, deadline: float | None = None) -> None:
        for client in self.pool.clients():
            client.release(session_id, deadline)

    def model_info(self, wait_s: float):
        deadline = time.monotonic() + wait_s
        while not self.pool.addresses():
            if time.monotonic() > deadline:
                raise Unavailable(f"no {self.role} replicas found within {wait_s:.0f} s")
            self.pool.discovery.wait_changed(1.0)
        remaining = max(1.0, deadline - time.monotonic())
        return self.pool.client(self.pool.addresses()[0]).model_info(retry_budget_s=remaining)
