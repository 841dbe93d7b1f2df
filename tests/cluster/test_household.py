"""The README's household, word for word (issue 24): one switch puts the controller on the LAN.

Five namespace hosts on one bridge (tests/cluster/household.py): `controller` runs
`BIND=<its address> make run` (the real launcher, with the environment a user has: no test-only
Redis or database), `gpu-desktop` and `ram-box` join with the exact line `racon tokens create`
prints, and so does `office-pc`, a machine with no Python at all (issue 26: `env -i`, every Python
of this machine masked; the standalone bundle). A model is placed across gpu-desktop and ram-box
and a streamed chat completes through the OpenAI SDK from the LAN (HTTPS, checked against the
controller's CA); a split over make run's own node and office-pc serves a chat with each as the
primary once. Past the transport, with the controller's own Redis user: a captured signed command
pushed again is refused as a replay, one signed for office-pc is refused on gpu-desktop's queue,
and a bit flipped after the RPC tunnel's handshake ends that connection. From `intruder`, reading
Redis without a node's password or over plaintext fails, a node's ggml-rpc and llama-server cannot
be used, and a rogue server impersonating the controller with its own certificate is refused by
the line's pin.

The fixture (`household_lan`, tests/cluster/conftest.py) is shared by the session.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.flipping_relay import FlippingRelay

from .harness import wait_for
from .household import NO_PYTHON, PORT, HouseholdLan, join_env

pytestmark = pytest.mark.timeout(2400)


def _rows(body: Any) -> list[dict[str, Any]]:
    return list(body.get("results", body) if isinstance(body, dict) else body)


def _deployment(lan: HouseholdLan, dep_id: str) -> dict[str, Any]:
    resp = lan.ctl.api("GET", f"/api/admin/deployments/{dep_id}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_the_ready_summary_names_the_lan_and_how_to_add_a_machine(
    household_lan: HouseholdLan,
) -> None:
    log = household_lan.ctl.log()
    addr = household_lan.ctl.address
    assert f"[racon] LAN: https://{addr}:{PORT}" in log, log[-3000:]
    assert "add a machine" in log and "racon tokens create" in log
    assert "LAN Redis on" in log and "TLS only" in log
    assert "NOT ready" not in log, log[-3000:]
    line = household_lan.line
    assert re.match(
        rf"^curl -fsSLk --pinnedpubkey sha256//[A-Za-z0-9+/=]{{44}} https://{re.escape(addr)}:{PORT}/join/rcn_\S+ ",
        line,
    ), line
    assert line.endswith("| sh"), line


def test_a_model_placed_across_both_joined_hosts_streams_a_chat_over_https(
    household_lan: HouseholdLan,
) -> None:
    import openai

    lan = household_lan
    nodes = {n["name"]: n for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())}
    for host in ("gpu-desktop", "ram-box"):
        assert nodes[host]["state"] == "READY", nodes[host]
        assert nodes[host]["address"] == lan.hh.addr(host), nodes[host]
    # make run's own node is a LAN member too: it advertises the LAN address, not loopback.
    local = nodes["local-1"]
    assert local["address"] == lan.ctl.address, local
    model = next(m["name"] for m in _rows(lan.ctl.api("GET", "/api/admin/models").json()))
    # Only the split serves the model: make run's own replica steps aside.
    for dep in _rows(lan.ctl.api("GET", f"/api/admin/deployments?model={model}").json()):
        if dep["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED"):
            lan.ctl.api("POST", f"/api/admin/deployments/{dep['id']}/stop")
    resp = lan.ctl.api(
        "POST",
        "/api/admin/deployments",
        {"model": model, "nodes": ["gpu-desktop", "ram-box"], "spread": True},
        timeout=300,
    )
    assert resp.status_code in (200, 201, 202), resp.text
    dep_id = resp.json()["id"]

    def ready() -> dict[str, Any] | None:
        dep = _deployment(lan, dep_id)
        assert dep["state"] not in ("FAILED", "STOPPED"), dep
        return dep if dep["state"] == "READY" else None

    dep = wait_for(ready, 600, "the split deployment to turn READY", interval=2)
    assert set(dep["node_names"]) == {"gpu-desktop", "ram-box"}, dep

    ca = str(lan.ctl.ca_file)
    key = lan.ctl.secret("AI_API_KEY")

    def chat() -> tuple[str, int]:
        client = openai.OpenAI(
            base_url=f"{lan.ctl.public_url}/v1",
            api_key=key,
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=ca), timeout=300
            ),
        )
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        text, chunks = "", 0
        for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text, chunks

    # From a LAN host: HTTPS against the controller's CA (the one the agents keep).
    text, chunks = lan.hh.call("ram-box", chat)
    print(
        f"\nhousehold chat over the split ({', '.join(dep['node_names'])}): {text!r} in {chunks} chunks"
    )
    assert text.strip() and chunks >= 2


def _bundle_route_checks(lan: HouseholdLan, host: str) -> dict[str, Any]:
    """What the line installed on `host`: the standalone agent, no venv (issue 26)."""
    out = (lan.hh.workdir / f"join-{host}.log").read_text(errors="replace")
    assert "no Python needed" in out and "through this machine's Python" not in out, out[-3000:]
    agent = lan.homes[host] / ".racon-agent" / "agent" / "node-agent"
    assert agent.is_file() and not (lan.homes[host] / ".racon-agent" / "venv").exists()
    return {"log": out, "agent": agent}


def test_a_machine_without_python_joins_with_the_line_and_turns_ready(
    household_lan: HouseholdLan,
) -> None:
    """office-pc runs the exact line with `env -i`, every Python of this machine masked (the
    system's, pyenv's, the checkout's .venv, ~/.cache/racon): the standalone bundle (issue 26)."""
    lan = household_lan
    got = _bundle_route_checks(lan, NO_PYTHON)
    nodes = {n["name"]: n for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())}
    assert nodes[NO_PYTHON]["state"] == "READY", nodes[NO_PYTHON]
    assert nodes[NO_PYTHON]["address"] == lan.hh.addr(NO_PYTHON), nodes[NO_PYTHON]
    assert lan.bundle is not None
    platform = json.loads((lan.bundle.parent / "manifest.json").read_text())["platform"]
    listed = lan.ctl.api("GET", "/api/admin/bundles").json()
    served = [b for b in listed if b["platform"] == platform]
    assert len(served) == 1, listed
    took = lan.ready_after[NO_PYTHON]
    record = {
        "seconds_to_ready": round(took, 1),
        "goal_seconds": 60,
        "bundle": served[0]["name"],
        "glibc_floor": served[0]["glibc"],
        "bundle_bytes": int(served[0]["size"]),
        "unpacked_bytes": sum(
            f.stat().st_size for f in got["agent"].parent.resolve().rglob("*") if f.is_file()
        ),
    }
    (lan.hh.workdir / "standalone-join.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"\nstandalone join: the line to READY in {took:.1f} s with no Python on {NO_PYTHON} "
        f"(goal <= 60 s); bundle {record['bundle_bytes'] / 2**20:.0f} MiB, "
        f"{record['unpacked_bytes'] / 2**20:.0f} MiB unpacked, glibc >= {record['glibc_floor']}"
    )


# Commands the controller pushed while the split with office-pc as the primary loaded, as its own
# Redis user saw them (MONITOR): the test past the transport replays them.
CAPTURED: list[dict[str, Any]] = []


@pytest.mark.parametrize("primary", ["local-1", NO_PYTHON])
def test_a_split_over_make_runs_own_node_and_a_joined_host_serves_a_chat_with_each_as_primary(
    household_lan: HouseholdLan, primary: str
) -> None:
    """make run's own node is a full LAN member: it advertises the LAN address, so a primary on
    either side reaches the other's RPC worker, and it fetches the model with its credential. The
    joined host is office-pc, which has no Python (issue 26): its bundle's llama-server and
    ggml-rpc-server serve the split with the controller's own agent, each as the primary once."""
    import openai

    lan = household_lan
    pair = ["local-1", NO_PYTHON]
    model = next(m["name"] for m in _rows(lan.ctl.api("GET", "/api/admin/models").json()))
    # The deployments before step aside: their nodes are BUSY while they hold them.
    for other in _rows(lan.ctl.api("GET", f"/api/admin/deployments?model={model}").json()):
        if other["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED"):
            lan.ctl.api("POST", f"/api/admin/deployments/{other['id']}/stop")

    def free() -> bool:
        states = {
            n["name"]: n["state"] for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())
        }
        return all(states.get(n) == "READY" for n in pair)

    wait_for(free, 180, f"{' and '.join(pair)} READY again", interval=2)
    tap = CommandTap.start(lan) if primary == NO_PYTHON else None
    try:
        resp = lan.ctl.api(
            "POST",
            "/api/admin/deployments",
            {"model": model, "nodes": pair, "spread": True, "primary": primary},
            timeout=300,
        )
        assert resp.status_code in (200, 201, 202), resp.text
        dep_id = resp.json()["id"]

        def ready() -> dict[str, Any] | None:
            dep = _deployment(lan, dep_id)
            assert dep["state"] not in ("FAILED", "STOPPED"), dep
            return dep if dep["state"] == "READY" else None

        dep = wait_for(ready, 600, f"the split over {pair} to turn READY", interval=2)
    finally:
        if tap is not None:
            CAPTURED.extend(tap.stop())
    assert set(dep["node_names"]) == set(pair), dep
    assert dep["primary_name"] == primary, dep
    ca = str(lan.ctl.ca_file)
    key = lan.ctl.secret("AI_API_KEY")

    def chat() -> str:
        client = openai.OpenAI(
            base_url=f"{lan.ctl.public_url}/v1",
            api_key=key,
            http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=ca), timeout=300
            ),
        )
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        return out.choices[0].message.content or ""

    text = lan.hh.call("gpu-desktop", chat)
    print(f"\nchat over {' + '.join(pair)} (primary {dep['primary_name']}): {text!r}")
    assert text.strip()


def _events(lan: HouseholdLan, kind: str) -> list[dict[str, Any]]:
    return _rows(lan.ctl.api("GET", f"/api/admin/events?kind={kind}&limit=200").json())


def _refused(lan: HouseholdLan, cid: str, node: str, code: str) -> bool:
    return any(
        e["data"].get("command_id") == cid and e["data"].get("code") == code and e["node"] == node
        for e in _events(lan, "COMMAND_REFUSED")
    )


def test_past_the_transport_a_replayed_or_moved_signed_command_is_refused(
    household_lan: HouseholdLan,
) -> None:
    """With the transport out of the way (the controller's own Redis user, inside the controller
    host): a signed command captured as the controller pushed it is refused when pushed again, and
    a command signed for one node is refused on another node's queue."""
    lan = household_lan
    assert CAPTURED, "the split with office-pc as the primary was not watched"
    ids = {n["name"]: n["id"] for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())}
    env = controller_env(lan)
    ca = str(lan.ctl.ca_file)
    # A command the controller sent to make run's own node (its RPC worker's start, carrying the
    # deployment's tunnel key), and one it sent to office-pc.
    to_local = next(c for c in CAPTURED if c["node_id"] == ids["local-1"])
    to_office = next(c for c in CAPTURED if c["node_id"] == ids[NO_PYTHON])

    def push(queue: str, raw: str) -> None:
        client = redis.Redis.from_url(env["REDIS_URL"], ssl_ca_certs=ca)
        try:
            client.rpush(queue, raw)
        finally:
            client.close()

    lan.hh.call("controller", lambda: push(to_local["queue"], to_local["raw"]))
    wait_for(
        lambda: _refused(lan, to_local["id"], ids["local-1"], "command_replayed"),
        60,
        f"local-1 refusing the replayed {to_local['kind']} as a replay",
        interval=1,
    )
    # office-pc's command, moved onto gpu-desktop's queue.
    other_queue = to_office["queue"].replace(ids[NO_PYTHON], ids["gpu-desktop"])
    assert other_queue != to_office["queue"]
    lan.hh.call("controller", lambda: push(other_queue, to_office["raw"]))
    wait_for(
        lambda: _refused(lan, to_office["id"], ids["gpu-desktop"], "command_wrong_node"),
        60,
        f"gpu-desktop refusing office-pc's {to_office['kind']}",
        interval=1,
    )
    print(
        f"\nreplayed {to_local['kind']} on local-1: command_replayed; office-pc's "
        f"{to_office['kind']} on gpu-desktop's queue: command_wrong_node"
    )
    # The deployment they belong to still serves: neither reached its runtime.
    deps = _rows(lan.ctl.api("GET", "/api/admin/deployments?state=READY").json())
    assert any(d.get("primary_name") == NO_PYTHON for d in deps), deps


def test_past_the_transport_a_byte_flipped_after_the_tunnel_handshake_breaks_that_connection(
    household_lan: HouseholdLan,
) -> None:
    """From the primary's own host (office-pc), with the deployment's own tunnel key and
    certificate (as the controller sent them): through an on-path relay, a connection to
    local-1's RPC tunnel is accepted and stays open; one bit flipped after the handshake ends it."""
    from agent.tunnel import TunnelClient, TunnelTls

    lan = household_lan
    ids = {n["name"]: n for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())}
    start = next(
        c for c in CAPTURED
        if c["node_id"] == ids["local-1"]["id"] and c["payload"].get("tunnel_key")
    )  # fmt: skip
    payload = start["payload"]
    assert payload["primary_address"] == lan.hh.addr(NO_PYTHON), payload["primary_address"]
    worker = (lan.ctl.address, int(ids["local-1"]["rpc_port"]))
    hello = bytes([14]) + (24).to_bytes(8, "little") + bytes(24)  # ggml-rpc v7 HELLO

    def attempt() -> dict[str, Any]:
        relay = FlippingRelay(worker)
        client = TunnelClient(
            remote_host="127.0.0.1", remote_port=relay.port,
            deployment_id=payload["deployment_id"], key_hex=payload["tunnel_key"],
            tls=TunnelTls.from_wire(payload["tunnel_tls"]),
        )  # fmt: skip
        out: dict[str, Any] = {}
        try:
            host, port = client.local_endpoint.split(":")
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(hello)
                out["open_before"] = not _closed_within(s, 4.0)
                relay.flip.set()
                s.sendall(hello)
                out["closed_after"] = _closed_within(s, 20.0)
            out["flipped"] = relay.flipped.is_set()
            out["failures"] = list(client.failures)
        finally:
            client.close()
            relay.close()
        return out

    got = lan.hh.call(NO_PYTHON, attempt, timeout=120)
    print(f"\nbyte flip on the path office-pc -> local-1's tunnel: {got}")
    assert got["open_before"], f"the tunnel refused the deployment's own credentials: {got}"
    assert got["flipped"] and got["closed_after"], got


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer ends the connection within `seconds` (data before that is read past)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


class CommandTap:
    """The controller's own Redis user (its REDIS_URL, inside the controller host) watching every
    command the controller pushes onto a node's queue (MONITOR), as an insider would."""

    def __init__(self, monitor: Any, client: Any) -> None:
        self.monitor, self.client = monitor, client
        self.seen: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, lan: HouseholdLan) -> CommandTap:
        url = controller_env(lan)["REDIS_URL"]
        ca = str(lan.ctl.ca_file)

        def connect() -> tuple[Any, Any]:
            client = redis.Redis.from_url(url, ssl_ca_certs=ca, socket_timeout=1)
            monitor = client.monitor()
            monitor.__enter__()
            return monitor, client

        return cls(*lan.hh.call("controller", connect))

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                line = self.monitor.connection.read_response()
            except (redis.TimeoutError, TimeoutError):
                continue
            except (redis.RedisError, OSError):
                return
            text = line.decode(errors="replace") if isinstance(line, bytes) else str(line)
            args = [_unrepr(a) for a in re.findall(r'"((?:[^"\\]|\\.)*)"', text)]
            if len(args) >= 3 and args[0].upper() == "RPUSH" and args[1].endswith(":commands"):
                for raw in args[2:]:
                    self.seen.append({"queue": args[1], "raw": raw, **json.loads(raw)})

    def stop(self) -> list[dict[str, Any]]:
        self.done.set()
        self.thread.join(10)
        for close in (self.monitor.connection.disconnect, self.client.close):
            try:
                close()
            except (redis.RedisError, OSError):
                pass
        return self.seen


def _unrepr(s: str) -> str:
    """One argument of a MONITOR line (Redis's sdscatrepr) back to its bytes."""
    out, i = bytearray(), 0
    named = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt == "x":
                out.append(int(s[i + 2 : i + 4], 16))
                i += 4
                continue
            out += named.get(nxt, nxt.encode())
            i += 2
        else:
            out += s[i].encode()
            i += 1
    return out.decode()


def controller_env(lan: HouseholdLan) -> dict[str, str]:
    """The environment make run gives the controller's own processes (a celery worker's)."""
    pids = lan.hh.run("controller", ["true"])  # the namespace exists
    assert pids.returncode == 0, pids.stderr
    out = subprocess.run(
        ["ip", "netns", "pids", lan.hh.hosts["controller"].netns],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    for pid in out.stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(b"celery" in part for part in cmd[:2]) and b"worker" in cmd:
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                return dict(kv.decode().split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)
        except OSError:
            continue
    raise AssertionError("no celery worker of make run in the controller host")


def _redis_port(lan: HouseholdLan) -> int:
    m = re.search(r"LAN Redis on [0-9.]+:(\d+)", lan.ctl.log())
    assert m, lan.ctl.log()[-3000:]
    return int(m.group(1))


def test_from_the_intruder_redis_cannot_be_read_without_a_password_or_in_plaintext(
    household_lan: HouseholdLan,
) -> None:
    lan = household_lan
    host, port = lan.ctl.address, _redis_port(lan)
    ca = str(lan.ctl.ca_file)

    def attempts() -> dict[str, str]:
        out: dict[str, str] = {}
        tries = {
            "plaintext": redis.Redis(host=host, port=port, socket_timeout=5, socket_connect_timeout=5),
            "plaintext with a password": redis.Redis(
                host=host, port=port, username="racon", password="guess", socket_timeout=5,
                socket_connect_timeout=5,
            ),
            "TLS as default": redis.Redis(
                host=host, port=port, ssl=True, ssl_ca_certs=ca, socket_timeout=5,
                socket_connect_timeout=5,
            ),
            "TLS as the controller, wrong password": redis.Redis(
                host=host, port=port, ssl=True, ssl_ca_certs=ca, username="racon",
                password="guess", socket_timeout=5, socket_connect_timeout=5,
            ),
        }  # fmt: skip
        for name, client in tries.items():
            try:
                keys = client.keys("racon:*")
                out[name] = f"READ {len(keys)} keys"
            except (redis.RedisError, OSError) as exc:
                out[name] = f"refused: {type(exc).__name__}: {exc}"
            finally:
                client.close()
        return out

    results = lan.hh.call("intruder", attempts)
    print("\n" + "\n".join(f"intruder, Redis {k}: {v}" for k, v in results.items()))
    for name, said in results.items():
        assert said.startswith("refused"), f"{name}: {said}"


def _listening(lan: HouseholdLan, host: str, program: str) -> list[tuple[str, int]]:
    out = lan.hh.run(host, ["ss", "-Hltnp"]).stdout
    found = []
    for line in out.splitlines():
        if program in line:
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            found.append((addr.strip("[]"), int(port)))
    return found


def test_from_the_intruder_a_nodes_ggml_rpc_and_llama_server_are_out_of_reach(
    household_lan: HouseholdLan,
) -> None:
    lan = household_lan
    # ggml-rpc v7's HELLO: command 14, a size, 24 bytes of connection capabilities; the answer is
    # a size (28) then version and capabilities (ggml-rpc.cpp rpc_msg_hello_req/rsp).
    hello = bytes([14]) + (24).to_bytes(8, "little") + bytes(24)
    hello_answer = (28).to_bytes(8, "little")

    def probe(host: str, port: int) -> str:
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.settimeout(5)
                s.sendall(hello)
                data = b""
                while len(data) < 11:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    data += chunk
        except (OSError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError | socket.timeout):
                return "no ggml-rpc answer (timed out)"
            return f"refused: {type(exc).__name__}"
        if data[:8] == hello_answer:
            return f"ggml-rpc ANSWERED {data[:11]!r}"
        return f"no ggml-rpc answer ({len(data)} other bytes, then closed)"

    servers: list[tuple[str, str, int]] = []
    for target in ("gpu-desktop", "ram-box", NO_PYTHON):
        address = lan.hh.addr(target)
        found = _listening(lan, target, "llama-server")
        print(f"\n{target} listens: llama-server {found}")
        # llama-server only on its node's loopback (the agent reaches it there, with its key).
        for addr, port in found:
            assert addr in ("127.0.0.1", "::1"), f"llama-server listens on {addr}:{port}"
            servers.append((target, address, port))
        said = lan.hh.call("intruder", functools.partial(probe, address, 50052))
        print(f"intruder -> {target} ggml-rpc {address}:50052: {said}")
        assert "ANSWERED" not in said, f"{target}: {said}"
        # The probe reached the node: its RPC tunnel logged the refusal of the intruder.
        log = lan.hh.workdir / f"join-{target}.log"
        wait_for(
            lambda log=log: (
                f"RPC tunnel refused a connection from {lan.hh.addr('intruder')}"
                in log.read_text(errors="replace")
            ),
            30,
            f"{target}'s tunnel refusing the intruder",
        )
    # make run's own node (local-1, in the controller's host) is a node like the others.
    for addr, port in _listening(lan, "controller", "llama-server"):
        assert addr in ("127.0.0.1", "::1"), f"local-1's llama-server listens on {addr}:{port}"
        servers.append(("controller", lan.ctl.address, port))
    assert servers, "the split deployments' primaries run a llama-server"
    for target, address, port in servers:
        said = lan.hh.call("intruder", functools.partial(probe, address, port))
        print(f"intruder -> {target} llama-server {address}:{port}: {said}")
        assert said.startswith("refused"), said


ROGUE = """
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"touch " + sys.argv[3].encode() + b"\\n"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
srv = http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[4], sys.argv[5])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("rogue ready", flush=True)
srv.serve_forever()
"""


def test_a_rogue_join_server_with_its_own_certificate_is_refused_by_the_pin(
    household_lan: HouseholdLan, tmp_path: Path
) -> None:
    from racon import tls

    lan = household_lan
    rogue = lan.hh.addr("intruder")
    ca, _ = tls.ca_load_or_create(var_dir=tmp_path / "rogue")
    cert, _ = tls.server_cert_ensure(var_dir=tmp_path / "rogue", ca=ca, ips=[rogue])
    marker = tmp_path / "pwned"
    script = tmp_path / "rogue.py"
    script.write_text(ROGUE)
    log = tmp_path / "rogue.log"
    proc = lan.hh.popen(
        "intruder",
        [
            "python3",
            str(script),
            rogue,
            str(PORT),
            str(marker),
            str(cert.cert_path),
            str(cert.key_path),
        ],
        log=log,
    )
    wait_for(lambda: "rogue ready" in log.read_text() or proc.poll() is not None, 30, "the rogue")
    assert proc.poll() is None, log.read_text()
    # The victim runs the controller's own line, but the name leads to the impersonator.
    line = lan.line.replace(f"https://{lan.ctl.address}:{PORT}", f"https://{rogue}:{PORT}")
    home = tmp_path / "victim"
    env = join_env(lan.hh, "ram-box", home)
    out = lan.hh.run("ram-box", ["sh", "-c", line], env=env, cwd=tmp_path, timeout=60)
    said = out.stdout + out.stderr
    print(f"\nrogue join: exit {out.returncode}: {said.strip()}")
    assert out.returncode != 0, said
    assert "the controller's certificate does not match the pin in this line" in said, said
    assert not marker.exists(), "the rogue's script ran"
    assert not (home / ".racon-agent").exists()
