from __future__ import annotations

import hashlib
import uuid
from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone
from factory.django import DjangoModelFactory

from apps.accounts.models import Account
from apps.nodes.models import Node
from apps.nodes.states import NodeState


def hardware_profile(
    *,
    cores: int = 8,
    ram_gib: int = 16,
    gpus: list[dict[str, Any]] | None = None,
    gflops: float = 50.0,
    bw: float = 20.0,
) -> dict[str, Any]:
    """A protocol.Hardware dict, as an agent would send it."""
    gib = 1024**3
    return {
        "cpu": {
            "model": "Test CPU",
            "physical_cores": cores // 2 or 1,
            "logical_cores": cores,
            "flags": ["avx2"],
        },
        "memory": {"total": ram_gib * gib, "available": ram_gib * gib // 2},
        "swap": {"total": 0, "free": 0},
        "disk": {"path": "/models", "total": 500 * gib, "free": 200 * gib},
        "network": [{"name": "eth0", "addresses": ["10.0.0.5"]}],
        "gpus": gpus or [],
        "benchmark": {"gflops": gflops, "mem_bandwidth_gbps": bw},
    }


class UserFactory(DjangoModelFactory):
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "pw-test-123")


class AccountFactory(DjangoModelFactory):
    class Meta:
        model = Account

    name = factory.Sequence(lambda n: f"acct-{n}")


class NodeFactory(DjangoModelFactory):
    class Meta:
        model = Node

    name = factory.Sequence(lambda n: f"node-{n}")
    machine_id = factory.LazyFunction(lambda: uuid.uuid4().hex)
    account = factory.SubFactory(AccountFactory)
    state = NodeState.READY
    state_changed_at = factory.LazyFunction(timezone.now)
    credential_hash = hashlib.sha256(b"cred").hexdigest()
    address = "127.0.0.1"
    rpc_port = 50052
    hardware = factory.LazyFunction(hardware_profile)
    cpu_logical_cores = 8
    ram_total = 16 * 1024**3
    ram_available = 8 * 1024**3
    gflops = 50.0
    mem_bandwidth_gbps = 20.0
