"""The Helm chart, rendered offline with the Helm v4 engine (helm-python-sdk) for several values sets:
lint --strict clean, every object valid against the Kubernetes schemas of the oldest and newest
versions we support (kubernetes-validate, strict), and the wiring that matters checked directly:
GPU counts, torchrun ranks, probes, NetworkPolicy selectors, the coordinator's addresses, and the
values schema rejecting bad input with a clear message. The values sets and helpers are in
specdec_chart.py, the fixtures in conftest.py; TLS, tokens, metrics, the dashboard, shutdown and the
locust load test are checked in test_chart_security.py."""

from __future__ import annotations

import pytest

import helm_python as helm
import kubernetes_validate
from specdec_chart import (CHART, CRD_KINDS, KUBE_VERSIONS, NAMESPACE, RELEASE, SET_NAMES, SPECDEC, VALUE_SETS,
                           Release, component_of, env_of, flags_of, gpu_requested, matches, port_named, server_tls,
                           service_for, split_redis_url)

pytestmark = pytest.mark.helm


@pytest.mark.parametrize("name", SET_NAMES)
def test_lint_strict_is_clean(name):
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.25.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", SET_NAMES)
def test_objects_valid_against_kubernetes_schemas(releases, name, version):
    errors = []
    for obj in releases[name].objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {err.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", SET_NAMES)
def test_target_gpus_and_ranks_follow_tensor_parallel_size(releases, name):
    release = releases[name]
    target = release.values["target"]
    tp = target["tensorParallelSize"]
    pod = release.workload("target")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert gpu_requested(container) == (tp if target["gpu"]["enabled"] else 0)
    requests = container["resources"].get("requests", {})
    assert int(requests.get("nvidia.com/gpu", gpu_requested(container))) == gpu_requested(container)
    command, args = container["command"], container["args"]
    if tp > 1:
        assert command[0] == "torchrun" and command[-2:] == ["-m", "target_service"]
        assert f"--nproc-per-node={tp}" in command
        assert f"--tensor-parallel-size={tp}" in args
    else:
        assert command == ["python", "-m", "target_service"]
    assert f"--device={'cuda' if target['gpu']['enabled'] else 'cpu'}" in args
    tolerated = {t["key"] for t in pod.get("tolerations", [])}
    assert ("nvidia.com/gpu" in tolerated) == target["gpu"]["enabled"]
    shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert [v["emptyDir"]["medium"] for v in pod["volumes"] if v["name"] in shm] == ["Memory"]


@pytest.mark.parametrize("name", SET_NAMES)
def test_every_container_has_probes(releases, name):
    release = releases[name]
    for workload in release.workloads():
        component = component_of(workload)
        if component not in (*SPECDEC, "redis", "kvstore"):
            continue  # the locust pods: see test_chart_security.py
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{workload['metadata']['name']}/{container['name']}: no {probe}"
            if component in ("redis", "kvstore"):
                continue
            if container["name"] == "openai":  # HTTP: see test_openai_gateway_beside_each_coordinator
                continue
            # Probes use the plaintext health port (threads of its own; Kubernetes' gRPC probes
            # speak no TLS); liveness asks "liveness", which a dependency outage does not turn off.
            probed_port = port_named(container, "health")
            assert probed_port is not None, f"{component}: no health container port"
            for probe in ("startupProbe", "readinessProbe"):
                assert container[probe]["grpc"] == {"port": probed_port}, f"{component} {probe}"
            assert container["livenessProbe"]["grpc"] == {"port": probed_port, "service": "liveness"}
            startup = container["startupProbe"]
            assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "model loading is slow"


@pytest.mark.parametrize("name", SET_NAMES)
def test_no_service_links_in_the_environment(releases, name):
    # A Service named specdec-coordinator would otherwise set SPECDEC_COORDINATOR_PORT=tcp://... in
    # every pod, next to the SPECDEC_* settings the services read.
    for component, _, spec in releases[name].pods():
        assert spec["enableServiceLinks"] is False, component


@pytest.mark.parametrize("name", SET_NAMES)
def test_network_policies_guard_the_right_pods(releases, name):
    release = releases[name]
    policies = release.of_kind("NetworkPolicy")
    guarded = {component_of(p) for p in policies}
    expected = {"coordinator", "target"}
    expected |= {"draft"} if release.values["draft"]["enabled"] else set()
    redis_mode = release.values["redis"]["mode"]
    expected |= {"redis"} if redis_mode != "external" else set()
    expected |= {"loadtest-master", "loadtest-worker"} if release.values["loadtest"]["enabled"] else set()
    kv = release.values["kvStore"]
    expected |= {"kvstore"} if kv["enabled"] and not kv["url"] else set()
    assert guarded == expected
    pods = release.pods()
    for policy in policies:
        component = component_of(policy)
        selected = [c for c, labels, _ in pods if matches(policy["spec"]["podSelector"]["matchLabels"], labels)]
        assert selected == [component], f"{policy['metadata']['name']} selects {selected}"
        if component.startswith("loadtest"):
            continue  # see test_chart_security.py
        if component == "redis":  # replication and the Sentinels' gossip run between the Redis pods
            ports = [release.pod_ports("redis")[n] for n in ("redis", "sentinel")[:1 + (redis_mode == "sentinel")]]
            peers = {"coordinator", "redis"} if redis_mode == "sentinel" else {"coordinator"}
        elif component == "kvstore":  # the workers' KV tier
            ports, peers = [release.pod_ports("kvstore")["redis"]], {"draft", "target"} & {c for c, _, _ in pods}
        else:
            ports, peers = [port_named(release.container(component), "grpc")], {"coordinator"}
        if component == "coordinator" and release.values["openai"]["enabled"]:
            ports.append(release.pod_ports("coordinator")["http"])  # the OpenAI-compatible API
        rule = policy["spec"]["ingress"][0]
        assert rule["ports"] == [{"port": port, "protocol": "TCP"} for port in ports]
        if component == "coordinator":
            allowed = release.values["networkPolicy"]["coordinator"]["from"]
            if not allowed:
                assert "from" not in rule, "the public API is open when networkPolicy.coordinator.from is empty"
            else:
                peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
                assert any(matches(s, labels) for s in peers for c, labels, _ in pods if c == "test")
            continue
        reached = set()
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}
            reached |= {c for c, labels, _ in pods if matches(peer["podSelector"]["matchLabels"], labels)}
        assert reached == peers, f"{component} is reached from {reached}"


@pytest.mark.parametrize("name", SET_NAMES)
def test_coordinator_points_at_the_rendered_services(releases, name):
    release = releases[name]
    env = env_of(release.container("coordinator"))
    dials = {"target": env["SPECDEC_TARGET_ADDRESS"]["value"], "draft": env["SPECDEC_DRAFT_ADDRESS"]["value"]}
    if not release.values["draft"]["enabled"]:
        assert dials.pop("draft") == ""
    for component, address in dials.items():
        assert address.startswith("dns:///"), "replicas are discovered through DNS"
        host, port = address.removeprefix("dns:///").rsplit(":", 1)
        service = service_for(release, host, int(port))
        assert service["spec"].get("clusterIP") == "None", "DNS discovery needs a headless Service"
        assert matches(service["spec"]["selector"], release.pod_labels(component))
    assert env["SPECDEC_TOKENIZER"]["value"] == (release.values["coordinator"]["tokenizer"]
                                                 or release.values["target"]["model"])

    redis = release.values["redis"]
    scheme, password, hosts, path = split_redis_url(env["REDIS_URL"]["value"])
    names = list(env)
    if redis["auth"]["existingSecret"]:
        assert password == "$(REDIS_PASSWORD)" and names.index("REDIS_PASSWORD") < names.index("REDIS_URL")
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": redis["auth"]["existingSecret"], "key": redis["auth"]["existingSecretPasswordKey"]}
    else:
        assert password is None and "REDIS_PASSWORD" not in env
    if redis["mode"] == "external":
        ext = redis["external"]
        tls = "rediss" if ext["tls"] else "redis"
        if ext["sentinel"]["hosts"]:
            assert (scheme, path) == (f"{tls}+sentinel", [ext["sentinel"]["masterName"], str(ext["db"])])
            assert [f"{host}:{port}" for host, port in hosts] == ext["sentinel"]["hosts"]
        else:
            assert (scheme, hosts, path) == (tls, [(ext["host"], ext["port"])], [str(ext["db"])])
        assert all(component_of(o) != "redis" for o in release.objects), "no bundled Redis with an external one"
    elif redis["mode"] == "sentinel":
        # Every Sentinel, by its pod's stable DNS name under the headless Service.
        statefulset = release.workload("redis")
        assert (scheme, path) == ("redis+sentinel", [redis["sentinel"]["masterName"], "0"])
        assert len(hosts) == statefulset["spec"]["replicas"] == redis["sentinel"]["replicas"]
        for ordinal, (host, port) in enumerate(hosts):
            assert host == (f"{statefulset['metadata']['name']}-{ordinal}.{statefulset['spec']['serviceName']}"
                            f".{NAMESPACE}.svc")
            service = service_for(release, statefulset["spec"]["serviceName"], port)
            assert service["spec"]["clusterIP"] == "None" and port == release.pod_ports("redis")["sentinel"]
            assert matches(service["spec"]["selector"], release.pod_labels("redis"))
    else:
        ((host, port),) = hosts
        service = service_for(release, host, port)
        assert scheme == "redis" and matches(service["spec"]["selector"], release.pod_labels("redis"))


@pytest.mark.parametrize("name", SET_NAMES)
def test_services_reach_named_container_ports(releases, name):
    release = releases[name]
    for service in release.of_kind("Service"):
        component = component_of(service)
        pods = "coordinator" if component == "openai" else component  # the gateway lives in coordinator pods
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(release.pod_ports(pods))


def test_models_from_a_volume_are_mounted_read_only(releases):
    release = releases["tp4-pvc"]
    for component in ("coordinator", "draft", "target"):
        pod = release.workload(component)["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert "--model=/models/Qwen2.5-72B-Instruct" in release.container("target")["args"]


def test_hf_token_comes_from_the_secret(releases):
    release = releases["external-redis-auth"]
    for component in ("coordinator", "draft", "target"):
        ref = env_of(release.container(component))["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "hf-token", "key": "HF_TOKEN"}
    assert "HF_TOKEN" not in env_of(releases["defaults"].container("target"))


def test_gpu_components_use_the_cuda_image(releases):
    release = releases["tp4-pvc"]
    assert release.container("target")["image"] == "specdec:0.1.0-cuda"
    assert release.container("draft")["image"] == "specdec:0.1.0-cuda"
    assert release.container("coordinator")["image"] == "specdec:0.1.0"
    assert releases["cpu-draft-autoscaling"].container("draft")["image"] == "specdec:0.1.0"


def test_coordinator_autoscaling_and_disruption_budget(releases):
    release = releases["cpu-draft-autoscaling"]
    deployment = release.one("Deployment", "coordinator")
    hpa = release.one("HorizontalPodAutoscaler", "coordinator")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    pdb = release.one("PodDisruptionBudget", "coordinator")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert not releases["defaults"].of_kind("HorizontalPodAutoscaler")
    draft = release.workload("draft")
    spread = draft["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["labelSelector"]["matchLabels"] == draft["spec"]["selector"]["matchLabels"]


def test_service_monitor_scrapes_the_metrics_ports(releases):
    release = releases["tp4-pvc"]
    (monitor,) = release.of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    selector = monitor["spec"]["selector"]
    scraped = {component_of(s) for s in release.of_kind("Service")
               if matches(selector["matchLabels"], s["metadata"]["labels"])
               and component_of(s) in selector["matchExpressions"][0]["values"]}
    assert scraped == {"coordinator", "draft", "target"}
    for component in scraped:
        assert "metrics" in [p["name"] for p in release.one("Service", component)["spec"]["ports"]]
    assert not releases["defaults"].of_kind("ServiceMonitor")


@pytest.mark.parametrize("name", SET_NAMES)
def test_helm_test_hook_sends_a_generate_to_the_coordinator(releases, name):
    release = releases[name]
    (pod,) = release.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["python", "-c"] and "stub.Generate(" in command[2]
    compile(command[2], "test-generate", "exec")  # the embedded script is valid Python
    host, port = command[3].rsplit(":", 1)
    coordinator = service_for(release, host, int(port))
    assert component_of(coordinator) == "coordinator"
    # Over TLS and with a token when the coordinator requires them, each from a mounted Secret file.
    env = {k: e["value"] for k, e in env_of(container).items()}
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounted = {m["mountPath"]: volumes[m["name"]]["secret"] for m in container.get("volumeMounts", [])}
    assert all(m["readOnly"] for m in container.get("volumeMounts", []))
    values = release.values
    if server_tls(values, "coordinator"):
        directory, file = env["TEST_TLS_CA_FILE"].rsplit("/", 1)
        secret = mounted[directory]
        assert secret["secretName"] == values["tls"]["public"]["existingSecret"]
        assert secret["items"] == [{"key": "ca.crt", "path": file}] and secret["optional"] is True
        assert env.get("TEST_TLS_SERVER_NAME") == (values["tls"]["public"]["serverName"] or None)
    else:
        assert "TEST_TLS_CA_FILE" not in env
    if values["auth"]["existingSecret"]:
        directory, file = env["TEST_TOKEN_FILE"].rsplit("/", 1)
        secret = mounted[directory]
        assert secret["secretName"] == values["auth"]["existingSecret"]
        assert secret["items"] == [{"key": values["auth"]["key"], "path": file}]
    else:
        assert "TEST_TOKEN_FILE" not in env


@pytest.mark.parametrize("values, message", [
    ({"coordinator": {"replicas": -1}}, "at '/coordinator/replicas': minimum: got -1, want 0"),
    ({"target": {"replicas": -2}}, "at '/target/replicas': minimum: got -2, want 0"),
    ({"target": {"model": None}}, "at '/target': missing property 'model'"),
    ({"draft": {"model": ""}}, "at '/draft/model': minLength: got 0, want 1"),
    ({"target": {"tensorParallelSize": 0}}, "at '/target/tensorParallelSize': minimum: got 0, want 1"),
    ({"redis": {"mode": "external"}}, "at '/redis/external/host': minLength: got 0, want 1"),
    ({"models": {"volume": {"type": "persistentVolumeClaim"}}}, "at '/models/volume/claimName'"),
    ({"target": {"gpus": 4}}, "additional properties 'gpus' not allowed"),
])
def test_schema_rejects_bad_values_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


def test_cross_field_checks_fail_rendering(chart):
    values = {"coordinator": {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}}
    with pytest.raises(helm.HelmRenderError, match="maxReplicas \\(2\\) must be >= minReplicas \\(4\\)"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("overlap", [True, False])
def test_coordinator_overlap_follows_the_values(chart, overlap):
    """Overlapped drafting is on by default in the chart (the draft has nodes of its own)."""
    values = {} if overlap else {"coordinator": {"overlap": False}}
    release = Release(chart.merge_values(values), chart.render(values, name=RELEASE, namespace=NAMESPACE))
    flags = flags_of(release.container("coordinator")["args"])
    assert ("overlap" in flags, "no-overlap" in flags) == (overlap, not overlap)


@pytest.mark.parametrize("name", SET_NAMES)
def test_openai_gateway_beside_each_coordinator(releases, name):
    """The OpenAI-compatible API: an `openai` container in each coordinator pod, calling its own
    coordinator over localhost (TLS with the public certificate when tls.public), HTTP probes, and
    a Service of its own that the network policy lets through."""
    release = releases[name]
    values = release.values
    containers = {c["name"]: c for c in release.pod_spec("coordinator")["containers"]}
    if not values["openai"]["enabled"]:
        assert "openai" not in containers
        return
    gateway = containers["openai"]
    assert gateway["command"] == ["python", "-m", "openai_gateway"]
    args = gateway["args"]
    assert f"--coordinator=127.0.0.1:{values['coordinator']['port']}" in args
    http = port_named(gateway, "http")
    assert http == values["openai"]["port"]
    tls = values["tls"]["enabled"] and values["tls"]["public"]["existingSecret"]
    scheme = "HTTPS" if tls else "HTTP"
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
    for probe in ("startupProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"] == {"path": "/health/live", "port": "http", "scheme": scheme}
    assert ("--coordinator-tls" in args) == bool(tls)
    if tls:
        mounted = {m["mountPath"] for m in gateway["volumeMounts"]}
        cert = next(a for a in args if a.startswith("--tls-cert=")).split("=", 1)[1]
        ca = next(a for a in args if a.startswith("--coordinator-tls-ca=")).split("=", 1)[1]
        assert cert.rsplit("/", 1)[0] in mounted and ca.rsplit("/", 1)[0] in mounted
        volumes = {v["name"]: v for v in release.pod_spec("coordinator")["volumes"]}
        assert volumes["tls-public-ca"]["secret"]["optional"] is True
    (service,) = [s for s in release.of_kind("Service") if s["metadata"]["name"].endswith("-openai")]
    assert matches(service["spec"]["selector"], release.pod_labels("coordinator"))
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    policies = [p for p in release.of_kind("NetworkPolicy") if component_of(p) == "coordinator"]
    for policy in policies:
        assert {"port": http, "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]


def test_openai_gateway_can_be_turned_off(chart):
    values = {"openai": {"enabled": False}}
    release = Release(chart.merge_values(values), chart.render(values, name=RELEASE, namespace=NAMESPACE))
    assert [c["name"] for c in release.pod_spec("coordinator")["containers"]] == ["coordinator"]
    assert not [s for s in release.of_kind("Service") if s["metadata"]["name"].endswith("-openai")]


@pytest.mark.kvstore
@pytest.mark.parametrize("name", SET_NAMES)
def test_workers_use_the_kv_store_when_enabled(releases, name):
    """kvStore: both workers get the tier's flags, pointing at the bundled Redis' Service (an LRU
    cache of its own, never the session store) or at kvStore.url."""
    release = releases[name]
    kv = release.values["kvStore"]
    workers = ["target"] + (["draft"] if release.values["draft"]["enabled"] else [])
    for component in workers:
        flags = flags_of(release.container(component)["args"])
        if not kv["enabled"]:
            assert not any(f.startswith("kv-") for f in flags), component
            continue
        assert flags["kv-chunk-tokens"] == str(kv["chunkTokens"])
        assert flags["kv-compression"] == kv["compression"]
        url = flags["kv-store-url"]
        if kv["url"]:
            assert url == kv["url"]
            continue
        host, port = url.removeprefix("redis://").removesuffix("/0").split(":")
        service = service_for(release, host, int(port))
        assert component_of(service) == "kvstore"
        redis_args = release.container("kvstore")["args"]
        options = dict(zip(redis_args[::2], redis_args[1::2]))
        assert options["--maxmemory-policy"] == "allkeys-lru" and options["--maxmemory"] == kv["bundled"]["maxmemory"]
        assert options["--appendonly"] == "no"
    if not kv["enabled"] or kv["url"]:
        assert not [w for w in release.workloads() if component_of(w) == "kvstore"]
