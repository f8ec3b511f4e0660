"""The committed Grafana dashboard (deploy/grafana/asyncinfer-fleet.json) reads only series the
code exports: every metric name in its queries is one a worker's or the gateway's registry
serves, checked against their real exposition; every family the fleet exports has a panel; and
the panels break the fleet down per worker and device."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer.gateway.metrics import GatewayMetrics
from asyncinfer.gateway.tensors import InferCall
from asyncinfer.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(30)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "asyncinfer-fleet.json"
#: A metric name in PromQL: a word followed by a selector, a range or the end of its argument.
NAME = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)")
#: Words that are PromQL's own (functions, aggregations, modifiers), never metrics.
PROMQL = {"sum", "max", "min", "avg", "rate", "histogram_quantile", "by", "without", "count"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def _exported() -> tuple[set[str], set[str]]:
    """(sample names, family names) a worker's and the gateway's registries serve, after one
    batch, every outcome, a retry and one gateway call."""
    worker = WorkerMetrics(device="cpu")
    worker.record_batch("mlp", "cpu", 4, 0.01, [0.001] * 4)
    for state, exc in (("SUCCESS", None), ("FAILURE", ValueError("x")), ("REVOKED", None)):
        worker.record_outcome("mlp", "cpu", state, exc)
    worker.count_retry("mlp", "cpu")
    worker.watch(pending=lambda: {"mlp": 0}, in_flight=lambda: 0)
    gateway = GatewayMetrics(None, lambda: ["mlp"], lambda: 0)
    gateway.record(InferCall(model="mlp", version="", id="r1", inputs=[], parameters={},
                             outputs=None, timeout_s=None, protocol="grpc"), 200, 0.002)
    samples: set[str] = set()
    families: set[str] = set()
    for registry in (worker.registry, gateway.registry):
        text = generate_latest(registry).decode()
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            samples.update(s.name for s in family.samples)
        # a family with no samples yet (the queue gauges without a broker) is still declared
        families.update(re.findall(r"^# TYPE (\S+) ", text, re.M))
    worker.close()
    return samples, families


def test_every_metric_the_dashboard_queries_is_one_the_fleet_exports() -> None:
    samples, families = _exported()
    queried = {n for e in _exprs() for n in NAME.findall(e)} - PROMQL
    assert queried, "no metric found in the dashboard's queries"
    missing = sorted(n for n in queried if n not in samples and n not in families)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"


def test_every_family_the_fleet_exports_has_a_panel() -> None:
    _, families = _exported()
    ours = {f for f in families if f.startswith("asyncinfer_")}
    text = "\n".join(_exprs())
    unused = sorted(f for f in ours if not re.search(rf"\b{f}(_total|_bucket|_sum|_count)?\b", text))
    assert not unused, f"exported and on no panel: {unused}"


def test_panels_break_the_fleet_down_per_worker_and_device_and_are_well_formed() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= variables
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
    exprs = _exprs()
    assert any("by (instance, device)" in e for e in exprs)
    assert any("histogram_quantile(0.99" in e for e in exprs)
    assert any("reason" in e and "failure_total" in e for e in exprs)
