"""The README's household, word for word (issue 24): one switch puts the controller on the LAN.

Four namespace hosts on one bridge (tests/cluster/household.py): `controller` runs
`BIND=<its address> make run` (the real launcher, with the environment a user has: no test-only
Redis or database), `gpu-desktop` and `ram-box` join with the exact line `racon tokens create`
prints, a model is placed across both and a streamed chat completes through the OpenAI SDK from
the LAN (HTTPS, checked against the controller's CA). From `intruder`, reading Redis without a
node's password or over plaintext fails, a node's ggml-rpc and llama-server cannot be used, and a
rogue server impersonating the controller with its own certificate is refused by the line's pin.

The fixture (`household_lan`, tests/cluster/conftest.py) is shared by the session: other checks
of the same LAN (signed commands, the tunnel) use it too.
"""

from __future__ import annotations

import re
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
import redis

from .harness import wait_for
from .household import PORT, HouseholdLan, join_env

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


def test_a_split_over_make_runs_own_node_and_a_joined_host_serves_a_chat(
    household_lan: HouseholdLan,
) -> None:
    """make run's own node is a full LAN member: it advertises the LAN address, so a primary on
    either side reaches the other's RPC worker, and it fetches the model with its credential."""
    import openai

    lan = household_lan
    model = next(m["name"] for m in _rows(lan.ctl.api("GET", "/api/admin/models").json()))
    # The first split steps aside: its nodes are BUSY while it holds them.
    for other in _rows(lan.ctl.api("GET", f"/api/admin/deployments?model={model}").json()):
        if other["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED"):
            lan.ctl.api("POST", f"/api/admin/deployments/{other['id']}/stop")

    def free() -> bool:
        states = {
            n["name"]: n["state"] for n in _rows(lan.ctl.api("GET", "/api/admin/nodes").json())
        }
        return states.get("local-1") == "READY" and states.get("gpu-desktop") == "READY"

    wait_for(free, 180, "local-1 and gpu-desktop READY again", interval=2)
    resp = lan.ctl.api(
        "POST",
        "/api/admin/deployments",
        {"model": model, "nodes": ["local-1", "gpu-desktop"], "spread": True},
        timeout=300,
    )  # fmt: skip
    assert resp.status_code in (200, 201, 202), resp.text
    dep_id = resp.json()["id"]

    def ready() -> dict[str, Any] | None:
        dep = _deployment(lan, dep_id)
        assert dep["state"] not in ("FAILED", "STOPPED"), dep
        return dep if dep["state"] == "READY" else None

    dep = wait_for(ready, 600, "the split over local-1 and gpu-desktop to turn READY", interval=2)
    assert set(dep["node_names"]) == {"local-1", "gpu-desktop"}, dep
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
    print(f"\nchat over local-1 + gpu-desktop (primary {dep.get('primary_name')}): {text!r}")
    assert text.strip()


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
    for target in ("gpu-desktop", "ram-box"):
        address = lan.hh.addr(target)
        found = _listening(lan, target, "llama-server")
        print(f"\n{target} listens: llama-server {found}")
        # llama-server only on its node's loopback (the agent reaches it there, with its key).
        for addr, port in found:
            assert addr in ("127.0.0.1", "::1"), f"llama-server listens on {addr}:{port}"
            servers.append((target, address, port))
        said = lan.hh.call("intruder", lambda a=address: probe(a, 50052))
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
        said = lan.hh.call("intruder", lambda a=address, p=port: probe(a, p))
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
