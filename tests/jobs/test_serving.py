"""Serving one request (apps/jobs/serving.py) against the real (test) Redis and database: admit,
hold, wait, give up, finish."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from agent.protocol import job_cancel_key, node_queue_key
from apps.jobs import admission, serving
from apps.jobs.models import Deployment, Job
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model
from apps.nodes.models import Event
from racon import ids
from racon.ids import JobId
from racon.redis import get_redis
from tests.factories import DeploymentFactory, ModelFileFactory, NodeFactory

pytestmark = pytest.mark.django_db


class Short(Exception):
    """What a credit hold raises when the account cannot cover the job."""


@pytest.fixture
def model() -> Model:
    return ModelFileFactory(
        model__name="serve-model", file_name="m.gguf", sha256="d" * 64, size=1000, n_layer=0
    ).model


def deployment(
    model: Model, *, n_parallel: int = 1, state: str = DeploymentState.READY, n_ctx: int = 2048
) -> Deployment:
    node = NodeFactory()
    dep = DeploymentFactory(
        model=model,
        model_file=model.files.get(),
        state=state,
        primary=node,
        n_parallel=n_parallel,
        n_ctx=n_ctx,
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {"node_id": str(node.id), "device": "CPU", "layer_start": 0, "layer_end": 30}
            ],
        },
    )
    dep.nodes.set([node])
    return dep


def open_(model: Model, **kw: Any) -> serving.Admission:
    args: dict[str, Any] = {
        "model_name": model.name,
        "account_id": None,
        "api_key_id": None,
        "kind": "chat",
        "params": {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0},
        "max_tokens": 16,
        "stream": False,
        "request_id": "req-1",
        "hold": None,
        "now": timezone.now(),
    }
    args.update(kw)
    return serving.admission_open(**args)


def test_a_free_slot_dispatches_at_once_with_the_hold_in_the_jobs_transaction(model: Model) -> None:
    dep = deployment(model)
    held: list[tuple[str, str]] = []

    def hold(job: Job, prompt_tokens: int) -> None:
        held.append((str(job.id), job.state))

    adm = open_(model, hold=hold)
    assert (
        adm.dispatched
        and adm.deployment_id == str(dep.id)
        and adm.primary_id == str(dep.primary_id)
    )
    # The fast path writes the job born DISPATCHED: the hold runs on that row, in its transaction.
    assert held == [(adm.job_id, JobState.DISPATCHED)]
    job = Job.objects.get(pk=adm.job_id)
    assert job.state == JobState.DISPATCHED and job.deployment_id == dep.id
    assert [n.pk for n in job.nodes.all()] == [dep.primary_id]
    event = Event.objects.get(job_id=adm.job_id, kind="JOB_DISPATCHED")
    assert (event.old_state, event.new_state) == (JobState.QUEUED, JobState.DISPATCHED)
    assert admission.slots_in_use([dep.id]) == {str(dep.id): 1}
    command = json.loads(get_redis().lrange(node_queue_key(str(dep.primary_id)), 0, 0)[0])
    assert command["kind"] == "run_job" and command["payload"]["job_id"] == adm.job_id
    assert adm.prompt_bound is not None and adm.prompt_bound > 0


def test_a_refused_hold_leaves_no_job_no_slot_and_tells_the_primary_to_cancel(model: Model) -> None:
    dep = deployment(model)

    def hold(job: Job, prompt_tokens: int) -> None:
        raise Short("not enough credits")

    with pytest.raises(Short):
        open_(model, hold=hold)
    assert not Job.objects.exists()
    assert admission.slots_in_use([dep.id]) == {str(dep.id): 0}
    # The run_job was pushed before the row: the primary finds the cancel flag.
    command = json.loads(get_redis().lrange(node_queue_key(str(dep.primary_id)), 0, 0)[0])
    assert get_redis().get(job_cancel_key(command["payload"]["job_id"], str(dep.primary_id))) == "1"


def test_without_a_free_slot_the_job_stays_queued_on_the_deployment(model: Model) -> None:
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )

    def hold(job: Job, prompt_tokens: int) -> None:
        raise Short("not enough credits")

    with pytest.raises(Short):
        open_(model, hold=hold)
    assert not Job.objects.exists()
    adm = open_(model)
    assert not adm.dispatched and adm.deployment_id == str(dep.id)
    assert Job.objects.get(pk=adm.job_id).state == JobState.QUEUED


def test_an_unknown_model_and_a_request_larger_than_the_context_are_refused(model: Model) -> None:
    deployment(model, n_ctx=64)
    with pytest.raises(serving.ModelNotFound):
        open_(model, model_name="no-such-model")
    with pytest.raises(serving.ContextTooLong) as too_long:
        open_(model, max_tokens=65)
    assert (too_long.value.max_tokens, too_long.value.n_ctx) == (65, 64)
    assert not Job.objects.exists()


def test_the_standing_bonus_moves_a_request_ahead_but_no_further_than_the_max_wait(
    settings: Any,
) -> None:
    settings.PRIORITY_MAX_WAIT_SECONDS = 30
    assert serving.priority_score(queued_at=1000.0, standing=0) == 1000.0
    assert serving.priority_score(queued_at=1000.0, standing=-5_000_000) == 1000.0
    settings.PRIORITY_STANDING_HALF = 1_000_000
    assert serving.priority_score(queued_at=1000.0, standing=1_000_000) == 985.0
    # More lending always buys more, and never the whole cap.
    assert 970.0 < serving.priority_score(queued_at=1000.0, standing=10**12) < 970.001


@pytest.mark.django_db(transaction=True)  # the step runs on the thread pool
def test_a_waiter_with_a_slot_free_is_dispatched_without_reading_its_standing(model: Model) -> None:
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )
    adm = open_(model)
    admission.slot_release(deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"))
    asked: list[int] = []

    def standing() -> float:
        asked.append(1)
        return 0.0

    async_to_sync(serving.admission_wait)(adm=adm, standing=standing)
    assert adm.dispatched and adm.primary_id == str(dep.primary_id) and asked == []
    assert Job.objects.get(pk=adm.job_id).state == JobState.DISPATCHED


@pytest.mark.django_db(transaction=True)  # the step runs on the thread pool
def test_giving_up_on_a_full_queue_fails_the_job_before_it_ran(model: Model, settings: Any) -> None:
    settings.JOB_QUEUE_MAX = 0
    dep = deployment(model)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(dep.id), job_id=JobId("running"), cap=1
    )
    adm = open_(model)
    with pytest.raises(admission.QueueFull):
        async_to_sync(serving.admission_wait)(adm=adm, standing=lambda: 0.0)
    job = Job.objects.get(pk=adm.job_id)
    assert job.state == JobState.FAILED and job.error == "no capacity: queue full"
    assert job.failed_during_execution is False and adm.finished
    assert admission.queue_order(deployment_id=ids.deployment_id(dep.id)) == []


@pytest.mark.django_db(transaction=True)  # the cancel is recorded from another thread
def test_a_cancel_flags_the_primary_and_records_the_job_cancelled(model: Model) -> None:
    dep = deployment(model)
    adm = open_(model)
    serving.admission_cancel(adm=adm)
    assert get_redis().get(job_cancel_key(adm.job_id, str(dep.primary_id))) == "1"
    for _ in range(500):
        if Job.objects.get(pk=adm.job_id).state == JobState.CANCELLED:
            break
        time.sleep(0.02)
    assert Job.objects.get(pk=adm.job_id).state == JobState.CANCELLED
    serving.admission_cancel(adm=adm)  # a second cancel is a no-op
    assert adm.finished
    # The record goes on past CANCELLED (settlement, the KV record): left running, it wrote rows
    # while the test database was flushed, and PostgreSQL found a deadlock (CI).
    assert adm.finishing is not None
    adm.finishing.result(timeout=30)


@pytest.mark.django_db(transaction=True)
def test_a_burst_of_cancels_is_recorded_on_the_bounded_pool_not_a_thread_each(model: Model) -> None:
    deployment(model)
    adms = [open_(model) for _ in range(3 * serving.FINISH_THREADS)]
    for adm in adms:
        serving.admission_cancel(adm=adm)
    finishers = [
        t for t in threading.enumerate() if t.name.startswith(serving.FINISH_THREAD_PREFIX)
    ]
    assert 0 < len(finishers) <= serving.FINISH_THREADS
    for adm in adms:
        assert adm.finishing is not None
        adm.finishing.result(timeout=60)
    states = set(
        Job.objects.filter(pk__in=[a.job_id for a in adms]).values_list("state", flat=True)
    )
    assert states == {JobState.CANCELLED}
