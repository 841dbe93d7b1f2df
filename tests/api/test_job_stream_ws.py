"""ws/jobs/<id>/ streams a job's tokens to users allowed to see that job."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from agent.protocol import job_stream_key
from apps.credits.ledger import account_for_user
from apps.jobs.models import Job
from apps.jobs.states import JobState
from racon.asgi import application
from racon.redis import get_redis
from tests.factories import DeploymentFactory, JobAttemptFactory, JobFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def make_job(owner) -> Job:  # type: ignore[no-untyped-def]
    """A running job on a deployment whose primary holds the job's stream (under its node prefix)."""
    dep = DeploymentFactory(model_file__size=1, request={})
    return JobFactory(
        model=dep.model,
        deployment=dep,
        account=account_for_user(user=owner),
        state=JobState.RUNNING,
        max_tokens=256,
    )


def stream_key(job: Job) -> str:
    return job_stream_key(str(job.id), str(job.deployment.primary_id))


def session_headers(user) -> list[tuple[bytes, bytes]]:  # type: ignore[no-untyped-def]
    from django.test import Client

    c = Client()
    c.force_login(user)
    cookie = c.cookies["sessionid"].value
    return [
        (b"cookie", f"sessionid={cookie}".encode()),
        (b"origin", b"http://localhost"),
        (b"host", b"localhost"),
    ]


async def _connect(
    path: str, headers: list[tuple[bytes, bytes]]
) -> tuple[WebsocketCommunicator, bool, int | None]:
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await comm.connect(timeout=5)
    return comm, connected, code


def test_owner_receives_the_stream_in_order_until_it_ends() -> None:
    import asyncio

    owner = UserFactory()
    job = make_job(owner)
    r = get_redis()
    for i, text in enumerate(["Hel", "lo"]):
        r.xadd(
            stream_key(job),
            {"seq": str(i), "type": "chunk", "text": text, "finish_reason": "", "usage": ""},
        )
    r.xadd(
        stream_key(job),
        {"seq": "2", "type": "done", "text": "", "finish_reason": "stop", "usage": "{}"},
    )
    headers = session_headers(owner)

    async def run() -> list[dict[str, object]]:
        comm, connected, _ = await _connect(f"/ws/jobs/{job.id}/", headers)
        assert connected
        got = [json.loads(await comm.receive_from(timeout=10))]
        while got[-1]["type"] != "done":
            got.append(json.loads(await comm.receive_from(timeout=10)))
        await comm.disconnect()
        return got

    got = asyncio.run(run())
    # Chunks read together come as one (the follower /v1 uses), then the end.
    assert "".join(str(m["text"]) for m in got) == "Hello"
    assert got[-1]["type"] == "done" and got[-1]["seq"] == 2


def test_another_user_cannot_watch_the_job() -> None:
    import asyncio

    job = make_job(UserFactory())
    stranger = UserFactory()
    headers = session_headers(stranger)

    async def run() -> bool:
        comm, connected, _ = await _connect(f"/ws/jobs/{job.id}/", headers)
        await comm.disconnect()
        return connected

    assert asyncio.run(run()) is False
    _ = sync_to_async


def test_the_job_page_follows_a_failover_to_the_next_attempt() -> None:
    """The page reads through /v1's follower: when the request's reader fails the job over (a
    JobAttempt row on another deployment), the page goes on from the new primary's stream."""
    import asyncio

    owner = UserFactory()
    job = make_job(owner)
    first = job.deployment
    assert first is not None
    r = get_redis()
    r.xadd(
        stream_key(job),
        {"seq": "0", "attempt": "1", "type": "chunk", "text": "Hel", "finish_reason": ""},
    )
    headers = session_headers(owner)

    def fail_over() -> None:
        """What apps/jobs/failover.py records, then the new primary's stream."""
        second = DeploymentFactory(model=job.model, model_file=first.model_file)
        now = timezone.now()
        JobAttemptFactory(
            job=job, number=1, deployment=first, primary=first.primary, started_at=now
        )
        JobAttemptFactory(
            job=job, number=2, deployment=second, primary=second.primary, started_at=now
        )
        Job.objects.filter(pk=job.pk).update(deployment=second)
        key = job_stream_key(str(job.id), str(second.primary_id))
        r.xadd(
            key, {"seq": "0", "attempt": "2", "type": "chunk", "text": "lo", "finish_reason": ""}
        )
        r.xadd(
            key, {"seq": "1", "attempt": "2", "type": "done", "text": "", "finish_reason": "stop"}
        )

    async def run() -> list[dict[str, object]]:
        comm, connected, _ = await _connect(f"/ws/jobs/{job.id}/", headers)
        assert connected
        got = [json.loads(await comm.receive_from(timeout=10))]
        assert got[0]["text"] == "Hel"  # attempt 1, live
        await sync_to_async(fail_over)()
        while got[-1]["type"] != "done":
            got.append(json.loads(await comm.receive_from(timeout=30)))
        await comm.disconnect()
        return got

    got = asyncio.run(run())
    assert "".join(str(m["text"]) for m in got) == "Hello"
    assert got[-1]["type"] == "done" and got[-1]["finish_reason"] == "stop"
