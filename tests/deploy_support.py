"""Helpers shared by tests/test_deploy.py and tests/test_observability.py: loading the
compose file (with Compose's ``!reset`` / ``!override`` tags), the shipped dashboard and
alert rules, and finding the metric names a PromQL expression reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

import lanegate.metrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = DEPLOY / "compose-cpu.yml"
PROMETHEUS_YML = DEPLOY / "prometheus.yml"
ALERTS_YML = DEPLOY / "alerts.yml"
ALERTS_TEST_YML = DEPLOY / "alerts_test.yml"
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


class Reset:
    """Compose's ``!reset`` tag: the merged file drops this key."""

    def __repr__(self) -> str:
        return "!reset"


class Override:
    """Compose's ``!override`` tag: the value replaces the base one instead of merging."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    return Reset()


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))  # type: ignore[arg-type]


ComposeLoader.add_constructor("!reset", _reset)
ComposeLoader.add_constructor("!override", _override)


def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.load(f, Loader=ComposeLoader)


def merge(base: Any, over: Any) -> Any:
    """Compose's merge of an override file: mappings merge key by key, sequences of
    ports/volumes/... are appended, scalars replaced, ``!reset`` deletes and
    ``!override`` replaces."""
    if isinstance(over, Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = value.value if isinstance(value, Override) else value
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + [v for v in over if v not in base]
    return over


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


class MissingVariable(KeyError):
    """``${NAME:?message}`` with NAME unset or empty: Compose refuses to start."""


_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation of every string in ``value``: ``$NAME``,
    ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:?error}``,
    ``${NAME?error}``, ``${NAME:+alt}``, ``${NAME+alt}`` and ``$$`` (a literal ``$``)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        unset_or_empty = not current
        if op in (":-", "-"):
            return arg if (unset_or_empty if op == ":-" else current is None) else str(current)
        if op in (":?", "?"):
            if unset_or_empty if op == ":?" else current is None:
                raise MissingVariable(f"{name}: {arg}")
            return str(current)
        if op in (":+", "+"):
            return "" if (unset_or_empty if op == ":+" else current is None) else arg
        return current or ""

    return _VARIABLE.sub(one, value)


def compose_with(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as Compose runs it with ``env`` as the shell / ``.env``."""
    result: dict[str, Any] = interpolate(compose(), env)
    return result


def compose_cpu() -> dict[str, Any]:
    merged: dict[str, Any] = merge(compose(), load_yaml(COMPOSE_CPU))
    return merged


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def panel_queries() -> list[tuple[str, str]]:
    """(where, expr) for every query of every panel of every shipped dashboard."""
    out = []
    for name, dash in dashboards().items():
        for panel in panels(dash):
            for target in panel.get("targets", []):
                out.append((f"{name}: {panel['title']} [{target['refId']}]", target["expr"]))
    return out


def alert_rules() -> list[dict[str, Any]]:
    data = load_yaml(ALERTS_YML)
    return [rule for group in data["groups"] for rule in group["rules"]]


#: Grafana's interval macros, as the test evaluates them
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def expand_macros(expr: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return expr


_THRESHOLD = re.compile(
    r"^(?P<query>.*?\S)\s*(?:>=|<=|==|!=|>|<)\s*(?:bool\s+)?[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?\s*$",
    re.S,
)


def without_threshold(expr: str) -> str:
    """``<query> > 0.3`` -> ``<query>``: what the alert compares, series whether or not
    the threshold is breached."""
    match = _THRESHOLD.match(expr.strip())
    if match is None:
        raise ValueError(f"alert expression is not `<query> <op> <number>`: {expr}")
    return match.group("query")


_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan", "atan2",
})


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    s = expand_macros(expr)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', s)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s
    )
    s = re.sub(r"(?<![A-Za-z_:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", " ", s)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = match.group(0)
        if s[match.end():].lstrip().startswith("("):
            continue  # a function call
        if token.lower() in _KEYWORDS:
            continue
        names.add(token)
    return names


def defined_metrics() -> dict[str, str]:
    """Exported sample name -> metric family name, for every metric in lanegate/metrics.py."""
    out: dict[str, str] = {}
    for obj in vars(lanegate.metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        for family in obj.describe():
            name, kind = family.name, family.type
            if kind == "counter":
                out[name + "_total"] = out[name + "_created"] = name + "_total"
            elif kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count", "_created"):
                    out[name + suffix] = name
            else:
                out[name] = name
    return out


def family_of(sample_name: str) -> str:
    return defined_metrics()[sample_name]
