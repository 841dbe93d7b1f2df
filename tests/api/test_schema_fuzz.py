"""A bounded schemathesis run over /api/schema/ (issue 12): 0 server errors, every status met is
documented, and responses match their schemas (status, content type, body).

Bounded twice: SCHEMA_FUZZ_EXAMPLES examples per operation (20) and SCHEMA_FUZZ_SECONDS for the
whole run (240); operations the budget does not reach are named in the output. Requests go
in-process through Django's test client (the test's own database transaction), so nothing the
run creates outlives it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from django.test import Client

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402
from schemathesis.core.transport import Response  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

pytestmark = [pytest.mark.django_db, pytest.mark.slow]
OPERATOR = {"Authorization": "Bearer test-operator-key"}
EXAMPLES = int(os.environ.get("SCHEMA_FUZZ_EXAMPLES", "20"))
BUDGET_SECONDS = float(os.environ.get("SCHEMA_FUZZ_SECONDS", "240"))
NEGATIVE_EXAMPLES = int(os.environ.get("SCHEMA_FUZZ_NEGATIVE_EXAMPLES", "10"))
# negative_data_rejection runs (the second test). positive_data_acceptance does not yet: the schema
# cannot say every rule the views check, so schema-valid input is still refused with 400 by eight
# operations (deployments/preview and models need an existing model or exactly one of path/pypi;
# tokens, enroll, credits adjust/grant/balance and receipts/verify check references, bounds and
# signatures the schema cannot express).
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.response_schema_conformance,
    st_checks.content_type_conformance,
]


def _send(client: Client, case: Any) -> Response:
    """The case sent through Django's test client, answered as schemathesis' Response."""
    kw = case.as_transport_kwargs(base_url="http://testserver", headers=OPERATOR)
    prepared = requests.Request(
        method=kw["method"],
        url=kw["url"],
        headers=kw.get("headers"),
        params=kw.get("params"),
        json=kw.get("json"),
        data=kw.get("data"),
        cookies=kw.get("cookies"),
    ).prepare()
    body = prepared.body or b""
    if isinstance(body, str):
        body = body.encode()
    headers = {
        k: v
        for k, v in prepared.headers.items()
        if k.lower() not in ("content-length", "content-type")
    }
    started = time.perf_counter()
    resp = client.generic(
        prepared.method or "GET",
        prepared.path_url,
        data=body,
        content_type=prepared.headers.get("Content-Type", "application/octet-stream"),
        headers=headers,
    )
    elapsed = time.perf_counter() - started
    content = (
        b"".join(resp.streaming_content) if getattr(resp, "streaming", False) else resp.content
    )
    return Response(
        status_code=resp.status_code,
        headers={k: [v] for k, v in resp.headers.items()},
        content=content,
        request=prepared,
        elapsed=elapsed,
        verify=False,
        message=resp.reason_phrase,
    )


@pytest.fixture
def seeded() -> None:
    """Rows for the list and detail responses to carry, including the awkward ones (a deployment
    without a primary yet, a job without usage)."""
    from apps.jobs.models import Deployment
    from apps.jobs.states import DeploymentState
    from tests.credits.factories import ModelFileFactory, deployment_for, funded_account, job_for
    from tests.factories import NodeFactory

    primary, worker = NodeFactory(), NodeFactory()
    dep = deployment_for([(primary, 16), (worker, 16)])
    Deployment.objects.create(
        model=dep.model,
        model_file=ModelFileFactory(model=dep.model),
        state=DeploymentState.PLANNING,
    )
    job_for(account=funded_account(1_000_000), model=dep.model, deployment=dep)


def _run_operations(
    client: Client, *, mode: GenerationMode, checks: list[Any], examples: int
) -> tuple[list[str], list[str], list[str]]:
    raw = client.get("/api/schema/?format=json", headers=OPERATOR)
    assert raw.status_code == 200, raw.content[:300]
    schema = schemathesis.openapi.from_dict(raw.json())
    deadline = time.monotonic() + BUDGET_SECONDS
    failures: list[str] = []
    ran: list[str] = []
    skipped: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        if time.monotonic() > deadline:
            skipped.append(label)
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        def run(case: Any) -> None:
            case.validate_response(_send(client, case), checks=checks)

        try:
            run()
        except Unsatisfiable:
            # No input of this kind exists (a negative case for an operation that takes nothing).
            skipped.append(f"{label} (no {mode.value} input)")
            continue
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - every failure is collected, then reported together
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:1500]}")
        ran.append(label)
    print(
        f"schemathesis ({mode.value}): {len(ran)} operations × ≤{examples} examples; "
        f"skipped or not reached in {BUDGET_SECONDS:.0f}s: {skipped or 'none'}"
    )
    return ran, skipped, failures


def test_the_admin_and_agent_apis_conform_to_their_schema_with_no_server_error(
    client: Client, seeded: None
) -> None:
    ran, _skipped, failures = _run_operations(
        client, mode=GenerationMode.POSITIVE, checks=CHECKS, examples=EXAMPLES
    )
    assert ran, "no operation was exercised"
    assert not failures, "\n\n".join(failures)


def test_input_the_schema_forbids_is_refused_with_a_client_error(
    client: Client, seeded: None
) -> None:
    """negative_data_rejection: a request that breaks the schema (a null offset, a string where an
    integer goes, a missing required field) gets a 4xx, never a 2xx that stores or answers it."""
    ran, _skipped, failures = _run_operations(
        client,
        mode=GenerationMode.NEGATIVE,
        checks=[st_checks.not_a_server_error, st_checks.negative_data_rejection],
        examples=NEGATIVE_EXAMPLES,
    )
    assert ran, "no operation was exercised"
    assert not failures, "\n\n".join(failures)
