"""Measured links (stored with their age, expired when stale, re-probed periodically) and the
live capacity the scheduler's snapshot takes from heartbeats."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agent.protocol import heartbeat_key, node_queue_key
from apps.jobs import selectors, tasks
from apps.jobs.reports import report_accept
from apps.jobs.scheduler import DEFAULT_LINK
from apps.nodes.links import LINKS_KEY, link_matrix, link_measurements, link_record
from apps.nodes.states import NodeState
from racon import ids
from racon.redis import get_redis
from tests.factories import NodeFactory, hardware_profile

pytestmark = pytest.mark.django_db
GiB = 1024**3


def _report(node_id: Any, links: list[dict[str, Any]], now: Any) -> dict[str, Any] | None:
    body = {"id": uuid.uuid4().hex, "kind": "links", "payload": {"links": links}}
    return report_accept(node_id=node_id, report=body, now=now)


def _measured(peer: Any, rtt: float = 0.4, mbps: float = 850.0) -> dict[str, Any]:
    return {
        "node_id": str(peer),
        "rtt_ms": rtt,
        "bandwidth_mbps": mbps,
        "rtt_method": "tunnel-echo",
        "bandwidth_method": "measured",
    }


def test_a_links_report_is_stored_with_its_age_and_how_it_was_measured() -> None:
    a, b, c = NodeFactory(name="a"), NodeFactory(name="b"), NodeFactory(name="c")
    t0 = timezone.now()
    out = _report(
        a.id, [_measured(b.id), {"node_id": str(c.id), "error": "unreachable: refused"}], t0
    )
    assert out == {"stored": 1}  # the failed probe measured nothing
    rows = link_matrix(now=t0 + timedelta(seconds=42))
    assert len(rows) == 1
    row = rows[0]
    assert (row["source_name"], row["target_name"]) == ("a", "b")
    assert row["rtt_ms"] == 0.4 and row["bandwidth_mbps"] == 850.0
    assert row["bandwidth_method"] == "measured" and row["rtt_method"] == "tunnel-echo"
    assert row["age_seconds"] == 42.0 and row["expired"] is False


def test_implausible_link_figures_are_refused_or_bounded() -> None:
    a, b = NodeFactory(), NodeFactory()
    now = timezone.now()
    with pytest.raises(ValueError, match="bandwidth_mbps"):
        link_record(
            node_id=ids.node_id(a.id), links=[{"node_id": str(b.id), "bandwidth_mbps": -1}], now=now
        )
    with pytest.raises(ValueError, match="rtt_ms"):
        link_record(
            node_id=ids.node_id(a.id), links=[{"node_id": str(b.id), "rtt_ms": "fast"}], now=now
        )
    assert get_redis().hlen(LINKS_KEY) == 0
    link_record(node_id=ids.node_id(a.id), links=[_measured(b.id, mbps=1e12)], now=now)
    assert link_measurements(now=now)[0].bandwidth_mbps == 10_000_000.0
    link_record(
        node_id=ids.node_id(a.id), links=[_measured(a.id)], now=now
    )  # a node's link to itself
    assert len(link_measurements(now=now)) == 1


def test_an_expired_link_is_unknown_to_the_scheduler_which_uses_its_default(settings: Any) -> None:
    settings.LINK_MAX_AGE_SECONDS = 60
    a, b = NodeFactory(), NodeFactory()
    t0 = timezone.now()
    _report(a.id, [_measured(b.id, rtt=7.5, mbps=9.5)], t0)
    fresh = selectors.cluster_snapshot(now=t0 + timedelta(seconds=59))
    assert fresh.link(str(a.id), str(b.id)).bandwidth_mbps == 9.5
    assert fresh.link(str(b.id), str(a.id)).rtt_ms == 7.5  # either direction
    stale = selectors.cluster_snapshot(now=t0 + timedelta(seconds=61))
    assert stale.links == {}
    assert stale.link(str(a.id), str(b.id)) == DEFAULT_LINK
    rows = link_matrix(now=t0 + timedelta(seconds=61))
    assert rows[0]["expired"] is True  # still listed for people, flagged


def test_a_nominal_nic_speed_is_only_an_upper_bound_and_a_measurement_is_used_as_is() -> None:
    a, b, c = NodeFactory(), NodeFactory(), NodeFactory()
    now = timezone.now()
    _report(
        a.id,
        [
            {
                "node_id": str(b.id),
                "rtt_ms": 0.3,
                "bandwidth_mbps": 100_000.0,
                "rtt_method": "tcp-connect",
                "bandwidth_method": "loopback",
            },  # fmt: skip
            _measured(c.id, mbps=3_200.0),
        ],
        now,
    )
    links = selectors.link_table(now=now)
    assert links[(str(a.id), str(b.id))].bandwidth_mbps == DEFAULT_LINK.bandwidth_mbps
    assert links[(str(a.id), str(c.id))].bandwidth_mbps == 3_200.0


def _heartbeat(node_id: Any, *, at: float, mem: int, gpu_free: list[int] | None = None) -> None:
    get_redis().hset(
        heartbeat_key(str(node_id)),
        mapping={
            "at": at,
            "mem_available": mem,
            "gpu_free": ",".join(str(x) for x in gpu_free or []),
        },
    )


def _device(snap: Any, node_id: Any, device: str) -> Any:
    node = next(n for n in snap.nodes if n.node_id == str(node_id))
    return next(d for d in node.devices if d.device == device)


def test_free_ram_and_vram_come_from_a_fresh_heartbeat_not_enrollment() -> None:
    gpu = {"index": 0, "name": "RTX", "vram_total": 24 * GiB, "vram_free": 23 * GiB}
    node = NodeFactory(
        hardware=hardware_profile(gpus=[gpu]), ram_total=64 * GiB, ram_available=8 * GiB
    )
    now = timezone.now()
    _heartbeat(node.id, at=now.timestamp() - 1, mem=40 * GiB, gpu_free=[5 * GiB])
    snap = selectors.cluster_snapshot(now=now)
    assert _device(snap, node.id, "CPU").free_bytes == 40 * GiB  # up from 8 GiB at enrollment
    assert _device(snap, node.id, "GPU0").free_bytes == 5 * GiB  # another program took VRAM


def test_live_figures_are_bounded_by_what_the_node_has() -> None:
    gpu = {"index": 0, "name": "RTX", "vram_total": 24 * GiB, "vram_free": 23 * GiB}
    node = NodeFactory(hardware=hardware_profile(gpus=[gpu]), ram_total=16 * GiB)
    now = timezone.now()
    _heartbeat(node.id, at=now.timestamp(), mem=900 * GiB, gpu_free=[80 * GiB])
    snap = selectors.cluster_snapshot(now=now)
    assert _device(snap, node.id, "CPU").free_bytes == 16 * GiB
    assert _device(snap, node.id, "GPU0").free_bytes == 24 * GiB


def test_a_stale_heartbeat_falls_back_to_the_stored_figures(settings: Any) -> None:
    gpu = {"index": 0, "name": "RTX", "vram_total": 24 * GiB, "vram_free": 23 * GiB}
    node = NodeFactory(hardware=hardware_profile(gpus=[gpu]), ram_available=8 * GiB)
    now = timezone.now()
    too_old = settings.HEARTBEAT_INTERVAL * settings.HEARTBEAT_OFFLINE_AFTER + 1
    _heartbeat(node.id, at=now.timestamp() - too_old, mem=1 * GiB, gpu_free=[1 * GiB])
    snap = selectors.cluster_snapshot(now=now)
    assert _device(snap, node.id, "CPU").free_bytes == 8 * GiB
    assert _device(snap, node.id, "GPU0").free_bytes == 23 * GiB


def test_a_verified_gpu_plans_at_its_measured_figures_an_unverified_one_at_the_floor() -> None:
    verified = {"index": 0, "name": "H200", "vram_total": 80 * GiB, "vram_free": 80 * GiB,
                "device": "CUDA0", "gflops": 40_000.0, "mem_bandwidth_gbps": 3_000.0,
                "verified_gflops": 38_000.0}  # fmt: skip
    claimed = {"index": 0, "name": "H200", "vram_total": 80 * GiB, "vram_free": 80 * GiB,
               "device": "CUDA0", "gflops": 900_000.0, "mem_bandwidth_gbps": 5_000.0}  # fmt: skip
    plain = {"index": 0, "name": "RTX", "vram_total": 24 * GiB, "vram_free": 24 * GiB}
    fast = NodeFactory(hardware=hardware_profile(gpus=[verified]))
    fake = NodeFactory(hardware=hardware_profile(gpus=[claimed]), gflops=50.0)
    old = NodeFactory(hardware=hardware_profile(gpus=[plain]), gflops=50.0)
    snap = selectors.cluster_snapshot(now=timezone.now())
    dev = _device(snap, fast.id, "CUDA0")
    assert (dev.gflops, dev.mem_bandwidth_gbps) == (38_000.0, 3_000.0)
    for node, name in ((fake, "CUDA0"), (old, "GPU0")):  # an older agent's GPU has no device name
        dev, cpu = _device(snap, node.id, name), _device(snap, node.id, "CPU")
        assert dev.gflops == cpu.gflops * selectors.GPU_UNVERIFIED_CPU_SHARE
        assert dev.mem_bandwidth_gbps == cpu.mem_bandwidth_gbps * selectors.GPU_UNVERIFIED_CPU_SHARE
    may_be_primary = {n.node_id: n.may_be_primary for n in snap.nodes}
    assert may_be_primary[str(fast.id)] and not may_be_primary[str(fake.id)]


def _commands(node_id: Any) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in get_redis().lrange(node_queue_key(str(node_id)), 0, -1)]


def test_the_periodic_reprobe_asks_ready_nodes_for_their_stalest_peers_and_prunes(
    settings: Any,
) -> None:
    settings.LINK_PROBE_MAX_PEERS = 2
    settings.LINK_MAX_AGE_SECONDS = 600
    a = NodeFactory(name="a")
    b, c, d = NodeFactory(name="b"), NodeFactory(name="c"), NodeFactory(name="d")
    busy = NodeFactory(name="busy", state=NodeState.BUSY)
    offline = NodeFactory(name="off", state=NodeState.OFFLINE)
    now = timezone.now()
    # a measured b just now and c a while ago; d never: d and c are the stalest two.
    link_record(node_id=ids.node_id(a.id), links=[_measured(b.id)], now=now)
    link_record(
        node_id=ids.node_id(a.id), links=[_measured(c.id)], now=now - timedelta(seconds=300)
    )
    link_record(
        node_id=ids.node_id(b.id), links=[_measured(c.id)], now=now - timedelta(seconds=601)
    )  # expired
    get_redis().hset(
        LINKS_KEY,
        f"{a.id}|{uuid.uuid4()}",
        json.dumps({"rtt_ms": 1, "bandwidth_mbps": 1, "at": now.timestamp()}),
    )

    result = tasks.links_reprobe.delay().get()

    assert result["pruned"] == 2  # the expired one and the one to a node that is gone
    probes = [cmd for cmd in _commands(a.id) if cmd["kind"] == "probe_links"]
    assert len(probes) == 1
    peers = [p["node_id"] for p in probes[0]["payload"]["peers"]]
    assert sorted(peers) == sorted([str(d.id), str(busy.id)])  # never measured: first
    # Every READY node was asked, the BUSY and OFFLINE ones were not.
    assert result["requested"] == 4
    assert not _commands(busy.id) and not _commands(offline.id)
    assert {m.source + m.target for m in link_measurements(now=now)} == {
        f"{a.id}{b.id}",
        f"{a.id}{c.id}",
    }


def test_the_reprobe_runs_on_the_beat_schedule() -> None:
    entry = django_settings.CELERY_BEAT_SCHEDULE["links-reprobe"]
    assert entry["task"] == "racon.jobs.links_reprobe"
    assert entry["schedule"] == django_settings.LINK_PROBE_INTERVAL_SECONDS
