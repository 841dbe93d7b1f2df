"""Placement across hosts (multi-host issue): three network-namespace hosts, one behind a slow link.

fast1 and fast2 share a LAN (0.5 ms each way, the wire's own speed); slow sits behind 10 Mbit/s
and 50 ms each way (about 100 ms round trip to anyone). Each host lends 200 MiB, so SmolLM2 must
be split over two of them. The tests run in order on one cluster: (a) the plan, (b) a real
two-host deployment's speed against its prediction, (d) trust across hosts while it serves, and
(c) a link that degrades, is measured again, and moves the next plan.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from typing import Any

import httpx
import pytest

from .harness import (
    BIN,
    OPERATOR_KEY,
    RPC_PORT,
    Cluster,
    links_by_name,
    shared_cpu_benchmark,
    wait_for,
)

N_CTX = 512
MAX_TOKENS = 40
PROMPT = "Count from one to one hundred: one, two, three,"
STATE: dict[str, Any] = {}


def preview(cl: Cluster, **body: Any) -> dict[str, Any]:
    r = cl.post("/api/admin/deployments/preview", {"model": "smollm2", "n_ctx": N_CTX, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


NAMES: dict[str, str] = {}


def plan_nodes(plan: dict[str, Any]) -> set[str]:
    """Names of the nodes a plan uses (a deployment's stored plan has ids only)."""
    return {
        d.get("node_name") or NAMES.get(d["node_id"], d["node_id"])
        for d in plan["devices"]
        if d["n_layers"] > 0 or d["endpoint"] is None
    }


def show(title: str, plan: dict[str, Any]) -> None:
    print(f"\n== {title}: nodes {sorted(plan_nodes(plan))}, primary {plan['primary_name']}, "
          f"predicted {plan['predicted_tokens_per_s']} tok/s")  # fmt: skip
    for line in plan["explanation"]:
        print("   ", line)


def decode_rate(cl: Cluster) -> float:
    """Streamed completion at temperature 0: decode tokens/s between the first and last token."""
    with httpx.stream(
        "POST",
        cl.url + "/v1/completions",
        headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
        json={"model": "smollm2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
              "stream": True, "stream_options": {"include_usage": True}},
        timeout=180,
    ) as resp:  # fmt: skip
        assert resp.status_code == 200, resp.read()
        stamps: list[float] = []
        tokens = 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    assert tokens >= 16 and len(stamps) >= 2, (tokens, len(stamps))
    return (tokens - 1) / (stamps[-1] - stamps[0])


def test_a_plan_avoids_the_slow_host_and_says_why(cluster3: Cluster) -> None:
    NAMES.update({v: k for k, v in cluster3.node_ids().items()})
    links = links_by_name(cluster3)
    for (a, b), v in sorted(links.items()):
        print(f"link {a}->{b}: {v['rtt_ms']} ms, {v['bandwidth_mbps']} Mbit/s ({v['rtt_method']})")
    assert links[("fast1", "slow")]["rtt_ms"] > 80 and links[("fast1", "fast2")]["rtt_ms"] < 20
    assert links[("fast1", "slow")]["bandwidth_mbps"] < 15
    plan = preview(cluster3)
    show("(a) free choice", plan)
    assert "slow" not in plan_nodes(plan), plan["explanation"]
    assert plan_nodes(plan) == {"fast1", "fast2"}  # 200 MiB each: one host cannot hold it
    why = [line for line in plan["explanation"] if line.startswith("not used: slow")]
    assert why and "slow link" in why[0] and "Mbit/s" in why[0], plan["explanation"]
    forced = preview(cluster3, nodes=["fast1", "slow"])
    show("(a) forced onto the slow host", forced)
    assert forced["predicted_tokens_per_s"] < plan["predicted_tokens_per_s"]
    STATE["plan"] = plan


def test_b_two_host_split_speed_matches_its_prediction(cluster3: Cluster) -> None:
    plan = STATE.get("plan") or preview(cluster3)
    dep = cluster3.post(
        "/api/admin/deployments",
        {"model": "smollm2", "nodes": sorted(plan_nodes(plan)), "n_ctx": N_CTX, "n_parallel": 1},
    )
    assert dep.status_code == 202, dep.text
    dep_id = dep.json()["id"]
    STATE["deployment"] = dep_id

    def ready() -> Any:
        d = cluster3.get(f"/api/admin/deployments/{dep_id}").json()
        assert d["state"] not in ("FAILED", "STOPPED"), (d, cluster3.logs())
        return d if d["state"] == "READY" else None

    t0 = time.monotonic()
    detail = wait_for(ready, 240, "the two-host deployment to be READY")
    print(f"\n(b) READY after {time.monotonic() - t0:.1f} s")
    STATE["detail"] = detail
    predicted = float(detail["plan"]["predicted_tokens_per_s"])
    decode_rate(cluster3)  # warm-up
    rates = [decode_rate(cluster3) for _ in range(3)]
    measured = statistics.median(rates)
    now = shared_cpu_benchmark(3)  # how the shared cores compare with the agents' figure now
    print(f"\n(b) two-host split {sorted(plan_nodes(detail['plan']))}: predicted {predicted:.1f} "
          f"tok/s, measured {measured:.1f} tok/s (runs {[round(r, 1) for r in rates]}), "
          f"predicted / measured {predicted / measured:.2f}; benchmark after the runs {now}")  # fmt: skip
    # The target, the prediction within ±30% of the measured speed, is a wall-clock
    # figure: bench/multihost.py measures and prints it (CLARIFICATIONS, "Tests and time": a test
    # asserts a generous bound). Met in this test's last runs with one thread per host: 0.72,
    # 1.13, 0.89. Here a factor of 3 either way: what a wrong model gives, not a busy machine
    # (before the per-host thread cap, two engines with a thread per core on the same cores
    # measured 0.18 and 0.20).
    ratio = predicted / measured
    print(f"(b) within the issue's ±30%: {'yes' if abs(ratio - 1) <= 0.3 else 'no'} ({ratio:.2f})")
    assert 1 / 3 <= ratio <= 3, (predicted, rates)


def _tcp_try(cl: Cluster, host: str, target: str, port: int, payload: str) -> dict[str, Any]:
    """From inside `host`'s namespace: connect, optionally speak the tunnel, report what came back."""
    code = f"""
import json, socket, sys
out = {{}}
try:
    s = socket.create_connection(({target!r}, {port}), timeout=5)
    out["connected"] = True
    nonce = s.recv(16)
    out["nonce"] = len(nonce)
    s.sendall(bytes.fromhex({payload!r}))
    s.settimeout(5)
    got = b""
    try:
        while True:
            b = s.recv(4096)
            if not b:
                break
            got += b
    except OSError as exc:
        out["recv_error"] = str(exc)
    out["reply"] = got.hex()
except OSError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""
    res = cl.ns_run(host, ["python3", "-c", code], timeout=30)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_d_a_host_that_is_not_the_primary_cannot_reach_a_worker(cluster3: Cluster) -> None:
    detail = STATE.get("detail")
    if detail is None:
        pytest.skip("needs the deployment of test (b)")
    primary = detail["primary_name"]
    worker = next(NAMES[d["node_id"]] for d in detail["plan"]["devices"] if d["endpoint"])
    worker_addr = cluster3.hosts[worker].address
    dep_id = detail["id"]
    # The right handshake shape, the right deployment id, a made-up key: refused, no byte back.
    dep = dep_id.encode()
    forged = (b"RCN1" + bytes([len(dep)]) + dep + b"\x00" * 32).hex()
    from_slow = _tcp_try(cluster3, "slow", worker_addr, RPC_PORT, forged)
    print(f"\n(d) slow -> {worker} tunnel with a forged key: {from_slow}")
    assert from_slow.get("connected") and from_slow["nonce"] == 16
    assert from_slow["reply"] == "", from_slow  # closed without the b"\x01" and without a byte
    # ggml-rpc itself listens on the worker's 127.0.0.1 only: another host cannot even connect.
    listening = cluster3.ns_run(worker, ["ss", "-ltnH"], timeout=20).stdout
    loopback = sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", listening)} - {RPC_PORT})
    assert loopback, listening  # ggml-rpc-server, bound to the worker's own loopback
    rpc_port = loopback[0]
    direct = _tcp_try(cluster3, "slow", worker_addr, rpc_port, "")
    print(f"(d) slow -> {worker} ggml-rpc port {rpc_port}: {direct}")
    assert "error" in direct and not direct.get("connected"), direct
    # The deployment still serves (the primary's own tunnel connection was never disturbed).
    assert decode_rate(cluster3) > 0
    events = cluster3.get("/api/admin/events?limit=200").json()
    events = events.get("results", events) if isinstance(events, dict) else events
    refused = [
        e
        for e in events
        if "refused" in json.dumps(e).lower() and "tunnel" in json.dumps(e).lower()
    ]
    print(f"(d) tunnel refusal events: {len(refused)}; primary {primary}, worker {worker}")
    assert refused, [e.get("kind") for e in events][:30]

    # The private-address rule across hosts: a host advertising a public address is refused.
    tok = cluster3.post("/api/admin/tokens", {"label": "public", "max_uses": 1}).json()["token"]
    state = cluster3.workdir / "agents" / "public"
    state.mkdir(parents=True, exist_ok=True)
    res = cluster3.ns_run(
        "slow",
        ["timeout", "25", str(BIN / "node-agent"), "--foreground", "--controller-url", cluster3.url,
         "--enrollment-token", tok, "--node-name", "public", "--state-dir", str(state),
         "--advertise-address", "203.0.113.7", "--rpc-port", "19151", "--no-benchmark"],
        timeout=60,
    )  # fmt: skip
    print(
        f"(d) agent advertising 203.0.113.7: rc {res.returncode}: {(res.stdout + res.stderr)[-300:]}"
    )
    assert "public" not in cluster3.node_ids()
    kinds = [e.get("kind") for e in cluster3.get("/api/admin/events?limit=200").json()]
    assert "PUBLIC_IP_VIOLATION" in json.dumps(kinds), kinds[:30]


def test_c_a_degraded_link_is_measured_again_and_moves_the_next_plan(cluster3: Cluster) -> None:
    dep_id = STATE.get("deployment")
    if dep_id:
        assert cluster3.post(f"/api/admin/deployments/{dep_id}/stop").status_code in (200, 202)
        wait_for(
            lambda: cluster3.get(f"/api/admin/deployments/{dep_id}").json()["state"] == "STOPPED",
            60,
            "the deployment to stop",
        )
    before = preview(cluster3)
    show("(c) before", before)
    assert plan_nodes(before) == {"fast1", "fast2"}
    # fast2's link degrades below slow's: 5 Mbit/s and 120 ms each way. (Much slower and the
    # probe's 2 MiB bulk transfer outlasts its 5 s timeout: agent/links.py then falls back to the
    # TCP connect time and the NIC's nominal speed, 10 Gbit/s on this TUN device.)
    cluster3.set_link("fast2", delay_ms=120, rate_mbit=5)
    t0 = time.monotonic()
    try:
        # fast2's links to slow too (about 340 ms round trip now): with their old figures
        # (about 115 ms) fast2+slow and fast1+slow were a tie that load noise decided.
        wait_for(
            lambda: all(
                (lk := links_by_name(cluster3).get(pair))
                and lk["rtt_ms"] > 200
                and (lk["bandwidth_method"] == "measured" or "slow" in pair)
                for pair in (
                    ("fast1", "fast2"),
                    ("fast2", "fast1"),
                    ("fast2", "slow"),
                    ("slow", "fast2"),
                )
            ),
            120,
            "fast2's links to be measured again",
        )
        print(f"\n(c) re-measured after {time.monotonic() - t0:.1f} s: "
              f"fast1-fast2 {links_by_name(cluster3)[('fast1', 'fast2')]}, "
              f"fast2-slow {links_by_name(cluster3)[('fast2', 'slow')]}")  # fmt: skip
        after = preview(cluster3)
        show("(c) after fast2's link degraded", after)
        assert plan_nodes(after) == {"fast1", "slow"}, after["explanation"]
        assert any(
            line.startswith("not used: fast2") and "slow link" in line
            for line in after["explanation"]
        ), after["explanation"]
    finally:
        cluster3.set_link("fast2", delay_ms=0.5, rate_mbit=0)
