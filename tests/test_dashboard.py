"""deploy/grafana/tokenrelay.json asks Prometheus only for what gateways and workers export.

The exported names come from the processes' own code: every module that
imports prometheus_client is imported (their metrics register as they load),
the per-component families are created as a gateway and a worker create them,
and prometheus_client's registry says each family's name, type and labels.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from telemetry.metrics import metrics_of

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenrelay.json"
PACKAGES = ("bus", "gateway", "schemas", "telemetry", "tokenrelay", "workers")

PANELS = {
    "Time to first token p50/p95/p99 by priority",
    "Inter-token latency p50/p95/p99 by priority",
    "End-to-end latency p50/p95/p99 by priority",
    "Token throughput",
    "Running / waiting requests",
    "Consumer lag by priority",
    "Failovers by reason",
    "Cancellations by reason",
    "Errors by reason",
    "Timeouts",
    "Requests by outcome",
    "HTTP 4xx / 5xx answers",
    "Tokens by tenant",
    "Requests by tenant and outcome",
    "Requests in flight by tenant",
}
# What a family of each type exports (prometheus_client's text format; `_created` aside).
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}
METRIC = re.compile(r"tokenrelay_[a-z0-9_]+")
SELECTOR = re.compile(r"(tokenrelay_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def _modules_with_metrics() -> list[str]:
    """Every module of the project's packages that imports prometheus_client: where families are defined."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "prometheus_client" in path.read_text():
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
    return found


@pytest.fixture(scope="module")
def exported() -> dict[str, tuple[str, ...]]:
    """Each sample name the processes export -> the labels its series carry."""
    for module in _modules_with_metrics():
        importlib.import_module(module)
    for component in ("gateway", "worker"):  # as a gateway's and a worker's service create them
        metrics_of(component)
    samples: dict[str, tuple[str, ...]] = {}
    collectors = list(REGISTRY._collector_to_names)  # the registry's collectors, each family's labels on it
    for collector in collectors:
        labels = tuple(getattr(collector, "_labelnames", ()))
        for family in collector.describe() if hasattr(collector, "describe") else collector.collect():
            for suffix in SUFFIXES.get(family.type, ("",)):
                samples[family.name + suffix] = labels + (("le",) if suffix == "_bucket" else ())
    return samples


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows hold theirs
    return panels


def _targets(dashboard: dict) -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in _panels(dashboard) for target in panel.get("targets", [])]


def test_the_registry_holds_the_gateways_and_the_workers_families(exported):
    # The fixture's derivation is sound: a family of each type, from telemetry/metrics.py and from elsewhere.
    for name in (
        "tokenrelay_gateway_time_to_first_token_seconds_bucket",
        "tokenrelay_worker_requests_total",
        "tokenrelay_gateway_requests_running",
        "tokenrelay_gateway_failovers_total",
        "tokenrelay_gateway_requests_held",
        "tokenrelay_worker_tokens_after_cancel_total",
        "tokenrelay_gateway_http_responses_total",
    ):
        assert name in exported, name
    assert exported["tokenrelay_gateway_e2e_request_latency_seconds_bucket"] == ("model", "priority", "le")
    assert exported["tokenrelay_gateway_http_responses_total"] == ("route", "status")
    assert (
        "tokenrelay_gateway_failovers" not in exported
        and "tokenrelay_gateway_e2e_request_latency_seconds" not in exported
    )


def test_every_expression_names_only_exported_metrics(dashboard, exported):
    targets = _targets(dashboard)
    assert len(targets) >= 11
    unknown = []
    for title, target in targets:
        names = METRIC.findall(target["expr"])
        assert names, (title, target["expr"])
        unknown += [(title, name) for name in names if name not in exported]
    assert not unknown, f"not exported by any gateway or worker: {unknown}"


def test_every_label_an_expression_or_a_legend_uses_is_on_its_metric(dashboard, exported):
    wrong = []
    for title, target in _targets(dashboard):
        expr = target["expr"]
        names = [name for name in METRIC.findall(expr) if name in exported]
        if not names:
            continue  # an unknown metric: the test above names it
        common = set.intersection(*(set(exported[name]) for name in names))
        for name, matchers in SELECTOR.findall(expr):
            wrong += [(title, name, label) for label in MATCHER.findall(matchers) if label not in exported[name]]
        for clause in GROUPING.findall(expr):
            wrong += [(title, expr, label) for label in clause.replace(" ", "").split(",") if label not in common]
        # A legend can name only what the expression keeps: the outermost `by` clause's labels (less `le`,
        # which histogram_quantile takes away), or every label when nothing is aggregated.
        outer = GROUPING.search(expr)
        kept = set(outer.group(1).replace(" ", "").split(",")) - {"le"} if outer else common
        legend = LEGEND_LABEL.findall(target.get("legendFormat", ""))
        wrong += [(title, target["legendFormat"], label) for label in legend if label not in kept]
    assert not wrong, f"labels that are not there: {wrong}"


def test_every_selector_filters_by_the_model_variable_where_its_metric_has_a_model(dashboard, exported):
    unfiltered = []
    for title, target in _targets(dashboard):
        selectors = SELECTOR.findall(target["expr"])
        assert len(selectors) == len(METRIC.findall(target["expr"])), (title, target["expr"])
        for name, matchers in selectors:
            if "model" in exported.get(name, ()):
                assert 'model=~"$model"' in matchers, (title, target["expr"])
            else:
                unfiltered.append(name)
    # By route and status, and by tenant: no model to filter.
    tenants = ["tokenrelay_gateway_tenant_tokens_total", "tokenrelay_gateway_tenant_requests_total"]
    assert unfiltered == ["tokenrelay_gateway_http_responses_total"] * 2 + [
        *tenants,
        "tokenrelay_gateway_tenant_in_flight",
    ]


def test_http_errors_are_shown_by_status_class_and_as_0_before_the_first(dashboard):
    (panel,) = (panel for panel in _panels(dashboard) if panel["title"] == "HTTP 4xx / 5xx answers")
    assert [(target["legendFormat"], target["expr"]) for target in panel["targets"]] == [
        (
            f"{digit}xx",
            f'sum(rate(tokenrelay_gateway_http_responses_total{{status=~"{digit}.."}}[$__rate_interval])) or vector(0)',
        )
        for digit in "45"
    ]


def test_the_dashboard_has_every_panel_and_its_variables(dashboard, exported):
    assert dashboard["schemaVersion"] >= 39
    titles = {panel["title"] for panel in _panels(dashboard)}
    assert PANELS <= titles, f"missing: {PANELS - titles}"
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    found = re.fullmatch(r"label_values\((tokenrelay_[a-z0-9_]+),\s*model\)", query)
    assert found and "model" in exported[found.group(1)], query
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert all(target["datasource"] == panel["datasource"] for target in panel["targets"]), panel["title"]
