"""Per-node Redis users, on a private redis-server with real ACLs (never the shared one).

A real controller runs against that Redis with NODE_REDIS_ACL on; a real `node-agent` serves a
chat through its own restricted user; then a second node's credentials are used as a hostile
contributor would, and every attack is refused by Redis itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from agent.protocol import PROTOCOL_VERSION, job_stream_key, node_queue_key
from racon.embedded import EmbeddedRedis, start_redis

from .harness import free_port, run_controller, start_agent, stop_agent, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    srv = start_redis(data_dir=tmp_path / "acl-redis", password="controller-" + "p" * 24)
    try:
        yield srv
    finally:
        srv.stop()


def _with_db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


def _enroll(ctl: Any, name: str) -> dict[str, Any]:
    tok = ctl.post("/api/admin/tokens", {"label": name}).json()["token"]
    hw = {"cpu": {"model": "x", "physical_cores": 2, "logical_cores": 2, "arch": "x86_64", "flags": []},
          "memory": {"total": 8 << 30, "available": 6 << 30}, "swap": {"total": 0, "free": 0},
          "disk": {"path": "/", "total": 100 << 30, "free": 50 << 30}, "network": [], "gpus": []}  # fmt: skip
    body = {"token": tok, "node_name": name, "machine_id": name + "-machine", "hardware": hw,
            "advertise_address": "127.0.0.1", "rpc_port": free_port(), "agent_version": "test",
            "protocol_version": PROTOCOL_VERSION, "models": []}  # fmt: skip
    resp = httpx.post(ctl.url + "/api/agent/enroll", json=body, timeout=30)
    assert resp.status_code in (200, 201), resp.text
    return dict(resp.json())


def _subscribe(client: redis.Redis) -> Any:
    ps = client.pubsub()
    ps.subscribe("racon:cache:invalidate")
    return ps.get_message(timeout=2)  # the refusal arrives as the reply


def test_a_node_reaches_only_its_own_keys_and_the_real_agent_still_serves(
    private_redis: EmbeddedRedis, model_path: Path, tmp_path: Path
) -> None:
    url = private_redis.url
    overrides = {
        "REDIS_URL": _with_db(url, 0),
        "CELERY_BROKER_URL": _with_db(url, 1),
        "RACON_AGENT_REDIS_URL": _with_db(url, 0),
        "NODE_REDIS_ACL": "true",
    }
    with run_controller(tmp_path / "controller", **overrides) as ctl:
        models_dir = tmp_path / "models"
        models_dir.mkdir()
        shutil.copy(model_path, models_dir / model_path.name)
        tok = ctl.post("/api/admin/tokens", {"label": "acl-real"}).json()["token"]
        agent = start_agent(ctl, tok, "acl-real", tmp_path, models_dir=models_dir)
        try:
            wait_for(
                lambda: [
                    n
                    for n in ctl.get("/api/admin/nodes?state=READY").json()
                    if n["name"] == "acl-real"
                ],
                90,
                "the node to be READY",
            )
            real = json.loads((agent.state_dir / "identity.json").read_text())
            assert real["redis_url"].startswith(
                f"redis://node-{real['node_id']}:"
            )  # its own user, not the controller's
            assert (
                ctl.post(
                    "/api/admin/models", {"path": str(model_path), "name": "smollm2"}
                ).status_code
                == 201
            )
            dep = ctl.post("/api/admin/deployments", {"model": "smollm2", "n_ctx": 512}).json()[
                "id"
            ]
            wait_for(
                lambda: ctl.get(f"/api/admin/deployments/{dep}").json()["state"] == "READY",
                120,
                "the deployment to be READY",
            )
            client = openai.OpenAI(base_url=ctl.url + "/v1", api_key=ctl.api_key)
            resp = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                temperature=0,
            )
            assert (
                resp.choices[0].message.content
                and resp.usage is not None
                and resp.usage.completion_tokens > 0
            )
            job_id = resp.id.removeprefix("chatcmpl-")
            # Its commands were acknowledged through its own user (MULTI/EXEC is allowed), so none
            # is left in its processing list to run again after a restart.
            assert "could not acknowledge" not in agent.log(), agent.log()[-2000:]

            # A second, hostile node, enrolled with a token of its own.
            evil = _enroll(ctl, "acl-evil")
            me = redis.Redis.from_url(evil["redis_url"], decode_responses=True)
            assert me.ping()
            mine = node_queue_key(evil["node_id"])
            assert me.lrange(mine, 0, -1) == []  # its own queue is fine
            me.xadd(f"racon:n:{evil['node_id']}:job:x", {"seq": "0"})  # so is its own stream
            theirs = real["node_id"]
            attacks = {
                "read another node's queue (prompts)": lambda: me.lrange(
                    node_queue_key(theirs), 0, -1
                ),
                "read another node's job stream": lambda: me.xrange(job_stream_key(job_id, theirs)),
                "forge tokens into another node's job": lambda: me.xadd(
                    job_stream_key(job_id, theirs), {"seq": "99", "type": "chunk", "text": "forged"}
                ),
                "read the Celery queue": lambda: me.lrange("celery", 0, -1),
                "overwrite another node's credential mirror": lambda: me.hset(
                    f"racon:node:{theirs}:meta", "credential", "x"
                ),
                "overwrite its own credential mirror": lambda: me.hset(
                    f"racon:node:{evil['node_id']}:meta", "state", "READY"
                ),
                "list every key": lambda: me.keys("*"),
                "scan the keyspace": lambda: me.scan(0),
                "CONFIG GET": lambda: me.config_get("*"),
                "CONFIG SET": lambda: me.config_set("maxmemory", "1"),
                "publish on the cache channel": lambda: me.publish("racon:cache:invalidate", "*"),
                "subscribe": lambda: _subscribe(me),
                "run a script": lambda: me.eval("return redis.call('GET', KEYS[1])", 1, "celery"),
                "flush the database": lambda: me.flushdb(),
                "list clients": lambda: me.client_list(),
            }
            for what, attack in attacks.items():
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attack()
                    pytest.fail(f"allowed: {what}")
            admin = redis.Redis.from_url(_with_db(url, 0), decode_responses=True)
            assert admin.hget(f"racon:node:{theirs}:meta", "credential") != "x"

            # Revoking the node deletes its user: its connection and its password stop working.
            assert ctl.post(f"/api/admin/nodes/{evil['node_id']}/revoke").status_code in (200, 202)
            with pytest.raises(
                (
                    redis.exceptions.AuthenticationError,
                    redis.exceptions.ConnectionError,
                    redis.exceptions.AuthenticationWrongNumberOfArgsError,
                )
            ):
                redis.Redis.from_url(evil["redis_url"]).ping()
            assert "node-" + evil["node_id"] not in admin.execute_command("ACL", "USERS")
        finally:
            stop_agent(agent)
