"""A KV state is restored only when its header matches (issue 28, item 2): the old primary could
upload anything, and the controller forwarded it into another contributor's llama-server checked
only against the hash of that same upload.

The old primary here is a node acting through its own channels: it takes kv_save from its command
queue, uploads a file to /api/agent/kv/<id> with its credential and reports the command's result
to /api/agent/reports. The file is written in llama.cpp's slot-save format (llama-context.cpp,
state_seq_save_file; llama-kv-cache.cpp, state_write): forged in one field at a time."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import uuid
from typing import Any

import pytest
from django.db import connections
from django.test import Client

from agent.protocol import node_queue_key
from apps.jobs import kvcache, kvtransfer
from apps.jobs.models import Deployment
from apps.jobs.states import DeploymentState
from apps.models_repo.models import Model
from apps.models_repo.profile import ModelProfile, synthetic_profile
from apps.nodes.models import Event
from racon import ids
from racon.ids import JobId
from racon.redis import get_redis
from tests.factories import DeploymentFactory, ModelFactory, ModelFileFactory, NodeFactory
from tests.jobs.helpers import chat

pytestmark = pytest.mark.django_db(transaction=True)  # the fake agents answer from threads

N_LAYER = 4
GGSQ = 0x67677371
F16 = 1


@pytest.fixture
def model() -> Model:
    m = ModelFactory(name="kv-header-model")
    tiny = synthetic_profile(
        name="tiny", n_layer=N_LAYER, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=256
    )
    ModelFileFactory(
        model=m, file_name="m.gguf", sha256="f" * 64, size=1000, n_layer=N_LAYER,
        profile=tiny.to_dict(),
    )  # fmt: skip
    return m


def rows(model: Model) -> tuple[int, int]:
    p = ModelProfile.from_dict(model.files.get().profile)
    return p.n_head_kv * p.key_length * 2, p.n_head_kv * p.value_length * 2  # f16


def slot_file(
    *,
    n_tokens: int,
    n_layer: int,
    k_row: int,
    v_row: int,
    n_stream: int = 2,
    magic: int = GGSQ,
    version: int = 3,
    cells: int | None = None,
    trailing: bytes = b"",
    packed: bool = True,
) -> bytes:
    """A saved slot as llama.cpp writes it: header, the prompt's tokens, then the KV cache of one
    sequence (the streams, one holding the cells; each cell's position and sequence; then per
    layer the K rows, then per layer the V rows). ``packed``: the token list in llama-server's
    own packing (server_tokens::serialize: -1, version 1, n, the tokens, no media), as a real
    slot save has it; else a plain list."""
    cells = n_tokens if cells is None else cells
    words = [-1, 1, n_tokens, *range(n_tokens), 0] if packed else list(range(n_tokens))
    out = [
        struct.pack("<III", magic, version, len(words)),
        struct.pack(f"<{len(words)}i", *words),
    ]
    out.append(struct.pack("<I", n_stream))
    for s in range(n_stream):
        if s != n_stream - 1:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", cells))
        for pos in range(cells):
            out.append(struct.pack("<iIi", pos, 1, s))
        out.append(struct.pack("<II", 0, n_layer))  # v_trans = 0
        for _ in range(n_layer):
            out.append(struct.pack("<iQ", F16, k_row) + b"\x01" * (cells * k_row))
        for _ in range(n_layer):
            out.append(struct.pack("<iQ", F16, v_row) + b"\x02" * (cells * v_row))
    return b"".join(out) + trailing


def deployment(model: Model) -> Deployment:
    return DeploymentFactory(
        model=model, model_file=model.files.get(), state=DeploymentState.READY,
        primary=NodeFactory(), n_parallel=2, n_ctx=2048,
    )  # fmt: skip


def hold(model: Model, dep: Deployment, tokens: int) -> kvcache.Held:
    chain = kvcache.prefix_chain(model_id=ids.model_id(model.id), kind="chat", params=chat("hello"))
    route = kvcache.Route(deployment=dep, policy="prefix", reason="", chain=chain)
    route.slot, route.slot_deployment_id = 1, str(dep.id)
    kvcache.job_finished(
        route=route, job_id=JobId("j-1"), deployment_id=ids.deployment_id(dep.id), completed=True,
        usage={"prompt_tokens": tokens - 10, "completion_tokens": 10}, served_slot=None,
    )  # fmt: skip
    return kvcache.slots_held(deployment_id=ids.deployment_id(dep.id))[0]


class FakeNode(threading.Thread):
    """Answers the first command on its queue through the agent endpoints, as an agent would."""

    def __init__(self, node_id: Any, answer: Any) -> None:
        super().__init__(daemon=True)
        self.node_id, self.answer = node_id, answer
        self.kinds: list[str] = []

    def run(self) -> None:
        try:
            got = get_redis().blpop([node_queue_key(str(self.node_id))], timeout=15)
            if got is None:
                return
            command = json.loads(got[1])
            self.kinds.append(command["kind"])
            result = self.answer(command)
            Client().post(
                "/api/agent/reports",
                {"id": uuid.uuid4().hex, "kind": "command_result", "payload": result,
                 "command_id": command["id"]},
                content_type="application/json",
                headers={"Authorization": f"Node {self.node_id}:cred"},
            )  # fmt: skip
        finally:
            connections.close_all()


def saver(node_id: Any, blob: bytes) -> Any:
    def answer(command: dict[str, Any]) -> dict[str, Any]:
        tid = command["payload"]["transfer_id"]
        resp = Client().post(
            f"/api/agent/kv/{tid}", blob, content_type="application/octet-stream",
            headers={"Authorization": f"Node {node_id}:cred"},
        )  # fmt: skip
        assert resp.status_code == 201, resp.content
        return {"ok": True, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}

    return answer


def move(model: Model, blob_for: Any, tmp_path: Any, settings: Any) -> tuple[Any, FakeNode]:
    settings.VAR_DIR = tmp_path
    settings.KV_TRANSFER_TIMEOUT_SECONDS = 10
    a, b = deployment(model), deployment(model)
    held = hold(model, a, tokens=100)
    old = FakeNode(a.primary_id, saver(a.primary_id, blob_for(held)))
    new = FakeNode(b.primary_id, lambda c: {"ok": True, "n_restored": held.tokens})
    old.start()
    new.start()
    try:
        outcome: Any
        try:
            outcome = kvtransfer.conversation_transfer(held=held, source=a, target=b)
        except kvtransfer.TransferFailed as exc:
            outcome = exc
    finally:
        old.join(20)
        get_redis().rpush(
            node_queue_key(str(b.primary_id)), json.dumps({"id": "x", "kind": "stop"})
        )
        new.join(20)
    return outcome, new


@pytest.mark.parametrize("packed", [True, False], ids=["llama-server", "plain"])
def test_a_state_in_llamas_format_matching_the_record_is_restored(
    model: Model, tmp_path: Any, settings: Any, packed: bool
) -> None:
    k, v = rows(model)
    outcome, new = move(
        model,
        lambda h: slot_file(n_tokens=h.tokens - 1, n_layer=N_LAYER, k_row=k, v_row=v, packed=packed),
        tmp_path, settings,
    )  # fmt: skip
    assert isinstance(outcome, tuple), outcome
    assert new.kinds == ["kv_restore"]


@pytest.mark.parametrize(
    ("forgery", "reason"),
    [
        ("tokens", "token"),
        ("layers", "layers"),
        ("row", "bytes per token"),
        ("magic", "not a llama.cpp slot"),
        ("version", "version"),
        ("trailing", "bytes after"),
        ("cells", "cells"),
    ],
)
def test_a_forged_state_is_never_sent_to_the_new_owner(
    model: Model, tmp_path: Any, settings: Any, forgery: str, reason: str
) -> None:
    k, v = rows(model)

    def blob(h: kvcache.Held) -> bytes:
        fields: dict[str, Any] = {
            "n_tokens": h.tokens - 1,
            "n_layer": N_LAYER,
            "k_row": k,
            "v_row": v,
        }
        if forgery == "tokens":
            fields["n_tokens"], fields["cells"] = 100_000, h.tokens - 1
        elif forgery == "layers":
            fields["n_layer"] = N_LAYER + 1
        elif forgery == "row":
            fields["k_row"] = k * 64
        elif forgery == "magic":
            fields["magic"] = 0x46554747  # GGUF
        elif forgery == "version":
            fields["version"] = 99
        elif forgery == "trailing":
            fields["trailing"] = b"\x00" * 4096
        elif forgery == "cells":
            fields["cells"] = h.tokens + 50
        return slot_file(**fields)

    outcome, new = move(model, blob, tmp_path, settings)
    assert isinstance(outcome, kvtransfer.TransferFailed), outcome
    assert reason in str(outcome)
    assert new.kinds == ["stop"]  # kv_restore never reached the new owner
    assert not Event.objects.filter(kind="KV_STATE_MOVED").exists()
