"""Static checks of the Kubernetes base in deploy/k8s (no cluster on the build machines):
every manifest against the pinned Kubernetes version's schemas with
``kubernetes-validate`` (strict: an unknown field fails), the KEDA resources against
KEDA's own CRD schemas (vendored in tests/schemas/keda), and the wiring between them:
names, selectors, ports, probes, settings, GPUs and lanes, the job stream, the drain."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_support import defined_metrics, metric_names

from lanegate.constants import JOB_GROUP, JOB_STREAM
from lanegate.settings import ENV_PREFIX, Settings, env_names, parse_value
from workers.process import FLUSH_TIMEOUT_S, REGISTRY_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KEDA_CRDS = Path(__file__).resolve().parent / "schemas" / "keda"
#: the Kubernetes version the manifests are written for (README "Kubernetes")
KUBERNETES_VERSION = "1.31.0"
#: seconds the gateway's preStop hook sleeps before its own drain starts
GATEWAY_SHUTDOWN_EXTRA_S = 5.0

Doc = dict[str, Any]


def kustomization() -> Doc:
    data: Doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def documents() -> list[tuple[str, Doc]]:
    out = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def by_kind(kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == kind}


def workloads() -> dict[str, Doc]:
    return {**by_kind("Deployment"), **by_kind("StatefulSet")}


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Doc) -> Doc:
    (only,) = pod_spec(workload)["containers"]
    result: Doc = only
    return result


def lanegate_workloads() -> dict[str, Doc]:
    return {n: w for n, w in by_kind("Deployment").items()
            if container(w)["command"][0] == "lanegate"}


def role(workload: Doc) -> str:
    command = container(workload)["command"]
    return str(command[command.index("--lane") + 1]) if command[1] == "worker" else command[1]


def config_env() -> dict[str, str]:
    data: dict[str, str] = by_kind("ConfigMap")["lanegate-config"]["data"]
    return data


def setting(workload: Doc, name: str) -> Any:
    """The value a lanegate container gets for a setting: its env, else the ConfigMap,
    else the default; parsed as the setting's type."""
    key = ENV_PREFIX + name.upper()
    env = {e["name"]: e.get("value") for e in container(workload).get("env", [])}
    raw = env.get(key, config_env().get(key))
    default = getattr(Settings(), name)
    return default if raw is None else parse_value(name, type(default), raw)


def secret_keys() -> set[str]:
    (generator,) = kustomization()["secretGenerator"]
    text = (K8S / (generator["envs"][0] + ".example")).read_text()
    return {line.split("=", 1)[0] for line in text.splitlines()
            if line.strip() and not line.startswith("#")}


def unknown_fields(value: Any, schema: Doc, path: str = "") -> list[str]:
    """Fields the API server would prune as unknown (``kubectl --validate=strict``):
    structural schemas list every field unless they preserve unknown ones."""
    out: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                out += unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def keda_schema(kind: str) -> Doc:
    for path in KEDA_CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
            schema: Doc = version["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(kind)


# --- the base ---------------------------------------------------------------------


def test_kustomization_names_every_manifest_and_only_existing_ones() -> None:
    listed = kustomization()["resources"]
    assert len(listed) == len(set(listed))
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists missing {name}"
    on_disk = {p.name for p in K8S.glob("*.yaml")} | {p.name for p in K8S.glob("*.yml")}
    assert on_disk - {"kustomization.yaml"} == set(listed)
    (generator,) = kustomization()["secretGenerator"]
    assert (K8S / (generator["envs"][0] + ".example")).is_file()
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "deploy/k8s/" + generator["envs"][0] in ignored, "the real secrets stay out of git"


@pytest.mark.parametrize("strict", [False, True])
def test_every_builtin_manifest_validates_against_the_pinned_kubernetes(strict: bool) -> None:
    checked, errors = 0, []
    for name, doc in documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=strict)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {doc['kind']}/{doc['metadata']['name']}: "
                          f"{'.'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert errors == []
    assert checked >= 12


def test_keda_resources_validate_against_the_keda_crds() -> None:
    keda = [(n, d) for n, d in documents() if d["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for _, d in keda} == {"ScaledObject", "TriggerAuthentication"}
    for name, doc in keda:
        schema = keda_schema(doc["kind"])
        jsonschema.validate(doc, schema)
        assert unknown_fields(doc, schema) == [], f"{name}: unknown fields"
    # the checker itself catches a misspelt field
    broken = {**by_kind("ScaledObject")["batch-worker"]}
    broken["spec"] = {**broken["spec"], "minReplicas": 1}
    assert unknown_fields(broken, keda_schema("ScaledObject")) == [".spec.minReplicas"]


def test_names_and_references_resolve() -> None:
    docs = documents()
    names = {(d["kind"], d["metadata"]["name"]) for _, d in docs}
    assert len(names) == len(docs), "duplicate kind/name"
    assert all("namespace" not in d["metadata"] for _, d in docs), "kustomize sets it"
    keys = secret_keys()
    assert keys == {"redis-password", "api-keys", "internal-token"}
    for workload in workloads().values():
        spec = pod_spec(workload)
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "lanegate-secrets"
                    assert ref["key"] in keys
        for volume in spec.get("volumes", []):
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in names
    for auth in by_kind("TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["name"] == "lanegate-secrets"
            assert ref["key"] in keys


def test_the_gateway_and_realtime_workers_share_the_internal_token() -> None:
    for name, workload in workloads().items():
        env = {e["name"]: e for c in pod_spec(workload)["containers"] for e in c.get("env", [])}
        if name in ("gateway", "realtime-worker"):
            ref = env["LANEGATE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("lanegate-secrets", "internal-token")


def test_services_and_budgets_select_their_pods() -> None:
    pods = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads().items()}
    for name, workload in workloads().items():
        assert workload["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
    for name, service in by_kind("Service").items():
        matched = [n for n, labels in pods.items()
                   if service["spec"]["selector"].items() <= labels.items()]
        assert matched == [name], f"service {name} selects {matched}"
        ports = {p["name"]: p["containerPort"] for p in container(workloads()[name])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    budgets = by_kind("PodDisruptionBudget")
    assert set(budgets) == set(lanegate_workloads())
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"].items() <= pods[name].items()


# --- lanegate's wiring ----------------------------------------------------------------


def test_every_lanegate_env_var_is_a_known_setting() -> None:
    known = env_names()
    for key, raw in config_env().items():
        assert key in known, f"ConfigMap: {key} is not a lanegate setting"
        name = key[len(ENV_PREFIX):].lower()
        parse_value(name, type(getattr(Settings(), name)), raw)
    for name, workload in lanegate_workloads().items():
        for env in container(workload).get("env", []):
            if env["name"].startswith(ENV_PREFIX):
                assert env["name"] in known, f"{name}: {env['name']}"
        url = setting(workload, "redis_url")
        assert re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@redis:6379/0", url), name
        env_names_in_order = [e["name"] for e in container(workload)["env"]]
        # $(VAR) expands only from variables defined before it
        assert env_names_in_order.index("REDIS_PASSWORD") < \
            env_names_in_order.index("LANEGATE_REDIS_URL")


def test_probes_ports_and_commands_agree() -> None:
    roles = {role(w): w for w in lanegate_workloads().values()}
    assert set(roles) == {"gateway", "realtime", "batch"}
    for kind, workload in roles.items():
        c = container(workload)
        port = setting(workload, "port" if kind == "gateway" else "worker_port")
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert list(named.values()) == [port]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert named[c[probe]["httpGet"]["port"]] == port
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        host = setting(workload, "host" if kind == "gateway" else "worker_host")
        assert host == "0.0.0.0", f"{kind} must listen beyond loopback"
        # the workers decode on GPUs: the image with cuBLAS (Dockerfile target `cuda`)
        assert c["image"] == ("lanegate" if kind == "gateway" else "lanegate-cuda")
        assert pod_spec(workload)["securityContext"]["runAsUser"] == 10001  # the Dockerfile's
    # the gateway reaches a realtime worker at the pod IP it advertises
    env = {e["name"]: e for e in container(roles["realtime"])["env"]}
    advertised = env["LANEGATE_WORKER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert advertised == "status.podIP"
    # the gateway writes uploads where the batch workers read them
    for kind in ("gateway", "batch"):
        mounts = {m["mountPath"]: m["name"] for m in container(roles[kind])["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(roles[kind])["volumes"]}
        blob_volume = volumes[mounts[setting(roles[kind], "blob_dir")]]
        assert blob_volume["persistentVolumeClaim"]["claimName"] == "lanegate-blobs"
    (claim,) = by_kind("PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_lanes_get_their_own_gpus_and_never_share_a_node() -> None:
    roles = {role(w): w for w in lanegate_workloads().values()}
    lane_of_node: dict[tuple[str, str], str] = {}
    for lane in ("realtime", "batch"):
        spec = pod_spec(roles[lane])
        limits = container(roles[lane])["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1, f"{lane} requests no GPU"
        selector = spec["nodeSelector"]
        assert selector == {"lanegate.io/lane": lane}
        for item in selector.items():
            assert lane_of_node.setdefault(item, lane) == lane
        tolerated = {(t["key"], t.get("value")) for t in spec["tolerations"]
                     if t["key"] == "lanegate.io/lane"}
        assert tolerated == {("lanegate.io/lane", lane)}, "tolerates only its own lane's taint"
    gateway = container(roles["gateway"])
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})
    assert "nodeSelector" not in pod_spec(roles["gateway"])


def test_redis_keeps_an_aof_and_needs_the_password() -> None:
    redis_set = by_kind("StatefulSet")["redis"]
    args = container(redis_set)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    data_dir = args[args.index("--dir") + 1]
    assert data_dir in {m["mountPath"] for m in container(redis_set)["volumeMounts"]}
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e for e in container(redis_set)["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert redis_set["spec"]["volumeClaimTemplates"]


def test_batch_pool_scales_on_the_job_streams_pending_entries() -> None:
    scaled = by_kind("ScaledObject")["batch-worker"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "batch-worker"
    assert role(by_kind("Deployment")["batch-worker"]) == "batch"
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    auths = by_kind("TriggerAuthentication")
    for trigger in triggers:
        meta = trigger["metadata"]
        assert meta["stream"] == JOB_STREAM
        assert meta["consumerGroup"] == JOB_GROUP
        assert meta["address"].split(".")[0] == "redis"
        assert meta["address"].endswith(":6379")
        auth = auths[trigger["authenticationRef"]["name"]]
        assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"password"}
    pending = next(t["metadata"] for t in triggers if "pendingEntriesCount" in t["metadata"])
    # a saturated pool (every worker holding BATCH_MAX_JOBS) must ask for more replicas
    max_jobs = setting(by_kind("Deployment")["batch-worker"], "batch_max_jobs")
    assert 0 < int(pending["pendingEntriesCount"]) < max_jobs
    assert any("lagCount" in t["metadata"] for t in triggers)


def test_realtime_pool_scales_on_free_slots() -> None:
    scaled = by_kind("ScaledObject")["realtime-worker"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "realtime-worker"
    assert scaled["spec"]["minReplicaCount"] >= 1, "never scaled to zero: streams need a slot"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    names = metric_names(query)
    assert "lanegate_free_slots" in names
    assert names <= set(defined_metrics()), f"unknown metrics {names - set(defined_metrics())}"
    assert 'lane="realtime"' in query
    assert 0 < float(trigger["metadata"]["threshold"]) < 1  # a used fraction, below full
    assert trigger["metricType"] == "Value"


def test_grace_periods_cover_the_drain() -> None:
    roles = {role(w): w for w in lanegate_workloads().values()}
    for kind, workload in roles.items():
        drain = setting(workload, "drain_timeout_s")
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        if kind == "realtime":
            needed = drain + 2 * FLUSH_TIMEOUT_S + REGISTRY_TIMEOUT_S
        elif kind == "gateway":
            pre_stop = container(workload)["lifecycle"]["preStop"]["exec"]["command"]
            assert pre_stop[0] == "sleep"
            needed = float(pre_stop[1]) + drain + GATEWAY_SHUTDOWN_EXTRA_S
        else:
            needed = drain + setting(workload, "heartbeat_s")
        assert grace > needed, f"{kind}: {grace} s of grace for a drain of {needed} s"
