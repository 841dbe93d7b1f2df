"""The Grafana dashboard in deploy/grafana queries only metrics and labels the controller emits."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.api.metrics import sample_names

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "racon.json"


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def exprs(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            yield f"variable {var['name']}", q["query"]


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_in_every_query_is_one_the_controller_emits(dash: dict[str, Any]) -> None:
    known = sample_names()
    seen: set[str] = set()
    for title, expr in exprs(dash):
        names = set(re.findall(r"\bracon_[a-z0-9_]+", expr))
        assert names, f"{title}: {expr!r} uses no RACoN metric"
        unknown = names - set(known)
        assert not unknown, f"{title}: unknown metric(s) {sorted(unknown)} in {expr!r}"
        # Anything else written like a metric (an identifier before '{' or '[') must be ours too.
        for word in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", expr):
            assert word in known, f"{title}: {word!r} is not a RACoN metric ({expr!r})"
        seen |= names
    # The four sections of the issue each have their figures.
    for needle in (
        "racon_nodes",
        "racon_ttft_seconds_bucket",
        "racon_tokens_generated_total",
        "racon_credits_minted_total",
        "racon_credits_spent_total",
        "racon_pool_ram_bytes",
        # Concurrent serving: replicas, slots, each model's queue, tokens/s per replica.
        "racon_replicas",
        "racon_deployment_slots_in_use",
        "racon_deployment_slots_free",
        "racon_model_queue_depth",
        "racon_model_queue_wait_seconds",
        "racon_replica_tokens_per_second",
    ):
        assert needle in seen, needle


def test_label_matchers_and_groupings_use_labels_the_series_carry(dash: dict[str, Any]) -> None:
    known = sample_names()
    for title, expr in exprs(dash):
        names = set(re.findall(r"\bracon_[a-z0-9_]+", expr))
        labels_in_expr = set().union(*(known[n] for n in names))
        for name, matchers in re.findall(r"\b(racon_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!=|!~|=)", matchers):
                assert label in known[name], f"{title}: {name} has no label {label!r}"
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                assert label in labels_in_expr, (
                    f"{title}: groups by {label!r}, which {sorted(names)} lack"
                )


def test_the_dashboard_is_importable_grafana_json(dash: dict[str, Any]) -> None:
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Cluster health", "Throughput and latency", "Nodes", "Credits"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in panels(dash["panels"]):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                for var in re.findall(r"\$([a-z_]+)", t["expr"]):
                    assert var in variables, f"{p['title']}: undefined variable ${var}"
