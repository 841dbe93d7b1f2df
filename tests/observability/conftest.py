"""Fixtures for the observability tests: model rows, jobs in given states, and one live run.

The live run (``live_run``) starts the real controller (daphne + Celery) and one real agent with
SmolLM2, enrolls, deploys, serves one chat for a user with a starting grant, drains the node, and
captures what the tests assert on: /metrics scrapes, the agent's /metrics, both logs, a bundle.
Every process is stopped before the tests look at the captures, so the database flush of the
transactional tests can never race a live process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from apps.models_repo.models import ModelFile
from racon import ids
from tests.factories import ModelFileFactory
from tests.support.observability import LiveRun


@pytest.fixture
def model_file(db: None) -> ModelFile:
    return ModelFileFactory(
        model__name="tiny-model",
        file_name="tiny.gguf",
        sha256=hashlib.sha256(b"tiny").hexdigest(),
        size=1234,
        n_layer=0,
    )


# --- the live run --------------------------------------------------------------------------------


METRICS_TOKEN = "live-metrics-token-" + "m" * 24


@pytest.fixture(scope="session")
def live_run(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveRun]:
    """One real chat on one real node, a drain, and everything captured (all processes stopped)."""
    import time

    import httpx
    import openai
    from django.conf import settings
    from django.utils import timezone

    from apps.api.auth import api_key_create
    from apps.credits.ledger import account_for_user
    from apps.credits.models import Entry
    from apps.jobs.diagnostics import node_diagnostics_bundle
    from tests.e2e.harness import (
        BIN,
        free_port,
        run_controller,
        smollm2_path,
        start_agent,
        stop_agent,
        wait_for,
    )
    from tests.factories import UserFactory

    t0 = time.monotonic()
    timings: dict[str, float] = {}
    model_path = smollm2_path()
    work = tmp_path_factory.mktemp("observability-live")
    with (
        django_db_blocker.unblock(),
        run_controller(work / "controller", METRICS_TOKEN=METRICS_TOKEN) as ctl,
    ):
        timings["controller_up"] = time.monotonic() - t0
        # A user with an account: its starting grant is minted, and its chat is charged.
        user = UserFactory()
        account = account_for_user(user=user)
        _, user_key = api_key_create(
            name="observability",
            account_id=ids.account_id(account.id),
            scopes=["inference"],
            user_id=user.pk,
        )
        tok = ctl.post("/api/admin/tokens", {"label": "observability"}).json()
        models_dir = work / "models"
        models_dir.mkdir()
        shutil.copy(model_path, models_dir / model_path.name)
        metrics_port = free_port()
        agent = start_agent(
            ctl,
            tok["token"],
            "obs-1",
            work,
            models_dir=models_dir,
            extra=["--metrics-port", str(metrics_port)],
        )
        try:
            node = wait_for(
                lambda: [
                    n
                    for n in ctl.get("/api/admin/nodes?state=READY").json()
                    if n["name"] == "obs-1"
                ],
                60,
                "the node to be READY",
            )[0]
            timings["node_ready"] = time.monotonic() - t0
            reg = ctl.post("/api/admin/models", {"path": str(model_path), "name": "smollm2"})
            assert reg.status_code == 201, reg.text
            dep = ctl.post("/api/admin/deployments", {"model": "smollm2", "n_ctx": 512})
            assert dep.status_code == 202, dep.text
            dep_id = dep.json()["id"]

            def ready() -> Any:
                d = ctl.get(f"/api/admin/deployments/{dep_id}").json()
                assert d["state"] not in ("FAILED", "STOPPED"), d
                return d if d["state"] == "READY" else None

            wait_for(ready, 120, "the deployment to be READY")
            timings["deployment_ready"] = time.monotonic() - t0
            client = openai.OpenAI(base_url=ctl.url + "/v1", api_key=user_key)
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                temperature=0,
                extra_headers={"X-Request-Id": "obs" + uuid.uuid4().hex},
            )
            resp = raw.parse()
            job_id = raw.headers["X-Racon-Job-Id"]
            request_id = raw.headers["X-Request-Id"]
            assert resp.usage is not None
            timings["chat_done"] = time.monotonic() - t0
            # Settlement runs in Celery after the job's commit: wait for its ledger entry.
            entry = wait_for(
                lambda: Entry.objects.filter(idempotency_key=f"settle:{job_id}").first(),
                30,
                "the job's settlement",
            )
            auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
            before = httpx.get(ctl.url + "/metrics", headers=auth, timeout=10)
            assert before.status_code == 200, before.text

            def agent_skipped_the_report() -> str | None:
                # The follower recorded the job's end and released its stream, so the agent
                # drops the job_finished report after its grace (agent/finished.py, 2 s).
                text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
                found = re.search(r"^racon_agent_job_reports_skipped_total (\S+)$", text, re.M)
                return text if found and float(found.group(1)) >= 1 else None

            agent_metrics = wait_for(agent_skipped_the_report, 20, "the agent to skip the report")
            drained = ctl.post(f"/api/admin/nodes/{node['id']}/drain")
            assert drained.status_code == 200, drained.text
            wait_for(
                # Its deployment has nowhere to move (one node) and no job left: stopped, then DRAINED.
                lambda: ctl.get(f"/api/admin/nodes/{node['id']}").json()["state"] == "DRAINED",
                30,
                "the node to be DRAINED",
            )
            after = httpx.get(ctl.url + "/metrics", headers=auth, timeout=10)
            unauthorized = httpx.get(ctl.url + "/metrics", timeout=10).status_code
            wrong = httpx.get(
                ctl.url + "/metrics", headers={"Authorization": "Bearer not-the-token"}, timeout=10
            ).status_code
            bundle = node_diagnostics_bundle(node_id=node["id"], now=timezone.now())
        except Exception as exc:
            # A live run that breaks says why: the tails of both logs travel with the error.
            raise RuntimeError(
                f"live run failed: {exc!r}\n--- controller log ---\n{ctl.logs()[-6000:]}"
                f"\n--- agent log ---\n{agent.log()[-4000:]}"
            ) from exc
        finally:
            stop_agent(agent)
        agent_log = agent.log()
        # The node-side half: `node-agent doctor --bundle` over the stopped agent's state dir.
        identity = json.loads((agent.state_dir / "identity.json").read_text())
        doctor_path = work / "doctor.tar.gz"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")
        }
        doctor = subprocess.run(
            [
                str(BIN / "node-agent"),
                "doctor",
                "--state-dir",
                str(agent.state_dir),
                "--models-dir",
                str(models_dir),
                "--bundle",
                str(doctor_path),
                "--no-benchmark",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert doctor_path.is_file(), doctor.stdout + doctor.stderr
    timings["total"] = time.monotonic() - t0
    yield LiveRun(
        job_id=job_id,
        request_id=request_id,
        node_id=node["id"],
        deployment_id=dep_id,
        model="smollm2",
        completion_tokens=resp.usage.completion_tokens,
        charged=int(entry.data["charged"]),
        starting_grant=int(settings.CREDITS_STARTING_GRANT),
        metrics_before_drain=before.text,
        metrics_after_drain=after.text,
        unauthorized_status=unauthorized,
        wrong_token_status=wrong,
        agent_metrics=agent_metrics,
        controller_log=ctl.logs(),
        agent_log=agent_log,
        doctor_bundle=doctor_path.read_bytes(),
        node_secrets=[
            identity["credential"],
            tok["token"],
            user_key,
            METRICS_TOKEN,
            ctl.env["SECRET_KEY"],
        ],
        bundle=bundle,
        timings=timings,
    )
