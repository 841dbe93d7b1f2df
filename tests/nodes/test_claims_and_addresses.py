"""Issue 12's remaining trust rules: speed claims are checked upward with timed work, an address
and port pair belongs to one node, node names are unique per account in the database too, the
enrollment's source address is checked, and login throttling follows the real client address."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.test import Client
from django.utils import timezone

from agent.hardware.benchmark import measure_gflops, speed_challenge_digest
from agent.protocol import node_queue_key
from apps.jobs.challenges import node_speed_challenge, speed_challenge_size
from apps.nodes.commands import command_result_accept
from apps.nodes.models import Event, Node
from racon import ids
from racon.ids import NodeId
from racon.redis import get_redis
from tests.factories import AccountFactory, NodeFactory, hardware_profile
from tests.support.enrollment import enroll_body, issue, post

pytestmark = pytest.mark.django_db(transaction=True)


class ChallengedAgent(threading.Thread):
    """Answers the node's speed_challenge from its Redis queue, as the agent's handler does:
    honestly (the real chain), or with a guess (a liar that skips the work)."""

    def __init__(self, node_id: str, *, honest: bool) -> None:
        super().__init__(daemon=True)
        self.node_id, self.honest = node_id, honest
        self.seen: dict[str, Any] = {}

    def run(self) -> None:
        got = get_redis().blpop([node_queue_key(self.node_id)], timeout=30)
        if got is None:
            return
        cmd = json.loads(got[1])
        self.seen = cmd
        p = cmd["payload"]
        digest = (
            speed_challenge_digest(seed=p["seed"], n=p["n"], reps=p["reps"])
            if self.honest
            else "0" * 64
        )
        command_result_accept(
            node_id=NodeId(self.node_id),
            command_id=cmd["id"],
            payload={"ok": True, "digest": digest},
            now=timezone.now(),
        )


def enrolled(client: Client, gflops: float, **over: Any) -> Node:
    resp = post(client, enroll_body(issue(), hardware=hardware_profile(gflops=gflops), **over))
    assert resp.status_code in (200, 201), resp.content
    return Node.objects.get(pk=resp.json()["node_id"])


def test_a_claim_above_the_unverified_floor_is_not_credited_before_its_challenge(
    client: Client, settings: Any
) -> None:
    settings.SPEED_CHALLENGE = True
    node = enrolled(client, 5000.0)
    assert (node.gflops_claimed, node.gflops, node.speed_verified_at) == (
        5000.0,
        settings.SPEED_UNVERIFIED_GFLOPS,
        None,
    )
    small = enrolled(
        client, 3.0, node_name="box-2", machine_id="machine-bbb", advertise_address="10.0.0.6"
    )
    assert small.gflops == 3.0  # nothing to check below the floor


def test_an_inflated_speed_claim_is_cut_to_what_the_timed_work_measured(
    client: Client, settings: Any
) -> None:
    settings.SPEED_CHALLENGE, settings.SPEED_CHALLENGE_MAX_REPS = True, 20
    real = measure_gflops(0.3)
    node = enrolled(client, real * 20)
    agent = ChallengedAgent(str(node.id), honest=True)
    agent.start()
    verdict = node_speed_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    agent.join(10)
    assert agent.seen["kind"] == "speed_challenge"
    assert verdict.outcome == "reduced" and verdict.credited < real * 20 / 2
    node.refresh_from_db()
    assert node.gflops == verdict.credited and node.speed_verified_at is not None
    event = Event.objects.get(node=node, kind="SPEED_CLAIM_REDUCED")
    assert event.data["claimed_gflops"] == real * 20 and event.data["answered"] is True


def test_an_honest_claim_is_confirmed_and_not_challenged_again_at_re_enrollment(
    client: Client, settings: Any
) -> None:
    # A generous slack: the machine is shared, and a test asserts no tight timing.
    settings.SPEED_CHALLENGE, settings.SPEED_CHALLENGE_SLACK = True, 20.0
    claim = max(settings.SPEED_UNVERIFIED_GFLOPS + 1, measure_gflops(0.3))
    resp = post(client, enroll_body(issue(), hardware=hardware_profile(gflops=claim)))
    node = Node.objects.get(pk=resp.json()["node_id"])
    agent = ChallengedAgent(str(node.id), honest=True)
    agent.start()
    verdict = node_speed_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    agent.join(10)
    assert verdict.outcome == "verified", verdict
    node.refresh_from_db()
    assert node.gflops == claim and node.speed_verified_at is not None
    # The same figure again (an agent restart) keeps the verified credit; a new figure loses it.
    creds = {"Authorization": f"Node {node.id}:{resp.json()['credential']}"}
    again = client.post(
        "/api/agent/enroll",
        enroll_body(issue(), hardware=hardware_profile(gflops=claim)),
        content_type="application/json",
        headers=creds,
    )
    assert again.status_code == 200, again.content
    node.refresh_from_db()
    assert node.gflops == claim
    creds = {"Authorization": f"Node {node.id}:{again.json()['credential']}"}
    changed = client.post(
        "/api/agent/enroll",
        enroll_body(issue(), hardware=hardware_profile(gflops=claim * 3)),
        content_type="application/json",
        headers=creds,
    )
    assert changed.status_code == 200
    node.refresh_from_db()
    assert (node.gflops, node.speed_verified_at) == (settings.SPEED_UNVERIFIED_GFLOPS, None)


def test_a_wrong_answer_fails_the_challenge_and_credits_only_the_floor(
    client: Client, settings: Any
) -> None:
    settings.SPEED_CHALLENGE = True
    node = enrolled(client, 800.0)
    agent = ChallengedAgent(str(node.id), honest=False)
    agent.start()
    verdict = node_speed_challenge(node_id=ids.node_id(node.id), now=timezone.now())
    agent.join(10)
    assert verdict.outcome == "failed" and verdict.measured == 0.0
    node.refresh_from_db()
    assert node.gflops == settings.SPEED_UNVERIFIED_GFLOPS and node.speed_verified_at is None
    assert Event.objects.filter(node=node, kind="SPEED_CHALLENGE_FAILED").exists()


def test_the_challenge_is_sized_by_the_claim_and_bounded(settings: Any) -> None:
    settings.SPEED_CHALLENGE_SECONDS, settings.SPEED_CHALLENGE_MAX_REPS = 1.0, 200
    assert speed_challenge_size(1.0) == 4  # 1 GFLOP of work at 0.27 GFLOP per 512^3 matmul
    assert speed_challenge_size(1e9) == 200


def test_the_challenge_chain_is_deterministic_and_depends_on_every_step() -> None:
    a = speed_challenge_digest(seed=7, n=64, reps=5)
    assert a == speed_challenge_digest(seed=7, n=64, reps=5)
    assert a != speed_challenge_digest(seed=7, n=64, reps=4)
    assert a != speed_challenge_digest(seed=8, n=64, reps=5)


# --- addresses and names ------------------------------------------------------------------------


def test_a_second_node_cannot_claim_an_address_and_port_already_enrolled(client: Client) -> None:
    first = post(client, enroll_body(issue()))
    assert first.status_code == 201
    resp = post(client, enroll_body(issue(), node_name="box-2", machine_id="machine-bbb"))
    assert resp.status_code == 409, resp.content
    err = resp.json()["error"]
    assert (
        err["code"] == "address_taken"
        and "10.0.0.5:50052" in err["message"]
        and "box-1" in err["message"]
    )
    assert Node.objects.count() == 1
    # Another port on the same host is another node.
    assert (
        post(
            client,
            enroll_body(issue(), node_name="box-2", machine_id="machine-bbb", rpc_port=50053),
        ).status_code
        == 201
    )


def test_node_names_are_unique_per_account_in_the_database_itself() -> None:
    acct = AccountFactory()
    NodeFactory(account=acct, name="same")
    with pytest.raises(IntegrityError), transaction.atomic():
        NodeFactory(account=acct, name="same")
    NodeFactory(account=AccountFactory(), name="same")  # another account may use it
    revoked = NodeFactory(account=acct, name="old", revoked_at=timezone.now())
    NodeFactory(account=acct, name="old")  # a revoked node's name is free again
    assert revoked.pk


def test_an_enrollment_from_a_public_source_address_is_refused_and_recorded(client: Client) -> None:
    token = issue()
    resp = client.post(
        "/api/agent/enroll",
        enroll_body(token),
        content_type="application/json",
        REMOTE_ADDR="203.0.113.9",
    )
    assert resp.status_code == 401, resp.content
    assert "203.0.113.9" in resp.json()["error"]["message"]
    assert Node.objects.count() == 0
    event = Event.objects.get(kind="PUBLIC_IP_VIOLATION")
    assert event.data["source_address"] == "203.0.113.9" and event.data["address"] == "10.0.0.5"


def test_a_forwarded_address_counts_only_through_a_trusted_proxy(
    client: Client, settings: Any
) -> None:
    body = enroll_body(issue(), advertise_address="10.0.0.1")
    # Not through a trusted proxy: the header is the client's own claim, and is ignored (it
    # would not match the advertise address, which must be where the enrollment came from).
    forged = client.post(
        "/api/agent/enroll",
        body,
        content_type="application/json",
        REMOTE_ADDR="10.0.0.1",
        HTTP_X_FORWARDED_FOR="10.9.9.9",
    )
    assert forged.status_code == 201
    settings.TRUSTED_PROXIES = ["10.0.0.1"]
    body = enroll_body(
        issue(), node_name="box-2", machine_id="machine-bbb", advertise_address="10.0.0.6"
    )
    resp = client.post(
        "/api/agent/enroll",
        body,
        content_type="application/json",
        REMOTE_ADDR="10.0.0.1",
        HTTP_X_FORWARDED_FOR="10.9.9.9, 198.51.100.7",
    )
    assert resp.status_code == 401 and "198.51.100.7" in resp.json()["error"]["message"]


# --- login throttling -------------------------------------------------------------------------------


def test_login_guesses_are_throttled_per_address_and_cannot_lock_the_user_out(
    client: Client, settings: Any
) -> None:
    # Issue 28: a lock-out is per (username, address); guesses from many addresses (which the
    # X-Forwarded-For of an untrusted peer cannot fake) never lock the user out of their own.
    settings.LOGIN_MAX_FAILURES, settings.LOGIN_MAX_FAILURES_PER_ADDRESS = 3, 6
    get_user_model().objects.create_user("victim", password="right-password-1")
    statuses = []
    for i in range(8):
        resp = client.post(
            "/login/", {"username": "victim", "password": f"guess-{i}"}, REMOTE_ADDR=f"10.1.0.{i}"
        )
        statuses.append(resp.status_code)
    assert statuses == [200] * 8, statuses
    resp = client.post(
        "/login/", {"username": "victim", "password": "right-password-1"}, REMOTE_ADDR="10.3.0.1"
    )
    assert resp.status_code == 302, resp.status_code
    client.logout()
    # One address is stopped after its own LOGIN_MAX_FAILURES.
    get_user_model().objects.create_user("other", password="right-password-2")
    codes = [
        client.post(
            "/login/", {"username": "other", "password": "x"}, REMOTE_ADDR="10.2.0.1"
        ).status_code
        for _ in range(4)
    ]
    assert codes == [200, 200, 200, 429]
