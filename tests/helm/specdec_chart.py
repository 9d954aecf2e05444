"""What the Helm chart tests share: the values sets they render, the rendered objects with lookups
by kind and component, and small helpers. The fixtures are in conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specdec"
EXAMPLES = sorted((ROOT / "helm" / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "sd", "inference"
KUBE_VERSIONS = ("1.25", "1.37")  # the oldest and newest kubernetes-validate 1.37 knows
CRD_KINDS = {"ServiceMonitor"}  # no upstream schema; checked by hand
SPECDEC = ("coordinator", "draft", "target")  # the components that run a specdec server

VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "tp4-pvc": {
        "models": {"volume": {"type": "persistentVolumeClaim", "claimName": "weights"}},
        "target": {"model": "/models/Qwen2.5-72B-Instruct", "tensorParallelSize": 4, "replicas": 2,
                   "gpu": {"enabled": True}, "shmSize": "32Gi"},
        "draft": {"model": "/models/Qwen2.5-0.5B-Instruct", "backend": "transformers",
                  "gpu": {"enabled": True, "count": 1}},
        "coordinator": {"tokenizer": "/models/Qwen2.5-72B-Instruct"},
        "monitoring": {"serviceMonitor": {"enabled": True}},
    },
    "external-redis-auth": {
        "redis": {"mode": "external", "external": {"host": "redis.data.svc", "port": 6380, "db": 2, "tls": True},
                  "auth": {"existingSecret": "redis-auth", "existingSecretPasswordKey": "password"}},
        "models": {"hfToken": {"existingSecret": "hf-token"}},
        "networkPolicy": {"coordinator": {"from": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]}},
    },
    "cpu-draft-autoscaling": {
        "target": {"model": "Qwen/Qwen2.5-7B-Instruct", "gpu": {"enabled": True}},
        "draft": {"model": "/models/qwen2.5-0.5b-instruct-q8_0.gguf", "backend": "llama.cpp", "replicas": 3,
                  "gpu": {"enabled": False},
                  "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                 "whenUnsatisfiable": "ScheduleAnyway"}]},
        "models": {"volume": {"type": "hostPath", "hostPath": "/mnt/models"}},
        "coordinator": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
        "redis": {"auth": {"existingSecret": "redis-auth"}, "bundled": {"persistence": {"enabled": True}}},
    },
    "no-draft": {"draft": {"enabled": False}},
    # Public TLS, mutual TLS to the workers, bearer tokens, Redis over TLS with its own CA, scraping
    # and the dashboard in Grafana's namespace.
    "tls-auth": {
        "tls": {"enabled": True, "public": {"existingSecret": "api-cert", "serverName": "api.example.com"},
                "internal": {"existingSecret": "mesh-cert", "serverName": "workers.specdec.internal"}},
        "auth": {"existingSecret": "api-tokens", "key": "tokens.txt"},
        "health": {"port": 8090},
        "redis": {"mode": "external", "external": {"host": "redis.data.svc", "tls": True,
                                                   "tlsCA": {"existingSecret": "redis-ca", "key": "root.pem"}},
                  "auth": {"existingSecret": "redis-auth"}},
        "monitoring": {"serviceMonitor": {"enabled": True},
                       "grafanaDashboard": {"enabled": True, "namespace": "grafana",
                                            "annotations": {"grafana_folder": "specdec"}}},
        "networkPolicy": {"coordinator": {"from": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]},
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": "monitoring"}}}]},
        "coordinator": {"drainSeconds": 120, "maxConcurrentRequests": 16, "sessionTtlSeconds": 3600},
        "target": {"drainSeconds": 45.5, "terminationGracePeriodSeconds": 90},
        "logFormat": "text",
    },
    # Mutual TLS to the workers only (the public API plaintext, e.g. behind a TLS-terminating
    # ingress), metrics off.
    "tls-internal-metrics-off": {
        "tls": {"enabled": True, "internal": {"existingSecret": "mesh-cert"}},
        "metrics": {"enabled": False},
        "shutdown": {"preStopSleepSeconds": 0, "marginSeconds": 5},
        "draft": {"drainSeconds": 0},
    },
    "loadtest": {
        "loadtest": {"enabled": True, "workers": 4, "users": 64, "spawnRate": 4, "maxNewTokens": 128,
                     "draft": "model", "numSpeculativeTokens": 4, "temperature": 0.7, "turns": 3},
        "networkPolicy": {"coordinator": {"from": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]},
                          "loadtest": {"webFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}},
        "monitoring": {"grafanaDashboard": {"enabled": True}},
    },
    "loadtest-headless": {
        "loadtest": {"enabled": True, "headless": True, "workers": 2, "runTime": "10m", "users": 8,
                     "spawnRate": 0.5, "locustfile": "/mnt/locust/custom.py", "extraArgs": ["--only-summary"],
                     "image": {"repository": "registry.example.com/specdec-load", "tag": "1.2"}},
        "tls": {"enabled": True, "internal": {"existingSecret": "mesh-cert"}},
    },
    # The strongest durability of one Redis: every write on disk before Redis answers, a big volume
    # on a named class, more memory; tenants with limits of their own.
    "durable": {
        "redis": {"bundled": {"appendfsync": "always", "maxmemory": "3gb",
                              "persistence": {"size": "10Gi", "storageClass": "fast-ssd"},
                              "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                                            "limits": {"memory": "4Gi"}}},
                  "auth": {"existingSecret": "redis-auth"}},
        "auth": {"existingSecret": "api-tokens"},
        "coordinator": {"tenantMaxSessions": 500, "tenantMaxRequests": 8},
    },
    # Redis with Sentinel failover (3 pods), a password, and two coordinators.
    "high-availability": {
        "redis": {"mode": "sentinel", "auth": {"existingSecret": "redis-auth"}},
        "coordinator": {"replicas": 2},
    },
    # Your own Sentinels, over TLS with their own CA.
    "external-sentinel": {
        "redis": {"mode": "external",
                  "external": {"db": 3, "tls": True, "tlsCA": {"existingSecret": "redis-ca"},
                               "sentinel": {"hosts": ["sentinel-0.data.svc:26379", "sentinel-1.data.svc:26379",
                                                      "sentinel-2.data.svc:26379"],
                                            "masterName": "sessions"}},
                  "auth": {"existingSecret": "redis-auth", "existingSecretPasswordKey": "password"}},
    },
    # The KV tier: the bundled LRU Redis, sized; and your own.
    "kv-store": {
        "kvStore": {"enabled": True, "chunkTokens": 128, "compression": "zlib",
                    "bundled": {"maxmemory": "6gb", "resources": {"limits": {"memory": "8Gi"}}}},
        "target": {"tensorParallelSize": 2, "gpu": {"enabled": True}},
    },
    "kv-store-external": {"kvStore": {"enabled": True, "url": "rediss://kv.cache.svc:6380/1"},
                          "draft": {"enabled": False}},
    **{f"example:{p.stem}": yaml.safe_load(p.read_text()) for p in EXAMPLES},
}

# The sets of the issue "Sessions that survive Redis faults": their tests carry the durability marker.
DURABILITY_SETS = ("durable", "high-availability", "external-sentinel")
SET_NAMES = [pytest.param(name, marks=pytest.mark.durability) if name in DURABILITY_SETS else name
             for name in VALUE_SETS]


class Release:
    """The objects one `helm template` produces, with lookups by kind and component."""

    def __init__(self, values: dict, manifests: dict[str, str]):
        self.values = values
        self.notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), "")
        self.objects = [o for path, text in manifests.items() if not path.endswith("NOTES.txt")
                        for o in yaml.safe_load_all(text) if o]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, component: str) -> dict:
        found = [o for o in self.of_kind(kind) if component_of(o) == component]
        assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")

    def pods(self) -> list[tuple[str, dict, dict]]:
        """(component, labels, pod spec) of every pod the release can create."""
        pods = [(component_of(w), w["spec"]["template"]["metadata"]["labels"], w["spec"]["template"]["spec"])
                for w in self.workloads()]
        return pods + [(component_of(p), p["metadata"]["labels"], p["spec"]) for p in self.of_kind("Pod")]

    def workload(self, component: str) -> dict:
        found = [w for w in self.workloads() if component_of(w) == component]
        assert len(found) == 1, f"expected one workload for {component}, found {len(found)}"
        return found[0]

    def pod_spec(self, component: str) -> dict:
        return self.workload(component)["spec"]["template"]["spec"]

    def pod_labels(self, component: str) -> dict:
        return self.workload(component)["spec"]["template"]["metadata"]["labels"]

    def container(self, component: str) -> dict:
        return self.pod_spec(component)["containers"][0]

    def pod_ports(self, component: str) -> dict[str, int]:
        """{name: port} of every container of the component's pods."""
        return {p["name"]: p["containerPort"] for c in self.pod_spec(component)["containers"]
                for p in c.get("ports", [])}

    def components(self) -> list[str]:
        """The specdec server components this release runs."""
        return [c for c in SPECDEC if c != "draft" or self.values["draft"]["enabled"]]

    def service(self, name: str) -> dict:
        services = [s for s in self.of_kind("Service") if s["metadata"]["name"] == name]
        assert len(services) == 1, f"{name} is not a Service of the release"
        return services[0]


def component_of(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def flags_of(args: list[str]) -> dict[str, str]:
    """--name=value arguments as {name: value} (each flag at most once)."""
    flags: dict[str, str] = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            assert name not in flags, f"--{name} given twice: {args}"
            flags[name] = value
    return flags


def port_named(container: dict, name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p["name"] == name), None)


def gpu_requested(container: dict) -> int:
    return int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


def service_for(release: Release, host: str, port: int) -> dict:
    service = release.service(host)
    assert port in [p["port"] for p in service["spec"]["ports"]], f"{host} does not serve port {port}"
    return service


def server_tls(values: dict, component: str) -> bool:
    """Whether the component's gRPC port speaks TLS under these values."""
    tls = values["tls"]
    part = tls["public"] if component == "coordinator" else tls["internal"]
    return bool(tls["enabled"] and part["existingSecret"])


def split_redis_url(url: str) -> tuple[str, str | None, list[tuple[str, int]], list[str]]:
    """(scheme, password, [(host, port)], path parts) of a redis://, rediss:// or
    redis+sentinel://[:password@]host:port,host:port/master/db URL (urlsplit cannot take the list)."""
    scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        password = userinfo.partition(":")[2]
    hosts = [(host, int(port)) for host, _, port in (h.rpartition(":") for h in netloc.split(","))]
    return scheme, password, hosts, path.split("/")
