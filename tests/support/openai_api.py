"""The /v1 tests' client calls: the operator key's header, a POST, and OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from django.test import Client

AUTH = {"Authorization": "Bearer test-operator-key"}


def post(
    client: Client,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> Any:
    return client.post(
        path,
        body,
        content_type="application/json",
        headers=headers if headers is not None else AUTH,
    )


def assert_openai_error(
    resp: Any, status: int, code: str | None, param: str | None = "<any>"
) -> dict[str, Any]:
    assert resp.status_code == status, resp.content
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    if param != "<any>":
        assert body["error"]["param"] == param
    assert "Traceback" not in body["error"]["message"]
    return body["error"]
