"""The chart's TLS, bearer tokens, metrics, Grafana dashboard, graceful shutdown and locust load test,
checked on the rendered objects of every values set in specdec_chart.VALUE_SETS (the lint and the
Kubernetes-schema checks of those sets are in test_chart.py):

- every certificate, key, CA and token path passed to a service is a file of a Secret mounted
  read-only in that container, from the Secret and key the values name;
- with TLS the probes move to the plaintext health port;
- metrics ports are wired from the flag through the container and Service ports to the
  ServiceMonitor and the NetworkPolicies;
- the dashboard is valid JSON that queries exactly the metrics specdec_core/metrics.py defines;
- terminationGracePeriodSeconds outlasts preStop + drain;
- the locust master and workers find each other and the coordinator, and locust itself accepts
  the options the chart passes (in a subprocess: importing locust monkey-patches the process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import PurePosixPath

import pytest

import helm_python as helm
from specdec_chart import (CHART, NAMESPACE, RELEASE, ROOT, SET_NAMES, SPECDEC, VALUE_SETS, Release, component_of,
                           env_of, flags_of, matches, port_named, server_tls, service_for)

pytestmark = pytest.mark.helm

LOADTEST_SETS = [name for name, values in VALUE_SETS.items() if values.get("loadtest", {}).get("enabled")]
METRICS_SOURCE = ROOT / "specdec_core" / "metrics.py"
LOCUSTFILE = ROOT / "specdec" / "locustfile.py"

# Flags whose value is a file the chart mounts from a Secret: flag -> (values path of the Secret's
# name, values path of its key or the fixed key).
PUBLIC = ("tls.public.existingSecret",)
INTERNAL = ("tls.internal.existingSecret",)
SECRET_FILES = {
    "coordinator": {
        "tls-cert": (*PUBLIC, "tls.crt"), "tls-key": (*PUBLIC, "tls.key"),
        "worker-tls-cert": (*INTERNAL, "tls.crt"), "worker-tls-key": (*INTERNAL, "tls.key"),
        "worker-tls-ca": (*INTERNAL, "ca.crt"),
        "auth-tokens-file": ("auth.existingSecret", "=auth.key"),
        "redis-tls-ca": ("redis.external.tlsCA.existingSecret", "=redis.external.tlsCA.key"),
    },
    "worker": {"tls-cert": (*INTERNAL, "tls.crt"), "tls-key": (*INTERNAL, "tls.key"),
               "tls-client-ca": (*INTERNAL, "ca.crt")},
}


def value(values: dict, path: str):
    for part in path.split("."):
        values = values[part]
    return values


def secret_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) behind a file path in the container; fails unless it is a read-only mount
    of a Secret volume whose items project exactly that file."""
    file = PurePosixPath(path)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if root not in file.parents:
            continue
        assert mount.get("readOnly") is True, f"{path}: {root} is not mounted read-only"
        secret = volumes[mount["name"]].get("secret")
        assert secret is not None, f"{path}: {root} is not a Secret volume"
        keys = {item["path"]: item["key"] for item in secret["items"]}
        relative = str(file.relative_to(root))
        assert relative in keys, f"{path}: {secret['secretName']} projects only {sorted(keys)}"
        return secret["secretName"], keys[relative]
    raise AssertionError(f"{path} is not under any volume mount of {container['name']}")


def expected_secret_flags(values: dict, component: str) -> dict[str, tuple[str, str]]:
    """flag -> (Secret, key) the component must get under these values."""
    tls, want = values["tls"], {}
    table = SECRET_FILES["coordinator" if component == "coordinator" else "worker"]
    for flag, (secret_path, key) in table.items():
        secret = value(values, secret_path)
        if not secret:
            continue
        if secret_path.startswith("tls.") and not tls["enabled"]:
            continue
        redis = values["redis"]
        if flag == "redis-tls-ca" and not (redis["mode"] == "external" and redis["external"]["tls"]):
            continue
        want[flag] = (secret, value(values, key[1:]) if key.startswith("=") else key)
    return want


@pytest.mark.parametrize("name", SET_NAMES)
def test_secret_file_flags_point_at_mounted_secret_files(releases, name):
    release = releases[name]
    for component in release.components():
        pod, container = release.pod_spec(component), release.container(component)
        flags = flags_of(container["args"])
        table = SECRET_FILES["coordinator" if component == "coordinator" else "worker"]
        got = {flag: secret_file(pod, container, flags[flag]) for flag in table if flag in flags}
        assert got == expected_secret_flags(release.values, component), component
        # No Secret is mounted that no flag reads (a worker never gets the public key or the tokens).
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        used = {m["name"] for m in container["volumeMounts"]
                if any(PurePosixPath(flags[f]).parent == PurePosixPath(m["mountPath"]) for f in got)}
        for gateway in (c for c in pod["containers"] if c["name"] == "openai"):  # HTTPS, and the coordinator's CA
            files = [PurePosixPath(v).parent for f, v in flags_of(gateway["args"]).items()
                     if f in ("tls-cert", "tls-key", "coordinator-tls-ca")]
            used |= {m["name"] for m in gateway.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) in files}
        assert secrets == used, f"{component}: mounted but unused: {secrets - used}"
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440


@pytest.mark.parametrize("name", SET_NAMES)
def test_tls_and_health_port_wiring(releases, name):
    release = releases[name]
    values = release.values
    for component in release.components():
        container = release.container(component)
        flags = flags_of(container["args"])
        health = values["health"]["port"]  # probes always use the plaintext health port
        assert flags["health-port"] == str(health) and port_named(container, "health") == health
        probes = ("startupProbe", "readinessProbe", "livenessProbe")
        assert {container[p]["grpc"]["port"] for p in probes} == {health}
        # The health port is plaintext and for the kubelet only: no Service exposes it.
        for service in release.of_kind("Service"):
            assert "health" not in {p["targetPort"] for p in service["spec"]["ports"]}
        if server_tls(values, component):
            # Workers demand the coordinator's client certificate (mutual TLS); the public API does not.
            assert ("tls-client-ca" in flags) == (component != "coordinator")
        else:
            assert not {"tls-cert", "tls-key", "tls-client-ca"} & set(flags)
    coordinator = flags_of(release.container("coordinator")["args"])
    if server_tls(values, "target"):
        # Workers are dialled by pod IP (DNS discovery): the name checked in their certificate.
        assert coordinator["worker-tls-server-name"] == values["tls"]["internal"]["serverName"]
    else:
        assert not [f for f in coordinator if f.startswith("worker-tls")]


def test_tls_auth_release_wires_everything(releases):
    release = releases["tls-auth"]
    flags = flags_of(release.container("coordinator")["args"])
    assert flags["auth-tokens-file"] == "/etc/specdec/auth/tokens"
    assert flags["redis-tls-ca"] == "/etc/specdec/redis-tls/ca.crt"
    assert flags["worker-tls-server-name"] == "workers.specdec.internal"
    assert flags["tls-cert"].startswith("/etc/specdec/tls/public/")
    assert flags["worker-tls-cert"] == flags_of(release.container("target")["args"])["tls-cert"]
    assert env_of(release.container("coordinator"))["REDIS_URL"]["value"].startswith("rediss://")
    for component in SPECDEC:
        assert port_named(release.container(component), "health") == 8090
    assert "Bearer" in release.notes and "-plaintext" not in release.notes
    # Mutual TLS to the workers without public TLS: the coordinator's own port stays plaintext.
    internal_only = releases["tls-internal-metrics-off"]
    coordinator = flags_of(internal_only.container("coordinator")["args"])
    assert "tls-cert" not in coordinator and coordinator["worker-tls-server-name"] == "specdec-internal"
    assert internal_only.container("coordinator")["startupProbe"]["grpc"]["port"] == internal_only.values["health"]["port"]


@pytest.mark.parametrize("name", SET_NAMES)
def test_server_flags_metrics_and_logging(releases, name):
    release = releases[name]
    values = release.values
    metrics = values["metrics"]
    for component in release.components():
        container = release.container(component)
        flags = flags_of(container["args"])
        assert float(flags["drain-seconds"]) == values[component]["drainSeconds"]
        env = env_of(container)
        assert env["SPECDEC_LOG_FORMAT"]["value"] == values["logFormat"]
        assert "SPECDEC_METRICS_PORT" not in env, "the port is passed as --metrics-port"
        service = release.one("Service", component)
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        if metrics["enabled"]:
            assert flags["metrics-port"] == str(metrics["port"])
            assert port_named(container, "metrics") == metrics["port"]
            assert service_ports["metrics"]["targetPort"] == "metrics"
        else:
            assert "metrics-port" not in flags and port_named(container, "metrics") is None
            assert "metrics" not in service_ports
        ports = [p["containerPort"] for p in container["ports"]]
        assert len(ports) == len(set(ports)), f"{component}: a port twice: {ports}"
    coordinator = flags_of(release.container("coordinator")["args"])
    assert coordinator["max-concurrent-requests"] == str(values["coordinator"]["maxConcurrentRequests"])
    assert coordinator["session-ttl"] == str(values["coordinator"]["sessionTtlSeconds"])
    assert coordinator["tenant-max-sessions"] == str(values["coordinator"]["tenantMaxSessions"])
    assert coordinator["tenant-max-requests"] == str(values["coordinator"]["tenantMaxRequests"])


@pytest.mark.parametrize("name", SET_NAMES)
def test_metrics_reachable_from_the_monitoring_peers_only(releases, name):
    release = releases[name]
    values = release.values
    if not values["networkPolicy"]["enabled"]:
        return
    for component in release.components():
        policy = release.one("NetworkPolicy", component)
        metric_rules = [r for r in policy["spec"]["ingress"]
                        if r["ports"] == [{"port": values["metrics"]["port"], "protocol": "TCP"}]]
        if values["metrics"]["enabled"]:
            assert [r["from"] for r in metric_rules] == [values["networkPolicy"]["metricsFrom"]], component
        else:
            assert not metric_rules, component
        health = values["health"]["port"]
        assert all(p["port"] != health for r in policy["spec"]["ingress"] for p in r["ports"]), \
            "the kubelet probes the health port; nothing else should reach it"


@pytest.mark.parametrize("name", SET_NAMES)
def test_service_monitor_follows_metrics(releases, name):
    release = releases[name]
    monitors = release.of_kind("ServiceMonitor")
    if not release.values["monitoring"]["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    (monitor,) = monitors
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    selector = monitor["spec"]["selector"]
    scraped = [s for s in release.of_kind("Service") if matches(selector["matchLabels"], s["metadata"]["labels"])
               and component_of(s) in selector["matchExpressions"][0]["values"]]
    assert {component_of(s) for s in scraped} == set(release.components())
    assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in scraped)


@pytest.mark.parametrize("name", SET_NAMES)
def test_termination_grace_outlasts_prestop_and_drain(releases, name):
    release = releases[name]
    values = release.values
    sleep = values["shutdown"]["preStopSleepSeconds"]
    for component in release.components():
        pod, container = release.pod_spec(component), release.container(component)
        drain = float(flags_of(container["args"])["drain-seconds"])
        grace = pod["terminationGracePeriodSeconds"]
        assert grace > sleep + drain, f"{component}: {grace} s grace < {sleep} s preStop + {drain} s drain"
        if values[component].get("terminationGracePeriodSeconds") is None:
            assert grace >= sleep + drain + values["shutdown"]["marginSeconds"]
        else:
            assert grace == values[component]["terminationGracePeriodSeconds"]
        if sleep:
            assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(sleep)]
        else:
            assert "lifecycle" not in container


# --- Grafana dashboard -------------------------------------------------------------------------

def defined_metrics() -> dict[str, str]:
    """{name: Counter|Gauge|Histogram} from specdec_core/metrics.py."""
    found = re.findall(r'\b(Counter|Gauge|Histogram)\(\s*"(specdec_\w+)"', METRICS_SOURCE.read_text())
    assert found, f"no metrics found in {METRICS_SOURCE}"
    return {name: kind for kind, name in found}


def panel_exprs(dashboard: dict) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in dashboard["panels"] if p["type"] != "row"}


def test_dashboard_configmap_carries_the_dashboard(releases):
    release = releases["tls-auth"]
    (configmap,) = release.of_kind("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "grafana"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "specdec"}
    shipped = json.loads((CHART / "dashboards" / "specdec.json").read_text())
    assert json.loads(configmap["data"]["specdec.json"]) == shipped
    (default_ns,) = releases["loadtest"].of_kind("ConfigMap")
    assert default_ns["metadata"]["namespace"] == NAMESPACE
    assert not releases["defaults"].of_kind("ConfigMap"), "the dashboard is opt-in"


def test_dashboard_queries_exactly_the_services_metrics():
    dashboard = json.loads((CHART / "dashboards" / "specdec.json").read_text())
    defined = defined_metrics()
    exprs = [e for es in panel_exprs(dashboard).values() for e in es]
    used = set()
    for expr in exprs:
        for name in re.findall(r"\bspecdec_\w+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in defined, f"{name} is not a metric of specdec_core/metrics.py"
            if name != base:
                assert defined[base] == "Histogram", f"{name}: {base} is a {defined[base]}"
            else:
                assert defined[base] != "Histogram", f"{name}: use {name}_bucket/_sum/_count"
            used.add(base)
    assert used == set(defined), f"metrics without a panel: {set(defined) - used}"
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
        assert 'namespace=~"$namespace"' in expr, f"not filtered by the dashboard's variables: {expr}"


def test_dashboard_has_the_panels_operators_need():
    dashboard = json.loads((CHART / "dashboards" / "specdec.json").read_text())
    panels = panel_exprs(dashboard)

    def panel(title_part: str) -> list[str]:
        found = [exprs for title, exprs in panels.items() if title_part.lower() in title.lower()]
        assert found, f"no panel titled like {title_part!r}"
        return [e for exprs in found for e in exprs]

    assert any("by (method, code)" in e and "specdec_requests_total" in e for e in panel("request rate"))
    assert any("rate(specdec_generated_tokens_total" in e for e in panel("tokens/s"))
    assert any(re.search(r"specdec_accepted_tokens_total.*\) / sum\(rate\(specdec_draft_tokens_total", e)
               for e in panel("acceptance rate"))
    assert any("by (position)" in e for e in panel("by position"))
    latency = panel("round latency")
    assert {q for e in latency for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} == {"0.5", "0.99"}
    assert all("by (le, phase)" in e for e in latency)
    assert any("specdec_verify_batch_size_bucket" in e for e in panel("verify batch"))
    assert any("specdec_requests_in_flight" in e for e in panel("in-flight"))
    for what in ("tokens", "sessions", "evictions"):
        assert any("by (role)" in e for e in panel(f"cache {what} by role"))
    # Grafana-loadable: a Prometheus datasource variable, unique ids, panels inside the 24-column grid.
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"


# --- locust ------------------------------------------------------------------------------------

def locust_pods(release: Release) -> dict[str, tuple[dict, dict]]:
    return {role: (release.pod_spec(f"loadtest-{role}"), release.container(f"loadtest-{role}"))
            for role in ("master", "worker")}


@pytest.mark.parametrize("name", LOADTEST_SETS)
def test_locust_master_and_workers_target_the_coordinator(releases, name):
    release = releases[name]
    lt = release.values["loadtest"]
    pods = locust_pods(release)
    master_flags = flags_of(pods["master"][1]["args"])
    worker_flags = flags_of(pods["worker"][1]["args"])
    assert "master" in master_flags and "worker" in worker_flags
    for flags in (master_flags, worker_flags):
        host, port = flags["host"].rsplit(":", 1)
        assert component_of(service_for(release, host, int(port))) == "coordinator"
        assert int(port) == release.values["coordinator"]["port"]
        assert flags["max-new-tokens"] == str(lt["maxNewTokens"]) and flags["draft"] == lt["draft"]
        assert flags["turns"] == str(lt["turns"])
        assert flags.get("num-speculative-tokens") == (None if lt.get("numSpeculativeTokens") is None
                                                         else str(lt["numSpeculativeTokens"]))
        assert flags.get("temperature") == (None if lt.get("temperature") is None else str(lt["temperature"]))
    # Workers reach the master through its Service.
    master_service = release.service(worker_flags["master-host"])
    assert matches(master_service["spec"]["selector"], release.pod_labels("loadtest-master"))
    target = {p["port"]: p["targetPort"] for p in master_service["spec"]["ports"]}
    assert target[int(worker_flags["master-port"])] == "master"
    assert port_named(pods["master"][1], "master") == int(master_flags["master-bind-port"]) == lt["masterPort"]
    assert master_flags["users"] == str(lt["users"]) and float(master_flags["spawn-rate"]) == lt["spawnRate"]
    assert master_flags.get("run-time") == (lt["runTime"] or None)
    if lt["headless"]:
        assert "headless" in master_flags and master_flags["expect-workers"] == str(lt["workers"])
        assert port_named(pods["master"][1], "web") is None
    else:
        assert "headless" not in master_flags and port_named(pods["master"][1], "web") == lt["webPort"]
        assert master_flags["web-port"] == str(lt["webPort"])
        assert pods["master"][1]["readinessProbe"]["httpGet"]["port"] == "web"
    assert release.workload("loadtest-worker")["spec"]["replicas"] == lt["workers"]
    assert release.workload("loadtest-master")["spec"]["replicas"] == 1
    for pod, container in pods.values():
        if lt["image"]["repository"]:
            assert container["image"] == f"{lt['image']['repository']}:{lt['image']['tag']}"
        else:
            assert container["image"] == release.container("coordinator")["image"]
        assert container["command"][:2] == ["sh", "-c"] and 'locust -f "$locustfile" "$@"' in container["command"][2]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["enableServiceLinks"] is False
        env = {k: e.get("value") for k, e in env_of(container).items()}
        assert env.get("SPECDEC_LOCUSTFILE") == (lt["locustfile"] or None)


@pytest.mark.parametrize("name", LOADTEST_SETS)
def test_locust_network_policies(releases, name):
    release = releases[name]
    pods = release.pods()
    coordinator = release.one("NetworkPolicy", "coordinator")
    api_rule = coordinator["spec"]["ingress"][0]
    if "from" in api_rule:  # restricted API: the locust workers are let in
        peers = [p["podSelector"]["matchLabels"] for p in api_rule["from"] if "podSelector" in p]
        assert any(matches(s, labels) for s in peers for c, labels, _ in pods if c == "loadtest-worker")
    master = release.one("NetworkPolicy", "loadtest-master")
    lt = release.values["loadtest"]
    rules = {r["ports"][0]["port"]: r for r in master["spec"]["ingress"]}
    (peer,) = rules[lt["masterPort"]]["from"]
    assert {c for c, labels, _ in pods if matches(peer["podSelector"]["matchLabels"], labels)} == {"loadtest-worker"}
    web_from = release.values["networkPolicy"]["loadtest"]["webFrom"]
    assert rules[lt["webPort"]].get("from", []) == web_from
    assert release.one("NetworkPolicy", "loadtest-worker")["spec"]["ingress"] == []


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory):
    """A PATH folder whose `locust` prints its arguments and whose `sleep` returns at once, ahead of
    the test's Python (so the scripts' `python -c 'import specdec'` finds this checkout)."""
    folder = tmp_path_factory.mktemp("bin")
    (folder / "locust").write_text('#!/bin/sh\nprintf "ARG %s\\n" "$@"\n')
    (folder / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("locust", "sleep"):
        (folder / tool).chmod(0o755)
    return folder


@pytest.mark.parametrize("name", LOADTEST_SETS)
def test_locust_scripts_find_the_locustfile_and_pass_the_arguments(releases, name, fake_bin):
    release = releases[name]
    for role, (_, container) in locust_pods(release).items():
        env = {**os.environ, "PATH": f"{fake_bin}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               "PYTHONPATH": str(ROOT)}
        env.pop("SPECDEC_LOCUSTFILE", None)
        env.update({k: e["value"] for k, e in env_of(container).items() if k != "HOME"})
        run = subprocess.run(container["command"] + container["args"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        lines = [line[4:] for line in run.stdout.splitlines() if line.startswith("ARG ")]
        locustfile = release.values["loadtest"]["locustfile"] or str(LOCUSTFILE)
        assert lines == ["-f", locustfile, *container["args"]], f"{role}: {run.stdout}"
        if release.values["loadtest"]["headless"]:
            assert "idle until deleted" in run.stdout


def test_locust_accepts_the_options_the_chart_passes(releases):
    """Parse every master and worker command line with locust's own parser, the locustfile's options
    included, in a subprocess (importing locust monkey-patches the standard library)."""
    argvs = [release.container(f"loadtest-{role}")["args"] for name in LOADTEST_SETS
             for release in [releases[name]] for role in ("master", "worker")]
    code = (
        "import json, sys\n"
        "import specdec.locustfile\n"
        "from locust.argument_parser import get_parser\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    o = get_parser(default_config_files=[]).parse_args(argv)\n"
        "    out.append({'host': o.host, 'master': o.master, 'worker': o.worker, 'max_new_tokens': o.max_new_tokens,\n"
        "                'turns': o.turns, 'headless': o.headless, 'num_users': o.num_users})\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    for argv, options in zip(argvs, parsed):
        flags = flags_of(argv)
        assert options["host"] == flags["host"] and options["max_new_tokens"] == int(flags["max-new-tokens"])
        assert options["master"] == ("master" in flags) and options["worker"] == ("worker" in flags)
        assert options["headless"] == ("headless" in flags)
        if "users" in flags:
            assert options["num_users"] == int(flags["users"])


# --- values that must be refused -----------------------------------------------------------------

@pytest.mark.parametrize("values, error, message", [
    ({"tls": {"enabled": True}}, helm.HelmRenderError, "tls.enabled needs tls.public.existingSecret"),
    ({"loadtest": {"enabled": True}, "auth": {"existingSecret": "tokens"}}, helm.HelmRenderError,
     "the locust user sends no bearer token"),
    ({"loadtest": {"enabled": True}, "tls": {"enabled": True, "public": {"existingSecret": "cert"}}},
     helm.HelmRenderError, "the locust user speaks plaintext gRPC"),
    ({"metrics": {"enabled": False}, "monitoring": {"serviceMonitor": {"enabled": True}}}, helm.HelmRenderError,
     "monitoring.serviceMonitor.enabled needs metrics.enabled"),
    ({"coordinator": {"drainSeconds": 60, "terminationGracePeriodSeconds": 65}}, helm.HelmRenderError,
     "coordinator.terminationGracePeriodSeconds (65) must exceed shutdown.preStopSleepSeconds + "
     "coordinator.drainSeconds (65)"),
    ({"tls": {"enabled": True, "internal": {"existingSecret": "mesh"}}, "health": {"port": 50052}},
     helm.HelmRenderError, "target: its gRPC, metrics and health ports must differ"),
    ({"metrics": {"port": 50051}}, helm.HelmRenderError, "draft: its gRPC, metrics and health ports must differ"),
    ({"logFormat": "xml"}, helm.HelmValuesError, "at '/logFormat'"),
    ({"loadtest": {"runTime": "ten minutes"}}, helm.HelmValuesError, "at '/loadtest/runTime'"),
    ({"loadtest": {"enabled": True, "headless": True, "workers": 0}}, helm.HelmValuesError,
     "at '/loadtest/workers': minimum: got 0, want 1"),
    ({"auth": {"existingSecret": "Bad_Name"}}, helm.HelmValuesError, "at '/auth/existingSecret'"),
    ({"tls": {"internal": {"serverName": ""}}}, helm.HelmValuesError, "at '/tls/internal/serverName'"),
    ({"target": {"drainSeconds": -1}}, helm.HelmValuesError, "at '/target/drainSeconds'"),
])
def test_inconsistent_security_and_loadtest_values_are_refused(chart, values, error, message):
    with pytest.raises(error) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)
