"""The Kubernetes manifests: valid for the API server, and in agreement with each other, the server's
config and the CLI.

Every kustomization under k8s/ (base, overlays/prod, overlays/gpu, jobs) is rendered by
``tests/deploy/k8s_render.py`` (a small kustomize for the features k8s/ uses; cross-checked
against ``kubectl kustomize`` where kubectl is installed) and:

- every core object passes kubernetes-validate's strict schemas (unknown fields are errors)
  for the oldest and the newest Kubernetes this deploy is meant for;
- the Prometheus Operator objects, which it has no schema for, pass a strict schema of the
  fields used here (test_prometheus_rule.py does the PrometheusRule's rules);
- labels, selectors, ports, volumes, flags and ``SHOPPING_AGENT_*`` names agree: the
  container command lines are parsed by the real ``shopping-agent`` parser and the server's
  Config is built from them as the process would build it.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bench.latency_curve import HPA_CPU_CORES
from server.app import SERVICE_NAME
from server.cli import parser
from server.config import ENV_PREFIX, SALT_ENV, Config, build_config
from simulator.drive import CRON_INTERVAL_S
from tests.deploy.k8s_render import containers, parse_cron, pod_labels, pod_spec, render, selects
from tests.harness import ROOT
from trainer.cli import EXIT_REFUSED

K8S = ROOT / "k8s"
VARIANTS = {"base": K8S / "base", "prod": K8S / "overlays" / "prod", "gpu": K8S / "overlays" / "gpu", "jobs": K8S / "jobs"}
# The oldest Kubernetes this deploy is for (native gRPC probes are GA since 1.27, podFailurePolicy
# on by default since 1.26 and GA in 1.31) and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CORE_GROUPS = {"", "apps", "batch", "autoscaling", "policy", "networking.k8s.io"}
CRD_GROUPS = {"monitoring.coreos.com"}
FIELD_NAMES = {f.name for f in dataclasses.fields(Config)}
SERVER = "shopping-agent"
TRAINER = "shopping-agent-trainer"
COMPACTOR = "shopping-agent-log-compactor"
ROLLBACK = "shopping-agent-rollback"

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {name: render(path) for name, path in VARIANTS.items()}


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def spec_of(doc: Doc) -> Doc:
    spec = pod_spec(doc)
    assert spec is not None, f"{doc['kind']} has no pod spec"
    return spec


def container(doc: Doc, name: str) -> Doc:
    found = [c for c in containers(doc) if c["name"] == name]
    assert len(found) == 1, f"{doc['kind']}/{doc['metadata']['name']}: no container {name!r}"
    return found[0]


def group(doc: Doc) -> str:
    return doc["apiVersion"].rpartition("/")[0]


def command_line(c: Doc) -> argparse.Namespace:
    """The container's command + args, parsed by the real CLI parser (argparse exits on an error)."""
    command = [*c.get("command", []), *c.get("args", [])]
    assert command[0] == "shopping-agent", f"{c['name']}: runs {command[0]!r}, not the shopping-agent console script"
    try:
        return parser().parse_args(command[1:])
    except SystemExit as exc:  # pragma: no cover - the assertion message is the point
        raise AssertionError(f"{c['name']}: shopping-agent rejects {command[1:]}") from exc


def env_of(c: Doc) -> dict[str, str]:
    """The container's environment as the process sees it; a secret's value is a stand-in."""
    env: dict[str, str] = {}
    for item in c.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else f"<{item['valueFrom']}>"
    return env


def server_config(deployment: Doc) -> Config:
    c = container(deployment, "server")
    args = command_line(c)
    assert args.command == "serve"
    return build_config(args, env_of(c))


def mount(c: Doc, path: Path | None) -> Doc:
    assert path is not None
    found = [m for m in c.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == PurePosixPath(path)]
    assert len(found) == 1, f"{c['name']}: nothing mounted at {path}"
    return found[0]


def claim(doc: Doc, volume_mount: Doc) -> Doc:
    """The persistentVolumeClaim volume source behind a mount."""
    volumes = {v["name"]: v for v in spec_of(doc)["volumes"]}
    source = volumes[volume_mount["name"]]
    assert "persistentVolumeClaim" in source, f"{volume_mount['mountPath']} is not a PVC"
    return source["persistentVolumeClaim"]


def container_port(c: Doc, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert name in ports, f"{c['name']}: no port named {name!r}"
    return ports[name]


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_core_object_passes_the_strict_schema(rendered: dict[str, list[Doc]], variant: str, version: str) -> None:
    checked = 0
    for doc in rendered[variant]:
        if group(doc) in CRD_GROUPS:
            continue  # no schema in kubernetes-validate: test_prometheus_operator_objects_pass_a_strict_schema
        assert group(doc) in CORE_GROUPS, f"{doc['kind']} ({doc['apiVersion']}): neither core nor a known CRD"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}")
        checked += 1
    assert checked >= 1


def test_strict_validation_has_teeth() -> None:
    """A misspelt field fails (the CLI would only warn about kinds it does not know; the API raises)."""
    deployment = one(render(VARIANTS["base"]), "Deployment", SERVER)
    spec_of(deployment)["terminationGracePeriodSecond"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor"}, K8S_VERSIONS[0], strict=True)


def test_base_holds_every_kind_the_deploy_needs(rendered: dict[str, list[Doc]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered["base"])
    assert kinds == sorted([
        ("Deployment", SERVER), ("Service", SERVER), ("Service", "shopping-agent-headless"),
        ("PersistentVolumeClaim", "shopping-agent-weights"), ("PersistentVolumeClaim", "shopping-agent-logs"),
        ("CronJob", TRAINER), ("HorizontalPodAutoscaler", SERVER), ("PodDisruptionBudget", SERVER),
        ("NetworkPolicy", SERVER), ("NetworkPolicy", TRAINER), ("NetworkPolicy", COMPACTOR), ("CronJob", COMPACTOR),
        ("NetworkPolicy", "shopping-agent-weights-rollback"),
        ("ServiceMonitor", SERVER), ("PrometheusRule", SERVER),
    ])


@pytest.mark.parametrize("variant", ["base", "prod", "gpu", "jobs"])
def test_the_loader_renders_what_kubectl_kustomize_renders(rendered: dict[str, list[Doc]], variant: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are checked as tests/deploy/k8s_render.py renders them")
    out = subprocess.run([kubectl, "kustomize", str(VARIANTS[variant])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(d: Doc) -> tuple[str, str, str]:
        return d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]

    assert sorted(rendered[variant], key=key) == sorted(theirs, key=key)


# A strict schema of the Prometheus Operator fields used here (types and patterns as in its
# CRDs, monitoring.coreos.com/v1): a misspelt or misplaced field fails, as the API server would.
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                   "namespace": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP},
}
_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
_KEY_SELECTOR = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
                 "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}
_SECRET_OR_CONFIGMAP = {"type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
                        "properties": {"secret": _KEY_SELECTOR, "configMap": _KEY_SELECTOR}}
_TLS_CONFIG = {"type": "object", "additionalProperties": False,
               "properties": {"ca": _SECRET_OR_CONFIGMAP, "cert": _SECRET_OR_CONFIGMAP, "keySecret": _KEY_SELECTOR,
                              "serverName": {"type": "string"}, "insecureSkipVerify": {"type": "boolean"}}}
CRD_SCHEMAS: dict[str, Doc] = {
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": _META,
            "spec": {
                "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                "properties": {
                    "selector": _SELECTOR,
                    "jobLabel": {"type": "string"},
                    "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                        "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                       "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                                       "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
                                       "tlsConfig": _TLS_CONFIG}}},
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": _META,
            "spec": {
                "type": "object", "additionalProperties": False,
                "properties": {"groups": {"type": "array", "items": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1}, "interval": _DURATION, "limit": {"type": "integer"},
                        "labels": _STRING_MAP,
                        "rules": {"type": "array", "items": {
                            "type": "object", "required": ["expr"], "additionalProperties": False,
                            "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                            "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                           "expr": {"type": ["string", "integer"]}, "for": _DURATION, "keep_firing_for": _DURATION,
                                           "labels": _STRING_MAP, "annotations": _STRING_MAP}}},
                    }}}},
            },
        },
    },
}


@pytest.mark.parametrize("variant", ["base", "prod", "gpu"])
def test_prometheus_operator_objects_pass_a_strict_schema(rendered: dict[str, list[Doc]], variant: str) -> None:
    crds = [d for d in rendered[variant] if group(d) in CRD_GROUPS]
    assert sorted(d["kind"] for d in crds) == ["PrometheusRule", "ServiceMonitor"]
    for doc in crds:
        jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).validate(doc)


def test_the_crd_schema_has_teeth(rendered: dict[str, list[Doc]]) -> None:
    monitor = one(rendered["base"], "ServiceMonitor", SERVER)
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"targetPort": "metrics", "interval": "15 s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(CRD_SCHEMAS["ServiceMonitor"]).validate(broken)


# --- the server -----------------------------------------------------------------------------


def test_server_flags_and_env_are_real_and_build_the_config(rendered: dict[str, list[Doc]]) -> None:
    deployment = one(rendered["base"], "Deployment", SERVER)
    c = container(deployment, "server")
    for name in env_of(c):
        if name in LIBRARY_ENV:
            continue
        assert name.startswith(ENV_PREFIX), f"{name}: the server reads only {ENV_PREFIX}* variables"
        assert name.removeprefix(ENV_PREFIX).lower() in FIELD_NAMES, f"{name}: no such field in server.config.Config"
    config = server_config(deployment)  # raises on an unknown flag or a bad value
    assert "--log-user-salt" not in " ".join(c["args"]), "a secret in args is visible in the pod spec and in ps"
    salt = next(item for item in c["env"] if item["name"] == SALT_ENV)
    assert salt["valueFrom"]["secretKeyRef"]["name"] == "shopping-agent-log-salt"
    assert not salt["valueFrom"]["secretKeyRef"].get("optional", False), "without the secret every pod would hash with another salt"
    assert config.port == container_port(c, "grpc") == 50051
    assert config.metrics and config.metrics_port == container_port(c, "metrics") == 9095
    assert config.host == config.metrics_host == "0.0.0.0", "the pod IP must be reachable"


LIBRARY_ENV = frozenset({"OMP_NUM_THREADS"})
"""Read by the libraries, not by the server's config (test_every_container_sizes_its_thread_pools_by_its_cpu_limit)."""


def test_every_container_sizes_its_thread_pools_by_its_cpu_limit(rendered: dict[str, list[Doc]]) -> None:
    """A container sees every CPU of its node whatever its limit: OpenBLAS, torch's OpenMP and Arrow's pool would start a
    thread per node CPU (and the trainer's results depend on the count). Each takes the count from its own limit."""
    seen = set()
    for variant in sorted(rendered):  # base, prod, gpu, jobs
        for doc in rendered[variant]:
            for c in containers(doc):
                limit = c.get("resources", {}).get("limits", {}).get("cpu")
                assert limit is not None, f"{doc['metadata']['name']}/{c['name']}: no CPU limit to size its threads by"
                threads = next((item for item in c.get("env", []) if item["name"] == "OMP_NUM_THREADS"), None)
                assert threads is not None, f"{doc['metadata']['name']}/{c['name']}: OMP_NUM_THREADS unset"
                assert threads["valueFrom"]["resourceFieldRef"] == {"containerName": c["name"], "resource": "limits.cpu"}
                seen.add(c["name"])
    assert seen == {"server", "trainer", "compactor", "rollback"}


def service_link_env(service: Doc) -> set[str]:
    """The variables the kubelet injects for a Service when enableServiceLinks is on (Docker-links style)."""
    prefix = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"}
    for port in service["spec"]["ports"]:
        base = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        names |= {f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}", base, f"{base}_PROTO", f"{base}_PORT", f"{base}_ADDR"}
    return names


def test_service_links_cannot_leak_into_the_config(rendered: dict[str, list[Doc]]) -> None:
    """A Service named shopping-agent makes the kubelet set SHOPPING_AGENT_PORT=tcp://IP:50051, which the
    server would read as --port: service links must be off in every pod that reads SHOPPING_AGENT_*."""
    docs = rendered["base"]
    injected = set().union(*(service_link_env(s) for s in of_kind(docs, "Service")))
    clashes = {name for name in injected if name.startswith(ENV_PREFIX) and name.removeprefix(ENV_PREFIX).lower() in FIELD_NAMES}
    assert "SHOPPING_AGENT_PORT" in clashes  # why this test exists
    for doc in [*docs, *rendered["jobs"]]:
        if pod_spec(doc) is not None:
            assert spec_of(doc).get("enableServiceLinks") is False, f"{doc['kind']}/{doc['metadata']['name']}: {sorted(clashes)}"


def test_weights_read_only_and_logs_writable_where_the_config_says(rendered: dict[str, list[Doc]]) -> None:
    deployment = one(rendered["base"], "Deployment", SERVER)
    c, config = container(deployment, "server"), server_config(deployment)
    weights = mount(c, config.weights_dir)
    assert weights.get("readOnly") is True
    assert claim(deployment, weights) == {"claimName": "shopping-agent-weights", "readOnly": True}
    logs = mount(c, config.log_dir)
    assert not logs.get("readOnly", False)
    assert claim(deployment, logs)["claimName"] == "shopping-agent-logs"


def test_shutdown_fits_in_the_termination_grace_period(rendered: dict[str, list[Doc]]) -> None:
    deployment = one(rendered["base"], "Deployment", SERVER)
    config = server_config(deployment)
    period = spec_of(deployment)["terminationGracePeriodSeconds"]
    drain = config.drain_delay_seconds + config.grace_seconds
    assert config.drain_delay_seconds > 0, "without a drain delay, calls routed during endpoint removal are cancelled"
    assert period > drain, f"SIGKILL after {period}s cuts the drain ({drain}s)"
    assert period - drain >= 10, "leave time to flush and finalise the decision logs after the drain"


def test_probes_are_native_grpc_health_checks_on_the_grpc_port(rendered: dict[str, list[Doc]]) -> None:
    deployment = one(rendered["base"], "Deployment", SERVER)
    c, config = container(deployment, "server"), server_config(deployment)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert set(probe) - {"grpc", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold",
                             "initialDelaySeconds", "terminationGracePeriodSeconds"} == set(), kind
        if config.tls_cert is None:
            assert probe["grpc"]["port"] == config.port == container_port(c, "grpc"), kind
        else:  # the kubelet's gRPC probes cannot do TLS: the plaintext health-only port
            assert probe["grpc"]["port"] == config.health_port == container_port(c, "health"), kind
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME), f"{kind}: the server reports health for '' and {SERVICE_NAME}"
    # A draining pod reports NOT_SERVING: liveness must not kill it before the drain ends.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > config.drain_delay_seconds + config.grace_seconds
    assert c["readinessProbe"]["grpc"].get("service") == SERVICE_NAME


def test_pods_run_unprivileged_on_a_read_only_root(rendered: dict[str, list[Doc]]) -> None:
    workloads = [d for variant in ("base", "jobs") for d in rendered[variant] if pod_spec(d) is not None]
    assert sorted(d["kind"] for d in workloads) == ["CronJob", "CronJob", "Deployment", "Job"]
    for doc in workloads:
        spec, where = pod_spec(doc), f"{doc['kind']}/{doc['metadata']['name']}"
        assert spec is not None
        pod_ctx = spec.get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True and pod_ctx.get("runAsUser", 0) > 0, where
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, f"{where}: no pod here talks to the API server"
        volumes = {v["name"] for v in spec["volumes"]}
        for c in containers(doc):
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            assert ctx.get("runAsUser", 1) != 0, where
            tmp = mount(c, Path("/tmp"))
            assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp["name"]), f"{where}: /tmp must be an emptyDir"
            assert {m["name"] for m in c["volumeMounts"]} <= volumes, where
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], where
        assert {m["name"] for c in containers(doc) for m in c["volumeMounts"]} == volumes, f"{where}: a volume nobody mounts"


# --- labels, selectors, ports ------------------------------------------------------------------


def test_deployment_selector_matches_its_pods_and_only_them(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    deployment, cronjob = one(docs, "Deployment", SERVER), one(docs, "CronJob", TRAINER)
    selector = deployment["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    assert selector["matchLabels"].items() <= pod_labels(deployment).items()
    assert not selects(selector, pod_labels(cronjob)), "the Deployment would adopt the trainer's pods"
    assert not selects(selector, pod_labels(one(rendered["jobs"], "Job", ROLLBACK)))


def test_services_route_to_the_named_container_ports(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    deployment = one(docs, "Deployment", SERVER)
    c, labels = container(deployment, "server"), pod_labels(deployment)
    trainer_labels = pod_labels(one(docs, "CronJob", TRAINER))
    for service in of_kind(docs, "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        assert selects(selector, labels), service["metadata"]["name"]
        assert not selects(selector, trainer_labels), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert port["port"] == container_port(c, port["targetPort"]), f"{service['metadata']['name']}: {port}"
            assert port["name"] == port["targetPort"]
    cluster_ip = one(docs, "Service", SERVER)["spec"]
    assert cluster_ip.get("type", "ClusterIP") == "ClusterIP" and "clusterIP" not in cluster_ip
    assert {p["name"] for p in cluster_ip["ports"]} == {"grpc", "metrics"}
    headless = one(docs, "Service", "shopping-agent-headless")["spec"]
    assert headless["clusterIP"] == "None", "client-side round robin needs one DNS record per pod"
    assert not headless.get("publishNotReadyAddresses", False), "clients must not be sent to pods without a model"
    assert [p["name"] for p in headless["ports"]] == ["grpc"]
    config = server_config(deployment)
    grpc_protocol = "https" if config.tls_cert is not None else "kubernetes.io/h2c"  # h2c would be a lie over TLS
    assert all(p["appProtocol"] == grpc_protocol for p in [*headless["ports"], cluster_ip["ports"][0]])
    metrics_port = next(p for p in cluster_ip["ports"] if p["name"] == "metrics")
    assert metrics_port["appProtocol"] == ("https" if config.metrics_tls_cert is not None else "http")


def test_rollout_never_drops_below_the_disruption_budget(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    deployment, pdb = one(docs, "Deployment", SERVER), one(docs, "PodDisruptionBudget", SERVER)
    hpa = one(docs, "HorizontalPodAutoscaler", SERVER)
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    replicas = deployment["spec"]["replicas"]
    assert replicas == 3 == hpa["spec"]["minReplicas"]
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    rolling = strategy["rollingUpdate"]

    def resolve(value: int | str, round_up: bool) -> int:
        if isinstance(value, int):
            return value
        share = int(value.rstrip("%")) * replicas / 100
        return -int(-share // 1) if round_up else int(share)

    budget = (resolve(pdb["spec"]["maxUnavailable"], True) if "maxUnavailable" in pdb["spec"]
              else replicas - resolve(pdb["spec"]["minAvailable"], True))
    assert budget >= 1, "a budget of 0 blocks every node drain"
    assert resolve(rolling["maxUnavailable"], False) <= budget, "the rollout would take more pods than the PDB allows"
    assert resolve(rolling["maxSurge"], True) >= 1, "with maxUnavailable 0 the rollout needs a surge to move"


def test_the_servers_spread_over_zones_and_nodes_without_blocking_a_rollout(rendered: dict[str, list[Doc]]) -> None:
    deployment = one(rendered["base"], "Deployment", SERVER)
    spread = pod_spec(deployment)["topologySpreadConstraints"]  # type: ignore[index]
    assert [c["topologyKey"] for c in spread] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    for constraint in spread:
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway" and constraint["maxSkew"] == 1
        assert selects(constraint["labelSelector"], pod_labels(deployment))


def test_the_autoscaler_targets_the_deployment_on_cpu(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    hpa, deployment = one(docs, "HorizontalPodAutoscaler", SERVER), one(docs, "Deployment", SERVER)
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (deployment["apiVersion"], "Deployment", SERVER)
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert container(deployment, "server")["resources"]["requests"]["cpu"], "CPU utilisation is relative to the request"


def test_the_latency_bench_measures_at_the_autoscalers_cpu_target(rendered: dict[str, list[Doc]]) -> None:
    """bench.latency_curve offers the load at which a pod reaches the HPA's target: the same cores as the manifests."""
    docs = rendered["base"]
    [metric] = one(docs, "HorizontalPodAutoscaler", SERVER)["spec"]["metrics"]
    request = str(container(one(docs, "Deployment", SERVER), "server")["resources"]["requests"]["cpu"])
    cores = float(request[:-1]) / 1000 if request.endswith("m") else float(request)
    assert abs(metric["resource"]["target"]["averageUtilization"] / 100 * cores - HPA_CPU_CORES) < 1e-12


def test_network_policy_lets_only_the_frontend_call_and_only_prometheus_scrape(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    deployment = one(docs, "Deployment", SERVER)
    c = container(deployment, "server")
    policy = one(docs, "NetworkPolicy", SERVER)["spec"]
    assert selects(policy["podSelector"], pod_labels(deployment))
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    by_port: dict[str, list[Doc]] = {}
    for rule in policy["ingress"]:
        assert rule.get("ports"), "an ingress rule without ports opens every port"
        assert rule.get("from"), "an ingress rule without peers admits everyone"
        for port in rule["ports"]:
            container_port(c, port["port"])  # a named container port
            by_port.setdefault(port["port"], []).extend(rule["from"])
    # The plaintext health port gets no rule: only the node (the kubelet's probes) reaches it.
    assert set(by_port) == {p["name"] for p in c["ports"]} - {"health"}
    assert server_config(deployment).health_port == container_port(c, "health")
    for peer in by_port["grpc"]:
        assert "ipBlock" not in peer
        assert peer["podSelector"]["matchLabels"] == {"shopping-agent.io/client": "frontend"}
    for peer in by_port["metrics"]:
        assert "ipBlock" not in peer
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    trainer = one(docs, "NetworkPolicy", TRAINER)["spec"]
    assert selects(trainer["podSelector"], pod_labels(one(docs, "CronJob", TRAINER)))
    assert not selects(trainer["podSelector"], pod_labels(deployment))
    assert trainer["ingress"] == [] and trainer["egress"] == [] and trainer["policyTypes"] == ["Ingress", "Egress"]
    compactor = one(docs, "NetworkPolicy", COMPACTOR)["spec"]  # no network at all: it only rewrites files
    assert selects(compactor["podSelector"], pod_labels(one(docs, "CronJob", COMPACTOR)))
    assert not selects(compactor["podSelector"], pod_labels(deployment))
    assert not selects(compactor["podSelector"], pod_labels(one(docs, "CronJob", TRAINER)))
    assert compactor["ingress"] == [] and compactor["egress"] == [] and compactor["policyTypes"] == ["Ingress", "Egress"]


def test_every_pod_the_manifests_make_is_under_one_network_policy(rendered: dict[str, list[Doc]]) -> None:
    """The one-off Jobs too: the rollback Job's pod matched no policy (an SRE review), so it could reach anything."""
    policies = [d for d in rendered["base"] if d["kind"] == "NetworkPolicy"]
    workloads = [d for variant in ("base", "jobs") for d in rendered[variant] if pod_spec(d) is not None]
    assert len(workloads) >= 4
    for workload in workloads:
        covering = [p["metadata"]["name"] for p in policies if selects(p["spec"]["podSelector"], pod_labels(workload))]
        assert len(covering) == 1, (workload["kind"], workload["metadata"]["name"], covering)
    rollback = one(policies, "NetworkPolicy", "shopping-agent-weights-rollback")["spec"]  # it only renames files
    assert rollback["ingress"] == [] and rollback["egress"] == [] and rollback["policyTypes"] == ["Ingress", "Egress"]


def test_server_pods_may_send_only_dns_queries_to_the_cluster_dns(rendered: dict[str, list[Doc]]) -> None:
    policy = one(rendered["base"], "NetworkPolicy", SERVER)["spec"]
    assert policy["egress"], "Egress without rules would also block DNS"
    for rule in policy["egress"]:
        assert rule.get("to"), "an egress rule without peers allows every destination"
        assert {(p["port"], p["protocol"]) for p in rule["ports"]} == {(53, "UDP"), (53, "TCP")}
        for peer in rule["to"]:
            assert "ipBlock" not in peer
            assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kube-system"}
            assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}


def test_tls_files_come_from_a_secret_mounted_whole_and_prometheus_trusts_its_ca(rendered: dict[str, list[Doc]]) -> None:
    """A Secret volume is updated in place when cert-manager renews (the server re-reads the files); a subPath
    mount never is. The Secret must exist (not optional): without it the pod would serve without TLS."""
    docs = rendered["base"]
    deployment = one(docs, "Deployment", SERVER)
    c, config = container(deployment, "server"), server_config(deployment)
    assert config.tls_cert and config.tls_key and config.tls_client_ca, "the gRPC port serves mutual TLS"
    assert config.metrics_tls_cert and config.metrics_tls_key
    volumes = {v["name"]: v for v in spec_of(deployment)["volumes"]}
    secrets = set()
    for path in (config.tls_cert, config.tls_key, config.tls_client_ca, config.metrics_tls_cert, config.metrics_tls_key):
        holding = [m for m in c["volumeMounts"] if PurePosixPath(path).parent == PurePosixPath(m["mountPath"])]
        assert len(holding) == 1, f"{path}: no mount holds it"
        volume_mount = holding[0]
        assert volume_mount.get("readOnly") is True and "subPath" not in volume_mount and "subPathExpr" not in volume_mount
        source = volumes[volume_mount["name"]]["secret"]
        assert not source.get("optional", False) and "items" not in source, "the file names are the Secret's keys"
        assert source["defaultMode"] & 0o007 == 0, "the private key must not be world-readable"
        secrets.add((source["secretName"], PurePosixPath(path).name))
    [secret] = {name for name, _ in secrets}
    assert {key for _, key in secrets} == {"tls.crt", "tls.key", "ca.crt"}  # what cert-manager writes
    [endpoint] = one(docs, "ServiceMonitor", SERVER)["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"] == {"secret": {"name": secret, "key": PurePosixPath(config.tls_client_ca).name}}
    assert endpoint["tlsConfig"]["serverName"] and not endpoint["tlsConfig"].get("insecureSkipVerify", False)


def test_service_monitor_scrapes_the_metrics_port_once_per_pod(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    monitor = one(docs, "ServiceMonitor", SERVER)["spec"]
    chosen = [s for s in of_kind(docs, "Service") if selects(monitor["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in chosen] == [SERVER], "scraping the headless Service too would count every pod twice"
    config = server_config(one(docs, "Deployment", SERVER))
    service_ports = {p["name"]: p for p in chosen[0]["spec"]["ports"]}
    [endpoint] = monitor["endpoints"]
    port = service_ports[endpoint["port"]]
    assert port["targetPort"] == "metrics" and port["port"] == config.metrics_port
    assert endpoint["path"] == "/metrics"


def test_volume_claims_are_shared_read_write_many(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    claims = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "PersistentVolumeClaim")}
    assert set(claims) == {"shopping-agent-weights", "shopping-agent-logs"}
    for spec in claims.values():
        assert spec["accessModes"] == ["ReadWriteMany"], "servers on several nodes and the trainer share both"
        assert spec["resources"]["requests"]["storage"]
    for doc in [*docs, *rendered["jobs"]]:
        for volume in (pod_spec(doc) or {}).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


# --- the trainer --------------------------------------------------------------------------------


def test_cronjob_schedule_is_five_fields_every_two_hours(rendered: dict[str, list[Doc]]) -> None:
    spec = one(rendered["base"], "CronJob", TRAINER)["spec"]
    minutes, hours, days, months, weekdays = parse_cron(spec["schedule"])
    assert len(minutes) == 1 and hours == set(range(0, 24, 2))
    assert CRON_INTERVAL_S == 2 * 3600, "the simulated cycles (simulator.drive.cycle_time) log one CronJob interval apart"
    assert days == set(range(1, 32)) and months == set(range(1, 13)) and weekdays == set(range(0, 8))
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["jobTemplate"]["spec"]["activeDeadlineSeconds"] < 2 * 3600, "a run must end before the next one is due"


def test_the_compactor_never_runs_when_the_trainer_starts(rendered: dict[str, list[Doc]]) -> None:
    """Readers on other nodes of a shared volume may miss a just-compacted segment's rows (docs/logs.md): the latest a
    compaction can still run, its start's deadline plus its own, ends before the trainer's minute."""
    compactor, trainer = (one(rendered["base"], "CronJob", name)["spec"] for name in (COMPACTOR, TRAINER))
    (start,), _, _, _, _ = parse_cron(compactor["schedule"])
    (train,), _, _, _, _ = parse_cron(trainer["schedule"])
    latest_end_s = start * 60 + compactor["startingDeadlineSeconds"] + compactor["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    assert latest_end_s < (train + 60) * 60, f"a compaction may run until minute {latest_end_s / 60 - 60:.0f} of the next hour"


@pytest.mark.parametrize("schedule", ["17 */2 * * *", "0 0-22/2 * * *", "5,35 * * jan-jun mon-fri", "0 0 1 * 7"])
def test_cron_parser_accepts_valid_schedules(schedule: str) -> None:
    assert len(parse_cron(schedule)) == 5


@pytest.mark.parametrize("schedule", ["17 */2 * *", "60 * * * *", "0 24 * * *", "*/0 * * * *", "@hourly", "0 5-1 * * *", "x * * * *"])
def test_cron_parser_refuses_invalid_schedules(schedule: str) -> None:
    with pytest.raises(ValueError):
        parse_cron(schedule)


def test_trainer_runs_cycle_on_the_servers_volumes(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    cronjob, deployment = one(docs, "CronJob", TRAINER), one(docs, "Deployment", SERVER)
    trainer = container(cronjob, "trainer")
    args = command_line(trainer)
    assert args.command == "cycle"
    assert not args.force, "--force publishes what the gate refused"
    config = server_config(deployment)
    logs, weights = mount(trainer, args.logs), mount(trainer, args.weights_dir)
    assert logs.get("readOnly") is True, "the trainer only reads the logs"
    assert not weights.get("readOnly", False), "cycle publishes onto the weights volume"
    server = container(deployment, "server")
    assert claim(cronjob, logs)["claimName"] == claim(deployment, mount(server, config.log_dir))["claimName"]
    assert claim(cronjob, weights)["claimName"] == claim(deployment, mount(server, config.weights_dir))["claimName"]
    assert not claim(cronjob, weights).get("readOnly", False)
    assert "trainer" in trainer["image"] and "trainer" not in container(deployment, "server")["image"]
    user = spec_of(cronjob)["securityContext"]["runAsUser"]
    assert user == spec_of(deployment)["securityContext"]["runAsUser"], "bundles the trainer writes must be readable by the servers"


def test_the_trainers_canaries_are_served_at_the_share_it_asks_for(rendered: dict[str, list[Doc]]) -> None:
    """cycle --canary writes the share into the canary's manifest; a server cap below it would quietly shrink the
    experiment the trainer judges (its interval would be wider than the run planned for)."""
    with_trainer = {name: docs for name, docs in rendered.items() if any(d["kind"] == "CronJob" for d in docs)}
    assert {"base", "prod"} <= set(with_trainer)
    for overlay, docs in with_trainer.items():
        args = command_line(container(one(docs, "CronJob", TRAINER), "trainer"))
        config = server_config(one(docs, "Deployment", SERVER))
        assert 0 < args.canary <= config.max_canary_fraction, overlay


def test_a_refused_gate_fails_the_job_at_once_instead_of_retrying(rendered: dict[str, list[Doc]]) -> None:
    job = one(rendered["base"], "CronJob", TRAINER)["spec"]["jobTemplate"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"
    rules = job["podFailurePolicy"]["rules"]
    fail_job = {code for r in rules if r["action"] == "FailJob" for code in r.get("onExitCodes", {}).get("values", [])}
    assert EXIT_REFUSED == 3 and EXIT_REFUSED in fail_job, "the gate's answer would be the same on a retry"
    assert 2 in fail_job, "a usage error would be the same on a retry"
    counted = {code for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    assert 1 not in counted, "exit 1 (a failure: I/O, a crash) is what backoffLimit retries"
    assert all(r["onExitCodes"]["operator"] == "In" and r["onExitCodes"].get("containerName") == "trainer"
               for r in rules if "onExitCodes" in r)
    assert 1 <= job["backoffLimit"] <= 3
    assert any(r["action"] == "Ignore" and r.get("onPodConditions", [{}])[0].get("type") == "DisruptionTarget" for r in rules)


# --- overlays and the rollback Job -------------------------------------------------------------


def test_gpu_overlay_puts_the_trainer_on_a_gpu_and_leaves_the_servers_alone(rendered: dict[str, list[Doc]]) -> None:
    gpu, prod = rendered["gpu"], rendered["prod"]
    cronjob = one(gpu, "CronJob", TRAINER)
    trainer = container(cronjob, "trainer")
    assert int(trainer["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert command_line(trainer).device == "cuda", "fail rather than train on CPU when the GPU is missing"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec_of(cronjob)["tolerations"])
    assert trainer["image"].endswith("-cuda")
    assert "nvidia.com/gpu" not in str(one(prod, "CronJob", TRAINER))
    others = [d for d in gpu if d["kind"] != "CronJob"]
    assert others == [d for d in prod if d["kind"] != "CronJob"], "the gpu overlay changes the trainer only"


def test_prod_overlay_puts_everything_in_one_namespace_from_one_registry(rendered: dict[str, list[Doc]]) -> None:
    prod = rendered["prod"]
    [namespace] = of_kind(prod, "Namespace")
    name = namespace["metadata"]["name"]
    assert all(d["metadata"]["namespace"] == name for d in prod if d["kind"] != "Namespace")
    images = {c["image"] for d in prod for c in containers(d)}
    assert images == {"registry.example.com/shopping-agent:0.1.0", "registry.example.com/shopping-agent-trainer:0.1.0"}
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert "release" in one(prod, kind, SERVER)["metadata"]["labels"], f"{kind}: Prometheus selects by this label"


def test_rollback_job_rolls_back_the_servers_weights_volume(rendered: dict[str, list[Doc]]) -> None:
    job, prod = one(rendered["jobs"], "Job", ROLLBACK), rendered["prod"]
    c = container(job, "rollback")
    args = command_line(c)
    assert (args.command, args.weights_command, args.to) == ("weights", "rollback", None)
    weights = mount(c, args.dir)
    assert not weights.get("readOnly", False), "rollback renames onto weights_active.bundle"
    deployment = one(prod, "Deployment", SERVER)
    config = server_config(deployment)
    server_weights = claim(deployment, mount(container(deployment, "server"), config.weights_dir))
    assert claim(job, weights)["claimName"] == server_weights["claimName"]
    assert job["metadata"]["namespace"] == deployment["metadata"]["namespace"], "keep k8s/jobs in step with the prod overlay"
    assert c["image"] == container(deployment, "server")["image"], "keep k8s/jobs in step with the prod overlay"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    with_version = parser().parse_args([*c["command"][1:], *c["args"], "--to=v42"])
    assert with_version.to == "v42"


def test_every_manifest_file_is_rendered_by_some_kustomization() -> None:
    used: set[Path] = set()

    def walk(directory: Path) -> None:
        used.add(directory / "kustomization.yaml")
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for entry in kustomization.get("resources", []):
            path = (directory / entry).resolve()
            if path.is_dir():
                walk(path)
            else:
                used.add(path)
        for patch in kustomization.get("patches", []):
            used.add((directory / patch["path"]).resolve())

    for path in VARIANTS.values():
        walk(path.resolve())
    files = {p.resolve() for p in K8S.rglob("*.yaml") if "monitoring" not in p.parts}
    assert files - {p.resolve() for p in used} == set(), "a manifest no kustomization applies"


def test_image_names_tags_and_labels_follow_one_convention(rendered: dict[str, list[Doc]]) -> None:
    """Images are shopping-agent (the Dockerfile's serve target) or shopping-agent-trainer, tagged with the project version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for variant, docs in rendered.items():
        for doc in docs:
            labels = doc["metadata"].get("labels", {})
            if doc["kind"] != "Namespace":
                assert labels.get("app.kubernetes.io/name") == "shopping-agent", f"{doc['kind']}/{doc['metadata']['name']}"
            assert labels.get("app.kubernetes.io/part-of") == "shopping-agent"
            for c in containers(doc):
                name, _, tag = c["image"].rpartition(":")
                assert name.rpartition("/")[2] in ("shopping-agent", "shopping-agent-trainer"), c["image"]
                assert tag == (f"{version}-cuda" if variant == "gpu" and c["name"] == "trainer" else version), f"{variant}: {c['image']}"
