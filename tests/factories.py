"""The suite's one set of factories: a typed factory per model, and the few helpers that build
the shapes several tests need (a deployment with a plan, a job, a funded account, a key).

The credits ledger's rows (Entry, Posting, Receipt) have no factory of their own on purpose: they
are written only through ``apps.credits`` (a grant, a reservation, a settlement), which keeps each
entry balanced; ``funded_account`` and ``job_finish`` plus a settlement make them."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.utils import timezone
from factory.django import DjangoModelFactory

from apps.accounts.models import Account, ApiKey
from apps.api.auth import api_key_create
from apps.credits.ledger import credit_grant
from apps.jobs.models import Deployment, Job, JobAttempt, MinuteRollup
from apps.jobs.states import DeploymentState, JobState
from apps.models_repo.models import Model, ModelFile, Replica
from apps.nodes.models import EnrollmentToken, Event, EventCategory, Node
from apps.nodes.states import NodeState
from racon import ids

T = TypeVar("T")

if TYPE_CHECKING:

    class TypedFactory(DjangoModelFactory[T]):
        """What calling a factory returns, for mypy: factory_boy's ``Factory()`` runs through an
        unannotated metaclass ``__call__``, so mypy would read it as the factory itself."""

        def __new__(cls, *args: Any, **kwargs: Any) -> T: ...  # type: ignore[misc]

else:
    TypedFactory = DjangoModelFactory


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


class UserFactory(TypedFactory[User]):
    class Meta:
        model = get_user_model()

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "pw-test-123")

    @classmethod
    def _after_postgeneration(
        cls, instance: User, create: bool, results: dict[str, Any] | None = None
    ) -> None:
        """Save the hashed password set after creation (factory_boy stops doing it on its own)."""
        if create:
            instance.save()


class AccountFactory(TypedFactory[Account]):
    class Meta:
        model = Account

    name = factory.Sequence(lambda n: f"acct-{n}")


class ApiKeyFactory(TypedFactory[ApiKey]):
    """A stored key whose plaintext nobody knows (``key_for`` makes one a test can send)."""

    class Meta:
        model = ApiKey

    name = factory.Sequence(lambda n: f"key-{n}")
    prefix = factory.Sequence(lambda n: f"rk_{n:08d}")
    key_hash = factory.LazyFunction(lambda: hashlib.sha256(uuid.uuid4().bytes).hexdigest())
    account = factory.SubFactory(AccountFactory)
    scopes = factory.LazyFunction(lambda: [ApiKey.SCOPE_INFERENCE])


class EnrollmentTokenFactory(TypedFactory[EnrollmentToken]):
    """A stored token whose plaintext nobody knows (``tests.support.enrollment.issue`` makes one
    an agent can enroll with)."""

    class Meta:
        model = EnrollmentToken

    label = factory.Sequence(lambda n: f"token-{n}")
    token_hash = factory.LazyFunction(lambda: hashlib.sha256(uuid.uuid4().bytes).hexdigest())
    prefix = factory.LazyAttribute(lambda o: o.token_hash[:10])
    account = factory.SubFactory(AccountFactory)
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1))


class NodeFactory(TypedFactory[Node]):
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


class ModelFactory(TypedFactory[Model]):
    class Meta:
        model = Model

    name = factory.Sequence(lambda n: f"model-{n}")
    price_weight_permille = 1000


class ModelFileFactory(TypedFactory[ModelFile]):
    class Meta:
        model = ModelFile

    model = factory.SubFactory(ModelFactory)
    file_name = factory.Sequence(lambda n: f"model-{n}.gguf")
    sha256 = factory.LazyFunction(lambda: hashlib.sha256(uuid.uuid4().bytes).hexdigest())
    size = 1024**3
    n_layer = 32


class ReplicaFactory(TypedFactory[Replica]):
    class Meta:
        model = Replica

    node = factory.SubFactory(NodeFactory)
    model_file = factory.SubFactory(ModelFileFactory)
    path = factory.LazyAttribute(lambda o: f"/models/{o.model_file.file_name}")
    verified_at = factory.LazyFunction(timezone.now)


class DeploymentFactory(TypedFactory[Deployment]):
    """A READY deployment of a new model file, its primary a new node (no plan: see
    ``deployment_for`` for one with a plan over given nodes)."""

    class Meta:
        model = Deployment

    model_file = factory.SubFactory(ModelFileFactory)
    model = factory.LazyAttribute(lambda o: o.model_file.model)
    state = DeploymentState.READY
    primary = factory.SubFactory(NodeFactory)


class JobFactory(TypedFactory[Job]):
    class Meta:
        model = Job

    model = factory.SubFactory(ModelFactory)
    state = JobState.QUEUED
    max_tokens = 100
    queued_at = factory.LazyFunction(timezone.now)


class JobAttemptFactory(TypedFactory[JobAttempt]):
    class Meta:
        model = JobAttempt

    job = factory.SubFactory(JobFactory)
    number = factory.Sequence(lambda n: n + 1)
    started_at = factory.LazyFunction(timezone.now)


class MinuteRollupFactory(TypedFactory[MinuteRollup]):
    class Meta:
        model = MinuteRollup

    minute = factory.LazyFunction(lambda: timezone.now().replace(second=0, microsecond=0))
    scope = "pool"


class EventFactory(TypedFactory[Event]):
    class Meta:
        model = Event

    kind = "TEST_EVENT"
    category = EventCategory.LIFECYCLE
    created_at = factory.LazyFunction(timezone.now)


def plan_for(layers: list[tuple[Node, int]], *, primary: Node | None = None) -> dict[str, Any]:
    """A Plan.to_dict()-shaped plan: nodes in order, each holding the given number of layers."""
    devices = []
    start = 0
    primary = primary or layers[0][0]
    for node, n in layers:
        devices.append(
            {
                "node_id": str(node.pk),
                "device": "CPU",
                "kind": "cpu",
                "layer_start": start,
                "layer_end": start + n,
                "n_layers": n,
                "memory_bytes": n * 100_000_000,
                "endpoint": None if node.pk == primary.pk else f"{node.address}:50052",
            }
        )
        start += n
    return {"primary_node_id": str(primary.pk), "devices": devices}


def deployment_for(
    layers: list[tuple[Node, int]], *, model: Model | None = None, primary: Node | None = None
) -> Deployment:
    model = model or ModelFactory()
    mf = ModelFileFactory(model=model)
    primary = primary or layers[0][0]
    dep = DeploymentFactory(
        model=model, model_file=mf, primary=primary, plan=plan_for(layers, primary=primary)
    )
    dep.nodes.set([n for n, _ in layers])
    return dep


def live_deployment(*, n_ctx: int = 512) -> Deployment:
    """A READY one-slot, one-node deployment of ``live-model`` whose primary a live /v1 test plays
    at the Redis edge (tests/api/live.py's FakePrimary, tests/api/hostile.py's HostilePrimary)."""
    m = Model.objects.create(name="live-model")
    mf = ModelFile.objects.create(model=m, file_name="live.gguf", sha256="d" * 64, size=1000)
    node = NodeFactory()
    d = Deployment.objects.create(
        model=m,
        model_file=mf,
        state=DeploymentState.READY,
        primary=node,
        n_parallel=1,
        n_ctx=n_ctx,
        plan={
            "primary_node_id": str(node.id),
            "devices": [
                {"node_id": str(node.id), "device": "CPU", "layer_start": 0, "layer_end": 30}
            ],
        },
    )
    d.nodes.set([node])
    return d


def job_for(
    *,
    account: Account | None,
    model: Model,
    deployment: Deployment | None = None,
    max_tokens: int = 100,
    queued_at: datetime | None = None,
) -> Job:
    return JobFactory(
        model=model,
        deployment=deployment,
        account=account,
        max_tokens=max_tokens,
        queued_at=queued_at or timezone.now(),
    )


def job_finish(
    job: Job,
    *,
    state: str = JobState.COMPLETED,
    prompt: int = 0,
    completion: int = 0,
    device_seconds: dict[str, float] | None = None,
) -> Job:
    """Move a job to a terminal state with usage, as the jobs app does before settlement.

    With device_seconds, the job was dispatched that long before it finished (settlement bounds
    each device's figure by the attempt's wall time as the controller saw it)."""
    now = timezone.now()
    longest = max((float(v) for v in (device_seconds or {}).values()), default=0.0)
    dispatched = now - timedelta(seconds=max(longest, 0.0) + 1.0)
    Job.objects.filter(pk=job.pk).update(
        state=state,
        prompt_tokens=prompt,
        completion_tokens=completion,
        device_seconds=device_seconds or {},
        dispatched_at=dispatched,
        queued_at=min(job.queued_at, dispatched),
        finished_at=now,
    )
    job.refresh_from_db()
    return job


def funded_account(amount: int, **kw: Any) -> Account:
    acct = AccountFactory(**kw)
    if amount:
        credit_grant(
            account_id=ids.account_id(acct.pk),
            amount=amount,
            reason="test funds",
            now=timezone.now(),
        )
    acct.refresh_from_db()
    return acct


def key_for(account: Account, scopes: tuple[str, ...] = ("inference",)) -> dict[str, Any]:
    """A new key of ``account`` with ``scopes``, as the test client's Authorization header."""
    _, plaintext = api_key_create(
        name="k", account_id=ids.account_id(account.pk), scopes=list(scopes)
    )
    return {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}
