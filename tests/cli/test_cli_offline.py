"""CLI paths that need a controller answer the live one cannot give on demand (httpx MockTransport)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from apps.credits import signing
from racon import ids
from racon.ids import JobId
from racon_cli import main as cli
from racon_cli.client import EXIT_API
from racon_cli.commands import common
from tests.support.cli import one_error_line

NODE = {
    "id": "0b9c7f3e-1d2a-4c5b-8e9f-0a1b2c3d4e5f",
    "name": "gpu-box",
    "state": "READY",
    "address": "10.0.0.7",
    "rpc_port": 50052,
}


def _bundle() -> bytes:
    """The same bytes at every call: gzip's header holds the time it was written (a test that
    compared two calls failed when a second ticked between them), so it is written with 0."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, body in (("summary.json", b'{"node": "gpu-box"}'), ("events.jsonl", b"{}\n" * 3)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return gzip.compress(raw.getvalue(), mtime=0)


def _run(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    handler: Callable[[httpx.Request], httpx.Response],
    *args: str,
) -> Any:
    transport = httpx.MockTransport(handler)
    real = common.Client

    class MockedClient(real):  # type: ignore[misc, valid-type]
        def __init__(self, url: str, key: str, **kw: Any) -> None:
            super().__init__(
                url, key, transport=transport, **{k: v for k, v in kw.items() if k != "transport"}
            )

    monkeypatch.setattr(common, "Client", MockedClient)  # every command makes its Client there
    monkeypatch.chdir(tmp_path)
    env = {
        "RACON_URL": "http://controller.test",
        "RACON_API_KEY": "rk_test",
        "RACON_CONFIG": str(tmp_path / "c.json"),
    }
    return CliRunner().invoke(cli.app, list(args), env=env, catch_exceptions=False)


def _nodes(request: httpx.Request) -> httpx.Response | None:
    if request.url.path == "/api/admin/nodes":
        return httpx.Response(200, json=[NODE])
    if request.url.path == f"/api/admin/nodes/{NODE['id']}":
        return httpx.Response(200, json=NODE)
    return None


def test_diagnose_saves_the_bundle_and_lists_its_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer rk_test"
        if request.url.path.endswith("/diagnostics"):
            return httpx.Response(
                200,
                content=_bundle(),
                headers={
                    "Content-Type": "application/gzip",
                    "Content-Disposition": 'attachment; filename="racon-diagnose-x.tar.gz"',
                },
            )
        return _nodes(request) or httpx.Response(404)

    res = _run(monkeypatch, tmp_path, handler, "diagnose", "gpu-box")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "racon-diagnose-x.tar.gz").read_bytes() == _bundle()
    assert (
        "Saved diagnostics of gpu-box" in res.stdout
        and "summary.json" in res.stdout
        and "events.jsonl" in res.stdout
    )
    res = _run(
        monkeypatch,
        tmp_path,
        handler,
        "diagnose",
        "gpu-box",
        "-o",
        str(tmp_path / "d.tgz"),
        "--json",
    )
    summary = json.loads(res.stdout)
    assert summary["file"] == str(tmp_path / "d.tgz") and {
        m["name"] for m in summary["members"]
    } == {"summary.json", "events.jsonl"}


def test_diagnose_on_a_controller_without_the_endpoint_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return _nodes(request) or httpx.Response(
            404, text="<html>Not found</html>", headers={"Content-Type": "text/html"}
        )

    res = _run(monkeypatch, tmp_path, handler, "diagnose", "gpu-box")
    assert res.exit_code == EXIT_API
    assert "no diagnostics endpoint" in one_error_line(res)


def test_diagnose_of_a_node_the_endpoint_does_not_know_passes_the_reason_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/diagnostics"):
            return httpx.Response(
                404, json={"error": {"message": "node vanished", "code": "not_found"}}
            )
        return _nodes(request) or httpx.Response(404)

    res = _run(monkeypatch, tmp_path, handler, "diagnose", str(NODE["id"]))
    assert (
        res.exit_code == EXIT_API and one_error_line(res) == "error: 404 not found: node vanished"
    )


def test_a_refused_placement_prints_the_schedulers_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            422,
            json={
                "error": {
                    "message": "needs 3.1 GiB more memory than the cluster has free",
                    "code": "placement_refused",
                }
            },
        )

    res = _run(monkeypatch, tmp_path, handler, "deploy", "big-model")
    assert res.exit_code == EXIT_API
    assert (
        one_error_line(res)
        == "error: 422 refused: needs 3.1 GiB more memory than the cluster has free"
    )


def test_validation_errors_name_the_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            400,
            json={
                "error": {
                    "message": "invalid request",
                    "code": "invalid",
                    "fields": {"n_ctx": ["Ensure this value is greater than or equal to 128."]},
                }
            },
        )

    res = _run(monkeypatch, tmp_path, handler, "deploy", "m", "--n-ctx", "5")
    assert (
        one_error_line(res)
        == "error: 400 bad request: invalid request: n_ctx: Ensure this value is greater than or equal to 128."
    )


def test_a_deployment_that_fails_while_loading_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dep = {
        "id": "5f0c6a8e-0000-4000-8000-000000000001",
        "model": "m",
        "state": "PLANNING",
        "node_names": [],
        "plan": {},
        "error": "",
    }
    states = iter(["LOADING", "FAILED"])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json=dep)
        state = next(states)
        return httpx.Response(
            200,
            json={
                **dep,
                "state": state,
                "error": "primary exited with 134" if state == "FAILED" else "",
            },
        )

    res = _run(monkeypatch, tmp_path, handler, "deploy", "m")
    assert res.exit_code == EXIT_API
    assert one_error_line(res) == "error: deployment 5f0c6a8e FAILED: primary exited with 134"


@pytest.mark.django_db
def test_deployments_ls_shows_slots_in_use_queue_and_replicas_per_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client: Any
) -> None:
    # The REST API's own answer (real database and Redis), served to the CLI as is.
    from apps.jobs import admission
    from apps.jobs.models import Deployment
    from apps.models_repo.models import Model, ModelFile
    from tests.factories import NodeFactory

    model = Model.objects.create(name="smol")
    mf = ModelFile.objects.create(model=model, file_name="smol.gguf", sha256="c" * 64, size=1)
    deps = []
    for name in ("box-a", "box-b"):
        node = NodeFactory(name=name)
        dep = Deployment.objects.create(
            model=model, model_file=mf, state="READY", primary=node, n_parallel=4
        )
        dep.nodes.set([node])
        deps.append(dep)
    assert admission.slot_try(
        deployment_id=ids.deployment_id(deps[0].id), job_id=JobId("j1"), cap=4
    )
    admission.queue_join(
        deployment_id=ids.deployment_id(deps[1].id),
        job_id=JobId("w1"),
        priority=1,
        model_id=ids.model_id(model.id),
    )
    body = client.get(
        "/api/admin/deployments", headers={"Authorization": "Bearer test-operator-key"}
    ).json()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/admin/deployments"
        return httpx.Response(200, json=body)

    res = _run(monkeypatch, tmp_path, handler, "deployments", "ls")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    row_a = next(ln for ln in lines if "box-a" in ln)
    row_b = next(ln for ln in lines if "box-b" in ln)
    assert " 1/4 " in row_a and " 0/4 " in row_b
    assert row_b.split()[6] == "1"  # QUEUE column of the replica with the waiter
    summary = next(ln for ln in lines if ln.startswith("smol") and "/" in ln and "box" not in ln)
    assert summary.split()[:4] == ["smol", "2", "1/8", "1"]


def _sse(*events: str) -> httpx.Response:
    body = "".join(f"data: {e}\n\n" for e in events)
    return httpx.Response(
        200,
        content=(": keep-alive\n\n" + body).encode(),
        headers={"Content-Type": "text/event-stream", "X-Racon-Job-Id": "j1"},
    )


def _chunk(content: str | None = None, usage: dict[str, int] | None = None) -> str:
    return json.dumps(
        {
            "choices": [{"delta": {"content": content}}] if content is not None else [],
            "usage": usage,
        }
    )


def test_chat_prints_the_streamed_tokens_and_their_timing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        sent.append(json.loads(request.content))
        return _sse(
            _chunk("Hel"),
            _chunk("lo"),
            _chunk(usage={"completion_tokens": 2}),
            "[DONE]",
            _chunk("after done"),
        )

    res = _run(monkeypatch, tmp_path, handler, "chat", "smol", "-m", "Hi", "--max-tokens", "8")
    assert res.exit_code == 0, res.output
    assert res.stdout == "Hello\n" and "[2 tokens," in res.stderr
    assert sent[0]["stream"] is True and sent[0]["stream_options"] == {"include_usage": True}
    assert sent[0]["messages"] == [{"role": "user", "content": "Hi"}] and sent[0]["max_tokens"] == 8


def test_an_error_event_in_the_stream_exits_with_its_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return _sse(
            _chunk("Hel"),
            json.dumps({"error": {"message": "the primary exited", "type": "server_error"}}),
            "[DONE]",
        )

    res = _run(monkeypatch, tmp_path, handler, "chat", "smol", "-m", "Hi")
    assert (
        res.exit_code == EXIT_API
        and one_error_line(res) == "error: stream error: the primary exited"
    )


def test_credits_verify_checks_a_receipt_offline_with_a_key_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = signing.private_key_generate()
    payload = {
        "version": signing.RECEIPT_VERSION,
        "receipt_id": "r1",
        "credits": 1200,
        "node_name": "gpu-box",
        "job_id": "5f0c6a8e-0000",
    }
    receipt = {**payload, "signature": signing.receipt_sign(payload, key)}
    (tmp_path / "key.pem").write_text(signing.public_key_pem(key))
    (tmp_path / "good.json").write_text(json.dumps({"document": receipt}))
    (tmp_path / "bad.json").write_text(json.dumps({**receipt, "credits": 1201}))

    def no_controller(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"--public-key must not ask the controller: {request.url}")

    res = _run(
        monkeypatch,
        tmp_path,
        no_controller,
        "credits",
        "verify",
        "good.json",
        "--public-key",
        "key.pem",
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("valid: receipt r1") and "1200 µ to node gpu-box" in res.stdout
    res = _run(
        monkeypatch,
        tmp_path,
        no_controller,
        "credits",
        "verify",
        "bad.json",
        "--public-key",
        "key.pem",
        "--json",
    )
    assert res.exit_code == EXIT_API and json.loads(res.stdout)["valid"] is False
