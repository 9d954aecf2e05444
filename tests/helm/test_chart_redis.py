"""Sessions that survive Redis faults, as the chart sets them up: the bundled Redis' durability levels
(append-only file and its fsync policy, a volume, maxmemory with noeviction), Redis with Sentinel
failover (redis.mode sentinel), external Sentinels, and what the coordinator is told (a
redis+sentinel:// URL, --redis-wait-replicas, the per-tenant limits); values the schema or the
templates refuse. The Sentinel script of the chart also runs for real: three Redis and three
Sentinels on loopback addresses, a master handed over as a rolling update does it, then one killed.
The lint and the Kubernetes-schema checks of these values sets are in test_chart.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

import helm_python as helm
from specdec_chart import (CHART, NAMESPACE, RELEASE, Release, component_of, env_of, flags_of, matches,
                           split_redis_url)

pytestmark = [pytest.mark.helm, pytest.mark.durability]

SCRIPT = CHART / "scripts" / "redis-sentinel.sh"


def render(chart, values: dict) -> Release:
    return Release(chart.merge_values(values), chart.render(values, name=RELEASE, namespace=NAMESPACE))


def redis_options(container: dict) -> dict[str, str]:
    """redis-server's `--name value` arguments as {name: value}."""
    args = container["args"]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return {name[2:]: value for name, value in zip(args[::2], args[1::2])}


def volume_of_data(release: Release) -> dict:
    """The claim template or the pod volume behind the Redis container's /data."""
    statefulset = release.workload("redis")
    mount = next(m for m in release.container("redis")["volumeMounts"] if m["mountPath"] == "/data")
    claims = [t for t in statefulset["spec"].get("volumeClaimTemplates", []) if t["metadata"]["name"] == mount["name"]]
    volumes = [v for v in release.pod_spec("redis").get("volumes", []) if v["name"] == mount["name"]]
    assert len(claims + volumes) == 1, "/data is one claim template or one volume"
    return (claims + volumes)[0]


# --- durability levels -------------------------------------------------------------------------

@pytest.mark.parametrize("bundled, appendonly, appendfsync", [
    ({}, "yes", "everysec"),  # the default
    ({"appendfsync": "always"}, "yes", "always"),
    ({"appendfsync": "no"}, "yes", "no"),
    ({"appendonly": False}, "no", None),
])
def test_durability_levels_set_the_append_only_file(chart, bundled, appendonly, appendfsync):
    release = render(chart, {"redis": {"bundled": bundled}})
    options = redis_options(release.container("redis"))
    assert options["appendonly"] == appendonly and options.get("appendfsync") == appendfsync
    assert options["save"] == "", "no snapshots besides the append-only file"
    assert (options["maxmemory"], options["maxmemory-policy"]) == ("800mb", "noeviction")
    assert options["dir"] == "/data" and options["protected-mode"] == "no"


def test_default_redis_keeps_its_append_only_file_on_a_claim(releases):
    release = releases["defaults"]
    claim = volume_of_data(release)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert "storageClassName" not in claim["spec"], "the cluster's default StorageClass"
    assert "append-only file (fsync everysec)" in release.notes


def test_without_persistence_the_file_lives_in_an_empty_dir(chart):
    release = render(chart, {"redis": {"bundled": {"persistence": {"enabled": False}}}})
    assert volume_of_data(release) == {"name": "data", "emptyDir": {}}
    assert "volumeClaimTemplates" not in release.workload("redis")["spec"]


def test_durable_release(releases):
    release = releases["durable"]
    redis = release.container("redis")
    options = redis_options(redis)
    assert (options["appendonly"], options["appendfsync"]) == ("yes", "always")
    assert (options["maxmemory"], options["maxmemory-policy"]) == ("3gb", "noeviction")
    assert redis["resources"]["limits"]["memory"] == "4Gi"
    assert options["requirepass"] == "$(REDIS_PASSWORD)"
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth",
                                                                            "key": "redis-password"}
    claim = volume_of_data(release)
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    flags = flags_of(release.container("coordinator")["args"])
    assert (flags["tenant-max-sessions"], flags["tenant-max-requests"]) == ("500", "8")
    assert flags["redis-wait-replicas"] == "0", "one Redis has no replica to wait for"
    assert flags["redis-retry"] == "5"


# --- Sentinel ----------------------------------------------------------------------------------

def test_high_availability_release(releases):
    release = releases["high-availability"]
    values = release.values["redis"]
    sentinel = values["sentinel"]
    statefulset = release.workload("redis")
    pod = release.pod_spec("redis")
    redis, sentinel_container = pod["containers"]
    assert statefulset["spec"]["replicas"] == sentinel["replicas"] == 3
    assert redis["command"] == ["sh", "/scripts/redis-sentinel.sh", "redis"]
    assert sentinel_container["command"] == ["sh", "/scripts/redis-sentinel.sh", "sentinel"]
    assert redis["lifecycle"]["preStop"]["exec"]["command"] == ["sh", "/scripts/redis-sentinel.sh", "pre-stop"]
    assert pod["terminationGracePeriodSeconds"] > sentinel["preStopWaitSeconds"]
    # Every Redis of it is as durable as the bundled one.
    options = redis_options(redis)
    assert (options["appendonly"], options["appendfsync"], options["maxmemory-policy"]) == (
        "yes", "everysec", "noeviction")
    assert "replicaof" not in options, "the script decides master or replica at each start"

    # The script knows every pod by the name the coordinator's URL gives its Sentinel.
    url = env_of(release.container("coordinator"))["REDIS_URL"]["value"]
    scheme, password, hosts, path = split_redis_url(url)
    assert (scheme, password, path) == ("redis+sentinel", "$(REDIS_PASSWORD)", ["specdec", "0"])
    for container in (redis, sentinel_container):
        env = env_of(container)
        assert env["PEERS"]["value"].split() == [host for host, _ in hosts]
        assert env["ANNOUNCE"]["value"] == f"$(POD_NAME).{statefulset['spec']['serviceName']}.{NAMESPACE}.svc"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["REDISCLI_AUTH"]["value"] == "$(REDIS_PASSWORD)"
        assert list(env).index("REDIS_PASSWORD") < list(env).index("REDISCLI_AUTH")
        assert (env["MASTER_NAME"]["value"], env["QUORUM"]["value"]) == ("specdec", "2")
        assert env["SENTINEL_PORT"]["value"] == str(sentinel["port"]) == str(hosts[0][1])
    service = release.service(statefulset["spec"]["serviceName"])
    assert service["spec"]["publishNotReadyAddresses"] is True

    # The script ships in a ConfigMap; a change to it rolls the pods.
    (configmap,) = release.of_kind("ConfigMap")
    text = configmap["data"]["redis-sentinel.sh"]
    assert text == SCRIPT.read_text()
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/scripts"] == hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["scripts"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert volumes["sentinel"] == {"name": "sentinel", "emptyDir": {}}

    # One pod at a time goes, and preferably not two on one node.
    budget = release.one("PodDisruptionBudget", "redis")
    assert budget["spec"]["maxUnavailable"] == 1
    assert matches(budget["spec"]["selector"]["matchLabels"], release.pod_labels("redis"))
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert matches(term["podAffinityTerm"]["labelSelector"]["matchLabels"], release.pod_labels("redis"))

    coordinator = flags_of(release.container("coordinator")["args"])
    assert coordinator["redis-wait-replicas"] == "1" and coordinator["redis-wait-timeout-ms"] == "1000"
    assert coordinator["redis-retry"] == "30", "the coordinator rides out a failover"
    assert "3 pods with Sentinel failover" in release.notes


def test_sentinel_settings_follow_the_values(chart):
    values = {"redis": {"mode": "sentinel",
                        "sentinel": {"replicas": 5, "quorum": 3, "port": 26380, "masterName": "sessions",
                                     "downAfterMilliseconds": 2000, "failoverTimeout": 20000,
                                     "preStopWaitSeconds": 30},
                        "bundled": {"affinity": {"nodeAffinity": {}}}},
              "coordinator": {"redisWaitReplicas": 2, "redisWaitTimeoutMs": 250, "redisRetrySeconds": 12.5}}
    release = render(chart, values)
    env = {k: e.get("value") for k, e in env_of(release.pod_spec("redis")["containers"][1]).items()}
    assert (env["QUORUM"], env["SENTINEL_PORT"], env["MASTER_NAME"]) == ("3", "26380", "sessions")
    assert (env["DOWN_AFTER_MS"], env["FAILOVER_TIMEOUT_MS"], env["PRE_STOP_WAIT_SECONDS"]) == ("2000", "20000", "30")
    assert len(env["PEERS"].split()) == 5 and "REDISCLI_AUTH" not in env
    _, password, hosts, path = split_redis_url(env_of(release.container("coordinator"))["REDIS_URL"]["value"])
    assert password is None and path == ["sessions", "0"]
    assert [port for _, port in hosts] == [26380] * 5
    assert release.pod_spec("redis")["affinity"] == {"nodeAffinity": {}}, "the values' affinity wins"
    flags = flags_of(release.container("coordinator")["args"])
    assert (flags["redis-wait-replicas"], flags["redis-wait-timeout-ms"], flags["redis-retry"]) == ("2", "250", "12.5")


def test_external_sentinel_release(releases):
    release = releases["external-sentinel"]
    url = env_of(release.container("coordinator"))["REDIS_URL"]["value"]
    assert url == ("rediss+sentinel://:$(REDIS_PASSWORD)@sentinel-0.data.svc:26379,sentinel-1.data.svc:26379,"
                   "sentinel-2.data.svc:26379/sessions/3")
    flags = flags_of(release.container("coordinator")["args"])
    assert flags["redis-wait-replicas"] == "1"
    assert flags["redis-tls-ca"] == "/etc/specdec/redis-tls/ca.crt"
    assert not [o for o in release.objects if component_of(o) == "redis"]
    assert "Sentinels sentinel-0.data.svc:26379" in release.notes


@pytest.mark.parametrize("redis, wait", [
    ({}, "0"),
    ({"mode": "external", "external": {"host": "redis.data.svc"}}, "0"),
    ({"mode": "sentinel"}, "1"),
])
def test_commits_wait_for_a_replica_only_where_there_is_one(chart, redis, wait):
    release = render(chart, {"redis": redis})
    assert flags_of(release.container("coordinator")["args"])["redis-wait-replicas"] == wait


def test_tenant_limits_are_passed(chart):
    flags = flags_of(render(chart, {}).container("coordinator")["args"])
    assert (flags["tenant-max-sessions"], flags["tenant-max-requests"]) == ("10000", "0")
    env = env_of(render(chart, {}).container("coordinator"))
    assert not {"SPECDEC_TENANT_MAX_SESSIONS", "SPECDEC_REDIS_WAIT_REPLICAS"} & set(env), "passed as flags"


# --- values refused ----------------------------------------------------------------------------

@pytest.mark.parametrize("values, message", [
    ({"redis": {"bundled": {"appendfsync": "sometimes"}}}, "at '/redis/bundled/appendfsync'"),
    ({"redis": {"bundled": {"appendfsync": False}}}, "at '/redis/bundled/appendfsync'"),  # a bare `no`
    ({"redis": {"bundled": {"maxmemory": "800MB"}}}, "at '/redis/bundled/maxmemory'"),
    ({"redis": {"bundled": {"maxmemory": "0"}}}, "at '/redis/bundled/maxmemory'"),
    ({"redis": {"mode": "cluster"}}, "at '/redis/mode'"),
    ({"redis": {"mode": "sentinel", "sentinel": {"replicas": 2}}},
     "at '/redis/sentinel/replicas': minimum: got 2, want 3"),
    ({"redis": {"mode": "external", "external": {"sentinel": {"hosts": ["sentinel-0"]}}}},
     "at '/redis/external/sentinel/hosts/0'"),
    ({"redis": {"mode": "external", "external": {"sentinel": {"hosts": []}}}},
     "at '/redis/external/host': minLength: got 0, want 1"),
    ({"coordinator": {"tenantMaxSessions": -1}}, "at '/coordinator/tenantMaxSessions': minimum: got -1, want 0"),
    ({"coordinator": {"redisWaitReplicas": -1}}, "at '/coordinator/redisWaitReplicas'"),
])
def test_schema_rejects_bad_redis_values(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


@pytest.mark.parametrize("values, message", [
    ({"redis": {"bundled": {"maxmemory": "1gb"}}}, "redis.bundled.maxmemory (1gb) must be below"),
    ({"redis": {"bundled": {"maxmemory": "2000m", "resources": {"limits": {"memory": "2G"}}}}},
     "redis.bundled.maxmemory (2000m) must be below"),
    ({"coordinator": {"redisWaitReplicas": 1}}, "the bundled Redis (redis.mode bundled) has none"),
    ({"redis": {"mode": "sentinel", "bundled": {"appendonly": False}}},
     "redis.mode sentinel needs redis.bundled.appendonly"),
    ({"redis": {"mode": "sentinel", "sentinel": {"quorum": 4}}},
     "quorum (4) must not exceed redis.sentinel.replicas (3)"),
    ({"redis": {"mode": "sentinel"}, "coordinator": {"redisWaitReplicas": 3}},
     "coordinator.redisWaitReplicas (3) must be below redis.sentinel.replicas (3)"),
])
def test_inconsistent_redis_values_fail_rendering(chart, values, message):
    with pytest.raises(helm.HelmRenderError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


def test_maxmemory_below_the_limit_in_other_units_renders(chart):
    values = {"redis": {"bundled": {"maxmemory": "1999mb", "resources": {"limits": {"memory": "2Gi"}}}}}
    assert redis_options(render(chart, values).container("redis"))["maxmemory"] == "1999mb"


# --- the Sentinel script, for real ---------------------------------------------------------------

PASSWORD = "s3cret"
PODS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # a pod's address: all loopback, one port for all


def free_port() -> int:
    """A port free on every pod address."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((PODS[0], 0))
            port = probe.getsockname()[1]
        try:
            for address in PODS[1:]:
                with socket.socket() as other:
                    other.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on all of " + ", ".join(PODS))


class Pods:
    """Three pods' worth of Redis and Sentinel, started by the chart's script as Kubernetes would
    (the same environment, minus DNS: the pod addresses are IPs)."""

    def __init__(self, root: Path):
        self.root = root
        self.redis_port, self.sentinel_port = free_port(), free_port()
        self.env = {**os.environ, "PEERS": " ".join(PODS), "REDIS_PORT": str(self.redis_port),
                    "SENTINEL_PORT": str(self.sentinel_port), "MASTER_NAME": "specdec", "QUORUM": "2",
                    "DOWN_AFTER_MS": "1000", "FAILOVER_TIMEOUT_MS": "3000", "PRE_STOP_WAIT_SECONDS": "15",
                    "REDIS_PASSWORD": PASSWORD, "REDISCLI_AUTH": PASSWORD}
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}

    def pod_env(self, i: int) -> dict[str, str]:
        sentinel_dir = self.root / f"pod{i}" / "sentinel"
        sentinel_dir.mkdir(parents=True, exist_ok=True)
        return {**self.env, "ANNOUNCE": PODS[i], "LOCAL_HOST": PODS[i], "SENTINEL_DIR": str(sentinel_dir)}

    def start(self, what: str, i: int) -> None:
        data = self.root / f"pod{i}" / "data"
        data.mkdir(parents=True, exist_ok=True)
        args = ["--bind", PODS[i]]
        if what == "redis":  # as the chart passes them
            args += ["--port", str(self.redis_port), "--dir", str(data), "--protected-mode", "no", "--save", "",
                     "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory", "100mb",
                     "--maxmemory-policy", "noeviction", "--requirepass", PASSWORD]
        log = open(self.root / f"pod{i}.{what}.log", "a")
        self.processes[what, i] = subprocess.Popen(["sh", str(SCRIPT), what, *args], env=self.pod_env(i),
                                                   stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def pre_stop(self, i: int) -> None:
        subprocess.run(["sh", str(SCRIPT), "pre-stop"], env=self.pod_env(i), check=True, timeout=30)

    def cli(self, i: int, port: int, *command: str) -> list[str]:
        out = subprocess.run(["redis-cli", "--raw", "-h", PODS[i], "-p", str(port), *command], env=self.env,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.split()

    def role(self, i: int) -> str:
        reply = self.cli(i, self.redis_port, "ROLE")
        return reply[0] if reply else ""

    def masters(self) -> set[str]:
        """The masters the running Sentinels name."""
        return {" ".join(self.cli(i, self.sentinel_port, "SENTINEL", "get-master-addr-by-name", "specdec")[:1])
                for i in range(len(PODS)) if self.running("sentinel", i)}

    def running(self, what: str, i: int) -> bool:
        return (what, i) in self.processes and self.processes[what, i].poll() is None

    def wait(self, condition, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "\n".join(f"{p.name}: ...{p.read_text()[-600:]}" for p in sorted(self.root.glob("*.log")))
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.2)

    def stop(self, what: str, i: int) -> None:
        """SIGTERM, as the kubelet sends it."""
        self.processes[what, i].terminate()
        self.processes[what, i].wait(timeout=15)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


@pytest.fixture
def pods(tmp_path):
    missing = [b for b in ("redis-server", "redis-cli", "timeout", "sha1sum") if not shutil.which(b)]
    if missing:
        pytest.skip(f"not on PATH: {', '.join(missing)}")
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    if tuple(int(x) for x in version.split("v=")[1].split()[0].split(".")[:2]) < (6, 2):
        pytest.skip(f"Sentinel with host names needs Redis 6.2 or later: {version.strip()}")
    started = Pods(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


def test_sentinel_script_hands_over_and_fails_over(pods):
    import redis

    # The first start: no Sentinel answers yet, so the first pod is the master. (The Redis go first
    # here, so that each Sentinel sees both replicas at once instead of at its next 10 s poll.)
    for i in range(len(PODS)):
        pods.start("redis", i)
        pods.wait(lambda: pods.role(i) in ("master", "slave"), f"pod {i}'s Redis")
    assert [pods.role(i) for i in range(3)] == ["master", "slave", "slave"]
    for i in range(len(PODS)):
        pods.start("sentinel", i)
    pods.wait(lambda: pods.masters() == {PODS[0]}, "the Sentinels to agree on the first pod")

    def client(i: int) -> redis.Redis:
        return redis.Redis(host=PODS[i], port=pods.redis_port, password=PASSWORD, socket_timeout=5)

    client(0).set("session", "a")
    pods.wait(lambda: client(0).wait(2, 1000) == 2, "both replicas to acknowledge the write", timeout=60)

    # A rolling update stops the master's pod: its Sentinel (no preStop) goes at once, while the
    # Redis' preStop hands the master role over through the other Sentinels, then Redis stops.
    pods.stop("sentinel", 0)
    pods.pre_stop(0)
    pods.wait(lambda: len(pods.masters()) == 1 and PODS[0] not in pods.masters(),
              "the other Sentinels to agree on the new master")  # they learn it from each other
    (new_master,) = pods.masters()
    assert new_master in PODS[1:]
    pods.stop("redis", 0)
    pods.start("sentinel", 0)  # the pod comes back: a replica of the new master, with the data
    pods.start("redis", 0)
    pods.wait(lambda: pods.role(0) == "slave", "the old master to come back as a replica")
    pods.wait(lambda: client(0).get("session") == b"a", "the old master to resync")

    # The master dies: the Sentinels promote a replica.
    master = PODS.index(new_master)
    client(master).set("session", "b")
    # both replicas acknowledge it (the one that followed the handover may still be resyncing: a
    # loaded machine once took longer than one 5-s WAIT)
    pods.wait(lambda: client(master).wait(2, 1000) == 2, "both replicas to acknowledge the write", timeout=60)
    pods.processes["redis", master].kill()
    pods.wait(lambda: pods.masters() - {new_master, ""} and len(pods.masters()) == 1,
              "the Sentinels to fail over")
    (promoted,) = pods.masters()
    assert client(PODS.index(promoted)).get("session") == b"b"
    pods.start("redis", master)
    pods.wait(lambda: pods.role(master) == "slave", "the dead master to come back as a replica")
