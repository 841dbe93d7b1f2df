"""Both halves of a live node's troubleshooting bundle: what they show, and that no secret is in them."""

from __future__ import annotations

import json

import pytest

from tests.support import timing
from tests.support.observability import LiveRun, unpack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_live_bundle_shows_the_node_reachable(live_run: LiveRun) -> None:
    files = unpack(live_run.bundle)
    reach = json.loads(files["reachability.json"])
    assert reach["rpc_probe"]["ok"] is True, reach
    age = reach["heartbeat_age_seconds"]
    assert age is not None and age < timing.live_heartbeat_age()
    jobs = json.loads(files["jobs.json"])
    assert [j["id"] for j in jobs] == [live_run.job_id]
    assert (
        jobs[0]["state"] == "COMPLETED"
        and jobs[0]["failure_phase"] is None
        and jobs[0]["primary"] is True
    )
    versions = json.loads(files["versions.json"])
    assert versions["agent_version"] and versions["controller_version"]


def test_the_agent_doctor_bundle_holds_the_report_and_logs_but_no_secret(live_run: LiveRun) -> None:
    files = {
        name.rsplit("/", 1)[-1]: data for name, data in _members(live_run.doctor_bundle).items()
    }
    # agent.log is there only for a detached agent; this one ran in the foreground (its log was stdout).
    assert {"doctor.json", "status.json"} <= set(files), sorted(files)
    assert "identity.json" not in files
    report = json.loads(files["doctor.json"])
    assert report["agent_version"] and {c["name"] for c in report["checks"]} >= {
        "identity",
        "controller",
        "redis",
    }
    everything = b"\n".join(files.values())
    for secret in live_run.node_secrets:
        assert secret.encode() not in everything, f"{secret[:8]}… is in the doctor bundle"


def test_the_controller_bundle_of_the_live_node_holds_no_secret(live_run: LiveRun) -> None:
    everything = b"\n".join(unpack(live_run.bundle).values())
    for secret in live_run.node_secrets:
        assert secret.encode() not in everything, f"{secret[:8]}… is in the controller bundle"


def _members(data: bytes) -> dict[str, bytes]:
    import io
    import tarfile

    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            fh = tar.extractfile(m)
            if fh is not None:
                out[m.name] = fh.read()
    return out
