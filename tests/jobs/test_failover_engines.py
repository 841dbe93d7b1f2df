"""A schema-constrained job's failover skips vLLM replicas (issue 30): vLLM's structured output
starts at the first token, so such an output resumes only on a llama.cpp replica (whose grammar
takes the text so far as generation_prompt)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.jobs.failover import failover_engine_excludes, job_failover_route
from apps.models_repo.models import Model
from racon import ids
from tests.factories import DeploymentFactory, JobFactory, ModelFileFactory, NodeFactory

pytestmark = pytest.mark.django_db


def test_a_constrained_job_resumes_only_on_llamacpp(model: Model) -> None:
    directory = ModelFileFactory(model=model, file_name="smol-st", format="safetensors")
    gguf = model.files.exclude(pk=directory.pk).get()
    vllm = DeploymentFactory(
        model=model, model_file=directory, engine="vllm", primary=NodeFactory(), n_parallel=4
    )
    llama = DeploymentFactory(model=model, model_file=gguf, primary=NodeFactory(), n_parallel=1)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constrained = JobFactory(model=model, params={"json_schema": schema, "temperature": 0})
    free = JobFactory(model=model, params={"temperature": 0})
    assert failover_engine_excludes(
        job_id=ids.job_id(constrained.id), model_id=ids.model_id(model.id)
    ) == {str(vllm.id)}
    assert (
        failover_engine_excludes(job_id=ids.job_id(free.id), model_id=ids.model_id(model.id))
        == set()
    )
    # With the vLLM replicas excluded, the route is the llama.cpp replica.
    exclude = failover_engine_excludes(
        job_id=ids.job_id(constrained.id), model_id=ids.model_id(model.id)
    )
    routed = job_failover_route(
        model_id=ids.model_id(model.id), exclude=exclude, now=timezone.now()
    )
    assert routed is not None and routed.id == llama.id
