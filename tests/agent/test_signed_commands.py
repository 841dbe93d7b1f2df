"""Signed and confined commands, through real Agents and real Redis: whoever can write to a node's
queue without the controller's per-node key gets a refusal with a code, and even the controller's
own commands reach only the models directory and the controller's origin."""

from __future__ import annotations

import hashlib
import json
import secrets
import stat
import time
import uuid
from typing import Any

from agent.identity import load_identity, save_identity
from agent.protocol import COMMAND_MAX_AGE_SECONDS, node_processing_key, node_queue_key
from tests.agent.harness import MODEL_BYTES, MODEL_SHA, Harness, wait


def _refusal(h: Harness, cid: str) -> dict[str, Any]:
    res = h.controller.result(cid)
    assert res["ok"] is False, res
    return res


def _speed(h: Harness) -> dict[str, Any]:
    return {"seed": secrets.randbelow(1000), "n": 16, "reps": 1}


def test_an_unsigned_command_is_refused_with_a_code(h: Harness) -> None:
    agent = h.start()
    assert agent.node_id is not None
    cid = uuid.uuid4().hex
    raw = {"id": cid, "kind": "speed_challenge", "payload": _speed(h), "issued_at": time.time()}
    h.r.rpush(node_queue_key(agent.node_id), json.dumps(raw))
    res = _refusal(h, cid)
    assert res["code"] == "command_unsigned" and "digest" not in res
    # A signature under another key (a guess, or an old key) is no better.
    forged = json.loads(h.signed(agent.node_id, "speed_challenge", _speed(h)))
    forged["sig"] = secrets.token_hex(32)
    h.r.rpush(node_queue_key(agent.node_id), json.dumps(forged))
    res = _refusal(h, forged["id"])
    assert res["code"] == "command_bad_signature" and "digest" not in res
    # ...and the agent still runs what the controller signs.
    assert h.controller.result(h.send(agent, "speed_challenge", _speed(h)))["ok"]


def test_a_captured_command_pushed_again_is_refused_as_a_replay_even_after_a_restart(
    h: Harness,
) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    node = agent.node_id
    assert node is not None
    raw = h.signed(node, "speed_challenge", _speed(h))
    cid = json.loads(raw)["id"]
    h.r.rpush(node_queue_key(node), raw)
    first = h.controller.result(cid)
    assert first["ok"] and first["digest"]
    # The same bytes, pushed again with the controller's own Redis connection.
    h.r.rpush(node_queue_key(node), raw)
    h.controller.wait_for(lambda c: len(c.results_for(cid)) >= 2)
    replay = h.controller.results_for(cid)[1]["payload"]
    assert replay["ok"] is False and replay["code"] == "command_replayed"
    assert "digest" not in replay
    # A restart does not reopen the window: the ids of commands run are kept in the state dir,
    # even when the controller's Redis user also wiped the agent's seen set.
    assert h.stop(agent) == 0
    kept = cfg.state_dir / "commands-seen"
    assert cid in kept.read_text() and stat.S_IMODE(kept.stat().st_mode) == 0o600
    h.r.delete(f"racon:n:{node}:seen")
    h.start(cfg)
    h.r.rpush(node_queue_key(node), raw)
    h.controller.wait_for(lambda c: len(c.results_for(cid)) >= 3)
    assert h.controller.results_for(cid)[2]["payload"]["code"] == "command_replayed"
    wait(lambda: h.r.llen(node_processing_key(node)) == 0)


def test_a_command_signed_for_node_a_pushed_onto_node_bs_queue_is_refused(h: Harness) -> None:
    a = h.start(h.config(state_dir=h.tmp / "a", node_name="node-a"))
    b = h.start(h.config(state_dir=h.tmp / "b", node_name="node-b"))
    assert a.node_id is not None and b.node_id is not None
    raw = h.signed(a.node_id, "speed_challenge", _speed(h))
    cid = json.loads(raw)["id"]
    h.r.rpush(node_queue_key(b.node_id), raw)
    res = h.controller.wait_for(lambda c: c.results_for(cid))[0]
    assert res["node_id"] == b.node_id
    assert res["payload"]["code"] == "command_wrong_node" and "digest" not in res["payload"]
    # Rewriting the address to B breaks A's signature.
    moved = json.loads(raw)
    moved["node_id"], moved["id"] = b.node_id, uuid.uuid4().hex
    h.r.rpush(node_queue_key(b.node_id), json.dumps(moved))
    assert _refusal(h, moved["id"])["code"] == "command_bad_signature"


def test_a_command_older_than_the_maximum_age_is_refused(h: Harness) -> None:
    agent = h.start(h.config(command_max_age=30.0))
    assert agent.node_id is not None
    for issued in (time.time() - 31, time.time() + COMMAND_MAX_AGE_SECONDS):
        raw = h.signed(agent.node_id, "speed_challenge", _speed(h), issued_at=issued)
        h.r.rpush(node_queue_key(agent.node_id), raw)
        res = _refusal(h, json.loads(raw)["id"])
        assert res["code"] == "command_stale" and "--command-max-age of 30s" in res["error"]
    fresh = h.signed(agent.node_id, "speed_challenge", _speed(h), issued_at=time.time() - 20)
    h.r.rpush(node_queue_key(agent.node_id), fresh)
    assert h.controller.result(json.loads(fresh)["id"])["ok"]


def test_a_node_enrolled_before_signing_fetches_its_key_in_a_heartbeat(h: Harness) -> None:
    cfg = h.config()
    agent = h.start(cfg)
    assert h.stop(agent) == 0
    ident = load_identity(cfg.state_dir)
    assert ident is not None and ident.command_key
    ident.command_key = ""  # as an identity stored by an older agent
    save_identity(cfg.state_dir, ident)
    again = h.start(cfg)
    assert again.node_id == ident.node_id
    assert [b for b in h.controller.heartbeats if b.get("want_command_key")]
    stored = load_identity(cfg.state_dir)
    assert stored is not None and stored.command_key == h.controller.command_keys[ident.node_id]
    assert h.controller.result(h.send(again, "speed_challenge", _speed(h)))["ok"]


def test_paths_outside_the_models_directory_are_refused(h: Harness) -> None:
    agent = h.start()
    secret = h.tmp / "secret.gguf"
    secret.write_bytes(MODEL_BYTES)  # the same bytes, so only the path can refuse it
    nonce = "cd" * 16
    for path in (str(secret), "../secret.gguf", "/etc/passwd"):
        challenge = {
            "sha256": MODEL_SHA, "path": path, "offset": 0, "length": len(MODEL_BYTES),
            "nonce": nonce,
        }  # fmt: skip
        res = _refusal(h, h.send(agent, "hash_challenge", challenge))
        assert res["code"] == "path_outside_models_dir" and "digest" not in res, res
    plan = h.plan(model_path=str(secret))
    res = _refusal(h, h.send(agent, "load_primary", plan))
    assert res["code"] == "path_outside_models_dir"
    assert plan["deployment_id"] not in agent.telemetry()["primaries"]
    # Inside the models dir, by name, it is answered.
    inside = {"sha256": MODEL_SHA, "path": "tiny.gguf", "offset": 0, "length": len(MODEL_BYTES)}
    assert h.controller.result(h.send(agent, "hash_challenge", {**inside, "nonce": nonce}))["ok"]


def test_a_hash_challenge_reads_only_a_file_with_its_sha_and_never_a_short_range(
    h: Harness,
) -> None:
    models = h.tmp / "big-models"
    models.mkdir()
    data = secrets.token_bytes(256 * 1024)
    (models / "big.gguf").write_bytes(data)
    (models / "other.gguf").write_bytes(MODEL_BYTES)
    agent = h.start(h.config(models_dir=models))
    sha = hashlib.sha256(data).hexdigest()
    nonce = "ef" * 16
    for offset, length in ((0, 1), (100, 64 * 1024 - 1), (len(data) - 1000, 64 * 1024)):
        ask = {"sha256": sha, "offset": offset, "length": length, "nonce": nonce}
        assert _refusal(h, h.send(agent, "hash_challenge", ask))["code"] == "challenge_range"
    # Another file's path with this sha: its sha is not the payload's.
    ask = {"sha256": sha, "path": "other.gguf", "offset": 0, "length": 64 * 1024, "nonce": nonce}
    assert _refusal(h, h.send(agent, "hash_challenge", ask))["code"] == "sha256_mismatch"
    ok = {"sha256": sha, "offset": 1000, "length": 64 * 1024, "nonce": nonce}
    res = h.controller.result(h.send(agent, "hash_challenge", ok))
    want = hashlib.sha256(bytes.fromhex(nonce) + data[1000 : 1000 + 64 * 1024]).hexdigest()
    assert res["ok"] and res["digest"] == want


def test_fetch_model_fetches_only_from_the_controllers_exact_origin(h: Harness) -> None:
    agent = h.start()
    data = b"GGUF-origin" * 100
    h.controller.files["m.gguf"] = data
    sha = hashlib.sha256(data).hexdigest()
    port = int(h.controller.url.rsplit(":", 1)[1])
    for url in (
        f"http://127.0.0.2:{port}/files/m.gguf",  # another host
        f"http://127.0.0.1:{port + 1}/files/m.gguf",  # another port
        f"https://127.0.0.1:{port}/files/m.gguf",  # another scheme
        "file:///etc/passwd",
    ):
        ask = {"sha256": sha, "file_name": "m.gguf", "size": len(data), "url": url}
        res = _refusal(h, h.send(agent, "fetch_model", ask))
        assert res["code"] == "foreign_origin", (url, res)
    assert not (agent.config.models_dir / "m.gguf").exists()
    ask = {"sha256": sha, "file_name": "m.gguf", "size": len(data), "url": "/files/m.gguf"}
    assert h.controller.result(h.send(agent, "fetch_model", ask))["ok"]
