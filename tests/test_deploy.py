"""Static checks of the deployment (there is no Docker engine on the build machines):
docker-compose.yml and its CPU variant, the Dockerfile, the Prometheus config and alert
rules (with the real ``promtool``), and the Grafana provisioning and dashboard."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from conftest import free_port
from deploy_support import (
    ALERTS_TEST_YML,
    ALERTS_YML,
    COMPOSE_CPU,
    DASHBOARD_DIR,
    PROMETHEUS_YML,
    PROVISIONING,
    ROOT,
    MissingVariable,
    alert_rules,
    compose,
    compose_cpu,
    compose_with,
    dashboards,
    defined_metrics,
    interpolate,
    load_yaml,
    metric_names,
    panel_queries,
    panels,
    without_threshold,
)

from gateway.app import anonymous_refusal
from lanegate.cli import COMMANDS, build_parser
from lanegate.settings import ENV_PREFIX, Appendfsync, Settings, env_names, parse_value
from lanegate.webhooks import webhooks_enabled

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing (apt-get install prometheus)"
)


# --- helpers ---------------------------------------------------------------------------

#: what an operator puts in .env (both are required)
SECRETS = {"LANEGATE_REDIS_PASSWORD": "5f1c0ffee" * 4, "GRAFANA_ADMIN_PASSWORD": "g-7d41aa",
           "LANEGATE_INTERNAL_TOKEN": "1e7a2b" * 6}


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def lanegate_services(data: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Services that run the lanegate image."""
    svcs = (data or compose())["services"]
    return {n: s for n, s in svcs.items() if s.get("command", [""])[0] == "lanegate"}


def role(service: dict[str, Any]) -> str:
    """gateway, realtime, batch or mixed."""
    command = service["command"]
    if command[1] == "worker":
        return str(command[command.index("--lane") + 1])
    return str(command[1])


def env(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: str(v) for k, v in raw.items()}


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def metrics_port(service: dict[str, Any]) -> int:
    """The port the process serves /metrics on: the gateway's --port, a worker's
    LANEGATE_WORKER_PORT (or --worker-port)."""
    command = service["command"]
    if role(service) == "gateway":
        value = flag(command, "--port") or env(service).get("LANEGATE_PORT")
        return int(value or Settings.port)
    value = flag(command, "--worker-port") or env(service).get("LANEGATE_WORKER_PORT")
    assert value, "workers need a fixed LANEGATE_WORKER_PORT in compose"
    assert int(value) > 0, "workers need a fixed LANEGATE_WORKER_PORT in compose"
    return int(value)


def healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"https?://[^'\" ]+", test)
    assert match, f"healthcheck has no URL: {test}"
    return match.group(0)


def volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source (named volume or ./path)."""
    out = {}
    for item in service.get("volumes", []):
        if isinstance(item, dict):
            out[item["target"]] = item["source"]
        else:
            parts = item.split(":")
            out[parts[1]] = parts[0]
    return out


def device_ids(service: dict[str, Any]) -> set[str]:
    devices = (service.get("deploy", {}).get("resources", {}).get("reservations", {})
               .get("devices", []))
    ids: set[str] = set()
    for device in devices:
        ids.update(str(i) for i in device.get("device_ids", []))
    return ids


def cpus(cpuset: str) -> set[int]:
    out: set[int] = set()
    for part in cpuset.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# --- compose ---------------------------------------------------------------------------


def test_compose_has_every_process() -> None:
    svcs = services()
    assert {"redis", "gateway", "prometheus", "grafana"} <= set(svcs)
    roles = [role(s) for s in lanegate_services().values()]
    assert roles.count("gateway") == 1
    assert roles.count("realtime") >= 1
    assert roles.count("batch") >= 1
    for name, svc in lanegate_services().items():
        assert svc["build"]["context"] == ".", f"{name} builds the repository's Dockerfile"


def test_every_command_is_a_real_lanegate_subcommand() -> None:
    parser = build_parser()
    for name, svc in lanegate_services().items():
        command = svc["command"]
        args = parser.parse_args(command[1:])  # unknown flags or choices exit here
        module = COMMANDS[args.command].split(":")[0]
        assert importlib.util.find_spec(module) is not None, (
            f"service {name}: `lanegate {args.command}` needs {module}, which is missing"
        )
        result = subprocess.run(
            [sys.executable, "-m", "lanegate.cli", command[1], "--help"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        assert "usage: lanegate" in result.stdout


def test_every_lanegate_env_var_is_a_known_setting() -> None:
    known = env_names()
    kinds = {ENV_PREFIX + f.name.upper(): type(f.default) for f in fields(Settings)}
    for data in (compose(), compose_cpu()):
        for name, svc in data["services"].items():
            for key, value in env(svc).items():
                if not key.startswith(ENV_PREFIX):
                    continue
                assert key in known, f"service {name}: {key} is not a lanegate setting"
                if "${" not in value:  # interpolated from the host's environment
                    parse_value(key[len(ENV_PREFIX):].lower(), kinds[key], value)
    dockerfile = (ROOT / "Dockerfile").read_text()
    for key in re.findall(r"\b(LANEGATE_[A-Z_]+)=", dockerfile):
        assert key in known, f"Dockerfile: {key} is not a lanegate setting"


def test_volumes_and_blob_store_agree() -> None:
    data = compose()
    declared = set(data.get("volumes", {}))
    used: set[str] = set()
    for name, svc in data["services"].items():
        for target, source in volume_mounts(svc).items():
            if source.startswith((".", "/")):
                assert (ROOT / source).resolve().exists(), f"{name}: {source} missing"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
                used.add(source)
            assert target.startswith("/"), f"{name}: {target}"
    assert used == declared, f"declared but unused volumes: {declared - used}"

    # The gateway writes uploads and the batch workers read them: one shared volume
    # mounted where LANEGATE_BLOB_DIR points.
    blob_sources = set()
    for name, svc in lanegate_services().items():
        if role(svc) not in ("gateway", "batch", "mixed"):
            continue
        blob_dir = env(svc).get("LANEGATE_BLOB_DIR")
        assert blob_dir, f"{name} needs LANEGATE_BLOB_DIR"
        mounts = volume_mounts(svc)
        assert blob_dir in mounts, f"{name}: nothing mounted at {blob_dir}"
        blob_sources.add(mounts[blob_dir])
    assert len(blob_sources) == 1, f"gateway and batch workers disagree: {blob_sources}"

    # Redis keeps its data in a volume with AOF on.
    redis_svc = data["services"]["redis"]
    command = " ".join(redis_svc["command"])
    assert "--appendonly yes" in command
    data_dir = flag(redis_svc["command"], "--dir") or "/data"
    assert data_dir in volume_mounts(redis_svc)


def test_ports_addresses_and_healthchecks_agree() -> None:
    data = compose_with(SECRETS)  # as Compose runs it: the Redis URL carries the password
    redis_url = None
    paths = set()
    for name, svc in lanegate_services(data).items():
        port = metrics_port(svc)
        environment = env(svc)
        url = urlsplit(healthcheck_url(svc))
        assert url.port == port, f"{name}: healthcheck port {url.port} != {port}"
        assert url.path in ("/healthz", "/readyz"), f"{name}: {url.path}"
        paths.add(url.path)
        if role(svc) == "gateway":
            assert flag(svc["command"], "--host") == "0.0.0.0"
            published = [str(p).split(":") for p in svc.get("ports", [])]
            assert [str(port), str(port)] in published, f"gateway port {port} not published"
        else:
            assert environment.get("LANEGATE_WORKER_HOST") == "0.0.0.0", name
            assert str(port) in [str(p) for p in svc.get("expose", [])], name
        if role(svc) in ("realtime", "mixed"):
            # The gateway reaches a realtime worker by its service name.
            assert environment.get("LANEGATE_WORKER_ADVERTISE_HOST") == name
            assert environment.get("LANEGATE_WORKER_ID"), name
        url_value = environment.get("LANEGATE_REDIS_URL")
        assert url_value, f"{name} needs LANEGATE_REDIS_URL"
        assert redis_url in (None, url_value)
        redis_url = url_value
        assert "redis" in svc.get("depends_on", {}), name
    assert paths == {"/healthz", "/readyz"}
    assert redis_url is not None
    parsed = urlsplit(redis_url)
    assert parsed.hostname in data["services"]
    assert parsed.port == 6379


def test_lanes_get_disjoint_gpus() -> None:
    realtime: list[set[str]] = []
    batch: set[str] = set()
    for name, svc in lanegate_services().items():
        ids = device_ids(svc)
        if role(svc) == "realtime":
            assert ids, f"{name} reserves no GPU"
            realtime.append(ids)
        elif role(svc) == "batch":
            assert ids, f"{name} reserves no GPU"
            batch |= ids
        else:
            assert not ids, f"{name} should not hold a GPU"
    realtime_ids = set().union(*realtime)
    assert realtime_ids == {"0", "1"}
    assert batch == {"2"}  # the engine decodes on one device: one GPU per batch service
    assert sum(len(s) for s in realtime) == len(realtime_ids), "realtime workers share a GPU"


def test_cpu_variant_pins_lanes_to_disjoint_cpusets() -> None:
    base = compose()
    override = load_yaml(COMPOSE_CPU)
    assert set(override["services"]) <= set(base["services"])
    merged = compose_cpu()
    sets: dict[str, set[int]] = {}
    for name, svc in lanegate_services(merged).items():
        assert not device_ids(svc), f"{name} still reserves a GPU in the CPU variant"
        if role(svc) != "gateway":
            assert "cpuset" in svc, f"{name} is not pinned"
            sets[name] = cpus(str(svc["cpuset"]))
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if role(merged["services"][a]) == role(merged["services"][b]) == "batch":
                continue
            assert not sets[a] & sets[b], f"{a} and {b} share CPUs"


def dockerfile_stages() -> dict[str, str]:
    """Stage name -> what it is built FROM (another stage or an image)."""
    text = (ROOT / "Dockerfile").read_text()
    return {m[1]: m[0] for m in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)}


def test_dockerfile_is_slim_nonroot_and_without_extras() -> None:
    text = (ROOT / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert bases
    stages = dockerfile_stages()
    images = [b for b in bases if b not in stages]
    assert images
    assert all(b == "python:3.11-slim" for b in images)
    assert list(stages)[-1] == "cpu", "a plain `docker build .` must give the CPU image"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users
    assert users[-1] not in ("root", "0")
    installs = re.findall(r"pip install (?!--upgrade)(.+)", text)
    assert installs
    assert all("[" not in i for i in installs), "no extras in the image"
    for src in re.findall(r"^COPY\s+(?!--from)(.+)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    ignore = (ROOT / ".dockerignore").read_text().split()
    copied = set(re.findall(r"^COPY\s+(?!--from)(\S+)\s+\./\1$", text, re.M))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert f"!{package}/" in ignore, f".dockerignore leaves out {package}"
        assert package in copied, f"the Dockerfile does not copy {package}"


def ctranslate2_nvidia_libraries() -> set[str]:
    """The NVIDIA libraries the installed CTranslate2 library names (it loads them itself)."""
    import ctranslate2

    libs = Path(ctranslate2.__file__).parent.parent / "ctranslate2.libs"
    found: set[str] = set()
    for lib in libs.glob("libctranslate2*.so*"):
        found |= {m.decode() for m in re.findall(rb"lib(?:cudnn|cublas|cudart|cufft)[A-Za-z_]*"
                                                 rb"\.so\.\d+", lib.read_bytes())}
    return found


def test_the_cuda_image_adds_what_ctranslate2_loads_and_the_workers_run_it() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages()
    assert stages["cuda"] == "runtime"
    assert stages["cpu"] == "runtime"
    assert stages["build-cuda"] == "build"
    # the installed wheel asks for cuBLAS 12 alone; the image brings exactly that
    assert ctranslate2_nvidia_libraries() == {"libcublas.so.12"}
    assert re.search(r'pip install "nvidia-cublas-cu12==12\.\*"', text)
    assert "cudnn" not in text.split("FROM build AS build-cuda", 1)[1].lower()
    library_path = re.search(r"LD_LIBRARY_PATH=(\S+)", text)
    assert library_path is not None
    assert library_path[1].endswith("/site-packages/nvidia/cublas/lib")
    assert "/opt/lanegate/lib/python3.11/" in library_path[1]  # the venv of python:3.11
    for name, svc in lanegate_services().items():
        target = svc["build"]["target"]
        assert target == ("cpu" if role(svc) == "gateway" else "cuda"), name
        assert env(svc)["LANEGATE_ENGINE"] == "whisper"
    for name, svc in lanegate_services(compose_cpu()).items():
        assert svc["build"]["target"] == "cpu", f"{name} runs the CUDA image without a GPU"
        if role(svc) != "gateway":
            assert env(svc)["LANEGATE_DEVICE"] == "cpu"


# --- secure by default ------------------------------------------------------------------

def settings_of(service: dict[str, Any]) -> Settings:
    """The settings a lanegate service runs with (its environment and --host)."""
    host = flag(service["command"], "--host")
    return Settings.from_env(env(service), **({"host": host} if host else {}))


def test_interpolation_follows_compose() -> None:
    env_ = {"SET": "v", "EMPTY": ""}
    cases = {"${SET}": "v", "$SET/x": "v/x", "${UNSET}": "", "${UNSET:-d}": "d",
             "${EMPTY:-d}": "d", "${EMPTY-d}": "", "${SET:+alt}": "alt", "${EMPTY:+alt}": "",
             "${EMPTY+alt}": "alt", "$${SET}": "${SET}", "${SET:?need it}": "v"}
    for raw, want in cases.items():
        assert interpolate(raw, env_) == want, raw
    for raw in ("${UNSET:?need it}", "${EMPTY:?need it}", "${UNSET?need it}"):
        with pytest.raises(MissingVariable, match="need it"):
            interpolate(raw, env_)
    assert interpolate("${EMPTY?fine}", env_) == ""


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_does_not_start_without_its_secrets(missing: str) -> None:
    with pytest.raises(MissingVariable, match=missing):
        compose_with({k: v for k, v in SECRETS.items() if k != missing})
    with pytest.raises(MissingVariable, match=missing):
        compose_with({**SECRETS, missing: ""})
    assert compose_with(SECRETS)["services"]


def test_redis_requires_the_password_that_every_service_is_given(tmp_path: Path) -> None:
    data = compose_with(SECRETS)
    password = SECRETS["LANEGATE_REDIS_PASSWORD"]
    redis_svc = data["services"]["redis"]
    assert "ports" not in redis_svc, "Redis must not be published to the host"
    assert flag(redis_svc["command"], "--requirepass") == password
    assert env(redis_svc)["REDISCLI_AUTH"] == password  # the healthcheck's redis-cli
    urls = {name: env(svc)["LANEGATE_REDIS_URL"] for name, svc in lanegate_services(data).items()}
    assert set(urls) == set(lanegate_services(data))
    for name, url in urls.items():
        parts = urlsplit(url)
        assert (parts.password, parts.hostname, parts.port) == (password, "redis", 6379), name

    # a real redis-server with compose's arguments: the services' URL gets in, nobody else
    argv = list(redis_svc["command"])
    argv[argv.index("--dir") + 1] = str(tmp_path)
    port = free_port()
    proc = subprocess.Popen([*argv, "--port", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis.from_url(next(iter(urls.values())).replace(
            "@redis:6379", f"@127.0.0.1:{port}"), socket_connect_timeout=1)
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        client.close()
        anonymous = redis.Redis(port=port, socket_connect_timeout=1)
        with pytest.raises(redis.exceptions.RedisError, match=r"(?i)auth"):
            anonymous.ping()
        anonymous.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_gateway_refuses_to_start_open_unless_keys_or_allow_anonymous() -> None:
    def gateway(extra: dict[str, str]) -> Settings:
        svcs = lanegate_services(compose_with({**SECRETS, **extra}))
        (svc,) = [s for s in svcs.values() if role(s) == "gateway"]
        return settings_of(svc)

    default = gateway({})
    assert default.host == "0.0.0.0"
    assert (default.api_key_set, default.allow_anonymous) == (frozenset(), False)
    assert anonymous_refusal(default) is not None  # exits 2 (tests/test_secure_defaults.py)
    assert anonymous_refusal(gateway({"LANEGATE_API_KEYS": "k1,k2"})) is None
    assert anonymous_refusal(gateway({"LANEGATE_ALLOW_ANONYMOUS": "true"})) is None


def test_prometheus_is_internal_and_cannot_be_reloaded_or_stopped_over_http() -> None:
    prom = services()["prometheus"]
    assert "ports" not in prom, "Prometheus has no auth: it is not published by default"
    assert "9090" in [str(p) for p in prom["expose"]]
    for option in ("--web.enable-lifecycle", "--web.enable-admin-api"):
        assert not any(str(arg).startswith(option) for arg in prom["command"]), option


def test_grafana_admin_password_comes_from_the_environment_and_never_defaults() -> None:
    raw = env(services()["grafana"])
    no_default = "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}"
    assert raw["GF_SECURITY_ADMIN_PASSWORD"] == no_default
    grafana = env(compose_with(SECRETS)["services"]["grafana"])
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == SECRETS["GRAFANA_ADMIN_PASSWORD"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_USERS_ALLOW_SIGN_UP"] == "false"


def test_webhook_secret_and_address_policy_come_from_the_environment() -> None:
    for svc in lanegate_services(compose_with(SECRETS)).values():
        settings = settings_of(svc)
        assert not webhooks_enabled(settings)  # no secret: webhooks refused, none sent
        assert not settings.webhook_allow_private
    hooked = compose_with({**SECRETS, "LANEGATE_WEBHOOK_SECRET": "whsec-1"})
    for svc in lanegate_services(hooked).values():
        assert settings_of(svc).webhook_secret == "whsec-1"


def test_appendfsync_is_everysec_unless_the_operator_chooses() -> None:
    def appendfsync(extra: dict[str, str]) -> str | None:
        return flag(compose_with({**SECRETS, **extra})["services"]["redis"]["command"],
                    "--appendfsync")

    assert appendfsync({}) == Appendfsync.EVERYSEC
    assert appendfsync({"LANEGATE_REDIS_APPENDFSYNC": "always"}) == Appendfsync.ALWAYS


# --- prometheus --------------------------------------------------------------------------


def test_prometheus_targets_match_the_services() -> None:
    config = load_yaml(PROMETHEUS_YML)
    targets: set[tuple[str, int]] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A"
            for host in dns["names"]:
                targets.add((host, int(dns["port"])))
    expected = {(name, metrics_port(svc)) for name, svc in lanegate_services().items()}
    assert targets == expected

    # rule files sit next to the config, and compose mounts both in one directory
    prom = services()["prometheus"]
    mounts = volume_mounts(prom)
    config_target = next(t for t, s in mounts.items() if s.endswith("deploy/prometheus.yml"))
    assert f"--config.file={config_target}" in prom["command"]
    for rule_file in config["rule_files"]:
        source = next(s for t, s in mounts.items()
                      if t == str(Path(config_target).parent / rule_file))
        assert (ROOT / source).resolve() == ALERTS_YML


@needs_promtool
def test_promtool_check_config_and_rules() -> None:
    assert PROMTOOL is not None
    for args in (["check", "config", str(PROMETHEUS_YML)],
                 ["check", "rules", str(ALERTS_YML)],
                 ["test", "rules", str(ALERTS_TEST_YML)]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True,
                                timeout=60, cwd=ALERTS_YML.parent)
        assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_cover_the_red_lines() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert len(rules) == 5
    exprs = " ".join(r["expr"] for r in rules.values())
    for metric in ("lanegate_partial_latency_seconds_bucket",
                   "lanegate_step_duration_seconds_bucket",
                   "lanegate_queue_oldest_age_seconds", "lanegate_workers",
                   "lanegate_rejections_total"):
        assert metric in exprs
    partial = next(r for r in rules.values() if "partial_latency" in r["expr"])
    assert partial["expr"].rstrip().endswith("> 0.3")
    assert partial["for"] == "5m"
    step = next(r for r in rules.values() if "step_duration" in r["expr"])
    assert step["expr"].rstrip().endswith("> 0.05")
    for rule in rules.values():
        without_threshold(rule["expr"])  # every alert is `<query> <op> <number>`
        assert rule["annotations"]["summary"]


def test_alert_expressions_name_only_defined_metrics() -> None:
    defined = defined_metrics()
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= set(defined), f"{rule['alert']}: unknown {names - set(defined)}"


# --- grafana -------------------------------------------------------------------------------


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    grafana = services()["grafana"]
    mounts = volume_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"].rstrip("/").endswith("deploy/grafana/provisioning")
    datasources = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert len(datasources) == 1
    source = datasources[0]
    assert source["type"] == "prometheus"
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus"
    assert url.hostname in services()
    # Grafana reads Prometheus on the compose network, where it is exposed (not published)
    assert str(url.port) in [str(p) for p in services()["prometheus"]["expose"]]
    providers = load_yaml(PROVISIONING / "dashboards" / "lanegate.yml")["providers"]
    path = providers[0]["options"]["path"]
    assert (ROOT / mounts[path]).resolve() == DASHBOARD_DIR
    for dash in dashboards().values():
        for panel in panels(dash):
            for target in [panel, *panel.get("targets", [])]:
                if "datasource" in target:
                    assert target["datasource"] == {"type": "prometheus", "uid": source["uid"]}


def test_dashboard_is_valid_and_names_only_defined_metrics() -> None:
    all_dashboards = dashboards()
    assert all_dashboards, "no dashboard in deploy/grafana/dashboards"
    defined = defined_metrics()
    used_families = set()
    for name, dash in all_dashboards.items():
        assert dash["uid"], name
        assert dash["title"], name
        ids = [p["id"] for p in panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
    queries = panel_queries()
    assert queries
    for where, expr in queries:
        names = metric_names(expr)
        assert names, where
        assert names <= set(defined), f"{where}: unknown metric {names - set(defined)}"
        used_families |= {defined[n] for n in names}
    # every metric a process exports is on the dashboard
    assert used_families == set(defined.values())


def test_latency_panels_show_percentiles_and_the_red_lines() -> None:
    (dash,) = dashboards().values()
    wanted = ("lanegate_partial_latency_seconds", "lanegate_first_partial_seconds",
              "lanegate_final_latency_seconds", "lanegate_step_duration_seconds")
    for metric in wanted:
        panel = next(p for p in panels(dash)
                     if any(metric in t["expr"] for t in p.get("targets", [])))
        exprs = [t["expr"] for t in panel["targets"]]
        for q in ("0.5", "0.95", "0.99"):
            assert any(f"histogram_quantile({q}," in e and "lane" in e for e in exprs), metric
        steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert {s["value"] for s in steps} >= {0.05, 0.3}, metric
        assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line"
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_metric_buckets_resolve_the_step_budget_and_the_red_line() -> None:
    import lanegate.metrics as m

    for hist in (m.STEP_DURATION, m.FIRST_PARTIAL, m.PARTIAL_LATENCY, m.FINAL_LATENCY,
                 m.QUEUE_WAIT):
        bounds = set(hist._upper_bounds)
        assert {0.05, 0.3} <= bounds, hist._name
    for metric in (m.STEP_DURATION, m.REALTIME_FACTOR, m.ACTIVE_SESSIONS, m.FREE_SLOTS,
                   m.EVENT_LOOP_LAG,
                   m.SOFT_CUTS, m.AUDIO_SECONDS, m.JOB_DURATION, m.QUEUE_WAIT, m.JOBS):
        assert {"lane", "worker"} <= set(metric._labelnames), metric._name
    for metric in (m.FIRST_PARTIAL, m.PARTIAL_LATENCY, m.FINAL_LATENCY, m.QUEUE_DEPTH,
                   m.QUEUE_OLDEST_AGE, m.WORKERS, m.REJECTIONS):
        assert "lane" in metric._labelnames, metric._name


def test_compose_yaml_parses_with_plain_yaml_too() -> None:
    # the base file uses no custom tags, so any YAML tool (and Compose v1) reads it
    with (ROOT / "docker-compose.yml").open() as f:
        assert yaml.safe_load(f)["services"]


def test_dashboard_panels_do_not_overlap() -> None:
    for name, dash in dashboards().items():
        cells: dict[tuple[int, int], str] = {}
        for panel in panels(dash):
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, f"{name}: {panel['title']} is too wide"
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    other = cells.setdefault((x, y), panel["title"])
                    assert other == panel["title"], f"{name}: {other} overlaps {panel['title']}"


#: the Compose service keys this deployment uses (a typo would be ignored by YAML
#: and only fail on a machine with a Docker engine)
SERVICE_KEYS = frozenset({
    "build", "image", "command", "environment", "ports", "expose", "volumes",
    "healthcheck", "deploy", "depends_on", "restart", "stop_grace_period", "cpuset",
})
HEALTHCHECK_KEYS = frozenset({"test", "interval", "timeout", "retries", "start_period"})


def test_compose_uses_only_known_keys() -> None:
    for data in (compose(), compose_cpu()):
        assert set(data) <= {"name", "services", "volumes"} | {
            k for k in data if k.startswith("x-")}
        for name, svc in data["services"].items():
            assert set(svc) <= SERVICE_KEYS, f"{name}: {set(svc) - SERVICE_KEYS}"
            assert set(svc.get("healthcheck", {})) <= HEALTHCHECK_KEYS, name
            assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
            assert set(svc.get("deploy", {})) <= {"resources", "replicas"}, name
            for device in (svc.get("deploy", {}).get("resources", {})
                           .get("reservations", {}).get("devices", [])):
                assert set(device) <= {"driver", "device_ids", "count", "capabilities"}
                assert "gpu" in device["capabilities"]
