"""Measured links between nodes: the one writer and the reads of the ``racon:links`` hash.

Each field is ``"<from>|<to>"`` (the node that measured, and the peer it measured); its value is
JSON: ``rtt_ms``, ``bandwidth_mbps``, ``at`` (the controller's clock when the report arrived, so
an agent's clock cannot make a link look fresh), ``rtt_method`` and ``bandwidth_method``. The
agent (agent/links.py) measures RTT with echo pings through the peer's RPC tunnel
(``tunnel-echo``) and bandwidth with a timed, bounded bulk transfer (``measured``); a peer
without the tunnel's probe mode gives the TCP connect time and the local NIC's nominal speed
(``nic:<if>``, ``loopback``, ``assumed``), which is an upper bound, not a measurement.

A measurement older than LINK_MAX_AGE_SECONDS has expired: the reads leave it out (the
scheduler then uses its conservative default link), and ``link_prune`` deletes it.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone

from agent.protocol import probe_key
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis

from .commands import command_send, node_command_key
from .models import Node
from .states import ONLINE, NodeState

LINKS_KEY = "racon:links"
MEASURED = "measured"  # bandwidth_method of a timed bulk transfer
# Plausibility bounds on what a node may claim about its links (a node's report is a claim).
MAX_RTT_MS = 60_000.0
MAX_BANDWIDTH_MBPS = 10_000_000.0  # 10 Tbit/s: more than any NIC or loopback copy reaches
_METHOD_MAX = 40


@dataclass(frozen=True)
class LinkMeasurement:
    """One stored measurement, from the node that measured to its peer."""

    source: str
    target: str
    rtt_ms: float
    bandwidth_mbps: float
    measured_at: float  # epoch seconds, the controller's clock
    rtt_method: str
    bandwidth_method: str

    @property
    def bandwidth_measured(self) -> bool:
        return self.bandwidth_method == MEASURED

    def age_seconds(self, now: datetime) -> float:
        return max(0.0, now.timestamp() - self.measured_at)

    def expired(self, now: datetime) -> bool:
        return self.age_seconds(now) > float(settings.LINK_MAX_AGE_SECONDS)

    def to_dict(self, *, now: datetime) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "rtt_ms": self.rtt_ms,
            "bandwidth_mbps": self.bandwidth_mbps,
            "rtt_method": self.rtt_method,
            "bandwidth_method": self.bandwidth_method,
            "measured_at": datetime.fromtimestamp(self.measured_at, tz=now.tzinfo).isoformat(),
            "age_seconds": round(self.age_seconds(now), 3),
            "expired": self.expired(now),
        }


def _figure(value: Any, *, field: str, bound: float) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"link {field} must be a number")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"link {field} must be a finite, non-negative number")
    return min(v, bound)


def link_record(*, node_id: NodeId, links: list[Any], now: datetime) -> int:
    """Store the links a node measured (ValueError names a malformed entry; nothing is written
    then); failed probes are skipped and leave the earlier measurement to age out. Returns how
    many were stored."""
    source = str(node_id)
    mapping: dict[str | bytes, str] = {}  # the key type redis-py's hset asks for
    for link in links:
        if not isinstance(link, dict) or "node_id" not in link:
            raise ValueError("each link needs node_id, rtt_ms and bandwidth_mbps")
        target = str(link["node_id"])
        if link.get("error") or not target or target == source:
            continue  # a failed probe measures nothing; the scheduler keeps what it had, or its default
        rtt = _figure(link.get("rtt_ms"), field="rtt_ms", bound=MAX_RTT_MS)
        bw = _figure(link.get("bandwidth_mbps"), field="bandwidth_mbps", bound=MAX_BANDWIDTH_MBPS)
        if not rtt and not bw:
            continue
        mapping[f"{source}|{target}"] = json.dumps(
            {
                "rtt_ms": rtt,
                "bandwidth_mbps": bw,
                "at": now.timestamp(),
                "rtt_method": str(link.get("rtt_method") or "unknown")[:_METHOD_MAX],
                "bandwidth_method": str(link.get("bandwidth_method") or "unknown")[:_METHOD_MAX],
            }
        )
    if mapping:
        get_redis().hset(LINKS_KEY, mapping=mapping)
    return len(mapping)


def _parse(pair: str, raw: str) -> LinkMeasurement | None:
    source, _, target = pair.partition("|")
    try:
        v = json.loads(raw)
        return LinkMeasurement(
            source=source,
            target=target,
            rtt_ms=float(v["rtt_ms"]),
            bandwidth_mbps=float(v["bandwidth_mbps"]),
            measured_at=float(v.get("at") or 0.0),
            rtt_method=str(v.get("rtt_method") or "unknown"),
            bandwidth_method=str(v.get("bandwidth_method") or "unknown"),
        )
    except (ValueError, KeyError, TypeError):
        return None


def link_measurements(*, now: datetime, include_expired: bool = False) -> list[LinkMeasurement]:
    """Every stored measurement, expired ones left out unless asked for, by source then target."""
    out = []
    for pair, raw in get_redis().hgetall(LINKS_KEY).items():
        m = _parse(pair, raw)
        if m is not None and (include_expired or not m.expired(now)):
            out.append(m)
    return sorted(out, key=lambda m: (m.source, m.target))


def link_prune(*, now: datetime, node_ids: set[str] | None = None) -> int:
    """Delete expired measurements, and those of nodes not in ``node_ids`` when given. Returns
    how many went."""
    r = get_redis()
    gone = []
    for pair, raw in r.hgetall(LINKS_KEY).items():
        m = _parse(pair, raw)
        if (
            m is None
            or m.expired(now)
            or (node_ids is not None and not {m.source, m.target} <= node_ids)
        ):
            gone.append(pair)
    if gone:
        r.hdel(LINKS_KEY, *gone)
    return len(gone)


def link_matrix(*, now: datetime, node_ids: set[str] | None = None) -> list[dict[str, Any]]:
    """The stored links as rows for people (UI, admin API, CLI): names, figures, how each was
    measured, and its age; expired ones are kept (flagged) until link_prune removes them. Only
    links with both ends in ``node_ids`` when given."""
    rows = [
        m
        for m in link_measurements(now=now, include_expired=True)
        if node_ids is None or {m.source, m.target} <= node_ids
    ]
    ids = {m.source for m in rows} | {m.target for m in rows}
    names = {
        str(pk): name
        for pk, name in Node.objects.filter(pk__in=[i for i in ids if _is_uuid(i)]).values_list(
            "id", "name"
        )
    }
    return [
        {
            **m.to_dict(now=now),
            "source_name": names.get(m.source, m.source[:8]),
            "target_name": names.get(m.target, m.target[:8]),
        }
        for m in sorted(
            rows, key=lambda m: (names.get(m.source, m.source), names.get(m.target, m.target))
        )
    ]


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def links_probe_request(
    *, node_id: NodeId, max_peers: int = 32, measured_at: dict[str, float] | None = None
) -> str | None:
    """Ask a node to measure its links to at most ``max_peers`` other live nodes, those it has
    never measured first, then the stalest (``measured_at``: peer → when, from this node)."""
    if measured_at is None:
        measured_at = {
            m.target: m.measured_at
            for m in link_measurements(now=timezone.now(), include_expired=True)
            if m.source == str(node_id)
        }
    candidates = list(
        Node.objects.filter(state__in=ONLINE, revoked_at__isnull=True)
        .exclude(pk=node_id)
        .only("id", "address", "rpc_port", "credential_hash")
    )
    candidates.sort(key=lambda n: (measured_at.get(str(n.id), 0.0), str(n.id)))
    # Each peer's tunnel answers probes only with that peer's probe key.
    peers = [
        {
            "node_id": str(n.id), "address": n.address, "rpc_port": n.rpc_port,
            "probe_key": probe_key(
                node_command_key(node_id=ids.node_id(n.id), credential_hash=n.credential_hash)
            ).hex(),
        }
        for n in candidates[:max_peers]
    ]  # fmt: skip
    if not peers:
        return None
    return command_send(node_id=node_id, kind="probe_links", payload={"peers": peers})


def links_reprobe(*, now: datetime) -> dict[str, int]:
    """One periodic round: drop expired links (and those of revoked or deleted nodes), then ask
    every READY node to re-measure at most LINK_PROBE_MAX_PEERS peers, the stalest first."""
    live = {
        str(n) for n in Node.objects.filter(revoked_at__isnull=True).values_list("id", flat=True)
    }
    pruned = link_prune(now=now, node_ids=live)
    by_source: dict[str, dict[str, float]] = {}
    for m in link_measurements(now=now, include_expired=True):
        by_source.setdefault(m.source, {})[m.target] = m.measured_at
    sent = 0
    for nid in Node.objects.filter(state=NodeState.READY, revoked_at__isnull=True).values_list(
        "id", flat=True
    ):
        if links_probe_request(
            node_id=ids.node_id(nid),
            max_peers=int(settings.LINK_PROBE_MAX_PEERS),
            measured_at=by_source.get(str(nid), {}),
        ):
            sent += 1
    return {"pruned": pruned, "requested": sent}
